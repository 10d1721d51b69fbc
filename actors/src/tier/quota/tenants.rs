//! One tier's tenants: their use, their quotas, and what admitting a block does.

use std::collections::HashMap;

use super::{QuotaRules, TenantUsage, Tier};
use crate::model::Namespace;

/// A namespace's index in [`Tenants`].
pub type TenantId = u32;

#[derive(Debug)]
struct Tenant {
    ns: Namespace,
    /// Pool slots it may hold; None: unlimited.
    quota: Option<usize>,
    /// Blocks it holds in RAM (sealed or not).
    used: usize,
    /// Blocks refused for its quota.
    refused: u64,
}

/// What a new block of a namespace gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// A slot as any block gets one (the pool's LRU evicts if it must).
    Admit,
    /// At its quota: it must give up one of its own blocks first (refused if it has none
    /// it can give up).
    ReplaceOwn { quota_slots: usize },
    /// Quota 0: never admitted.
    Never,
}

/// Every namespace a tier has held, with its quota and use. Namespaces stay once seen:
/// they come from registered instances (and the leases of their queries), so there are as
/// many as the engines ever served models and layouts.
#[derive(Debug)]
pub struct Tenants {
    rules: QuotaRules,
    tier: Tier,
    slot_bytes: u64,
    ids: HashMap<Namespace, TenantId>,
    list: Vec<Tenant>,
}

impl Tenants {
    /// RAM's tenants, counted in pool slots of `slot_bytes`.
    pub fn new(rules: QuotaRules, slot_bytes: u64) -> Self {
        Self::of_tier(rules, Tier::Ram, slot_bytes)
    }

    /// `tier`'s tenants, counted in slots of `slot_bytes`.
    pub fn of_tier(rules: QuotaRules, tier: Tier, slot_bytes: u64) -> Self {
        Self {
            rules,
            tier,
            slot_bytes: slot_bytes.max(1),
            ids: HashMap::new(),
            list: Vec::new(),
        }
    }

    /// New rules; every namespace seen keeps its id and use and gets its new quota.
    pub fn set_rules(&mut self, rules: QuotaRules) {
        self.rules = rules;
        for i in 0..self.list.len() {
            self.list[i].quota = self.quota_slots(&self.list[i].ns);
        }
    }

    /// [`Self::set_rules`], counted in slots of `slot_bytes` from now on.
    pub fn set_rules_counted_in(&mut self, rules: QuotaRules, slot_bytes: u64) {
        self.slot_bytes = slot_bytes.max(1);
        self.set_rules(rules);
    }

    fn quota_slots(&self, ns: &Namespace) -> Option<usize> {
        self.rules
            .quota_for(ns.as_str(), self.tier)
            .map(|b| usize::try_from(b / self.slot_bytes).unwrap_or(usize::MAX))
    }

    /// The id of `ns`, adding it on first sight.
    pub fn id(&mut self, ns: &Namespace) -> TenantId {
        if let Some(&id) = self.ids.get(ns) {
            return id;
        }
        let id = self.list.len() as TenantId;
        let quota = self.quota_slots(ns);
        self.list.push(Tenant {
            ns: ns.clone(),
            quota,
            used: 0,
            refused: 0,
        });
        self.ids.insert(ns.clone(), id);
        id
    }

    /// The id of `ns` if it was seen.
    pub fn known(&self, ns: &Namespace) -> Option<TenantId> {
        self.ids.get(ns).copied()
    }

    /// Whether `t` is under a quota (its blocks then keep an LRU list of their own).
    pub fn has_quota(&self, t: TenantId) -> bool {
        self.list.get(t as usize).is_some_and(|x| x.quota.is_some())
    }

    /// What a new block of `t` gets now.
    pub fn admission(&self, t: TenantId) -> Admission {
        match self
            .list
            .get(t as usize)
            .and_then(|x| x.quota.map(|q| (q, x.used)))
        {
            None => Admission::Admit,
            Some((0, _)) => Admission::Never,
            Some((q, used)) if used < q => Admission::Admit,
            Some((q, _)) => Admission::ReplaceOwn { quota_slots: q },
        }
    }

