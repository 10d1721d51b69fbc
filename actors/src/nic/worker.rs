//! `NicWorker`: one per NIC, on its own `Arbiter`. Owns the QPs to every peer, keyed by
//! (peer node id, NIC, QP number), connects them, posts ordered batches and answers each batch
//! once all of its requests are reported. Completions arrive from the NIC's
//! [`CompletionPoller`] as a stream of batches.
//!
//! On a QP error the worker keeps feeding completions until the QP has drained, then resets
//! and reconnects it; posts that arrive meanwhile wait for the reconnect.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{Actor, AsyncContext, Context, Handler, Message, MessageResult, StreamHandler};
use kvferry_transport::{
    CompletionQueue, CompletionStatus, Connector, MrTable, NicConfig, NicId, NodeId, Qp, QpError,
    QpGaugeValues, QpGauges, QpKey, QpNum, QpState, QueueFault, ReadRequest, WorkCompletion,
};
use thiserror::Error;
use tokio::sync::oneshot;

use super::poller::{CompletionPoller, CompletionStream};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum WorkerError {
    #[error("nic {nic}: no connection to peer {peer}")]
    UnknownPeer { nic: String, peer: NodeId },
    #[error("nic {nic}: connecting to peer {peer} failed")]
    Connect {
        nic: String,
        peer: NodeId,
        #[source]
        source: QpError,
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
    #[error("qp {qp}: reconnecting failed: {reason}")]
    Reconnect { qp: QpKey, reason: String },
    #[error("nic {nic}: worker stopped before the batch finished")]
    Stopped { nic: String },
    #[error("nic {nic}: starting the completion poller failed: {reason}")]
    Poller { nic: String, reason: String },
}

/// Every request's completion in post order, or the typed failure.
pub type BatchResult = Result<Vec<WorkCompletion>, WorkerError>;

struct Batch {
    len: usize,
    done: Vec<WorkCompletion>,
    reply: oneshot::Sender<BatchResult>,
}

struct Waiting {
    reads: Vec<ReadRequest>,
    reply: oneshot::Sender<BatchResult>,
}

struct Slot {
    qp: Qp,
    /// Batches posted on this QP, in post order (reports come back in the same order).
    batches: VecDeque<Batch>,
    /// Posts held back until the QP has drained and reconnected.
    waiting: VecDeque<Waiting>,
    /// The cause of the current error state, kept for the replies of the drained batches.
    fault: Option<QueueFault>,
}

struct Peer {
    connector: Arc<dyn Connector>,
    qps: Vec<QpKey>,
}

/// QPs of a worker by state (the `kvferry_qps{state}` gauge).
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
    /// Batches posted and not yet answered.
    pub batches: usize,
    /// Posts waiting for a reconnect.
    pub waiting: usize,
    pub reconnects: u64,
    /// Completions for QPs this worker does not know (dropped).
    pub stray: u64,
    pub states: QpStateCounts,
    pub completion_errors: CompletionErrorCounts,
}

pub struct NicWorker {
    nic: NicId,
    config: NicConfig,
    table: MrTable,
    gauges: Arc<QpGauges>,
    cq: Arc<CompletionQueue>,
    poller: Option<CompletionPoller>,
    stream: Option<CompletionStream>,
    peers: HashMap<NodeId, Peer>,
    slots: HashMap<QpKey, Slot>,
    next_qp: u32,
    reconnects: u64,
    stray: u64,
    errors: CompletionErrorCounts,
    scratch: Vec<WorkCompletion>,
}

impl NicWorker {
    /// A worker for NIC `nic` whose destinations are checked against `table`; starts the
    /// NIC's completion poller thread.
    pub fn new(nic: NicId, config: NicConfig, table: MrTable) -> Result<Self, WorkerError> {
        let window = config.max_send_wr as usize * config.qps_per_peer as usize;
        let cq = Arc::new(CompletionQueue::new(window));
        let (poller, stream) = CompletionPoller::spawn(
            &config.name,
            cq.clone(),
            config.max_send_wr as usize,
            16,
            Duration::from_millis(50),
        )
        .map_err(|e| WorkerError::Poller {
            nic: config.name.clone(),
            reason: e.to_string(),
        })?;
        Ok(NicWorker {
            nic,
            config,
            table,
            gauges: Arc::new(QpGauges::default()),
            cq,
            poller: Some(poller),
            stream: Some(stream),
            peers: HashMap::new(),
            slots: HashMap::new(),
            next_qp: 1,
            reconnects: 0,
            stray: 0,
            errors: CompletionErrorCounts::default(),
            scratch: Vec::new(),
        })
    }

    fn gauge_values(&self) -> WorkerGaugeValues {
        let mut g = WorkerGaugeValues {
            qp: self.gauges.snapshot(),
            reconnects: self.reconnects,
            stray: self.stray,
            completion_errors: self.errors,
            ..WorkerGaugeValues::default()
        };
        for s in self.slots.values() {
            g.states.add(s.qp.state());
            match s.qp.state() {
                QpState::ReadyToSend => g.ready += 1,
                QpState::Error => g.error += 1,
                _ => g.reset += 1,
            }
            g.batches += s.batches.len();
            g.waiting += s.waiting.len();
        }
        g
    }

