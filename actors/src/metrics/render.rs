//! The text a scrape returns.

use crate::api::Stats;
use crate::metrics::registry::{process, Registry};
use crate::metrics::scrape::record_scrape;
use crate::metrics::{Counters, Extra};

/// The Prometheus text exposition of a node: its own recorder after this scrape's values,
/// then, for a node whose directory is across the network, the process's directory call
/// latencies. Labels are low-cardinality only (path, status, stage, result, op, nic, kind,
/// reason, state).
pub fn render(stats: &Stats, c: &Counters, extra: Extra) -> String {
    render_with(stats, c, &extra, process())
}

pub(super) fn render_with(
    stats: &Stats,
    c: &Counters,
    extra: &Extra,
    process: &Registry,
) -> String {
    c.registry.record(|| record_scrape(stats, extra));
    let mut text = c.registry.render();
    if extra.sampled.iter().any(|s| s.with_process_latencies()) {
        text.push_str(&process.render());
    }
    text
}
