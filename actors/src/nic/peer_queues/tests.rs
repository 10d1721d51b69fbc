//! `PeerQueues` against a simulated owner on a simulated clock: the two endpoints of an RC
//! link (the requester's bookkeeping and an owner that completes reads when their latency
//! has passed, in any order it is told, with injected faults), stepped together one
//! millisecond at a time. Nothing sleeps and nothing races: every run is the same.
//!
//! The owner keeps its pending reads in a map keyed by (QP, `wr_id`), as the verbs provider
//! does, so a duplicate id replacing a pending entry is seen (and counted) here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_transport::{
    Access, CompletionQueue, CompletionSink, CompletionStatus, Connection, ConnectionError,
    Connector, HostRegion, LocalSegment, MrHandle, MrKey, MrTable, NicConfig, NicId, NodeId,
    ProviderKind, QpKey, QueueFault, ReadRequest, RemoteDescriptor, WorkCompletion, WorkRequest,
};

use super::*;

const PEER: NodeId = NodeId(7);
const MS: Duration = Duration::from_millis(1);

struct Pending {
    seq: usize,
    /// `None`: never completes unless flushed.
    due: Option<Instant>,
    status: CompletionStatus,
    len: u64,
    sink: Arc<dyn CompletionSink>,
}

/// The owner endpoint and the wire.
struct Owner {
    now: Instant,
    latency: Duration,
    /// How long the flushes of an aborted connection take to come back.
    flush_delay: Duration,
    /// Complete what is due newest first (out of order).
    reverse: bool,
    dead: bool,
    pending: HashMap<(QpKey, u64), Pending>,
    /// Pending entries a duplicate `wr_id` replaced (a provider loses the first for good).
    replaced: usize,
    issued: usize,
    /// The `n`th read issued (1-based) completes with this status.
    fail_at: Option<(usize, CompletionStatus)>,
    /// The `n`th read issued never completes on its own.
    stuck_at: Option<usize>,
    connects: usize,
    max_total: usize,
    max_per_qp: HashMap<QpKey, usize>,
}

impl Owner {
    fn new(now: Instant) -> Arc<Mutex<Self>> {
        Arc::new(Mutex::new(Owner {
            now,
            latency: 3 * MS,
            flush_delay: 2 * MS,
            reverse: false,
            dead: false,
            pending: HashMap::new(),
            replaced: 0,
            issued: 0,
            fail_at: None,
            stuck_at: None,
            connects: 0,
            max_total: 0,
            max_per_qp: HashMap::new(),
        }))
    }

    fn in_flight(&self, qp: QpKey) -> usize {
        self.pending.keys().filter(|(k, _)| *k == qp).count()
    }

    /// Completes every read that is due, in issue order (or reversed).
    fn complete_due(&mut self) {
        let now = self.now;
        let mut due: Vec<(QpKey, u64, usize)> = self
            .pending
            .iter()
            .filter(|(_, p)| p.due.is_some_and(|d| d <= now))
            .map(|((qp, id), p)| (*qp, *id, p.seq))
            .collect();
        due.sort_by_key(|d| d.2);
        if self.reverse {
            due.reverse();
        }
        for (qp, wr_id, _) in due {
            if let Some(p) = self.pending.remove(&(qp, wr_id)) {
                let bytes = if p.status.is_success() { p.len } else { 0 };
                p.sink.push(WorkCompletion {
                    qp,
                    wr_id,
                    status: p.status,
                    bytes,
                });
            }
        }
    }

    fn abort(&mut self, qp: QpKey) {
        let at = self.now + self.flush_delay;
        for ((k, _), p) in self.pending.iter_mut() {
            if *k == qp {
                p.status = CompletionStatus::Flushed;
                p.due = Some(at);
            }
        }
    }
}

struct SimConnector(Arc<Mutex<Owner>>);

struct SimConnection {
    qp: QpKey,
    sink: Arc<dyn CompletionSink>,
    owner: Arc<Mutex<Owner>>,
}

