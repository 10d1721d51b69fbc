//! `NicWorker`: one per NIC, on its own `Arbiter` of the node's actix `System`. A thin driver
//! around [`PeerQueues`], which holds every QP to every peer and all of their bookkeeping:
//! the worker feeds it requests, completion rounds from the NIC's [`CompletionPoller`] and the
//! clock, sends the answers it produces, and runs the connects it asks for on threads of
//! their own (a connect or handshake waits on the network; the worker's thread never does,
//! and neither does stopping it) and feeds each outcome back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::fut::wrap_future;
use actix::{
    Actor, ActorContext, ActorFutureExt, AsyncContext, Context, Handler, Message, MessageResult,
    ResponseFuture, StreamHandler,
};
use kvferry_transport::{
    CompletionQueue, Connector, MrTable, NicConfig, NicId, NodeId, QpKey, ReadRequest,
    WorkCompletion,
};
use tokio::sync::oneshot;

use crate::nic::peer_queues::{ConnectResult, Event, PeerQueues};
use crate::nic::poller::{CompletionPoller, CompletionStream};

pub use crate::nic::peer_queues::{
    BatchResult, CompletionErrorCounts, FailureKind, QpStateCounts, WorkerError, WorkerGaugeValues,
};

type Queues = PeerQueues<oneshot::Sender<BatchResult>, oneshot::Sender<ConnectResult>>;

/// Batches the poller thread may have sent before it waits for the worker.
const POLLER_CHANNEL: usize = 16;

pub struct NicWorker {
    queues: Queues,
    poller: Option<CompletionPoller>,
    stream: Option<CompletionStream>,
    /// The same channel as `stream`: every batch that is ready is taken in one round.
    ready: Option<CompletionStream>,
}

impl NicWorker {
    /// A worker for NIC `nic` whose destinations are checked against `table`, whose
    /// completion queue holds `cq_depth` entries; starts the NIC's completion poller thread.
    pub fn new(
        nic: NicId,
        config: NicConfig,
        table: MrTable,
        cq_depth: usize,
    ) -> Result<Self, WorkerError> {
        let cq = Arc::new(CompletionQueue::new(cq_depth));
        let queues = PeerQueues::new(nic, config.clone(), table, cq.clone(), cq_depth)?;
        let (poller, stream) = CompletionPoller::spawn(
            &config.name,
            cq,
            config.max_send_wr as usize,
            POLLER_CHANNEL,
            Duration::from_millis(50),
        )
        .map_err(|source| WorkerError::Poller {
            nic: config.name.clone(),
            source,
        })?;
        Ok(NicWorker {
            queues,
            poller: Some(poller),
            ready: Some(stream.clone()),
            stream: Some(stream),
        })
    }

