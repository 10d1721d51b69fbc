//! Per-namespace metrics with bounded label cardinality: the first `cap` namespaces a node
//! sees are labelled by name, every later one is counted under `namespace="other"`, so a
//! node serving many models (or a client naming a new namespace per request) cannot grow a
//! scrape without bound. A label is the namespace as logs show it (`model/dtype/fingerprint`,
//! already printable ASCII: [`crate::model::Namespace`] refuses anything else), cut to
//! [`LABEL_CHARS`] with a hash of the whole name appended, so two long names that share a
//! beginning keep two labels.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use ::metrics::{counter, gauge};

use crate::metrics::names::{
    NAMESPACE_RAM_BYTES, NAMESPACE_RAM_QUOTA_BYTES, NAMESPACE_REFUSED, NAMESPACE_SSD_BYTES,
    NAMESPACE_SSD_QUOTA_BYTES, NAMESPACE_SSD_REFUSED,
};
use crate::metrics::Sampled;
use crate::model::Namespace;

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

/// The label of every namespace past the cap.
pub const OTHER: &str = "other";

/// Longest label (characters), the hash suffix included.
pub const LABEL_CHARS: usize = 96;

/// The label of a namespace: its name, or its first characters and `~` and 16 hex digits
/// of a hash of all of it.
pub fn label_text(ns: &str) -> String {
    if ns.len() <= LABEL_CHARS && ns.is_ascii() {
        return ns.to_owned();
    }
    let mut h = std::hash::DefaultHasher::new();
    ns.hash(&mut h);
    let keep: String = ns
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(LABEL_CHARS - 17)
        .collect();
    format!("{keep}~{:016x}", h.finish())
}

/// Which namespaces have labels of their own (the first `cap` seen).
#[derive(Debug)]
pub struct NamespaceLabels {
    cap: AtomicUsize,
    named: Mutex<HashMap<Namespace, String>>,
}

impl NamespaceLabels {
    pub fn new(cap: usize) -> Self {
        Self {
            cap: AtomicUsize::new(cap),
            named: Mutex::new(HashMap::new()),
        }
    }

    /// How many namespaces get labels of their own from now on (the config's
    /// `tenants.metric-namespaces`); those named already keep theirs.
    pub fn set_cap(&self, cap: usize) {
        self.cap.store(cap, Ordering::Relaxed);
    }

    /// `ns`'s label: its own while fewer than the cap have one, else [`OTHER`].
    pub fn label(&self, ns: &Namespace) -> String {
        // A poisoned lock only means a panic elsewhere mid-insert; the map is still whole.
        let mut named = self.named.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = named.get(ns) {
            return l.clone();
        }
        if named.len() >= self.cap.load(Ordering::Relaxed) {
            return OTHER.to_owned();
        }
        let l = label_text(ns.as_str());
        named.insert(ns.clone(), l.clone());
        l
    }
}

/// One label's RAM use, for a scrape (namespaces past the cap summed under [`OTHER`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceRow {
    pub label: String,
    pub ram_bytes: u64,
    /// Summed over the namespaces of the label that have one; None: none has.
    pub ram_quota_bytes: Option<u64>,
    pub refused_blocks: u64,
}

/// Every label's RAM use, sampled at scrape time.
#[derive(Clone, Debug, Default)]
pub struct NamespaceUsage(pub Vec<NamespaceRow>);

impl NamespaceUsage {
    /// Rows by label, in the order the namespaces were first seen.
    pub fn of(labels: &NamespaceLabels, usage: &[TenantUsage]) -> Self {
        let mut rows: Vec<NamespaceRow> = Vec::new();
        for u in usage {
            let label = labels.label(&u.namespace);
            let i = match rows.iter().position(|r| r.label == label) {
                Some(i) => i,
                None => {
                    rows.push(NamespaceRow {
                        label,
                        ..Default::default()
                    });
                    rows.len() - 1
                }
            };
            let r = &mut rows[i];
            r.ram_bytes = r.ram_bytes.saturating_add(u.bytes);
            r.refused_blocks = r.refused_blocks.saturating_add(u.refused);
            if let Some(q) = u.quota_bytes {
                r.ram_quota_bytes = Some(r.ram_quota_bytes.unwrap_or(0).saturating_add(q));
            }
        }
        Self(rows)
    }
}

impl Sampled for NamespaceUsage {
    fn record(&self) {
        for r in &self.0 {
            let ns = r.label.clone();
            gauge!(NAMESPACE_RAM_BYTES, "namespace" => ns.clone()).set(r.ram_bytes as f64);
            if let Some(q) = r.ram_quota_bytes {
                gauge!(NAMESPACE_RAM_QUOTA_BYTES, "namespace" => ns.clone()).set(q as f64);
            }
            counter!(NAMESPACE_REFUSED, "namespace" => ns).absolute(r.refused_blocks);
        }
    }
}