impl Connector for SimConnector {
    fn connect(
        &self,
        qp: QpKey,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<Box<dyn Connection>, ConnectionError> {
        let mut o = self.0.lock().unwrap();
        o.connects += 1;
        if o.dead {
            return Err(ConnectionError::PeerUnreachable { peer: qp.peer });
        }
        Ok(Box::new(SimConnection {
            qp,
            sink,
            owner: Arc::clone(&self.0),
        }))
    }
}

impl Connection for SimConnection {
    fn peer(&self) -> NodeId {
        self.qp.peer
    }

    fn issue(&mut self, wr: WorkRequest) -> Result<(), ConnectionError> {
        let mut o = self.owner.lock().unwrap();
        o.issued += 1;
        let seq = o.issued;
        let status = match o.fail_at {
            Some((n, s)) if n == seq => s,
            _ => CompletionStatus::Success,
        };
        let due = (o.stuck_at != Some(seq)).then(|| o.now + o.latency);
        let old = o.pending.insert(
            (self.qp, wr.wr_id),
            Pending {
                seq,
                due,
                status,
                len: wr.remote.len,
                sink: Arc::clone(&self.sink),
            },
        );
        if old.is_some() {
            o.replaced += 1;
        }
        let total = o.pending.len();
        o.max_total = o.max_total.max(total);
        let here = o.in_flight(self.qp);
        let m = o.max_per_qp.entry(self.qp).or_default();
        *m = (*m).max(here);
        Ok(())
    }

    fn abort(&mut self) {
        self.owner.lock().unwrap().abort(self.qp);
    }
}

impl Drop for SimConnection {
    fn drop(&mut self) {
        // Dropping aborts, and the flushes come back at once: nothing lands afterwards. (A
        // failed assertion poisons the lock; the drop during that unwind must not panic.)
        let mut o = self
            .owner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = o.now;
        o.abort(self.qp);
        for p in o.pending.values_mut() {
            p.due = p.due.map(|_| now);
        }
        o.complete_due();
    }
}

/// The requester: the queues under test, its completion queue and destinations, the answers
/// it gave, and the simulated clock both endpoints share.
struct World {
    now: Instant,
    q: PeerQueues<u32, u32>,
    cq: Arc<CompletionQueue>,
    owner: Arc<Mutex<Owner>>,
    table: MrTable,
    dst: Arc<HostRegion>,
    mr: MrHandle,
    batches: Vec<(u32, BatchResult)>,
    connects: Vec<(u32, ConnectResult)>,
    /// Connect jobs are held here instead of run while set.
    hold_connects: bool,
    held: Vec<ConnectJob>,
    next_reply: u32,
}

fn config(send: u32, rd: u32, qps: u32) -> NicConfig {
    NicConfig {
        name: "sim0".into(),
        provider: ProviderKind::Loopback,
        qps_per_peer: qps,
        max_send_wr: send,
        max_rd_atomic: rd,
        max_sge: 4,
        completion_timeout: Duration::from_millis(50),
    }
}

impl World {
    fn new(cfg: NicConfig, cq_depth: usize) -> Self {
        let now = Instant::now();
        let table = MrTable::new();
        let dst = Arc::new(HostRegion::anonymous(1 << 20).unwrap());
        let mr = table
            .register_host(Arc::clone(&dst), Access::LOCAL_WRITE)
            .unwrap();
        let cq = Arc::new(CompletionQueue::new(cq_depth));
        let q = PeerQueues::new(NicId(0), cfg, table.clone(), cq.clone(), cq_depth).unwrap();
        World {
            now,
            q,
            cq,
            owner: Owner::new(now),
            table,
            dst,
            mr,
            batches: Vec::new(),
            connects: Vec::new(),
            hold_connects: false,
            held: Vec::new(),
            next_reply: 0,
        }
    }

    fn connector(&self) -> Arc<dyn Connector> {
        Arc::new(SimConnector(Arc::clone(&self.owner)))
    }

    /// Connects `PEER` through `c` and runs the connect jobs; returns the reply id.
    fn connect_with(&mut self, c: Arc<dyn Connector>, qps: Option<u32>) -> u32 {
        let id = self.reply();
        self.q.handle_connect(PEER, c, qps, id, self.now);
        self.step();
        id
    }

