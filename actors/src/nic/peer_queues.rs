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

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kvferry_transport::{
    CompletionSink, CompletionStatus, ConnectionError, Connector, MrTable, NicConfig, NicId,
    NodeId, Qp, QpError, QpGaugeValues, QpGauges, QpKey, QpNum, QpState, QueueFault, RcQueueError,
    ReadRequest, WorkCompletion,
};
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
    fn add(&mut self, s: QpState) {
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
    fn count(&mut self, s: CompletionStatus) {
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

/// What the driver delivers: `B` answers a batch, `C` a connect.
#[derive(Debug)]
pub enum Event<B, C> {
    Batch { reply: B, result: BatchResult },
    Connect { reply: C, result: ConnectResult },
}

/// One QP to bring from reset to ready-to-send: the connection and the handshake block on
/// the network, so the driver runs [`ConnectJob::run`] off its thread and feeds the outcome
/// back with [`PeerQueues::handle_connected`].
pub struct ConnectJob {
    qp: Qp,
    connector: Arc<dyn Connector>,
    sink: Arc<dyn CompletionSink>,
    generation: u64,
}

impl std::fmt::Debug for ConnectJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectJob").field("qp", &self.qp).finish()
    }
}

impl ConnectJob {
    pub fn key(&self) -> QpKey {
        self.qp.key()
    }

    /// Connects (blocking).
    pub fn run(mut self) -> Connected {
        let result = self.qp.connect(&self.connector, self.sink.clone());
        Connected {
            qp: self.qp,
            result,
            generation: self.generation,
        }
    }
}

/// A connect job's outcome, with its QP.
pub struct Connected {
    qp: Qp,
    result: Result<(), QpError>,
    generation: u64,
}

impl std::fmt::Debug for Connected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connected")
            .field("qp", &self.qp)
            .field("result", &self.result)
            .finish()
    }
}

struct Batch<B> {
    /// The QP-local id of the first read; the batch's reads carry `first..first + ids.len()`.
    first: u64,
    /// The callers' ids, restored on the completions.
    ids: Vec<u64>,
    done: Vec<WorkCompletion>,
    reply: B,
}

struct Waiting<B> {
    reads: Vec<ReadRequest>,
    reply: B,
}

struct Slot<B> {
    /// `None` while a connect job holds it.
    qp: Option<Qp>,
    /// Batches posted on this QP, in post order (reports come back in the same order).
    batches: VecDeque<Batch<B>>,
    /// Posts held back: QP not ready, or no room in the completion queue.
    waiting: VecDeque<Waiting<B>>,
    /// The cause of the current error state (callers' ids), for the drained batches' replies.
    fault: Option<QueueFault>,
    /// The next QP-local `wr_id`; never reused, so no two pending reads share one.
    next_wr: u64,
    /// What this QP counts against the completion queue now.
    charge: usize,
    /// In the stalled list (its head batch waits for room in the completion queue).
    stalled: bool,
}

/// The connect requests of a peer whose QPs are being opened for the first time.
struct Opening<C> {
    replies: Vec<C>,
    pending: usize,
    failed: Option<Arc<QpError>>,
}

struct Peer<C> {
    connector: Arc<dyn Connector>,
    /// Bumped when the connector is replaced: a connect job of an older one is stale.
    generation: u64,
    qps: Vec<QpKey>,
    opening: Option<Opening<C>>,
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

    /// Opens `qps` QPs (default: the NIC's qps-per-peer) to `peer` through `connector`;
    /// `reply` is answered once every one is connected, or with the first failure (then
    /// nothing of the peer is kept). A known peer's QPs are answered at once; a known peer
    /// with another connector (it restarted, at a new endpoint) has its QPs errored, drained
    /// and rebuilt through the new one.
    pub fn handle_connect(
        &mut self,
        peer: NodeId,
        connector: Arc<dyn Connector>,
        qps: Option<u32>,
        reply: C,
        now: Instant,
    ) {
        if let Some(p) = self.peers.get_mut(&peer) {
            if let Some(o) = p.opening.as_mut() {
                // Answered with the connect already under way.
                o.replies.push(reply);
                return;
            }
            let keys = p.qps.clone();
            let replaced = !Arc::ptr_eq(&p.connector, &connector);
            if replaced {
                p.connector = connector;
                p.generation += 1;
            }
            if replaced {
                // Another connector for a known peer: it restarted, at a new endpoint. Its
                // QPs' connections (even idle ones that look ready) lead to the dead process:
                // error them, let them drain, and reconnect through the new one.
                tracing::info!(nic = %self.config.name, %peer, "peer re-linked: rebuilding its QPs");
                for key in &keys {
                    if let Some(qp) = self.slots.get_mut(key).and_then(|s| s.qp.as_mut()) {
                        qp.set_error();
                    }
                    self.advance(*key, now);
                }
                self.settle(now);
            }
            self.events.push_back(Event::Connect {
                reply,
                result: Ok(keys),
            });
            return;
        }
        let n = qps.unwrap_or(self.config.qps_per_peer).max(1);
        let mut keys = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let key = QpKey::new(peer, self.nic, QpNum(self.next_qp));
            self.next_qp = self.next_qp.wrapping_add(1).max(1);
            let qp = Qp::new(
                key,
                self.config.queue_limits(),
                self.table.clone(),
                self.gauges.clone(),
            );
            self.jobs.push_back(ConnectJob {
                qp,
                connector: connector.clone(),
                sink: self.sink.clone(),
                generation: 0,
            });
            self.slots.insert(key, Slot::new());
            keys.push(key);
        }
        self.peers.insert(
            peer,
            Peer {
                connector,
                generation: 0,
                qps: keys,
                opening: Some(Opening {
                    replies: vec![reply],
                    pending: n as usize,
                    failed: None,
                }),
            },
        );
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

