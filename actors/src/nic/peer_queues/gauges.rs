//! What a worker reports about itself: QPs by state, failed completions by status, and the
//! snapshot the `kvferry_*` gauges are read from.

use kvferry_transport::{CompletionStatus, QpGaugeValues, QpState};

/// QPs of a worker by state (the `kvferry_qps{state}` gauge). A QP whose connect job is out
/// counts as `init`: it is on its way from reset to ready-to-send.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpStateCounts {
    pub reset: usize,
    pub init: usize,
    pub rtr: usize,
    pub rts: usize,
    pub error: usize,
}

impl QpStateCounts {
    pub(super) fn add(&mut self, s: QpState) {
        match s {
            QpState::Reset => self.reset += 1,
            QpState::Init => self.init += 1,
            QpState::ReadyToReceive => self.rtr += 1,
            QpState::ReadyToSend => self.rts += 1,
            QpState::Error => self.error += 1,
        }
    }

    /// `(state label, QPs)` for every state, zeros included.
    pub fn labelled(&self) -> [(&'static str, usize); 5] {
        [
            ("reset", self.reset),
            ("init", self.init),
            ("rtr", self.rtr),
            ("rts", self.rts),
            ("error", self.error),
        ]
    }
}

/// Reported requests that did not succeed, by status (flushes included: each drained request
/// of a QP in error counts once).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompletionErrorCounts {
    pub remote_access_error: u64,
    pub local_write_error: u64,
    pub flushed: u64,
    pub transport_error: u64,
    pub timed_out: u64,
    pub post_failed: u64,
}

impl CompletionErrorCounts {
    pub(super) fn count(&mut self, s: CompletionStatus) {
        match s {
            CompletionStatus::Success => {}
            CompletionStatus::RemoteAccessError => self.remote_access_error += 1,
            CompletionStatus::LocalWriteError => self.local_write_error += 1,
            CompletionStatus::Flushed => self.flushed += 1,
            CompletionStatus::TimedOut => self.timed_out += 1,
            CompletionStatus::PostFailed => self.post_failed += 1,
            // A status added later is a transport failure until it gets its own label.
            _ => self.transport_error += 1,
        }
    }

    pub fn total(&self) -> u64 {
        self.labelled().iter().map(|(_, n)| n).sum()
    }

    /// `(status label, completions)` for every error status, zeros included.
    pub fn labelled(&self) -> [(&'static str, u64); 6] {
        [
            (
                CompletionStatus::RemoteAccessError.as_str(),
                self.remote_access_error,
            ),
            (
                CompletionStatus::LocalWriteError.as_str(),
                self.local_write_error,
            ),
            (CompletionStatus::Flushed.as_str(), self.flushed),
            (
                CompletionStatus::TransportError.as_str(),
                self.transport_error,
            ),
            (CompletionStatus::TimedOut.as_str(), self.timed_out),
            (CompletionStatus::PostFailed.as_str(), self.post_failed),
        ]
    }
}

/// Snapshot of a worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerGaugeValues {
    pub qp: QpGaugeValues,
    pub ready: usize,
    pub error: usize,
    pub reset: usize,
    /// QPs whose connect job is out (counted in `reset` too).
    pub connecting: usize,
    /// Batches posted and not yet answered.
    pub batches: usize,
    /// Posts waiting for a connect, a reconnect or room in the completion queue.
    pub waiting: usize,
    /// Completions the QPs may have outstanding at once (what admission charges against the
    /// completion queue), and the queue's depth.
    pub cq_charged: usize,
    pub cq_depth: usize,
    pub reconnects: u64,
    /// Completions for QPs this worker does not know (dropped).
    pub stray: u64,
    pub states: QpStateCounts,
    pub completion_errors: CompletionErrorCounts,
}
