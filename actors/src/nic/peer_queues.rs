//! `PeerQueues`: the bookkeeping of one NIC's QPs to every peer, as a plain struct. No actor,
//! no clock, no thread, nothing that blocks: the NIC worker (or a test) feeds it with
//! `handle_*` calls, passing `now`, and takes what it produced with `poll_*`:
//!
//! - [`PeerQueues::handle_connect`] / [`PeerQueues::handle_post`] (requests from the load
//!   path), [`PeerQueues::handle_completions`] (one round of the completion queue),
//!   [`PeerQueues::handle_connected`] (a connect job is back), [`PeerQueues::handle_timeout`];
//! - [`PeerQueues::poll_event`] (answers to send), [`PeerQueues::poll_connect`] (connects and
//!   handshakes to run off the driver's thread: they block on the network),
//!   [`PeerQueues::poll_timeout`] (when to call `handle_timeout` next).
//!
//! The rules it keeps:
//! - **Windows**: each QP issues at most `min(max_send_wr, max_rd_atomic)` reads (the RC queue
//!   enforces it); batches beyond it queue on the QP.
//! - **The shared CQ is never overrun**: every issued read yields one completion on the NIC's
//!   one CQ, so a batch is admitted onto a QP only while the reads the QPs may have issued at
//!   once (per QP the smaller of its outstanding reads and its window) fit in the CQ's depth;
//!   otherwise it waits, in order, until completions make room.
//! - **Ordering**: each batch is answered once, after every one of its reads is reported, with
//!   the completions in post order; batches of one QP are answered in post order.
//! - **`wr_id`s are unique per QP**: callers' ids are replaced by a per-QP counter on the way
//!   in and restored on the way out, so two links posting the same ids to one peer (an old one
//!   draining beside a new one) never alias each other's requests.
//! - **Errors drain before release**: on a completion error, timeout, failed post or lost
//!   connection the QP goes to error, every outstanding read is drained (flushes counted), the
//!   batches are answered, and only then is the QP reset and rebuilt through a connect job.

mod advance;
mod connect_job;
mod error;
mod gauges;
mod peer;
mod slot;
mod wr_ids;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kvferry_transport::{
    CompletionSink, MrTable, NicConfig, NicId, NodeId, Qp, QpGauges, QpKey, QpState, ReadRequest,
    WorkCompletion,
};
// The tests name it through `use super::*`, as they did before the split.
#[cfg(test)]
use kvferry_transport::QpError;

pub use connect_job::{ConnectJob, Connected};
pub use error::{BatchResult, ConnectResult, FailureKind, WorkerError};
pub use gauges::{CompletionErrorCounts, QpStateCounts, WorkerGaugeValues};

use peer::Peer;
use slot::{Slot, Waiting};

/// What the driver delivers: `B` answers a batch, `C` a connect.
#[derive(Debug)]
pub enum Event<B, C> {
    Batch { reply: B, result: BatchResult },
    Connect { reply: C, result: ConnectResult },
}

/// The per-QP bookkeeping of one NIC (see the module documentation).
pub struct PeerQueues<B, C> {
    nic: NicId,
    config: NicConfig,
    window: usize,
    table: MrTable,
    gauges: Arc<QpGauges>,
    sink: Arc<dyn CompletionSink>,
    cq_depth: usize,
    cq_charged: usize,
    peers: HashMap<NodeId, Peer<C>>,
    slots: HashMap<QpKey, Slot<B>>,
    next_qp: u32,
    /// QPs whose head batch waits for room in the completion queue, in the order they
    /// stalled (the first to stall is the first let in).
    stalled: VecDeque<QpKey>,
    jobs: VecDeque<ConnectJob>,
    events: VecDeque<Event<B, C>>,
    reconnects: u64,
    stray: u64,
    errors: CompletionErrorCounts,
    scratch: Vec<WorkCompletion>,
}

impl<B, C> std::fmt::Debug for PeerQueues<B, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerQueues")
            .field("nic", &self.config.name)
            .field("peers", &self.peers.len())
            .field("qps", &self.slots.len())
            .field("cq_charged", &self.cq_charged)
            .finish()
    }
}

impl<B, C> PeerQueues<B, C> {
    /// Queues of NIC `nic` whose destinations are checked against `table`, whose providers
    /// deliver completions to `sink`, a completion queue of `cq_depth` entries.
    pub fn new(
        nic: NicId,
        config: NicConfig,
        table: MrTable,
        sink: Arc<dyn CompletionSink>,
        cq_depth: usize,
    ) -> Result<Self, WorkerError> {
        let window = config.queue_limits().window() as usize;
        if cq_depth < window {
            return Err(WorkerError::CqTooSmall {
                nic: config.name.clone(),
                cq_depth,
                window,
            });
        }
        Ok(PeerQueues {
            nic,
            config,
            window,
            table,
            gauges: Arc::new(QpGauges::default()),
            sink,
            cq_depth,
            cq_charged: 0,
            peers: HashMap::new(),
            slots: HashMap::new(),
            next_qp: 1,
            stalled: VecDeque::new(),
            jobs: VecDeque::new(),
            events: VecDeque::new(),
            reconnects: 0,
            stray: 0,
            errors: CompletionErrorCounts::default(),
            scratch: Vec::new(),
        })
    }