    /// A connect job is back.
    pub fn handle_connected(&mut self, done: Connected, now: Instant) {
        let Connected {
            mut qp,
            result,
            generation,
        } = done;
        let key = qp.key();
        let Some(peer) = self.peers.get_mut(&key.peer) else {
            // The peer was given up meanwhile; the QP closes here.
            return;
        };
        if let Some(o) = peer.opening.as_mut() {
            o.pending = o.pending.saturating_sub(1);
            if let Err(e) = result {
                o.failed.get_or_insert_with(|| Arc::new(e));
            }
            let finished = o.pending == 0;
            if let Some(slot) = self.slots.get_mut(&key) {
                slot.qp = Some(qp);
            }
            if finished {
                self.finish_opening(key.peer, now);
            }
            return;
        }
        let stale = generation != peer.generation;
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        match result {
            Ok(()) => {
                if stale {
                    // Connected through a connector replaced meanwhile: rebuild at once.
                    qp.set_error();
                }
                slot.qp = Some(qp);
            }
            Err(e) => {
                tracing::warn!(nic = %self.config.name, qp = %key, error = %e, "reconnecting a QP failed");
                slot.qp = Some(qp);
                let source = Arc::new(e);
                while let Some(w) = slot.waiting.pop_front() {
                    self.events.push_back(Event::Batch {
                        reply: w.reply,
                        result: Err(WorkerError::Reconnect {
                            qp: key,
                            source: Arc::clone(&source),
                        }),
                    });
                }
                if slot.stalled {
                    slot.stalled = false;
                    self.stalled.retain(|k| *k != key);
                }
                // Stays in reset; the next post tries again.
                return;
            }
        }
        self.advance(key, now);
        self.settle(now);
    }

    /// A connect job was lost (its thread panicked): the QP went with it. A new one in reset
    /// takes its place, and the connect counts as failed.
    pub fn handle_connect_lost(&mut self, key: QpKey, now: Instant) {
        let qp = Qp::new(
            key,
            self.config.queue_limits(),
            self.table.clone(),
            self.gauges.clone(),
        );
        let generation = self.peers.get(&key.peer).map_or(0, |p| p.generation);
        let result = Err(QpError::Connect {
            qp: key,
            source: ConnectionError::Setup {
                peer: key.peer,
                what: "connect job",
                source: std::io::Error::other("the connect job panicked"),
            },
        });
        self.handle_connected(
            Connected {
                qp,
                result,
                generation,
            },
            now,
        );
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

    /// Every QP of a peer opened for the first time is back.
    fn finish_opening(&mut self, peer: NodeId, now: Instant) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        let Some(opening) = p.opening.take() else {
            return;
        };
        let keys = p.qps.clone();
        if let Some(source) = opening.failed {
            tracing::warn!(nic = %self.config.name, %peer, error = %source, "connecting to a peer failed");
            self.peers.remove(&peer);
            let mut waiting = Vec::new();
            for key in &keys {
                if let Some(mut slot) = self.slots.remove(key) {
                    // The QPs that did connect close here.
                    drop(slot.qp.take());
                    waiting.extend(slot.waiting.drain(..).map(|w| w.reply));
                }
            }
            self.stalled.retain(|k| k.peer != peer);
            let err = |nic: &str| WorkerError::Connect {
                nic: nic.to_string(),
                peer,
                source: Arc::clone(&source),
            };
            for reply in waiting {
                self.events.push_back(Event::Batch {
                    reply,
                    result: Err(err(&self.config.name)),
                });
            }
            for reply in opening.replies {
                self.events.push_back(Event::Connect {
                    reply,
                    result: Err(err(&self.config.name)),
                });
            }
            return;
        }
        tracing::info!(nic = %self.config.name, %peer, qps = keys.len(), "peer connected");
        for reply in opening.replies {
            self.events.push_back(Event::Connect {
                reply,
                result: Ok(keys.clone()),
            });
        }
        for key in keys {
            self.advance(key, now);
        }
        self.settle(now);
    }

