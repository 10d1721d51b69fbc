//! How one QP moves forward: which QP a post goes to, admission against the shared
//! completion queue, and recovery of a drained QP in error.

use std::time::Instant;

use kvferry_transport::{NodeId, Qp, QpError, QpKey, QpState};

use super::slot::{deliver, Batch};
use super::wr_ids::{caller_error, caller_fault};
use super::{ConnectJob, Event, PeerQueues, WorkerError};

impl<B, C> PeerQueues<B, C> {
    /// A ready QP of `peer` with the fewest outstanding requests, else any of its QPs.
    pub(super) fn pick(&self, peer: NodeId) -> Option<QpKey> {
        let p = self.peers.get(&peer)?;
        p.qps
            .iter()
            .filter_map(|k| self.slots.get(k).map(|s| (k, s)))
            .min_by_key(|(_, s)| {
                let ready =
                    s.qp.as_ref()
                        .is_some_and(|q| q.state() == QpState::ReadyToSend);
                (
                    !ready || !s.waiting.is_empty(),
                    s.qp.as_ref().map_or(0, Qp::outstanding) + s.waiting.len(),
                )
            })
            .map(|(k, _)| *k)
    }

    /// Lets stalled QPs in while the completion queue has room, in the order they stalled.
    pub(super) fn settle(&mut self, now: Instant) {
        let mut rounds = self.stalled.len();
        while rounds > 0 {
            rounds -= 1;
            let Some(key) = self.stalled.pop_front() else {
                return;
            };
            if let Some(slot) = self.slots.get_mut(&key) {
                slot.stalled = false;
            }
            self.advance(key, now);
            // Still no room: the rest (stalled later) wait behind it.
            if self.slots.get(&key).is_some_and(|s| s.stalled) {
                // `advance` put it back at the end; restore its place at the front.
                self.stalled.retain(|k| *k != key);
                self.stalled.push_front(key);
                return;
            }
        }
    }

    /// Brings one QP forward: hands reported requests to their batches, recovers a drained
    /// QP in error, and posts waiting batches while it is ready and the completion queue has
    /// room.
    pub(super) fn advance(&mut self, key: QpKey, now: Instant) {
        let nic = &self.config.name;
        let peer = self.peers.get(&key.peer);
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        loop {
            let Some(qp) = slot.qp.as_mut() else {
                // A connect job holds it; its return brings it forward.
                return;
            };
            // The cause first, while the batch it names is still here to translate its id.
            if slot.fault.is_none() {
                slot.fault = qp.fault().map(|f| caller_fault(f, &slot.batches));
                if let Some(fault) = slot.fault {
                    tracing::warn!(%nic, qp = %key, ?fault, outstanding = qp.outstanding(), "QP in error: draining before it is rebuilt");
                }
            }
            self.scratch.clear();
            qp.poll_completions(&mut self.scratch);
            deliver(
                key,
                &mut slot.batches,
                slot.fault,
                &self.scratch,
                &mut self.errors,
                &mut self.stray,
                &mut self.events,
            );
            let charge = qp.outstanding().min(self.window);
            self.cq_charged = self.cq_charged + charge - slot.charge;
            slot.charge = charge;

            match qp.state() {
                QpState::Error if qp.is_drained() => {
                    // Errors drain before release: every batch has been answered now.
                    if qp.reset().is_err() {
                        return;
                    }
                    slot.fault = None;
                    self.reconnects += 1;
                    // Rebuild right away so the QP is ready before the next post.
                    let Some(p) = peer else { return };
                    if let Some(qp) = slot.qp.take() {
                        self.jobs.push_back(ConnectJob {
                            qp,
                            connector: p.connector.clone(),
                            sink: self.sink.clone(),
                            generation: p.generation,
                        });
                    }
                    return;
                }
                QpState::Reset if !slot.waiting.is_empty() => {
                    let Some(p) = peer else { return };
                    if let Some(qp) = slot.qp.take() {
                        self.jobs.push_back(ConnectJob {
                            qp,
                            connector: p.connector.clone(),
                            sink: self.sink.clone(),
                            generation: p.generation,
                        });
                    }
                    return;
                }
                QpState::ReadyToSend => {
                    if slot.stalled {
                        // Waits for its turn in `settle`.
                        return;
                    }
                    let Some(front) = slot.waiting.front() else {
                        return;
                    };
                    let len = front.reads.len();
                    if len == 0 {
                        if let Some(w) = slot.waiting.pop_front() {
                            self.events.push_back(Event::Batch {
                                reply: w.reply,
                                result: Ok(Vec::new()),
                            });
                        }
                        continue;
                    }
                    // Admission: the completions this QP may owe at once after the post.
                    let after = (qp.outstanding() + len).min(self.window);
                    if self.cq_charged - slot.charge + after > self.cq_depth {
                        slot.stalled = true;
                        self.stalled.push_back(key);
                        return;
                    }
                    let Some(mut w) = slot.waiting.pop_front() else {
                        return;
                    };
                    let first = slot.next_wr;
                    slot.next_wr += len as u64;
                    let ids: Vec<u64> = w
                        .reads
                        .iter_mut()
                        .zip(first..)
                        .map(|(r, id)| std::mem::replace(&mut r.wr_id, id))
                        .collect();
                    let batch = Batch {
                        first,
                        ids,
                        done: Vec::with_capacity(len),
                        reply: w.reply,
                    };
                    match qp.post(&w.reads, now) {
                        Ok(_) => slot.batches.push_back(batch),
                        // The batch was queued and a post failed while issuing it: the QP
                        // is in error and the batch drains like any other.
                        Err(QpError::Post { .. } | QpError::NotConnected { .. }) => {
                            slot.batches.push_back(batch)
                        }
                        Err(source) => {
                            self.events.push_back(Event::Batch {
                                reply: batch.reply,
                                result: Err(WorkerError::Rejected {
                                    nic: nic.clone(),
                                    source: caller_error(source, first, &batch.ids),
                                }),
                            });
                        }
                    }
                    continue;
                }
                _ => return,
            }
        }
    }
}
