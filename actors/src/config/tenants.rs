//! `[tenants]`: RAM and SSD quotas per namespace (`[[tenants.quota]]`) and how many namespaces the
//! metrics name (the rest are counted as `"other"`). The rules a quota follows are in
//! [`crate::tier::quota`].

use serde::{Deserialize, Serialize};

use crate::config::{ByteSize, ConfigError};
use crate::tier::quota::{NsMatch, QuotaRule, QuotaRules};

/// Most namespaces the metrics may name (each name is a label value of several families).
pub const MAX_METRIC_NAMESPACES: usize = 1024;

/// Longest namespace a rule may name: four parts (the last a tenant) of 128 characters and
/// three `/`.
const MAX_NAMESPACE: usize = 4 * 128 + 3;

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct TenantsConfig {
    /// Namespaces the per-namespace metrics show by name, the first ones seen; the others
    /// are summed under `namespace="other"`. 0: every namespace is "other".
    pub metric_namespaces: usize,
    /// The RAM quota of a namespace no `[[tenants.quota]]` matches; absent: unlimited.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_ram: Option<ByteSize>,
    /// The SSD quota of a namespace no `[[tenants.quota]]` matches; absent: unlimited.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_ssd: Option<ByteSize>,
    /// `[[tenants.quota]]`, each naming one namespace or a prefix.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub quota: Vec<QuotaSection>,
}

impl Default for TenantsConfig {
    fn default() -> Self {
        Self {
            metric_namespaces: 32,
            default_ram: None,
            default_ssd: None,
            quota: Vec::new(),
        }
    }
}

/// One `[[tenants.quota]]`: exactly one of `namespace` (`model/dtype/fingerprint`, as the
/// node's logs and metrics show it) and `prefix` (e.g. `"llama8b/"`: every dtype and
/// layout of a model), and its RAM bytes, its SSD bytes, or both (one at least). `0`:
/// never admitted to that tier.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct QuotaSection {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram: Option<ByteSize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssd: Option<ByteSize>,
}

impl QuotaSection {
    fn matches(&self) -> Option<NsMatch> {
        match (&self.namespace, &self.prefix) {
            (Some(n), None) => Some(NsMatch::Exact(n.clone())),
            (None, Some(p)) => Some(NsMatch::Prefix(p.clone())),
            _ => None,
        }
    }
}

/// A RAM quota against the pool: 0 (never admitted), or one slot to the whole pool.
fn check_ram(ram: u64, pool_size: u64, slot_bytes: u64) -> Result<(), String> {
    if ram == 0 {
        return Ok(());
    }
    if ram < slot_bytes {
        return Err(format!(
            "{} is less than one pool slot (pool.slot-bytes = {}): it would admit nothing \
             (ram = 0 says that)",
            ByteSize(ram),
            ByteSize(slot_bytes)
        ));
    }
    if ram > pool_size {
        return Err(format!(
            "{} is larger than the whole pool (pool.size = {})",
            ByteSize(ram),
            ByteSize(pool_size)
        ));
    }
    Ok(())
}

/// An SSD quota against the tier: 0 (never admitted), or one disk slot to the whole tier;
/// `ssd`: `(capacity, slot)` of the tier, None without one.
fn check_ssd(bytes: u64, ssd: Option<(u64, u64)>) -> Result<(), String> {
    let Some((capacity, slot)) = ssd else {
        return Err("the node has no [ssd] tier to hold it to".into());
    };
    if bytes == 0 {
        return Ok(());
    }
    if bytes < slot {
        return Err(format!(
            "{} is less than one disk slot ({}: pool.slot-bytes and a block header): it would \
             admit nothing (ssd = 0 says that)",
            ByteSize(bytes),
            ByteSize(slot)
        ));
    }
    if bytes > capacity {
        return Err(format!(
            "{} is larger than the whole SSD tier ({})",
            ByteSize(bytes),
            ByteSize(capacity)
        ));
    }
    Ok(())
}

impl TenantsConfig {
    /// Every value against the pool's size and slot and the SSD tier's capacity and slot
    /// (None: no SSD tier), naming the key (and the quota's index).
    pub fn validate(
        &self,
        pool_size: u64,
        slot_bytes: u64,
        ssd: Option<(u64, u64)>,
    ) -> Result<(), ConfigError> {
        let invalid = |key, reason: String| Err(ConfigError::Invalid { key, reason });
        if self.metric_namespaces > MAX_METRIC_NAMESPACES {
            return invalid(
                "tenants.metric-namespaces",
                format!(
                    "{} is more than {MAX_METRIC_NAMESPACES} (each is a label value of several \
                     metric families)",
                    self.metric_namespaces
                ),
            );
        }
        if let Some(d) = self.default_ram {
            check_ram(d.0, pool_size, slot_bytes).or_else(|r| invalid("tenants.default-ram", r))?;
        }
        if let Some(d) = self.default_ssd {
            check_ssd(d.0, ssd).or_else(|r| invalid("tenants.default-ssd", r))?;
        }
        let mut seen: Vec<NsMatch> = Vec::new();
        for (i, q) in self.quota.iter().enumerate() {
            let Some(m) = q.matches() else {
                return invalid(
                    "tenants.quota",
                    format!("quota #{i} must name exactly one of namespace and prefix"),
                );
            };
            let (key, text) = match &m {
                NsMatch::Exact(n) => ("tenants.quota.namespace", n),
                NsMatch::Prefix(p) => ("tenants.quota.prefix", p),
            };
            if text.is_empty()
                || text.len() > MAX_NAMESPACE
                || !text.chars().all(|c| c.is_ascii_graphic())
            {
                return invalid(
                    key,
                    format!(
                        "quota #{i}: {} must be 1 to {MAX_NAMESPACE} printable ASCII characters \
                         (no spaces or control characters), as namespaces are",
                        crate::model::shown(text)
                    ),
                );
            }
            if let NsMatch::Exact(n) = &m {
                if let Err(e) = crate::peer::server::parse_namespace(n) {
                    return invalid(key, format!("quota #{i}: {e}"));
                }
            }
            if seen.contains(&m) {
                return invalid(
                    key,
                    format!(
                        "quota #{i}: {} is named by an earlier quota",
                        crate::model::shown(text)
                    ),
                );
            }
            seen.push(m);
            if q.ram.is_none() && q.ssd.is_none() {
                return invalid(
                    "tenants.quota",
                    format!("quota #{i} must set ram, ssd or both"),
                );
            }
            if let Some(ram) = q.ram {
                check_ram(ram.0, pool_size, slot_bytes)
                    .or_else(|r| invalid("tenants.quota.ram", format!("quota #{i}: {r}")))?;
            }
            if let Some(b) = q.ssd {
                check_ssd(b.0, ssd)
                    .or_else(|r| invalid("tenants.quota.ssd", format!("quota #{i}: {r}")))?;
            }
        }
        Ok(())
    }

    /// The quotas as the cache applies them (call after [`Self::validate`]).
    pub fn rules(&self) -> QuotaRules {
        QuotaRules {
            rules: self
                .quota
                .iter()
                .filter_map(|q| {
                    q.matches().map(|matches| QuotaRule {
                        matches,
                        ram: q.ram.map(|b| b.0),
                        ssd: q.ssd.map(|b| b.0),
                    })
                })
                .collect(),
            default_ram: self.default_ram.map(|b| b.0),
            default_ssd: self.default_ssd.map(|b| b.0),
        }
    }
}
