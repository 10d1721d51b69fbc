//! The quota rules of `[tenants]`: which namespace gets which quota in each tier.

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

/// The tier a [`Tenants`](super::Tenants) counts.
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