    /// `t` got a slot for a new block.
    pub fn stored(&mut self, t: TenantId) {
        if let Some(x) = self.list.get_mut(t as usize) {
            x.used += 1;
        }
    }

    /// A block of `t` left RAM.
    pub fn dropped(&mut self, t: TenantId) {
        if let Some(x) = self.list.get_mut(t as usize) {
            x.used = x.used.saturating_sub(1);
        }
    }

    /// A block of `t` was refused for its quota.
    pub fn refused(&mut self, t: TenantId) {
        if let Some(x) = self.list.get_mut(t as usize) {
            x.refused += 1;
        }
    }

    /// Blocks `t` holds.
    pub fn used(&self, t: TenantId) -> usize {
        self.list.get(t as usize).map_or(0, |x| x.used)
    }

    pub fn namespace(&self, t: TenantId) -> Option<&Namespace> {
        self.list.get(t as usize).map(|x| &x.ns)
    }

    /// Every namespace seen, in the order they were first seen.
    pub fn usage(&self) -> Vec<TenantUsage> {
        let sb = self.slot_bytes;
        self.list
            .iter()
            .map(|x| TenantUsage {
                namespace: x.ns.clone(),
                blocks: x.used,
                bytes: (x.used as u64).saturating_mul(sb),
                quota_bytes: x.quota.map(|q| (q as u64).saturating_mul(sb)),
                refused: x.refused,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::quota::{NsMatch, QuotaRule};

    fn ns(model: &str) -> Namespace {
        Namespace::new(model, "bf16", "t").unwrap()
    }

    fn rules() -> QuotaRules {
        QuotaRules {
            rules: vec![
                QuotaRule {
                    matches: NsMatch::Prefix("llama".into()),
                    ram: Some(4 << 20),
                    ssd: None,
                },
                QuotaRule {
                    matches: NsMatch::Prefix("llama-big".into()),
                    ram: Some(8 << 20),
                    ssd: None,
                },
                QuotaRule {
                    matches: NsMatch::Exact("llama-big/bf16/t".into()),
                    ram: Some(1 << 20),
                    ssd: None,
                },
                QuotaRule {
                    matches: NsMatch::Prefix("off".into()),
                    ram: Some(0),
                    ssd: None,
                },
            ],
            default_ram: None,
            default_ssd: None,
        }
    }

    #[test]
    fn exact_then_longest_prefix_then_default() {
        let r = rules();
        assert_eq!(r.ram_for("llama-big/bf16/t"), Some(1 << 20));
        assert_eq!(r.ram_for("llama-big/fp8/t"), Some(8 << 20));
        assert_eq!(r.ram_for("llama8b/bf16/t"), Some(4 << 20));
        assert_eq!(r.ram_for("qwen/bf16/t"), None);
        let d = QuotaRules {
            default_ram: Some(3),
            ..r
        };
        assert_eq!(d.ram_for("qwen/bf16/t"), Some(3));
        assert_eq!(d.ram_for("off/bf16/t"), Some(0));
    }

    #[test]
    fn admission_by_use_against_the_quota_in_slots() {
        // 1 MiB slots: llama8b may hold 4 blocks, llama-big 1, qwen any number, off none.
        let mut t = Tenants::new(rules(), 1 << 20);
        let (a, big, q, off) = (
            t.id(&ns("llama8b")),
            t.id(&ns("llama-big")),
            t.id(&ns("qwen")),
            t.id(&ns("off")),
        );
        assert_eq!(t.id(&ns("llama8b")), a);
        assert!(t.has_quota(a) && !t.has_quota(q));
        for _ in 0..4 {
            assert_eq!(t.admission(a), Admission::Admit);
            t.stored(a);
        }
        assert_eq!(t.admission(a), Admission::ReplaceOwn { quota_slots: 4 });
        t.dropped(a);
        assert_eq!(t.admission(a), Admission::Admit);
        t.stored(big);
        assert_eq!(t.admission(big), Admission::ReplaceOwn { quota_slots: 1 });
        for _ in 0..100 {
            t.stored(q);
        }
        assert_eq!(t.admission(q), Admission::Admit);
        assert_eq!(t.admission(off), Admission::Never);
        t.refused(off);
        let u = t.usage();
        assert_eq!(u[0].blocks, 3);
        assert_eq!(u[0].bytes, 3 << 20);
        assert_eq!(u[0].quota_bytes, Some(4 << 20));
        assert_eq!((u[2].blocks, u[2].quota_bytes), (100, None));
        assert_eq!((u[3].quota_bytes, u[3].refused), (Some(0), 1));
        // Dropping more than was stored never wraps.
        t.dropped(off);
        assert_eq!(t.used(off), 0);
    }

    #[test]
    fn a_quota_below_one_slot_admits_nothing() {
        let r = QuotaRules {
            default_ram: Some((1 << 20) - 1),
            ..Default::default()
        };
        let mut t = Tenants::new(r, 1 << 20);
        let a = t.id(&ns("m"));
        assert_eq!(t.admission(a), Admission::Never);
    }

    #[test]
    fn each_tier_takes_the_most_specific_rule_that_sets_it() {
        let r = QuotaRules {
            rules: vec![
                // RAM only for one namespace: its SSD quota comes from the prefix rule.
                QuotaRule {
                    matches: NsMatch::Exact("llama/bf16/t".into()),
                    ram: Some(1 << 20),
                    ssd: None,
                },
                QuotaRule {
                    matches: NsMatch::Prefix("llama/".into()),
                    ram: None,
                    ssd: Some(10 << 20),
                },
                QuotaRule {
                    matches: NsMatch::Prefix("cold/".into()),
                    ram: None,
                    ssd: Some(0),
                },
            ],
            default_ram: None,
            default_ssd: Some(3 << 20),
        };
        assert_eq!(r.ram_for("llama/bf16/t"), Some(1 << 20));
        assert_eq!(r.ssd_for("llama/bf16/t"), Some(10 << 20));
        assert_eq!(
            r.ram_for("llama/fp8/t"),
            None,
            "the prefix rule sets no RAM quota"
        );
        assert_eq!(r.ssd_for("llama/fp8/t"), Some(10 << 20));
        assert_eq!(r.ssd_for("qwen/bf16/t"), Some(3 << 20));
        assert_eq!(r.ssd_for("cold/bf16/t"), Some(0));
        // The SSD's tenants count in disk slots, by their own rules; RAM's are untouched.
        let mut ssd = Tenants::of_tier(r.clone(), Tier::Ssd, 1 << 20);
        let (llama, cold, qwen) = (
            ssd.id(&ns("llama")),
            ssd.id(&ns("cold")),
            ssd.id(&ns("qwen")),
        );
        assert_eq!(ssd.admission(cold), Admission::Never);
        for _ in 0..3 {
            assert_eq!(ssd.admission(qwen), Admission::Admit);
            ssd.stored(qwen);
        }
        assert_eq!(
            ssd.admission(qwen),
            Admission::ReplaceOwn { quota_slots: 3 }
        );
        for _ in 0..10 {
            ssd.stored(llama);
        }
        assert_eq!(
            ssd.admission(llama),
            Admission::ReplaceOwn { quota_slots: 10 }
        );
        let u = ssd.usage();
        assert_eq!(
            (u[0].blocks, u[0].bytes, u[0].quota_bytes),
            (10, 10 << 20, Some(10 << 20))
        );
        let mut ram = Tenants::new(r, 1 << 20);
        let llama_ram = ram.id(&ns("llama"));
        ram.stored(llama_ram);
        assert_eq!(
            ram.admission(llama_ram),
            Admission::ReplaceOwn { quota_slots: 1 }
        );
        let cold_ram = ram.id(&ns("cold"));
        assert_eq!(
            ram.admission(cold_ram),
            Admission::Admit,
            "no RAM quota for cold/"
        );
    }
}