    fn reply(&mut self) -> u32 {
        self.next_reply += 1;
        self.next_reply
    }

    /// `n` reads of 4 KiB with callers' ids `first..`, into distinct destinations.
    fn reads(&self, first: u64, n: usize) -> Vec<ReadRequest> {
        (0..n as u64)
            .map(|i| ReadRequest {
                wr_id: first + i,
                remote: RemoteDescriptor {
                    addr: 0x10_0000 + i * 4096,
                    len: 4096,
                    rkey: MrKey(1),
                },
                local: vec![LocalSegment {
                    lkey: self.mr.key(),
                    addr: self.dst.addr() + ((first + i) % 256) * 4096,
                    len: 4096,
                }],
            })
            .collect()
    }

    fn post(&mut self, reads: Vec<ReadRequest>) -> u32 {
        let id = self.reply();
        self.q.handle_post(PEER, reads, id, self.now);
        self.collect();
        id
    }

    /// Runs connect jobs (unless held) and takes every answer.
    fn collect(&mut self) {
        loop {
            let mut ran = false;
            while let Some(job) = self.q.poll_connect() {
                if self.hold_connects {
                    self.held.push(job);
                } else {
                    let done = job.run();
                    self.q.handle_connected(done, self.now);
                    ran = true;
                }
            }
            while let Some(e) = self.q.poll_event() {
                match e {
                    Event::Batch { reply, result } => self.batches.push((reply, result)),
                    Event::Connect { reply, result } => self.connects.push((reply, result)),
                }
            }
            if !ran {
                return;
            }
        }
    }

    /// One round at the current time: the owner completes what is due, the requester takes
    /// the round from its completion queue, checks timeouts and hands out what it produced.
    fn step(&mut self) {
        self.owner.lock().unwrap().complete_due();
        let mut round = Vec::new();
        self.cq.poll(&mut round, usize::MAX);
        if !round.is_empty() {
            self.q.handle_completions(&round, self.now);
        }
        self.q.handle_timeout(self.now);
        self.collect();
    }

    fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        while self.now < end {
            self.now += MS;
            self.owner.lock().unwrap().now = self.now;
            self.step();
        }
    }

    fn answer(&self, id: u32) -> Option<&BatchResult> {
        self.batches.iter().find(|(r, _)| *r == id).map(|(_, b)| b)
    }

    fn ok(&self, id: u32) -> Vec<WorkCompletion> {
        match self.answer(id) {
            Some(Ok(c)) => c.clone(),
            other => panic!("batch {id}: {other:?}"),
        }
    }

    fn gauges(&self) -> WorkerGaugeValues {
        self.q.gauge_values()
    }
}

fn ids(c: &[WorkCompletion]) -> Vec<u64> {
    c.iter().map(|w| w.wr_id).collect()
}

/// Each QP issues at most min(max_send_wr, max_rd_atomic) reads; a batch five times larger
/// than that completes, in post order, with the callers' ids.
#[test]
fn windows_bound_each_qp_and_batches_past_them_complete() {
    let mut w = World::new(config(8, 3, 1), 64);
    let c = w.connector();
    w.connect_with(c, None);
    let b = w.post(w.reads(100, 15));
    w.advance(40 * MS);
    let done = w.ok(b);
    assert_eq!(ids(&done), (100..115).collect::<Vec<_>>());
    assert!(done.iter().all(|c| c.bytes == 4096));
    let o = w.owner.lock().unwrap();
    assert_eq!(o.max_per_qp.values().copied().max(), Some(3), "read depth");
    drop(o);

    // The send window binds where it is the smaller.
    let mut w = World::new(config(2, 2, 1), 64);
    let c = w.connector();
    w.connect_with(c, None);
    let b = w.post(w.reads(0, 9));
    w.advance(40 * MS);
    assert_eq!(w.ok(b).len(), 9);
    assert_eq!(w.owner.lock().unwrap().max_per_qp.values().max(), Some(&2));
    let g = w.gauges();
    assert_eq!((g.qp.outstanding, g.qp.in_flight, g.batches), (0, 0, 0));
    assert_eq!(w.table.gauges().uses, 0, "destinations released");
}