    fn connect_peer(
        &mut self,
        peer: NodeId,
        connector: Arc<dyn Connector>,
        qps: u32,
    ) -> Result<Vec<QpKey>, WorkerError> {
        if let Some(p) = self.peers.get_mut(&peer) {
            let keys = p.qps.clone();
            if !Arc::ptr_eq(&p.connector, &connector) {
                // Another connector for a known peer: a new link was made for it because
                // the peer restarted, at a new data endpoint. Its QPs' connections (even
                // idle ones that look ready) lead to the dead process: error them, let them
                // drain, and reconnect through the new connector.
                p.connector = connector;
                for key in &keys {
                    if let Some(slot) = self.slots.get_mut(key) {
                        slot.qp.set_error();
                    }
                    self.advance(*key);
                }
            }
            return Ok(keys);
        }
        let mut keys = Vec::with_capacity(qps as usize);
        let mut created = Vec::with_capacity(qps as usize);
        for _ in 0..qps.max(1) {
            let key = QpKey::new(peer, self.nic, QpNum(self.next_qp));
            self.next_qp = self.next_qp.wrapping_add(1).max(1);
            let mut qp = Qp::new(
                key,
                self.config.queue_limits(),
                self.table.clone(),
                self.gauges.clone(),
            );
            // On failure the QPs created so far drop here, closing their connections.
            qp.connect(&connector, self.cq.clone())
                .map_err(|source| WorkerError::Connect {
                    nic: self.config.name.clone(),
                    peer,
                    source,
                })?;
            keys.push(key);
            created.push(qp);
        }
        for qp in created {
            self.slots.insert(
                qp.key(),
                Slot {
                    qp,
                    batches: VecDeque::new(),
                    waiting: VecDeque::new(),
                    fault: None,
                },
            );
        }
        self.peers.insert(
            peer,
            Peer {
                connector,
                qps: keys.clone(),
            },
        );
        Ok(keys)
    }

    /// A ready QP of `peer` with the fewest outstanding requests, else any of its QPs.
    fn pick(&self, peer: NodeId) -> Option<QpKey> {
        let p = self.peers.get(&peer)?;
        p.qps
            .iter()
            .filter_map(|k| self.slots.get(k).map(|s| (k, s)))
            .min_by_key(|(_, s)| {
                (
                    s.qp.state() != QpState::ReadyToSend || !s.waiting.is_empty(),
                    s.qp.outstanding(),
                )
            })
            .map(|(k, _)| *k)
    }

    fn post(&mut self, peer: NodeId, reads: Vec<ReadRequest>, reply: oneshot::Sender<BatchResult>) {
        let Some(key) = self.pick(peer) else {
            let _ = reply.send(Err(WorkerError::UnknownPeer {
                nic: self.config.name.clone(),
                peer,
            }));
            return;
        };
        if let Some(slot) = self.slots.get_mut(&key) {
            slot.waiting.push_back(Waiting { reads, reply });
        }
        self.advance(key);
    }

    /// Brings one QP forward: hands reported requests to their batches, recovers a drained
    /// QP in error, and posts waiting batches when it is ready.
    fn advance(&mut self, key: QpKey) {
        let nic = self.config.name.clone();
        let connector = self.peers.get(&key.peer).map(|p| p.connector.clone());
        let cq = self.cq.clone();
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        // Reconnect right after a reset so the QP is ready before the next post; a QP that
        // could not reconnect then stays in reset until a post asks for it again.
        let mut just_reset = false;
        loop {
            self.scratch.clear();
            slot.qp.poll_completions(&mut self.scratch);
            if slot.fault.is_none() {
                slot.fault = slot.qp.fault();
            }
            deliver(slot, &self.scratch, &mut self.errors);

            match slot.qp.state() {
                QpState::Error if slot.qp.is_drained() => {
                    // Errors drain before release: every batch has been answered now.
                    if slot.qp.reset().is_err() {
                        return;
                    }
                    slot.fault = None;
                    self.reconnects += 1;
                    just_reset = true;
                    continue;
                }
                QpState::Reset if just_reset || !slot.waiting.is_empty() => {
                    just_reset = false;
                    let Some(c) = connector.as_ref() else { return };
                    if let Err(source) = slot.qp.connect(c, cq.clone()) {
                        // The peer is unreachable: fail what waits, try again on the next post.
                        let reason = source.to_string();
                        while let Some(w) = slot.waiting.pop_front() {
                            let _ = w.reply.send(Err(WorkerError::Reconnect {
                                qp: key,
                                reason: reason.clone(),
                            }));
                        }
                        return;
                    }
                    continue;
                }
                QpState::ReadyToSend => {
                    let Some(w) = slot.waiting.pop_front() else {
                        return;
                    };
                    let len = w.reads.len();
                    if len == 0 {
                        let _ = w.reply.send(Ok(Vec::new()));
                        continue;
                    }
                    match slot.qp.post(&w.reads, Instant::now()) {
                        Ok(_) => slot.batches.push_back(Batch {
                            len,
                            done: Vec::with_capacity(len),
                            reply: w.reply,
                        }),
                        // The batch was queued and a post failed while issuing it: the QP
                        // is in error and the batch drains like any other.
                        Err(QpError::Post { .. } | QpError::NotConnected { .. }) => {
                            slot.batches.push_back(Batch {
                                len,
                                done: Vec::with_capacity(len),
                                reply: w.reply,
                            });
                        }
                        Err(source) => {
                            let _ = w.reply.send(Err(WorkerError::Rejected {
                                nic: nic.clone(),
                                source,
                            }));
                        }
                    }
                    continue;
                }
                _ => return,
            }
        }
    }

