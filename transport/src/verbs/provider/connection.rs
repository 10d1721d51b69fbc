//! A requester's RC connection to a peer: requests cut into READs at the owner's MR
//! boundaries and `max_msg_sz`, issued (the first part at once, so a refusal is the caller's
//! error), aborted into error so everything flushes, and drained before the QP goes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::lock;
use super::send_queue::{ConnShared, Pending};
use super::VerbsNic;
use crate::completion::CompletionStatus;
use crate::connection::{Connection, ConnectionError, WorkRequest};
use crate::qp_key::NodeId;
use crate::verbs::qp_attrs::Transition;
use crate::verbs::registration::KeyMap;
use crate::verbs::work::{build_read, ReadWr};

/// One RC QP to a peer.
pub struct VerbsConnection {
    pub(super) nic: Arc<VerbsNic>,
    pub(super) shared: Arc<ConnShared>,
    pub(super) qpn: u32,
    pub(super) remote_keys: KeyMap,
    pub(super) max_sge: u32,
    pub(super) max_msg: u64,
    pub(super) peer: NodeId,
    pub(super) aborted: bool,
}

impl VerbsConnection {
    /// Cuts `wr` into READs: at the owner's MR boundaries and at `max_msg_sz`.
    fn parts(&self, wr: &WorkRequest) -> Result<Vec<ReadWr>, String> {
        let ranges = wr.scatter.ranges();
        let (start, len) = (wr.remote.addr, wr.remote.len);
        let end = start
            .checked_add(len)
            .ok_or_else(|| format!("remote range {start:#x}+{len} wraps"))?;
        let mut out = Vec::new();
        let mut at = start;
        // Position in the local ranges: (index, offset into it).
        let (mut li, mut lo) = (0usize, 0u64);
        let local_keys = self.nic.inner.device.local_keys();
        while at < end {
            let region_end = self
                .remote_keys
                .region_end(at)
                .ok_or_else(|| format!("remote {at:#x} is in no region the owner advertised"))?;
            let part_end = end.min(region_end).min(at.saturating_add(self.max_msg));
            let mut want = part_end - at;
            let mut local = Vec::new();
            while want > 0 {
                let (addr, rlen) = *ranges
                    .get(li)
                    .ok_or_else(|| "the destination is shorter than the read".to_string())?;
                let n = (rlen - lo).min(want);
                local.push((addr + lo, n));
                want -= n;
                lo += n;
                if lo == rlen {
                    li += 1;
                    lo = 0;
                }
            }
            let rd = crate::descriptor::RemoteDescriptor {
                addr: at,
                len: part_end - at,
                rkey: wr.remote.rkey,
            };
            let r = build_read(
                0,
                &rd,
                &local,
                &self.remote_keys,
                &local_keys,
                self.max_sge,
                self.max_msg,
            )
            .map_err(|e| e.to_string())?;
            out.push(r);
            at = part_end;
        }
        if out.is_empty() {
            return Err("a read of zero bytes".into());
        }
        Ok(out)
    }
}

impl Connection for VerbsConnection {
    fn peer(&self) -> NodeId {
        self.peer
    }

    fn issue(&mut self, wr: WorkRequest) -> Result<(), ConnectionError> {
        let peer = self.peer;
        let wr_id = wr.wr_id;
        if self.aborted || lock(&self.shared.sq).broken {
            return Err(ConnectionError::ConnectionLost { peer });
        }
        let post_err = |reason: String| ConnectionError::Post {
            peer,
            wr_id,
            reason,
        };
        let mut parts = self.parts(&wr).map_err(post_err)?;
        {
            let mut pending = lock(&self.shared.pending);
            if pending.contains_key(&wr_id) {
                // Two requests under one id would complete as one: refuse the second.
                return Err(post_err(format!("wr_id {wr_id} is already outstanding")));
            }
            pending.insert(
                wr_id,
                Pending {
                    wr,
                    parts_left: parts.len(),
                    status: CompletionStatus::Success,
                },
            );
        }
        // The first part is posted here when nothing waits before it, so that a refusal is
        // the caller's error; the rest (and everything behind a backlog) wait their turn.
        let first = {
            let mut sq = lock(&self.shared.sq);
            for p in &mut parts {
                sq.next_part += 1;
                p.wr_id = sq.next_part;
                sq.parts.insert(p.wr_id, wr_id);
            }
            let direct = sq.backlog.is_empty() && sq.posted < self.shared.max_send_wr;
            let first = if direct {
                sq.posted += 1;
                Some(parts.remove(0))
            } else {
                None
            };
            sq.backlog.extend(parts);
            first
        };
        if let Some(p) = first {
            if let Err(e) = self.nic.inner.device.ops().post_read(self.shared.qp, &p) {
                let mut sq = lock(&self.shared.sq);
                sq.posted -= 1;
                // Nothing of this request is posted: undo it whole.
                let ids: Vec<u64> = sq
                    .parts
                    .iter()
                    .filter(|(_, w)| **w == wr_id)
                    .map(|(p, _)| *p)
                    .collect();
                for id in &ids {
                    sq.parts.remove(id);
                }
                sq.backlog.retain(|b| !ids.contains(&b.wr_id));
                drop(sq);
                lock(&self.shared.pending).remove(&wr_id);
                return Err(post_err(e.to_string()));
            }
        }
        self.shared.pump();
        Ok(())
    }

    fn abort(&mut self) {
        if self.aborted {
            return;
        }
        self.aborted = true;
        // Error state flushes every outstanding read; parts never posted fail here.
        let _ = self
            .nic
            .inner
            .device
            .modify(self.shared.qp, &Transition::error());
        let unposted: Vec<u64> = {
            let mut sq = lock(&self.shared.sq);
            sq.broken = true;
            sq.backlog.drain(..).map(|w| w.wr_id).collect()
        };
        for part in unposted {
            self.shared
                .part_done(part, CompletionStatus::Flushed, false);
        }
    }
}

impl Drop for VerbsConnection {
    fn drop(&mut self) {
        self.abort();
        let deadline = Instant::now() + self.nic.nic.completion_timeout;
        while !lock(&self.shared.pending).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        lock(&self.nic.inner.conns).remove(&self.qpn);
        self.nic.inner.device.destroy_qp(self.shared.qp);
        // Whatever the NIC never flushed still completes exactly once.
        self.shared.fail_all(CompletionStatus::Flushed);
    }
}