/// Completions come back newest first; every batch is still answered with its completions
/// in post order, and the batches of one QP in post order.
#[test]
fn completions_reported_in_post_order_per_batch() {
    let mut w = World::new(config(8, 8, 1), 64);
    w.owner.lock().unwrap().reverse = true;
    let c = w.connector();
    w.connect_with(c, None);
    let a = w.post(w.reads(10, 5));
    let b = w.post(w.reads(20, 2));
    let c = w.post(w.reads(30, 4));
    w.advance(MS);
    assert!(w.batches.is_empty());
    w.advance(20 * MS);
    assert_eq!(
        w.batches.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
        [a, b, c]
    );
    assert_eq!(ids(&w.ok(a)), [10, 11, 12, 13, 14]);
    assert_eq!(ids(&w.ok(b)), [20, 21]);
    assert_eq!(ids(&w.ok(c)), [30, 31, 32, 33]);
    // An empty batch is answered at once, in its turn.
    let e = w.post(Vec::new());
    assert!(w.ok(e).is_empty());
}

/// Issue 17: the NIC's one CQ is shared by every QP. Two QPs of window 4 on a CQ of 6: the
/// second batch waits until completions make room, so the owner never sees more than 6
/// reads at once (8 without admission), and both batches complete.
#[test]
fn completion_queue_admission_bounds_the_total_in_flight() {
    let mut w = World::new(config(4, 4, 2), 6);
    let c = w.connector();
    w.connect_with(c, None);
    let a = w.post(w.reads(0, 4));
    let b = w.post(w.reads(10, 4));
    let g = w.gauges();
    assert_eq!((g.cq_charged, g.cq_depth, g.waiting), (4, 6, 1), "{g:?}");
    assert_eq!(w.owner.lock().unwrap().pending.len(), 4);
    w.advance(30 * MS);
    assert_eq!(ids(&w.ok(a)), [0, 1, 2, 3]);
    assert_eq!(ids(&w.ok(b)), [10, 11, 12, 13]);
    let o = w.owner.lock().unwrap();
    assert!(o.max_total <= 6, "{} reads owed to a CQ of 6", o.max_total);
    assert_eq!(o.max_per_qp.len(), 2, "both QPs carried reads");
    drop(o);
    assert_eq!(w.gauges().cq_charged, 0);

    // A CQ that cannot hold one QP's window is refused at start.
    let cq = Arc::new(CompletionQueue::new(2));
    let e =
        PeerQueues::<u32, u32>::new(NicId(0), config(4, 4, 1), MrTable::new(), cq, 3).unwrap_err();
    assert!(
        matches!(
            e,
            WorkerError::CqTooSmall {
                cq_depth: 3,
                window: 4,
                ..
            }
        ),
        "{e}"
    );
}

/// Issue 17: two links to one peer (an old one draining beside a new one) both number their
/// reads from 1. On one QP the ids must not alias: the owner's pending map (keyed by id, as
/// the verbs provider's) never has an entry replaced, and a failure in the second batch is
/// reported against the second batch's read, with the caller's id.
#[test]
fn duplicate_wr_ids_from_two_links_never_alias() {
    let mut w = World::new(config(8, 8, 1), 64);
    let c = w.connector();
    w.connect_with(c, None);
    w.owner.lock().unwrap().fail_at = Some((6, CompletionStatus::RemoteAccessError));
    let old = w.post(w.reads(1, 4));
    let new = w.post(w.reads(1, 4));
    w.advance(30 * MS);
    assert_eq!(
        w.owner.lock().unwrap().replaced,
        0,
        "a pending read was replaced"
    );
    assert_eq!(ids(&w.ok(old)), [1, 2, 3, 4]);
    let Some(Err(WorkerError::ReadFailed {
        wr_id,
        status,
        fault,
        completions,
        ..
    })) = w.answer(new)
    else {
        panic!("{:?}", w.answer(new));
    };
    assert_eq!((*wr_id, *status), (2, CompletionStatus::RemoteAccessError));
    assert_eq!(
        *fault,
        Some(QueueFault::Completion {
            wr_id: 2,
            status: CompletionStatus::RemoteAccessError
        })
    );
    assert_eq!(ids(completions), [1, 2, 3, 4]);
}