    /// Sends the answers the queues produced and starts the connects they asked for.
    fn drive(&mut self, ctx: &mut Context<Self>) {
        while let Some(job) = self.queues.poll_connect() {
            let key = job.key();
            // A thread per connect rather than tokio's blocking pool: a runtime waits for its
            // blocking tasks when it shuts down, so a handshake hanging on a dead peer would
            // hold up stopping the worker. Connects are rare (first use, rebuilds).
            let (tx, rx) = oneshot::channel();
            let spawned = std::thread::Builder::new()
                .name(format!("kvf-connect-{}", key.qp.0))
                .spawn(move || {
                    let _ = tx.send(job.run());
                });
            if let Err(e) = spawned {
                tracing::warn!(qp = %key, error = %e, "starting a connect thread failed");
                self.queues.handle_connect_lost(key, Instant::now());
                continue;
            }
            ctx.spawn(wrap_future::<_, Self>(rx).map(move |done, w, ctx| {
                let now = Instant::now();
                match done {
                    Ok(done) => w.queues.handle_connected(done, now),
                    // The thread ended without an answer (it panicked): the QP went with it.
                    Err(_) => w.queues.handle_connect_lost(key, now),
                }
                w.drive(ctx);
            }));
        }
        while let Some(event) = self.queues.poll_event() {
            // A dropped receiver means the caller gave up; the QP bookkeeping is done anyway.
            match event {
                Event::Batch { reply, result } => {
                    let _ = reply.send(result);
                }
                Event::Connect { reply, result } => {
                    let _ = reply.send(result);
                }
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
        let tick = (self.queues.config().completion_timeout / 4)
            .clamp(Duration::from_millis(5), Duration::from_millis(100));
        ctx.run_interval(tick, |w, ctx| {
            w.queues.handle_timeout(Instant::now());
            w.drive(ctx);
        });
    }

    fn stopped(&mut self, ctx: &mut Context<Self>) {
        self.queues.shutdown();
        self.drive(ctx);
        self.poller = None;
    }
}

impl StreamHandler<Vec<WorkCompletion>> for NicWorker {
    fn handle(&mut self, batch: Vec<WorkCompletion>, ctx: &mut Context<Self>) {
        let now = Instant::now();
        self.queues.handle_completions(&batch, now);
        // Everything else that is ready, in the same round.
        while let Some(more) = self.ready.as_ref().and_then(CompletionStream::try_next) {
            self.queues.handle_completions(&more, now);
        }
        self.drive(ctx);
    }

    fn finished(&mut self, ctx: &mut Context<Self>) {
        // The poller ends only once the worker drops it; ending earlier, no completion would
        // ever arrive again and every drain would hang: stop, answering everything `Stopped`.
        tracing::error!(nic = %self.queues.config().name, "completion poller ended: stopping the NIC worker");
        ctx.stop();
    }
}

/// Opens `qps` QPs (default: the NIC's qps-per-peer) to `peer` and connects them (off the
/// worker's thread); answered once they are ready. Connecting a peer that is already
/// connected returns its QPs.
#[derive(Message)]
#[rtype(result = "Result<Vec<QpKey>, WorkerError>")]
pub struct Connect {
    pub peer: NodeId,
    pub connector: Arc<dyn Connector>,
    pub qps: Option<u32>,
}

impl Handler<Connect> for NicWorker {
    type Result = ResponseFuture<Result<Vec<QpKey>, WorkerError>>;

    fn handle(&mut self, msg: Connect, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.queues
            .handle_connect(msg.peer, msg.connector, msg.qps, tx, Instant::now());
        self.drive(ctx);
        let nic = self.queues.config().name.clone();
        Box::pin(async move { rx.await.unwrap_or(Err(WorkerError::Stopped { nic })) })
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

    fn handle(&mut self, msg: PostReads, ctx: &mut Context<Self>) {
        self.queues
            .handle_post(msg.peer, msg.reads, msg.reply, Instant::now());
        self.drive(ctx);
    }
}

/// QP counters and states.
#[derive(Message)]
#[rtype(result = "WorkerGaugeValues")]
pub struct Gauges;

impl Handler<Gauges> for NicWorker {
    type Result = MessageResult<Gauges>;

    fn handle(&mut self, _: Gauges, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.queues.gauge_values())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::sync::Mutex;

    use kvferry_transport::loopback::LoopbackConnector;
    use kvferry_transport::{CompletionSink, Connection, ConnectionError, ProviderKind};

    use super::*;
    use crate::nic::NicRuntime;

    /// A connector whose connects wait until the test lets each one through: a peer slow to
    /// answer a handshake.
    struct Slow {
        go: Mutex<mpsc::Receiver<()>>,
        inner: LoopbackConnector,
    }

    impl Connector for Slow {
        fn connect(
            &self,
            qp: QpKey,
            sink: Arc<dyn CompletionSink>,
        ) -> Result<Box<dyn Connection>, ConnectionError> {
            let waited = self
                .go
                .lock()
                .map(|rx| rx.recv_timeout(Duration::from_secs(10)));
            if !matches!(waited, Ok(Ok(()))) {
                return Err(ConnectionError::PeerUnreachable { peer: qp.peer });
            }
            self.inner.connect(qp, sink)
        }
    }

    /// A loopback NIC runtime and its worker, asked to connect `qps` QPs to peer 9 through
    /// handshakes that hang until released (one `go` each); the Connect's answer is
    /// `connect`. Call inside a runtime.
    #[allow(clippy::type_complexity)]
    fn hanging_connect(
        qps: u32,
    ) -> (
        NicRuntime,
        actix::Addr<NicWorker>,
        mpsc::Sender<()>,
        tokio::task::JoinHandle<Result<ConnectResult, actix::MailboxError>>,
    ) {
        let nics = NicRuntime::start(vec![NicConfig {
            name: "lo0".into(),
            provider: ProviderKind::Loopback,
            ..NicConfig::default()
        }])
        .unwrap();
        let worker = nics.workers[0].clone();
        let (go, rx) = mpsc::channel();
        let slow = Arc::new(Slow {
            go: Mutex::new(rx),
            inner: LoopbackConnector::new(NodeId(9), MrTable::new()),
        });
        let connect = tokio::spawn(worker.send(Connect {
            peer: NodeId(9),
            connector: slow,
            qps: Some(qps),
        }));
        (nics, worker, go, connect)
    }

    /// Connects wait on the network off the worker's thread: while two handshakes hang, the
    /// worker still answers (it would be stuck in the Connect handler if it connected there),
    /// shows both QPs connecting, and answers the Connect once they are through.
    #[test]
    fn a_hanging_handshake_does_not_block_the_worker() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (_nics, worker, go, connect) = hanging_connect(2);
            let mut connecting = 0;
            for _ in 0..200 {
                let g = tokio::time::timeout(Duration::from_secs(1), worker.send(Gauges))
                    .await
                    .expect("the worker answers while handshakes hang")
                    .unwrap();
                connecting = g.connecting;
                if connecting == 2 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(connecting, 2);
            assert!(!connect.is_finished());
            go.send(()).unwrap();
            go.send(()).unwrap();
            let keys = tokio::time::timeout(Duration::from_secs(5), connect)
                .await
                .expect("connect answered")
                .unwrap()
                .unwrap()
                .unwrap();
            assert_eq!(keys.len(), 2);
            let g = worker.send(Gauges).await.unwrap();
            assert_eq!((g.ready, g.connecting), (2, 0), "{g:?}");
        });
    }

    /// Stopping the NIC actors does not wait for handshakes hanging on a dead peer: the
    /// pending connect is answered and the runtime is gone at once.
    #[test]
    fn stopping_does_not_wait_for_a_hanging_handshake() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (nics, worker, go, connect) = hanging_connect(1);
            for _ in 0..200 {
                if worker.send(Gauges).await.unwrap().connecting == 1 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let t = Instant::now();
            drop(nics);
            let stopped = t.elapsed();
            let answer = tokio::time::timeout(Duration::from_secs(5), connect)
                .await
                .expect("connect answered")
                .unwrap();
            assert!(
                !matches!(answer, Ok(Ok(_))),
                "connected after the stop: {answer:?}"
            );
            assert!(
                stopped < Duration::from_secs(2),
                "stopping waited {stopped:?} for the handshake"
            );
            // Let the connect thread end.
            drop(go);
        });
    }
}