    fn on_completions(&mut self, batch: Vec<WorkCompletion>) {
        let now = Instant::now();
        let mut touched: Vec<QpKey> = Vec::new();
        for wc in &batch {
            match self.slots.get_mut(&wc.qp) {
                Some(slot) => {
                    // An error here is a completion the queue does not know (already
                    // flushed); the queue state stays consistent, so it is only counted.
                    if slot.qp.handle_completion(wc, now).is_err() {
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
            self.advance(key);
        }
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        let mut expired = Vec::new();
        for (key, slot) in &mut self.slots {
            if slot.qp.poll_timeout(now).is_some() || slot.qp.state() == QpState::Error {
                expired.push(*key);
            }
        }
        for key in expired {
            self.advance(key);
        }
    }
}

/// Hands in-order reports to the batches they belong to; answers finished batches.
fn deliver(slot: &mut Slot, reports: &[WorkCompletion], errors: &mut CompletionErrorCounts) {
    for wc in reports {
        errors.count(wc.status);
        let Some(front) = slot.batches.front_mut() else {
            return;
        };
        front.done.push(*wc);
        if front.done.len() >= front.len {
            if let Some(b) = slot.batches.pop_front() {
                let result = match b.done.iter().find(|c| !c.status.is_success()) {
                    None => Ok(b.done),
                    Some(first) => Err(WorkerError::ReadFailed {
                        qp: first.qp,
                        wr_id: first.wr_id,
                        status: first.status,
                        fault: slot.fault,
                        completions: b.done.clone(),
                    }),
                };
                let _ = b.reply.send(result);
            }
        }
    }
}

impl Actor for NicWorker {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(64);
        if let Some(stream) = self.stream.take() {
            ctx.add_stream(stream);
        }
        let tick = (self.config.completion_timeout / 4)
            .clamp(Duration::from_millis(5), Duration::from_millis(100));
        ctx.run_interval(tick, |w, _| w.on_tick());
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        for slot in self.slots.values_mut() {
            slot.qp.set_error();
        }
        let nic = self.config.name.clone();
        for (_, mut slot) in self.slots.drain() {
            for b in slot.batches.drain(..) {
                let _ = b.reply.send(Err(WorkerError::Stopped { nic: nic.clone() }));
            }
            for w in slot.waiting.drain(..) {
                let _ = w.reply.send(Err(WorkerError::Stopped { nic: nic.clone() }));
            }
            // Dropping the QP aborts and joins its connection before destinations release.
        }
        self.poller = None;
    }
}

impl StreamHandler<Vec<WorkCompletion>> for NicWorker {
    fn handle(&mut self, batch: Vec<WorkCompletion>, _: &mut Context<Self>) {
        self.on_completions(batch);
    }
}

/// Opens `qps` QPs (default: the NIC's qps-per-peer) to `peer` and connects them.
/// Connecting a peer that is already connected returns its QPs.
#[derive(Message)]
#[rtype(result = "Result<Vec<QpKey>, WorkerError>")]
pub struct Connect {
    pub peer: NodeId,
    pub connector: Arc<dyn Connector>,
    pub qps: Option<u32>,
}

impl Handler<Connect> for NicWorker {
    type Result = Result<Vec<QpKey>, WorkerError>;

    fn handle(&mut self, msg: Connect, _: &mut Context<Self>) -> Self::Result {
        let qps = msg.qps.unwrap_or(self.config.qps_per_peer);
        self.connect_peer(msg.peer, msg.connector, qps)
    }
}

/// Posts an ordered batch of reads on one QP to `peer`. `reply` is answered once every
/// request has completed or been flushed.
#[derive(Message)]
#[rtype(result = "()")]
pub struct PostReads {
    pub peer: NodeId,
    pub reads: Vec<ReadRequest>,
    pub reply: oneshot::Sender<BatchResult>,
}

impl Handler<PostReads> for NicWorker {
    type Result = ();

    fn handle(&mut self, msg: PostReads, _: &mut Context<Self>) {
        self.post(msg.peer, msg.reads, msg.reply);
    }
}

/// QP counters and states.
#[derive(Message)]
#[rtype(result = "WorkerGaugeValues")]
pub struct Gauges;

impl Handler<Gauges> for NicWorker {
    type Result = MessageResult<Gauges>;

    fn handle(&mut self, _: Gauges, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.gauge_values())
    }
}