/// Design rule 2: a completion error puts the QP in error; the batch is answered only after
/// every outstanding read has come back (flushes counted), destinations stay held until
/// then, and only then is the QP reset and rebuilt; the next batch works.
#[test]
fn error_drains_before_release_then_rebuilds() {
    let mut w = World::new(config(4, 4, 1), 64);
    w.owner.lock().unwrap().flush_delay = 10 * MS;
    let c = w.connector();
    w.connect_with(c, None);
    {
        let mut o = w.owner.lock().unwrap();
        o.fail_at = Some((3, CompletionStatus::RemoteAccessError));
        // The fourth read is slow: the error is seen while it is still out.
        o.stuck_at = Some(4);
    }
    let b = w.post(w.reads(1000, 12));
    w.advance(3 * MS);
    // The error came back; read 4 (and the two issued when 1 and 2 made room) are still on
    // the wire, flushed 10 ms after the abort.
    let g = w.gauges();
    assert!(w.answer(b).is_none(), "answered before the drain");
    assert_eq!((g.error, g.qp.in_flight), (1, 3), "{g:?}");
    assert!(
        w.table.gauges().uses > 0,
        "destinations released before the drain"
    );
    assert!(w.q.poll_connect().is_none(), "rebuilt before the drain");
    w.advance(10 * MS);
    let Some(Err(WorkerError::ReadFailed {
        wr_id,
        fault,
        completions,
        ..
    })) = w.answer(b)
    else {
        panic!("{:?}", w.answer(b));
    };
    assert_eq!(*wr_id, 1002);
    assert_eq!(
        *fault,
        Some(QueueFault::Completion {
            wr_id: 1002,
            status: CompletionStatus::RemoteAccessError
        })
    );
    assert_eq!(ids(completions), (1000..1012).collect::<Vec<_>>());
    let flushed = completions
        .iter()
        .filter(|c| c.status == CompletionStatus::Flushed)
        .count();
    assert_eq!(flushed, 9, "{completions:?}");
    let g = w.gauges();
    assert_eq!(g.completion_errors.flushed, 9);
    assert_eq!(g.completion_errors.remote_access_error, 1);
    assert_eq!(w.table.gauges().uses, 0);
    assert_eq!((g.reconnects, g.ready, g.qp.in_error), (1, 1, 0), "{g:?}");
    assert_eq!(w.owner.lock().unwrap().connects, 2);

    let next = w.post(w.reads(1, 3));
    w.advance(10 * MS);
    assert_eq!(ids(&w.ok(next)), [1, 2, 3]);
    assert_eq!(
        WorkerError::ReadFailed {
            qp: QpKey::new(PEER, NicId(0), kvferry_transport::QpNum(1)),
            wr_id: 0,
            status: CompletionStatus::RemoteAccessError,
            fault: None,
            completions: Vec::new(),
        }
        .kind(),
        FailureKind::Remote
    );
}

/// A read that never completes: nothing happens before the completion timeout on the
/// simulated clock; at it the QP goes to error, the connection is aborted, the drain brings
/// the flushes back and the batch is answered `TimedOut`, naming the caller's read.
#[test]
fn timeout_on_the_simulated_clock() {
    let mut w = World::new(config(4, 4, 1), 64);
    w.owner.lock().unwrap().flush_delay = MS;
    let c = w.connector();
    w.connect_with(c, None);
    w.owner.lock().unwrap().stuck_at = Some(2);
    let start = w.now;
    let b = w.post(w.reads(50, 3));
    assert_eq!(w.q.poll_timeout(), Some(start + Duration::from_millis(50)));
    w.advance(49 * MS);
    assert!(w.answer(b).is_none());
    assert_eq!(w.gauges().ready, 1);
    w.advance(3 * MS);
    let Some(Err(
        e @ WorkerError::ReadFailed {
            fault, completions, ..
        },
    )) = w.answer(b)
    else {
        panic!("{:?}", w.answer(b));
    };
    assert_eq!(*fault, Some(QueueFault::Timeout { wr_id: 51 }));
    let st: Vec<_> = completions.iter().map(|c| c.status).collect();
    use CompletionStatus::*;
    assert_eq!(st, [Success, TimedOut, Flushed]);
    assert_eq!(e.kind(), FailureKind::Connection);
    assert_eq!(w.gauges().reconnects, 1);
}