    /// A ready QP of `peer` with the fewest outstanding requests, else any of its QPs.
    fn pick(&self, peer: NodeId) -> Option<QpKey> {
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
    fn settle(&mut self, now: Instant) {
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
    fn advance(&mut self, key: QpKey, now: Instant) {
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

impl<B> Slot<B> {
    fn new() -> Self {
        Slot {
            qp: None,
            batches: VecDeque::new(),
            waiting: VecDeque::new(),
            fault: None,
            next_wr: 1,
            charge: 0,
            stalled: false,
        }
    }
}

/// The caller's id of QP-local id `id`, where a batch still holds it.
fn caller_id<B>(batches: &VecDeque<Batch<B>>, id: u64) -> u64 {
    batches
        .iter()
        .find_map(|b| {
            let i = id.checked_sub(b.first)?;
            b.ids.get(usize::try_from(i).ok()?).copied()
        })
        .unwrap_or(id)
}

fn caller_fault<B>(f: QueueFault, batches: &VecDeque<Batch<B>>) -> QueueFault {
    let id = |id| caller_id(batches, id);
    match f {
        QueueFault::Completion { wr_id, status } => QueueFault::Completion {
            wr_id: id(wr_id),
            status,
        },
        QueueFault::PostFailed { wr_id } => QueueFault::PostFailed { wr_id: id(wr_id) },
        QueueFault::Timeout { wr_id } => QueueFault::Timeout { wr_id: id(wr_id) },
        QueueFault::ConnectionLost { wr_id } => QueueFault::ConnectionLost { wr_id: id(wr_id) },
        other => other,
    }
}

/// A refusal of a batch that was never queued, naming the caller's `wr_id`.
fn caller_error(e: QpError, first: u64, ids: &[u64]) -> QpError {
    let id = |id: u64| {
        id.checked_sub(first)
            .and_then(|i| ids.get(usize::try_from(i).ok()?).copied())
            .unwrap_or(id)
    };
    match e {
        QpError::LocalSegment { qp, wr_id, source } => QpError::LocalSegment {
            qp,
            wr_id: id(wr_id),
            source,
        },
        QpError::LengthMismatch {
            qp,
            wr_id,
            remote_len,
            local_len,
        } => QpError::LengthMismatch {
            qp,
            wr_id: id(wr_id),
            remote_len,
            local_len,
        },
        QpError::Queue { qp, source } => QpError::Queue {
            qp,
            source: match source {
                RcQueueError::TooManySegments {
                    wr_id,
                    sges,
                    max_sge,
                } => RcQueueError::TooManySegments {
                    wr_id: id(wr_id),
                    sges,
                    max_sge,
                },
                RcQueueError::EmptyRequest { wr_id } => {
                    RcQueueError::EmptyRequest { wr_id: id(wr_id) }
                }
                other => other,
            },
        },
        other => other,
    }
}

/// Hands in-order reports to the batches they belong to (restoring the callers' ids);
/// answers finished batches.
fn deliver<B, C>(
    qp: QpKey,
    batches: &mut VecDeque<Batch<B>>,
    fault: Option<QueueFault>,
    reports: &[WorkCompletion],
    errors: &mut CompletionErrorCounts,
    stray: &mut u64,
    events: &mut VecDeque<Event<B, C>>,
) {
    for wc in reports {
        errors.count(wc.status);
        let Some(front) = batches.front_mut() else {
            *stray += 1;
            continue;
        };
        let mut wc = *wc;
        wc.wr_id = front.ids.get(front.done.len()).copied().unwrap_or(wc.wr_id);
        front.done.push(wc);
        if front.done.len() < front.ids.len() {
            continue;
        }
        let Some(b) = batches.pop_front() else {
            continue;
        };
        let result = match b.done.iter().find(|c| !c.status.is_success()) {
            None => Ok(b.done),
            Some(first) => Err(WorkerError::ReadFailed {
                qp,
                wr_id: first.wr_id,
                status: first.status,
                fault,
                completions: b.done.clone(),
            }),
        };
        events.push_back(Event::Batch {
            reply: b.reply,
            result,
        });
    }
}

#[cfg(test)]
mod tests;
