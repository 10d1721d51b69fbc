//! The recorders: one per node, one for the process, each with explicit histogram buckets.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use ::metrics::{histogram, with_local_recorder};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use crate::metrics::{describe, DIRECTORY_CALL_SECONDS, STAGE_SECONDS};

/// Upper bounds (seconds) of the stage and directory-call histograms: 10 us to 10 s.
/// Explicit, so the exporter renders histograms (without buckets it renders summaries,
/// which cannot be aggregated across nodes).
pub const STAGE_BUCKETS: [f64; 13] = [
    1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 1.0, 10.0,
];

/// Histogram samples wait in the recorder until a scrape or an upkeep folds them into
/// buckets; a node nobody scrapes folds them every this many samples, so they stay bounded.
pub(super) const UPKEEP_EVERY: u64 = 4096;

/// A Prometheus recorder and its handle: what one node (or the process) records into.
pub(super) struct Registry {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    samples: AtomicU64,
}

impl Registry {
    pub(super) fn new() -> Self {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(STAGE_SECONDS.into()), &STAGE_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full(DIRECTORY_CALL_SECONDS.into()),
                    &STAGE_BUCKETS,
                )
            })
            // Only fails for an empty bucket list; STAGE_BUCKETS is a non-empty constant.
            .expect("STAGE_BUCKETS is not empty")
            .build_recorder();
        let handle = recorder.handle();
        with_local_recorder(&recorder, describe);
        Self {
            recorder,
            handle,
            samples: AtomicU64::new(0),
        }
    }

    pub(super) fn record<T>(&self, f: impl FnOnce() -> T) -> T {
        with_local_recorder(&self.recorder, f)
    }

    /// Counts histogram samples just recorded, folding them in now and then.
    pub(super) fn sampled(&self, n: u64) {
        let before = self.samples.fetch_add(n, Ordering::Relaxed);
        if before / UPKEEP_EVERY != (before + n) / UPKEEP_EVERY {
            self.handle.run_upkeep();
        }
    }

    pub(super) fn render(&self) -> String {
        self.handle.render()
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

/// The process's recorder: what belongs to no single node.
pub(super) fn process() -> &'static Registry {
    static PROCESS: OnceLock<Registry> = OnceLock::new();
    PROCESS.get_or_init(Registry::new)
}

/// One call to a networked directory (`op`: `lookup`, or `write` for one pipeline), failed
/// ones included. The directory is shared by this process's nodes, so its latencies are the
/// process's.
pub fn directory_call(op: &'static str, seconds: f64) {
    let p = process();
    p.record(|| record_directory_call(op, seconds));
    p.sampled(1);
}

pub(super) fn record_directory_call(op: &'static str, seconds: f64) {
    histogram!(DIRECTORY_CALL_SECONDS, "op" => op).record(seconds);
}