/// The peer vanishes: after the drain the rebuild fails and the QP waits in reset; a post
/// then fails with a typed connection error; once the peer is back the next post works.
#[test]
fn reconnect_fails_typed_until_the_peer_returns() {
    let mut w = World::new(config(4, 4, 1), 64);
    let c = w.connector();
    w.connect_with(c, None);
    {
        let mut o = w.owner.lock().unwrap();
        o.fail_at = Some((2, CompletionStatus::TransportError));
        o.dead = true;
    }
    let b = w.post(w.reads(0, 4));
    w.advance(10 * MS);
    assert!(matches!(
        w.answer(b),
        Some(Err(WorkerError::ReadFailed { .. }))
    ));
    let g = w.gauges();
    assert_eq!((g.states.reset, g.ready, g.connecting), (1, 0, 0), "{g:?}");

    let b = w.post(w.reads(0, 2));
    let Some(Err(e @ WorkerError::Reconnect { source, .. })) = w.answer(b) else {
        panic!("{:?}", w.answer(b));
    };
    assert!(
        matches!(
            **source,
            QpError::Connect {
                source: ConnectionError::PeerUnreachable { .. },
                ..
            }
        ),
        "{source}"
    );
    assert_eq!(e.kind(), FailureKind::Connection);

    w.owner.lock().unwrap().dead = false;
    let b = w.post(w.reads(0, 2));
    w.advance(10 * MS);
    assert_eq!(w.ok(b).len(), 2);
    assert_eq!(w.gauges().ready, 1);
}

/// Connects run as jobs off the driver: the connect is answered only when every QP's job is
/// back, posts made meanwhile wait for it, and gauges show the QPs connecting. A failed
/// first connect answers both with a typed error and forgets the peer.
#[test]
fn connects_are_jobs_and_posts_wait_for_them() {
    let mut w = World::new(config(4, 4, 2), 64);
    w.hold_connects = true;
    let c = w.connector();
    let conn = w.connect_with(c.clone(), None);
    assert_eq!(w.held.len(), 2);
    assert!(w.connects.is_empty());
    let b = w.post(w.reads(0, 3));
    let g = w.gauges();
    assert_eq!((g.connecting, g.waiting, g.states.init), (2, 1, 2), "{g:?}");
    // A second connect for the same peer is answered with the first.
    let again = w.connect_with(c, None);
    for job in std::mem::take(&mut w.held) {
        let done = job.run();
        w.q.handle_connected(done, w.now);
    }
    w.collect();
    let keys: Vec<_> = w
        .connects
        .iter()
        .map(|(r, k)| (*r, k.as_ref().map(Vec::len).ok()))
        .collect();
    assert_eq!(keys, [(conn, Some(2)), (again, Some(2))]);
    w.advance(10 * MS);
    assert_eq!(w.ok(b).len(), 3);

    // A peer that cannot be reached.
    let mut w = World::new(config(4, 4, 2), 64);
    w.owner.lock().unwrap().dead = true;
    w.hold_connects = true;
    let c = w.connector();
    let conn = w.connect_with(c, None);
    let b = w.post(w.reads(0, 1));
    for job in std::mem::take(&mut w.held) {
        let done = job.run();
        w.q.handle_connected(done, w.now);
    }
    w.collect();
    assert!(matches!(
        w.connects.as_slice(),
        [(r, Err(WorkerError::Connect { .. }))] if *r == conn
    ));
    assert!(matches!(
        w.answer(b),
        Some(Err(WorkerError::Connect { .. }))
    ));
    let b = w.post(w.reads(0, 1));
    assert!(matches!(
        w.answer(b),
        Some(Err(WorkerError::UnknownPeer { .. }))
    ));
    let g = w.gauges();
    assert_eq!((g.qp.qps, g.waiting), (0, 0), "{g:?}");
}

