//! The node's metrics, through the `metrics` facade into a Prometheus recorder of
//! `metrics-exporter-prometheus`. [`describe`] names every family once; [`Counters`] records
//! what happens (transfers, queries) as it happens; [`render`] adds the values sampled at
//! scrape time (gauges of the actors, the NIC runtime, the directory, the engine service)
//! and lets the exporter write the text format. `Node::stats` reads the plain counters.
//!
//! One recorder per node, not the process-wide one: several nodes run in one process (the
//! in-process cluster, tests, an engine embedding two), and `Node::metrics_text` must show
//! one node's numbers. Each [`Counters`] owns a recorder and records through
//! [`metrics::with_local_recorder`], so nothing here installs or reads the global recorder
//! (an embedding application keeps its own). What belongs to the process rather than a node
//! — the Redis directory's call latencies — goes to one process recorder ([`directory_call`]),
//! shown in the scrape of every node that uses a networked directory.

mod counters;
pub mod names;
pub mod namespaces;
mod registry;
mod render;
mod scrape;

pub use counters::{Counters, InFlight, FAILURE_LOG_PERIOD};
pub use names::*;
pub use registry::{directory_call, STAGE_BUCKETS};
pub use render::render;
pub use scrape::{EngineGauges, EngineProbe, Extra, Sampled};

#[cfg(test)]
mod tests;