/// The same rows for the SSD tier's use (the `ram_*` fields hold the SSD's bytes and quota).
#[derive(Clone, Debug, Default)]
pub struct SsdNamespaceUsage(pub NamespaceUsage);

impl Sampled for SsdNamespaceUsage {
    fn record(&self) {
        for r in &self.0 .0 {
            let ns = r.label.clone();
            gauge!(NAMESPACE_SSD_BYTES, "namespace" => ns.clone()).set(r.ram_bytes as f64);
            if let Some(q) = r.ram_quota_bytes {
                gauge!(NAMESPACE_SSD_QUOTA_BYTES, "namespace" => ns.clone()).set(q as f64);
            }
            counter!(NAMESPACE_SSD_REFUSED, "namespace" => ns).absolute(r.refused_blocks);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Stats;
    use crate::metrics::{render, Counters, Extra};

    fn ns(model: &str) -> Namespace {
        Namespace::new(model, "bf16", "t").unwrap()
    }

    fn usage(model: &str, blocks: usize, quota: Option<u64>, refused: u64) -> TenantUsage {
        TenantUsage {
            namespace: ns(model),
            blocks,
            bytes: blocks as u64 * 4096,
            quota_bytes: quota,
            refused,
        }
    }

    #[test]
    fn past_the_cap_namespaces_are_other_and_sum_there() {
        let c = Counters::default();
        c.set_namespace_labels(2);
        c.namespace_query(&ns("a"), 3, 1);
        c.namespace_query(&ns("b"), 0, 4);
        c.namespace_query(&ns("c"), 2, 0);
        c.namespace_query(&ns("d"), 1, 1);
        c.namespace_query(&ns("a"), 1, 0);
        let u = c.namespace_usage(&[
            usage("a", 2, Some(8192), 0),
            usage("b", 1, None, 0),
            usage("c", 3, Some(4096), 5),
            usage("d", 4, None, 1),
        ]);
        let text = render(
            &Stats::default(),
            &c,
            Extra {
                sampled: vec![Box::new(u)],
                ..Default::default()
            },
        );
        for line in [
            "kvferry_namespace_query_blocks_total{namespace=\"a/bf16/t\",result=\"hit\"} 4\n",
            "kvferry_namespace_query_blocks_total{namespace=\"a/bf16/t\",result=\"miss\"} 1\n",
            "kvferry_namespace_query_blocks_total{namespace=\"b/bf16/t\",result=\"miss\"} 4\n",
            "kvferry_namespace_query_blocks_total{namespace=\"other\",result=\"hit\"} 3\n",
            "kvferry_namespace_query_blocks_total{namespace=\"other\",result=\"miss\"} 1\n",
            "kvferry_namespace_ram_bytes{namespace=\"a/bf16/t\"} 8192\n",
            "kvferry_namespace_ram_bytes{namespace=\"b/bf16/t\"} 4096\n",
            "kvferry_namespace_ram_bytes{namespace=\"other\"} 28672\n",
            "kvferry_namespace_ram_quota_bytes{namespace=\"a/bf16/t\"} 8192\n",
            "kvferry_namespace_ram_quota_bytes{namespace=\"other\"} 4096\n",
            "kvferry_namespace_refused_blocks_total{namespace=\"other\"} 6\n",
            "# TYPE kvferry_namespace_ram_bytes gauge\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
        assert!(
            !text.contains("c/bf16/t") && !text.contains("d/bf16/t"),
            "{text}"
        );
        assert!(
            !text.contains("kvferry_namespace_ram_quota_bytes{namespace=\"b/bf16/t\"}"),
            "{text}"
        );
        // However many namespaces come, the families hold cap + 1 label values.
        for i in 0..500 {
            c.namespace_query(&ns(&format!("m{i}")), 1, 0);
        }
        let text = render(&Stats::default(), &c, Extra::default());
        let series = text
            .lines()
            .filter(|l| l.starts_with("kvferry_namespace_query_blocks_total{"))
            .count();
        assert_eq!(series, 6, "{text}");
        assert!(
            text.contains(
                "kvferry_namespace_query_blocks_total{namespace=\"other\",result=\"hit\"} 503\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn long_names_are_cut_with_a_hash_so_they_stay_apart() {
        let long = "m".repeat(128);
        let (a, b) = (format!("{long}/bf16/aaaa"), format!("{long}/bf16/bbbb"));
        let (la, lb) = (label_text(&a), label_text(&b));
        assert_ne!(la, lb);
        assert_eq!(la.chars().count(), LABEL_CHARS);
        assert!(la.starts_with("mmmm") && la.contains('~'), "{la}");
        assert_eq!(label_text("llama/bf16/t"), "llama/bf16/t");
        // Zero: every namespace is "other".
        let labels = NamespaceLabels::new(0);
        assert_eq!(labels.label(&ns("a")), OTHER);
    }
}
