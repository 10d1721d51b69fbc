//! What a finished work request reports, and where providers deliver it.

use std::fmt;

use crate::qp_key::QpKey;

/// Outcome of one work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CompletionStatus {
    Success,
    /// The owner refused the read: unknown key, out of bounds or no remote-read access.
    RemoteAccessError,
    /// A local destination could not be written (device sink failure, length mismatch).
    LocalWriteError,
    /// The request was drained without executing because its QP went to error.
    Flushed,
    /// The connection failed while the request was outstanding.
    TransportError,
    /// The request was outstanding past the completion timeout.
    TimedOut,
    /// The provider refused to post the request.
    PostFailed,
}

impl CompletionStatus {
    pub fn is_success(self) -> bool {
        self == CompletionStatus::Success
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CompletionStatus::Success => "success",
            CompletionStatus::RemoteAccessError => "remote_access_error",
            CompletionStatus::LocalWriteError => "local_write_error",
            CompletionStatus::Flushed => "flushed",
            CompletionStatus::TransportError => "transport_error",
            CompletionStatus::TimedOut => "timed_out",
            CompletionStatus::PostFailed => "post_failed",
        }
    }
}

impl fmt::Display for CompletionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One completion: raw from a provider on the completion queue, or in order from a QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    pub qp: QpKey,
    pub wr_id: u64,
    pub status: CompletionStatus,
    /// Bytes placed in the destination (0 unless `Success`).
    pub bytes: u64,
}

/// Where a provider delivers completions: a [`crate::CompletionQueue`], or a wrapper around
/// one (the fault injector interposes here). Must not block for long; providers may call it
/// from inside `Connection::issue`.
pub trait CompletionSink: Send + Sync {
    fn push(&self, wc: WorkCompletion);
}
