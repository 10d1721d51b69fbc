//! Tenants of the RAM cache and of the SSD tier: which namespace may hold how much of the
//! pool or of the disks, and what a namespace at its quota does when it stores more. Plain
//! state, no I/O: the [`crate::tier::cache::BlockCache`] (RAM) and the
//! [`crate::tier::ssd::index::SsdIndex`] (SSD) each keep a [`Tenants`] of their tier, ask it
//! before they give a new block a slot, and tell it what they stored and dropped.
//!
//! The rules (the README's "Tenants and quotas" says the same to users):
//! - Per tier (`ram`, `ssd`), a namespace's quota is the first rule naming it exactly that
//!   sets that tier, else the longest prefix rule that matches it and sets that tier, else
//!   the tier's default; none of them: unlimited. A quota is counted in slots (RAM: `ram /
//!   slot-bytes`; SSD: `ssd /` a disk slot, the block and its header; rounded down), since a
//!   block takes a whole slot whatever its size; every block of the namespace in the tier
//!   counts (in RAM: saved, put or fetched from a peer; on SSD: written behind or through).
//! - **On SSD the same rules hold at admission** (a write-behind of a block RAM evicts, or a
//!   write-through): a namespace at its SSD quota replaces its own oldest idle disk block,
//!   never another namespace's; when all of its disk blocks are busy (read, held by leases,
//!   being written) the write is skipped, and a block RAM evicted then leaves the node.
//! - **Hard at admission.** A namespace below its quota is admitted as any block is (a full
//!   pool evicts its oldest unpinned block, whoever's it is). A namespace at its quota
//!   replaces its own oldest unpinned block (fetched copies first, then saved ones): it
//!   never takes a slot from another namespace, so a tenant cannot push the others out.
//!   When all its blocks are pinned (by leases and writers), the block is refused, with an
//!   error naming the namespace and its quota; the blocks before it in the request stay.
//! - So no namespace is ever over its quota: the eviction that "prefers the namespace over
//!   its quota" is the admission rule itself, and the pool-wide eviction stays plain LRU.
//! - **A quota of 0** means "never admitted": the namespace's blocks are refused at once
//!   (for a model that must never be cached here, or a tenant switched off).
//! - Quotas larger than the pool are refused by the config's `validate()`; quotas that add
//!   up to more than the pool are allowed (each is a cap, not a reservation).

use std::collections::HashMap;

use crate::model::Namespace;

/// Which namespaces a quota rule applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NsMatch {
    /// This namespace (`model/dtype/fingerprint`) only.
    Exact(String),
    /// Every namespace whose name starts with this (e.g. `"llama8b/"`: every dtype and
    /// layout of one model).
    Prefix(String),
}

/// One quota: RAM and SSD bytes for the namespaces it matches (None: this rule says nothing
/// about that tier).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaRule {
    pub matches: NsMatch,
    pub ram: Option<u64>,
    pub ssd: Option<u64>,
}

/// The tier a [`Tenants`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Ram,
    Ssd,
}

impl QuotaRule {
    fn bytes(&self, tier: Tier) -> Option<u64> {
        match tier {
            Tier::Ram => self.ram,
            Tier::Ssd => self.ssd,
        }
    }
}

/// The quotas of a node, as the config gives them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuotaRules {
    pub rules: Vec<QuotaRule>,
    /// The RAM quota of a namespace no rule gives one; None: unlimited.
    pub default_ram: Option<u64>,
    /// The SSD quota of a namespace no rule gives one; None: unlimited.
    pub default_ssd: Option<u64>,
}

impl QuotaRules {
    /// RAM bytes `ns` may hold (see the module doc for the order); None: unlimited.
    pub fn ram_for(&self, ns: &str) -> Option<u64> {
        self.quota_for(ns, Tier::Ram)
    }

    /// SSD bytes `ns` may hold; None: unlimited.
    pub fn ssd_for(&self, ns: &str) -> Option<u64> {
        self.quota_for(ns, Tier::Ssd)
    }

    /// `tier`'s bytes `ns` may hold: the exact rule, else the longest prefix, else the
    /// default, each only where it sets `tier`.
    pub fn quota_for(&self, ns: &str, tier: Tier) -> Option<u64> {
        let exact = self.rules.iter().find_map(|r| match &r.matches {
            NsMatch::Exact(n) if n == ns => r.bytes(tier),
            _ => None,
        });
        let default = match tier {
            Tier::Ram => self.default_ram,
            Tier::Ssd => self.default_ssd,
        };
        exact
            .or_else(|| {
                self.rules
                    .iter()
                    .filter_map(|r| match &r.matches {
                        NsMatch::Prefix(p) if ns.starts_with(p.as_str()) => {
                            r.bytes(tier).map(|b| (p.len(), b))
                        }
                        _ => None,
                    })
                    .max_by_key(|(len, _)| *len)
                    .map(|(_, b)| b)
            })
            .or(default)
    }
}

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

/// One namespace's use of a tier, as metrics and operators see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantUsage {
    pub namespace: Namespace,
    pub blocks: usize,
    /// Bytes its blocks hold (`blocks × slot bytes`).
    pub bytes: u64,
    /// Its quota in bytes (slots × slot bytes); None: unlimited.
    pub quota_bytes: Option<u64>,
    /// Blocks refused for its quota since the start.
    pub refused: u64,
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
