//! What a failed batch or connect tells its caller, sorted by how the caller reacts.

use std::sync::Arc;

use kvferry_transport::{CompletionStatus, NodeId, QpError, QpKey, QueueFault, WorkCompletion};
use thiserror::Error;

/// What a caller should do about a failure (issue 13: connection errors and local resource
/// errors are told apart because callers react differently).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureKind {
    /// The path to the peer is broken or could not be made, or a QP went to error (a post
    /// the provider refused included): rebuild the link.
    Connection,
    /// A local resource failed (destination not registered, local write error, a batch
    /// refused before posting, the poller): back off, the peer is fine.
    Local,
    /// The owner refused the read (unknown key, out of bounds): what the plan points at is
    /// gone there; report the blocks.
    Remote,
    /// The worker stopped (node shutting down).
    Stopped,
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum WorkerError {
    #[error("nic {nic}: no connection to peer {peer}")]
    UnknownPeer { nic: String, peer: NodeId },
    /// Opening the QPs to a peer failed; nothing of it is kept.
    #[error("nic {nic}: connecting to peer {peer} failed")]
    Connect {
        nic: String,
        peer: NodeId,
        #[source]
        source: Arc<QpError>,
    },
    /// The batch was refused before anything was posted (bad destination, too many SGEs...).
    #[error("nic {nic}: batch refused")]
    Rejected {
        nic: String,
        #[source]
        source: QpError,
    },
    /// Some requests failed; `completions` has every request's status, in post order, and
    /// the QP had drained before this was sent.
    #[error("qp {qp}: read {wr_id} failed with {status}")]
    ReadFailed {
        qp: QpKey,
        wr_id: u64,
        status: CompletionStatus,
        fault: Option<QueueFault>,
        completions: Vec<WorkCompletion>,
    },
    /// A drained QP could not be reconnected; the next post tries again.
    #[error("qp {qp}: reconnecting failed")]
    Reconnect {
        qp: QpKey,
        #[source]
        source: Arc<QpError>,
    },
    #[error("nic {nic}: worker stopped before the batch finished")]
    Stopped { nic: String },
    #[error("nic {nic}: starting the completion poller failed")]
    Poller {
        nic: String,
        #[source]
        source: std::io::Error,
    },
    /// The NIC's completion queue cannot hold even one QP's window: no read could ever be
    /// admitted.
    #[error("nic {nic}: completion queue of {cq_depth} entries is smaller than one QP's window of {window}")]
    CqTooSmall {
        nic: String,
        cq_depth: usize,
        window: usize,
    },
}

impl WorkerError {
    /// How a caller should react.
    pub fn kind(&self) -> FailureKind {
        match self {
            WorkerError::UnknownPeer { .. }
            | WorkerError::Connect { .. }
            | WorkerError::Reconnect { .. } => FailureKind::Connection,
            WorkerError::Rejected { .. }
            | WorkerError::Poller { .. }
            | WorkerError::CqTooSmall { .. } => FailureKind::Local,
            WorkerError::Stopped { .. } => FailureKind::Stopped,
            WorkerError::ReadFailed { status, .. } => FailureKind::of_status(*status),
        }
    }
}

impl FailureKind {
    /// How a caller reacts to a read that completed with `status` (not `Success`).
    ///
    /// A post the provider refused puts the QP in error like a failed completion does: it
    /// is drained and rebuilt, and the reads flushed beside it report the link. Calling it
    /// the link too gives one answer whichever batch reports first.
    pub fn of_status(status: CompletionStatus) -> Self {
        match status {
            CompletionStatus::RemoteAccessError => FailureKind::Remote,
            CompletionStatus::LocalWriteError => FailureKind::Local,
            _ => FailureKind::Connection,
        }
    }
}

/// Every request's completion in post order, or the typed failure.
pub type BatchResult = Result<Vec<WorkCompletion>, WorkerError>;

/// The QPs of a connect, or why it failed.
pub type ConnectResult = Result<Vec<QpKey>, WorkerError>;