/// The peer restarted at a new endpoint: a connect with another connector errors its QPs
/// (even idle ones), drains them and rebuilds them through the new connector; reads in
/// flight on the old connection are answered flushed, the next ones go to the new peer.
#[test]
fn a_replaced_connector_rebuilds_the_qps() {
    let mut w = World::new(config(4, 4, 1), 64);
    let old = w.connector();
    w.connect_with(old, None);
    let b = w.post(w.reads(0, 2));
    let fresh_owner = Owner::new(w.now);
    let fresh: Arc<dyn Connector> = Arc::new(SimConnector(Arc::clone(&fresh_owner)));
    let conn = w.connect_with(fresh, None);
    assert!(matches!(w.connects.last(), Some((r, Ok(k))) if *r == conn && k.len() == 1));
    w.advance(10 * MS);
    assert!(matches!(
        w.answer(b),
        Some(Err(WorkerError::ReadFailed { .. }))
    ));
    assert_eq!(fresh_owner.lock().unwrap().connects, 1);
    let b = w.post(w.reads(0, 2));
    fresh_owner.lock().unwrap().now = w.now;
    // The fresh owner completes on its own clock: step it with ours.
    for _ in 0..10 {
        w.now += MS;
        fresh_owner.lock().unwrap().now = w.now;
        fresh_owner.lock().unwrap().complete_due();
        w.step();
    }
    assert_eq!(w.ok(b).len(), 2);
    assert_eq!(fresh_owner.lock().unwrap().issued, 2);
}

/// Shutdown answers every batch, post and connect exactly once, after the QPs closed.
#[test]
fn shutdown_answers_everything_once() {
    let mut w = World::new(config(2, 2, 1), 64);
    let c = w.connector();
    w.connect_with(c, None);
    w.owner.lock().unwrap().stuck_at = Some(1);
    let a = w.post(w.reads(0, 4));
    let b = w.post(w.reads(10, 1));
    w.q.shutdown();
    w.collect();
    let answered: Vec<u32> = w.batches.iter().map(|(r, _)| *r).collect();
    assert_eq!(answered.len(), 2);
    assert!(answered.contains(&a) && answered.contains(&b));
    assert!(w
        .batches
        .iter()
        .all(|(_, r)| matches!(r, Err(WorkerError::Stopped { .. }))));
    assert_eq!(w.gauges().qp.qps, 0);
    assert_eq!(w.table.gauges().uses, 0);
}

/// A load's reads cut with `even_batches` and posted at once land on the peer's QPs in equal
/// shares (each batch goes to the QP with the fewest outstanding reads); batches of a fixed
/// size that do not divide by the QPs leave one QP with more (the tcp direct load of 56 reads
/// in batches of 8: 32 against 24).
#[test]
fn batches_cut_evenly_share_the_qps_equally() {
    use crate::peer::batches::even_batches;

    let per_qp = |cuts: Vec<std::ops::Range<usize>>| {
        let mut w = World::new(config(128, 16, 2), 1024);
        let c = w.connector();
        w.connect_with(c, None);
        let posted: Vec<u32> = cuts
            .iter()
            .map(|r| {
                let reads = w.reads(r.start as u64, r.len());
                w.post(reads)
            })
            .collect();
        w.advance(100 * MS);
        let mut share: HashMap<QpKey, usize> = HashMap::new();
        for b in posted {
            for wc in w.ok(b) {
                *share.entry(wc.qp).or_default() += 1;
            }
        }
        let mut share: Vec<usize> = share.into_values().collect();
        share.sort_unstable();
        share
    };
    assert_eq!(per_qp(even_batches(56, 2, 8)), vec![28, 28]);
    assert_eq!(per_qp(even_batches(30, 2, 4)), vec![15, 15]);
    let fixed = (0..56).step_by(8).map(|s| s..s + 8).collect();
    assert_eq!(per_qp(fixed), vec![24, 32]);
}