    pub fn config(&self) -> &NicConfig {
        &self.config
    }

    pub fn gauge_values(&self) -> WorkerGaugeValues {
        let mut g = WorkerGaugeValues {
            qp: self.gauges.snapshot(),
            reconnects: self.reconnects,
            stray: self.stray,
            completion_errors: self.errors,
            cq_charged: self.cq_charged,
            cq_depth: self.cq_depth,
            ..WorkerGaugeValues::default()
        };
        for s in self.slots.values() {
            match s.qp.as_ref().map(Qp::state) {
                None => {
                    g.states.add(QpState::Init);
                    g.connecting += 1;
                    g.reset += 1;
                }
                Some(state) => {
                    g.states.add(state);
                    match state {
                        QpState::ReadyToSend => g.ready += 1,
                        QpState::Error => g.error += 1,
                        _ => g.reset += 1,
                    }
                }
            }
            g.batches += s.batches.len();
            g.waiting += s.waiting.len();
        }
        g
    }

    /// The next answer to deliver.
    pub fn poll_event(&mut self) -> Option<Event<B, C>> {
        self.events.pop_front()
    }

    /// The next connect to run off the driver's thread.
    pub fn poll_connect(&mut self) -> Option<ConnectJob> {
        self.jobs.pop_front()
    }

    /// When the oldest read in flight on any QP times out: call `handle_timeout` then.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.slots
            .values()
            .filter_map(|s| s.qp.as_ref()?.next_deadline())
            .min()
    }

    /// Queues an ordered batch of reads to `peer` on one of its QPs; `reply` is answered once
    /// every read has completed or been flushed.
    pub fn handle_post(&mut self, peer: NodeId, reads: Vec<ReadRequest>, reply: B, now: Instant) {
        let Some(key) = self.pick(peer) else {
            self.events.push_back(Event::Batch {
                reply,
                result: Err(WorkerError::UnknownPeer {
                    nic: self.config.name.clone(),
                    peer,
                }),
            });
            return;
        };
        if let Some(slot) = self.slots.get_mut(&key) {
            slot.waiting.push_back(Waiting { reads, reply });
        }
        self.advance(key, now);
        self.settle(now);
    }

    /// One round of completions from the completion queue.
    pub fn handle_completions(&mut self, batch: &[WorkCompletion], now: Instant) {
        let mut touched: Vec<QpKey> = Vec::new();
        for wc in batch {
            match self.slots.get_mut(&wc.qp).and_then(|s| s.qp.as_mut()) {
                Some(qp) => {
                    // An error here is a completion the queue does not know (already
                    // flushed); the queue state stays consistent, so it is only counted.
                    if qp.handle_completion(wc, now).is_err() {
                        self.stray += 1;
                    }
                    if !touched.contains(&wc.qp) {
                        touched.push(wc.qp);
                    }
                }
                None => self.stray += 1,
            }
        }
        for key in touched {
            self.advance(key, now);
        }
        self.settle(now);
    }

    /// Checks completion timeouts against `now`; a QP past it goes to error and drains.
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut expired = Vec::new();
        for (key, slot) in &mut self.slots {
            if let Some(qp) = slot.qp.as_mut() {
                if qp.poll_timeout(now).is_some() || qp.state() == QpState::Error {
                    expired.push(*key);
                }
            }
        }
        for key in expired {
            self.advance(key, now);
        }
        self.settle(now);
    }

    /// Stops everything: every QP goes to error and closes (its connection joined, so nothing
    /// lands afterwards), then every batch, post and connect still open is answered with
    /// `Stopped`. Connect jobs out keep their QP and close it when they finish.
    pub fn shutdown(&mut self) {
        let nic = self.config.name.clone();
        let stopped = || WorkerError::Stopped { nic: nic.clone() };
        let mut batches = Vec::new();
        for (_, mut slot) in self.slots.drain() {
            if let Some(mut qp) = slot.qp.take() {
                qp.set_error();
                // Dropping the QP aborts and joins its connection before destinations release.
                drop(qp);
            }
            batches.extend(slot.batches.drain(..).map(|b| b.reply));
            batches.extend(slot.waiting.drain(..).map(|w| w.reply));
        }
        for reply in batches {
            self.events.push_back(Event::Batch {
                reply,
                result: Err(stopped()),
            });
        }
        for (_, peer) in self.peers.drain() {
            for reply in peer.opening.into_iter().flat_map(|o| o.replies) {
                self.events.push_back(Event::Connect {
                    reply,
                    result: Err(stopped()),
                });
            }
        }
        self.jobs.clear();
        self.stalled.clear();
        self.cq_charged = 0;
    }
}

#[cfg(test)]
mod tests;
