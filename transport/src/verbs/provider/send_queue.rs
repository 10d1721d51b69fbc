//! One requester QP's outstanding work, shared by its connection (which issues) and the
//! poller thread (which completes): each request's parts, the send-queue slots they hold and
//! the backlog that waits for room, and the single report per request.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use super::lock;
use crate::completion::{CompletionSink, CompletionStatus, WorkCompletion};
use crate::connection::WorkRequest;
use crate::qp_key::{NodeId, QpKey};
use crate::verbs::device::VerbsDevice;
use crate::verbs::ops::Handle;
use crate::verbs::work::ReadWr;

/// An issued request: holding it holds its destination (the scatter pins the regions, so
/// they stay registered) until its last part completes.
pub(super) struct Pending {
    pub(super) wr: WorkRequest,
    pub(super) parts_left: usize,
    pub(super) status: CompletionStatus,
}

#[derive(Default)]
pub(super) struct SendQueue {
    /// Part id → request wr_id.
    pub(super) parts: HashMap<u64, u64>,
    /// Parts not yet posted (the send queue was full).
    pub(super) backlog: VecDeque<ReadWr>,
    pub(super) posted: usize,
    pub(super) next_part: u64,
    /// The QP failed outside a completion (CQ overrun): nothing more is posted.
    pub(super) broken: bool,
}

pub(super) struct ConnShared {
    pub(super) key: QpKey,
    pub(super) peer: NodeId,
    pub(super) qp: Handle,
    pub(super) cq: Handle,
    pub(super) device: Arc<VerbsDevice>,
    pub(super) max_send_wr: usize,
    pub(super) sink: Arc<dyn CompletionSink>,
    pub(super) pending: Mutex<HashMap<u64, Pending>>,
    pub(super) sq: Mutex<SendQueue>,
}

impl ConnShared {
    /// Posts backlogged parts while the send queue has room.
    pub(super) fn pump(&self) {
        loop {
            let wr = {
                let mut sq = lock(&self.sq);
                if sq.broken || sq.posted >= self.max_send_wr {
                    return;
                }
                let Some(wr) = sq.backlog.pop_front() else {
                    return;
                };
                sq.posted += 1;
                wr
            };
            if let Err(e) = self.device.ops().post_read(self.qp, &wr) {
                tracing::warn!(peer = %self.peer, error = %e, "verbs: posting a read part failed");
                lock(&self.sq).posted -= 1;
                self.part_done(wr.wr_id, CompletionStatus::PostFailed, false);
            }
        }
    }

    /// One part finished (`posted`: it had been posted, so it held a send-queue slot).
    pub(super) fn part_done(&self, part: u64, status: CompletionStatus, posted: bool) {
        let wr_id = {
            let mut sq = lock(&self.sq);
            if posted {
                sq.posted = sq.posted.saturating_sub(1);
            }
            match sq.parts.remove(&part) {
                Some(w) => w,
                None => return,
            }
        };
        let finished = {
            let mut pending = lock(&self.pending);
            let Some(p) = pending.get_mut(&wr_id) else {
                return;
            };
            p.parts_left -= 1;
            if !status.is_success() && p.status.is_success() {
                p.status = status;
            }
            if p.parts_left == 0 {
                pending.remove(&wr_id)
            } else {
                None
            }
        };
        if let Some(p) = finished {
            self.complete(wr_id, p);
        }
    }

    /// Finishes one request: make device pieces visible on success, release the
    /// destination, then report.
    fn complete(&self, wr_id: u64, p: Pending) {
        let len = p.wr.remote.len;
        let status = if p.status.is_success() {
            match p.wr.scatter.finish() {
                Ok(()) => CompletionStatus::Success,
                Err(_) => CompletionStatus::LocalWriteError,
            }
        } else {
            p.status
        };
        drop(p);
        self.sink.push(WorkCompletion {
            qp: self.key,
            wr_id,
            status,
            bytes: if status.is_success() { len } else { 0 },
        });
    }

    /// Fails every outstanding request with `status` (the QP is unusable and nothing more
    /// will come from the device for it).
    pub(super) fn fail_all(&self, status: CompletionStatus) {
        {
            let mut sq = lock(&self.sq);
            sq.broken = true;
            sq.backlog.clear();
            sq.parts.clear();
            sq.posted = 0;
        }
        let left: Vec<(u64, Pending)> = lock(&self.pending).drain().collect();
        for (wr_id, mut p) in left {
            p.status = status;
            self.complete(wr_id, p);
        }
    }
}
