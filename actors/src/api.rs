//! The `Node` handle's API: the engine's requests and answers (shared with the gRPC client,
//! in `kvferry-proto`) and the observer a running load reports to.

pub use kvferry_proto::api::*;

use crate::NodeError;

/// Watches one load land layer by layer (what an engine's per-layer wait needs).
pub trait LoadObserver: Send + Sync {
    /// The first `layers` of `total` layers have landed in every destination block of the
    /// load. Called with growing counts, each once, from the device's completion thread as a
    /// batch lands or from the node's actor thread: implementations must return at once.
    fn layers_landed(&self, layers: u32, total: u32);

    /// The load ended with `result`, after its pins and guards were released and just
    /// before the caller's report is sent: a client that learns the end here learns it one
    /// thread hop sooner. Called at most once, from the node's actor thread; must return at
    /// once. Not called for a load that never started or whose transfer was dropped
    /// unfinished (the node stopping): the report says so.
    fn finished(&self, result: &Result<TransferReport, NodeError>) {
        let _ = result;
    }

    /// Whether the load's client asked it to stop (CancelLoad): read before each copy batch
    /// is submitted; once true, no more are, and the load ends [`NodeError::Cancelled`]
    /// when what was submitted has drained.
    fn cancelled(&self) -> bool {
        false
    }
}
