//! `kvferry.v1.Engine` over a [`Node`]: what inference engines call. Every request is checked
//! (token, then each field) before it reaches the node, so a refused request changes
//! nothing. Loads are accepted and answered at once with a load id; their results go to
//! the [`CompletionBook`]. Sessions tie instances to a client's stream: when it ends, they
//! are unregistered. Client memory arrives on the [`FdSocket`] as [`MemoryHandles`].

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::tokio_stream::Stream;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

use crate::api;
use crate::config::EngineConfig;
use crate::fence::Fence;
use crate::lease::keeper::DIRECT_REFUSAL;
use crate::model::InstanceId;
use crate::node::Node;
use crate::peer::server::same_token;
use crate::service::engine::completions::{CompletionBook, LoadState, RankKey};
use crate::service::engine::fd_socket::{self, FdSocket};
use crate::service::engine::mailbox::{self as mailbox_thread, MailboxThread};
use crate::service::engine::memory_handles::{MemoryHandle, MemoryHandles, MemoryKind};
use crate::service::engine::request::{self as check, status};
use crate::service::statuses::{self, AsPromised};
use kvferry_proto::shm::board::{Board, BoardError, Outcome};
use kvferry_proto::shm::mailbox::Mailbox;
use kvferry_proto::v1::engine_server::{Engine, EngineServer};
use kvferry_proto::v1::*;
use kvferry_proto::{
    ENGINE_PROTOCOL, MAX_ENGINE_BLOCKS, MAX_ENGINE_HASHES, MAX_ENGINE_LAYERS, MAX_ENGINE_MAILBOXES,
    MAX_ENGINE_REGIONS, MAX_HASH_BYTES, VERSION,
};

/// Requests in flight on one connection; more wait for a free slot.
const MAX_IN_FLIGHT_PER_CONNECTION: usize = 256;

/// Memory handles waiting for RegisterInstance, over all clients.
const MAX_HANDLES: usize = 1024;

/// Loads accepted and not yet completed, per instance rank.
const MAX_RUNNING_PER_RANK: usize = 4096;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EngineServeError {
    #[error("engine service on {addr}: reading the listener's address")]
    LocalAddr {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("engine service on {addr} failed")]
    Serve {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// The fd socket's directory is not private to the node's user (or cannot be made so).
    #[error("engine fd socket directory {source}")]
    FdDir {
        #[source]
        source: crate::private_fs::PrivateDirError,
    },
    #[error("engine fd socket {path}: {what}")]
    FdSocket {
        what: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How the engine service runs.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Bearer token every call must carry; empty: not checked.
    pub token: String,
    pub max_message_bytes: usize,
    /// Completed results kept per instance rank.
    pub completion_retention: usize,
    pub handle_ttl: Duration,
    /// Longest a unary call may take on the server (the client's `grpc-timeout` may be
    /// shorter).
    pub call_timeout: Duration,
    /// How long a mailbox thread polls after a request (`engine.mailbox-spin-us`).
    pub mailbox_spin: Duration,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self::from_config(&EngineConfig::default())
    }
}

impl EngineOptions {
    pub fn from_config(c: &EngineConfig) -> Self {
        Self {
            token: c.token.clone(),
            max_message_bytes: usize::try_from(c.max_message_bytes.0).unwrap_or(usize::MAX),
            completion_retention: c.completion_retention as usize,
            handle_ttl: c.handle_ttl(),
            call_timeout: Duration::from_secs(30),
            mailbox_spin: c.mailbox_spin(),
        }
    }
}

/// What the gRPC service and the fd socket share.
pub(crate) struct Shared {
    node: Node,
    pub(crate) options: EngineOptions,
    handles: Mutex<MemoryHandles>,
    book: Mutex<CompletionBook>,
    /// Completion boards of registered ranks, with the rank's layer count.
    boards: Mutex<HashMap<RankKey, (Arc<Board>, u32)>>,
    sessions: AtomicUsize,
    /// Request mailboxes attached, and the requests they served.
    pub(crate) mailboxes: AtomicUsize,
    pub(crate) mailbox_requests: std::sync::atomic::AtomicU64,
    fd_path: Option<String>,
    stop: watch::Receiver<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded state stays consistent between statements, so a poisoned lock is usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    pub(crate) fn node(&self) -> &Node {
        &self.node
    }

    pub(crate) fn handles(&self) -> MutexGuard<'_, MemoryHandles> {
        lock(&self.handles)
    }

    fn book(&self) -> MutexGuard<'_, CompletionBook> {
        lock(&self.book)
    }

    fn boards(&self) -> MutexGuard<'_, HashMap<RankKey, (Arc<Board>, u32)>> {
        lock(&self.boards)
    }

    pub(crate) fn check_token(&self, got: &str) -> Result<(), Status> {
        let want = &self.options.token;
        if want.is_empty() || same_token(want.as_bytes(), got.as_bytes()) {
            Ok(())
        } else {
            Err(Status::unauthenticated(format!(
                "node {}: the engine token is missing or wrong",
                self.node.config().node_id
            )))
        }
    }

    /// Everything a session bound goes: the instances are unregistered (their leases
    /// released, their transfers drained), their unused handles closed, their results
    /// dropped.
    async fn end_session(&self, bound: Vec<InstanceId>) {
        for instance in bound {
            // Already unregistered by the client: nothing left to do.
            let _ = self.node.unregister_instance(instance.clone()).await;
            self.handles().drop_instance(&instance);
            self.book().drop_instance(&instance);
            self.boards().retain(|(i, _), _| *i != instance);
        }
        self.sessions.fetch_sub(1, Ordering::Relaxed);
    }
}

impl crate::metrics::EngineProbe for Shared {
    fn engine_gauges(&self) -> crate::metrics::EngineGauges {
        let memory_handles = self.handles().len() as u64;
        let b = self.book();
        crate::metrics::EngineGauges {
            sessions: self.sessions.load(Ordering::Relaxed) as u64,
            memory_handles,
            loads_pending: b.running() as u64,
            completions_retained: b.retained() as u64,
            completions_dropped: b.dropped(),
            mailboxes: self.mailboxes.load(Ordering::Relaxed) as u64,
            mailbox_requests: self.mailbox_requests.load(Ordering::Relaxed),
        }
    }
}

/// Serves `kvferry.v1.Engine` on `listener` (and memory fds on `fd_socket`, whose file is
/// removed at the end) until `shutdown` resolves; then ends the open sessions and
/// completion streams and waits for the calls in flight.
pub async fn serve(
    listener: TcpListener,
    fd_socket: Option<FdSocket>,
    node: Node,
    options: EngineOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), EngineServeError> {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .map_err(|source| EngineServeError::LocalAddr {
            addr: "?".into(),
            source,
        })?;
    let (stop_tx, stop) = watch::channel(false);
    let shared = Arc::new(Shared {
        handles: Mutex::new(MemoryHandles::new(options.handle_ttl, MAX_HANDLES)),
        book: Mutex::new(CompletionBook::new(options.completion_retention)),
        boards: Mutex::new(HashMap::new()),
        sessions: AtomicUsize::new(0),
        mailboxes: AtomicUsize::new(0),
        mailbox_requests: std::sync::atomic::AtomicU64::new(0),
        fd_path: fd_socket.as_ref().map(|s| s.path.display().to_string()),
        stop: stop.clone(),
        node,
        options: options.clone(),
    });
    let probe: Arc<dyn crate::metrics::EngineProbe> = shared.clone();
    shared.node.attach_engine(Arc::downgrade(&probe));
    let fd_path = fd_socket.as_ref().map(|s| s.path.clone());
    if let Some(sock) = fd_socket {
        tokio::spawn(fd_socket::serve(sock, Arc::clone(&shared), stop.clone()));
    }
    tokio::spawn(sweep_handles(Arc::clone(&shared), stop.clone()));
    let auth = Arc::clone(&shared);
    let closing = Arc::clone(&shared);
    let service = EngineServer::new(EngineService {
        shared: Arc::clone(&shared),
    })
    .max_decoding_message_size(options.max_message_bytes)
    .max_encoding_message_size(options.max_message_bytes);
    let service =
        tonic::service::interceptor::InterceptedService::new(service, move |req: Request<()>| {
            let got = req
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or("");
            auth.check_token(got)?;
            Ok(req)
        });
    let served = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(MAX_IN_FLIGHT_PER_CONNECTION)
        .timeout(options.call_timeout)
        // A client that vanished without closing its session is noticed within ~40 s.
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .serve_with_incoming_shutdown(
            AsPromised(service),
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            async {
                shutdown.await;
                // No new memory is taken, and sessions and completion streams end, so the
                // drain can finish.
                let _ = stop_tx.send(true);
                closing.book().close_streams();
                if let Some(p) = &fd_path {
                    let _ = std::fs::remove_file(p);
                }
            },
        )
        .await
        .map_err(|source| EngineServeError::Serve { addr, source });
    let _ = stop_tx.send(true);
    if let Some(p) = &fd_path {
        let _ = std::fs::remove_file(p);
    }
    served
}

async fn sweep_handles(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                shared.handles().expire(Instant::now());
            }
            _ = stop.wait_for(|s| *s) => break,
        }
    }
}

#[derive(Clone)]
pub(crate) struct EngineService {
    pub(crate) shared: Arc<Shared>,
}

impl EngineService {
    /// The fence a request takes effect by: the client's (`fence_ns`, 0: none), and in any
    /// case this node's call timeout from now, at which the service answers
    /// DEADLINE_EXCEEDED itself and stops waiting for the node.
    fn fence(&self, fence_ns: u64) -> Fence {
        let own = Fence::after(self.shared.options.call_timeout);
        own.min_with((fence_ns != 0).then(|| Fence::at_ns(fence_ns)))
    }

    /// Queries on a task of its own and hands the answer over; a lease nobody takes is
    /// released. The handler's future may be dropped at any await (the service's timeout, a
    /// mailbox thread's deadline, a client gone): a lease granted meanwhile must not stay
    /// until its TTL. An answer that would leave after `fence` releases its lease too: the
    /// client has stopped waiting for it.
    async fn lease_handed_over(
        &self,
        req: api::QueryRequest,
        fence: Fence,
    ) -> Result<api::QueryResponse, Status> {
        const M: &str = "Query";
        let node = self.shared.node.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let r = node.query_fenced(req, Some(fence)).await;
            let late = match tx.send(r) {
                Ok(()) => return,
                Err(r) => r,
            };
            if let Ok(api::QueryResponse {
                lease: Some(lease),
                local_blocks,
                remote_blocks,
                ..
            }) = late
            {
                // Released already (the instance went) is fine.
                let _ = node.release(lease).await;
                node.counters()
                    .abandoned("query", local_blocks + remote_blocks, Duration::ZERO);
            }
        });
        let q = rx
            .await
            .map_err(|_| status(M, crate::NodeError::Stopped { what: "query" }))?
            .map_err(|e| status(M, e))?;
        let now = crate::fence::monotonic_ns();
        if fence.passed_at(now) {
            if let Some(lease) = q.lease {
                let _ = self.shared.node.release(lease).await;
            }
            let late = fence.late_by(now);
            self.shared
                .node
                .counters()
                .abandoned("query", q.hit_blocks(), late);
            return Err(status(
                M,
                crate::NodeError::DeadlinePassed {
                    what: "Query",
                    late,
                },
            ));
        }
        Ok(q)
    }

    /// The memory a fd-socket handle names, checked against the request.
    fn memory_of(
        &self,
        m: &'static str,
        r: &RegisterInstanceRequest,
        instance: &InstanceId,
        handle: u64,
    ) -> Result<(u64, u64, crate::lease::registry::Memory), Status> {
        if handle == 0 {
            return Err(Status::invalid_argument(format!(
                "{m}: no memory handle; send the KV's fd on the fd socket first (or give a \
                 CUDA IPC handle)"
            )));
        }
        let h = self.handle(handle, || {
            format!("{m}: memory handle {handle} is unknown, expired or already registered")
        })?;
        if h.instance != *instance || h.rank != r.rank {
            return Err(Status::permission_denied(format!(
                "{m}: memory handle {handle} was sent for instance {} rank {}, not {instance} \
                 rank {}",
                h.instance, h.rank, r.rank
            )));
        }
        if matches!(h.kind, MemoryKind::Board | MemoryKind::Mailbox) {
            return Err(Status::invalid_argument(format!(
                "{m}: memory handle {handle} is a {}, not KV memory",
                h.kind.as_str()
            )));
        }
        if h.device != r.device {
            return Err(Status::invalid_argument(format!(
                "{m}: memory handle {handle} is memory of device {}, not {}",
                h.device, r.device
            )));
        }
        Ok((h.base, h.len, Arc::clone(&h.memory)))
    }

    /// The fd-socket handle `id`, or NOT_FOUND saying `missing`.
    fn handle(&self, id: u64, missing: impl FnOnce() -> String) -> Result<MemoryHandle, Status> {
        self.shared
            .handles()
            .get(id, Instant::now())
            .cloned()
            .ok_or_else(|| Status::not_found(missing()))
    }

    /// Takes the mailbox of fd-socket handle `id` and starts its thread.
    fn attach_mailbox(&self, id: u64) -> Result<MailboxThread, Status> {
        const M: &str = "Session";
        let h = self.handle(id, || {
            format!("{M}: mailbox {id} is unknown, expired or already attached")
        })?;
        let kind = h.kind;
        let mailbox = Arc::downcast::<Mailbox>(h.memory).map_err(|_| {
            Status::invalid_argument(format!(
                "{M}: handle {id} is {} memory, not a mailbox",
                kind.as_str()
            ))
        })?;
        let thread = mailbox_thread::attach(self.clone(), mailbox)?;
        self.shared.handles().take(id);
        Ok(thread)
    }

    /// The completion board a registration names (0: none), checked against the request.
    fn board_of(
        &self,
        m: &'static str,
        r: &RegisterInstanceRequest,
        instance: &InstanceId,
    ) -> Result<Option<Arc<Board>>, Status> {
        if r.completion_board == 0 {
            return Ok(None);
        }
        let id = r.completion_board;
        let h = self.handle(id, || {
            format!("{m}: completion board {id} is unknown, expired or already registered")
        })?;
        if h.instance != *instance || h.rank != r.rank {
            return Err(Status::permission_denied(format!(
                "{m}: completion board {id} was sent for instance {} rank {}, not {instance} \
                 rank {}",
                h.instance, h.rank, r.rank
            )));
        }
        let board = Arc::downcast::<Board>(h.memory).map_err(|_| {
            Status::invalid_argument(format!(
                "{m}: handle {id} is {} memory, not a completion board",
                h.kind.as_str()
            ))
        })?;
        Ok(Some(board))
    }

    /// The allocation a CUDA IPC handle names, mapped on the requested device.
    fn ipc_memory(
        &self,
        m: &'static str,
        r: &RegisterInstanceRequest,
        ipc: &[u8],
    ) -> Result<(u64, u64, crate::lease::registry::Memory), Status> {
        if ipc.len() > 1024 {
            return Err(Status::invalid_argument(format!(
                "{m}: a CUDA IPC handle of {} bytes (64, or PyTorch's framed form)",
                ipc.len()
            )));
        }
        let device = self.shared.node.device(r.device).ok_or_else(|| {
            Status::not_found(format!("{m}: device {} is not on this node", r.device))
        })?;
        let buf = device.import_ipc(ipc).map_err(|e| {
            Status::failed_precondition(format!(
                "{m}: device {} cannot map the CUDA IPC handle: {e}",
                r.device
            ))
        })?;
        Ok((buf.ptr(), buf.len(), Arc::new(buf)))
    }

    /// The memory regions of a registration, in the request's order, and the fd-socket
    /// handles they take once it succeeds. Protocol 1's single memory is region 0.
    #[allow(clippy::type_complexity)]
    fn regions_of(
        &self,
        m: &'static str,
        r: &RegisterInstanceRequest,
        instance: &InstanceId,
    ) -> Result<
        (
            Vec<check::Placed>,
            Vec<crate::lease::registry::Memory>,
            Vec<u64>,
        ),
        Status,
    > {
        use memory_region::Memory as Region;
        // Counted before any region is looked at (each may map memory).
        if r.regions.len() > MAX_ENGINE_REGIONS {
            return Err(Status::resource_exhausted(format!(
                "{m}: {} memory regions; at most {MAX_ENGINE_REGIONS} per registration",
                r.regions.len()
            )));
        }
        let single = r.memory_handle != 0 || !r.cuda_ipc_handle.is_empty();
        let regions: Vec<Region> = match (single, r.regions.is_empty()) {
            (true, false) => {
                return Err(Status::invalid_argument(format!(
                    "{m}: give memory regions, or (protocol 1) one memory handle or CUDA IPC \
                     handle, not both"
                )));
            }
            (true, true) if r.memory_handle != 0 && !r.cuda_ipc_handle.is_empty() => {
                return Err(Status::invalid_argument(format!(
                    "{m}: give a memory handle or a CUDA IPC handle, not both"
                )));
            }
            (true, true) if r.memory_handle != 0 => vec![Region::MemoryHandle(r.memory_handle)],
            (true, true) => vec![Region::CudaIpcHandle(r.cuda_ipc_handle.clone())],
            (false, true) => vec![Region::MemoryHandle(0)],
            (false, false) => r
                .regions
                .iter()
                .enumerate()
                .map(|(i, g)| {
                    g.memory.clone().ok_or_else(|| {
                        Status::invalid_argument(format!("{m}: memory region {i} names no memory"))
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        let mut placed = Vec::with_capacity(regions.len());
        let mut memory = Vec::with_capacity(regions.len());
        let mut handles = Vec::new();
        for (i, region) in regions.iter().enumerate() {
            let (base, len, mem) = match region {
                Region::MemoryHandle(h) => {
                    if handles.contains(h) {
                        return Err(Status::invalid_argument(format!(
                            "{m}: memory handle {h} is named by two regions (region {i})"
                        )));
                    }
                    let got = self.memory_of(m, r, instance, *h)?;
                    handles.push(*h);
                    got
                }
                Region::CudaIpcHandle(ipc) => self.ipc_memory(m, r, ipc)?,
            };
            placed.push(check::Placed { base, len });
            memory.push(mem);
        }
        Ok((placed, memory, handles))
    }
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Reports one load of the Engine API as it lands: its layers into its completion board
/// slot, and its end into the completion book (for PollLoad and the stream) and then the
/// board, from the node's thread as the transfer ends.
struct LoadWatch {
    shared: Arc<Shared>,
    load_id: u64,
    req: api::LoadRequest,
    board: Option<(Arc<Board>, u32, u32)>,
    reported: AtomicBool,
}

impl LoadWatch {
    /// Books the result, then shows it on the board; once, whoever comes first.
    fn report(&self, r: Result<&Result<api::TransferReport, crate::NodeError>, ()>) {
        if self.reported.swap(true, Ordering::AcqRel) {
            return;
        }
        let c = completion(self.load_id, &self.req, r);
        let outcome = if c.status == LoadStatus::LoadOk as i32 {
            Outcome::Ok
        } else {
            Outcome::Failed {
                blocks: u32::try_from(c.failed_blocks.len()).unwrap_or(u32::MAX),
            }
        };
        // The board's ok is the delivery: that result stays in the book only for details.
        let shown = self.board.is_some() && outcome == Outcome::Ok;
        self.shared.book().finish(c, shown);
        // After the book: a client woken by the board finds the details in PollLoad.
        if let Some((b, slot, tag)) = &self.board {
            b.finish(*slot, *tag, outcome);
        }
    }
}

impl api::LoadObserver for LoadWatch {
    fn layers_landed(&self, layers: u32, _total: u32) {
        if let Some((b, slot, tag)) = &self.board {
            b.layers(*slot, *tag, layers);
        }
    }

    fn finished(&self, result: &Result<api::TransferReport, crate::NodeError>) {
        self.report(Ok(result));
    }
}

/// Why this node refuses `direct_gpu`, if it does: the keeper's rule, asked before a query.
/// A verbs gate that cannot serve refuses first; a node without peers has no remote suffix.
fn direct_refusal(node: &Node) -> Option<String> {
    if let Some(reason) = node.nics().and_then(|n| n.direct_refusal.clone()) {
        return Some(reason);
    }
    (!node.has_peers()).then(|| DIRECT_REFUSAL.to_owned())
}

fn completion(
    load_id: u64,
    req: &api::LoadRequest,
    r: Result<&Result<api::TransferReport, crate::NodeError>, ()>,
) -> LoadCompletion {
    let mut c = LoadCompletion {
        load_id,
        instance: req.instance.as_str().to_owned(),
        rank: req.rank,
        ..Default::default()
    };
    match r {
        Ok(Ok(rep)) => {
            c.status = LoadStatus::LoadOk as i32;
            c.bytes = rep.bytes;
            c.blocks = rep.blocks as u32;
            c.path = rep.path.as_str().to_owned();
            c.seconds = rep.seconds;
            c.stages = rep
                .stages
                .iter()
                .map(|s| StageSeconds {
                    name: s.name.as_str().to_owned(),
                    seconds: s.seconds,
                })
                .collect();
        }
        Ok(Err(e)) => {
            c.status = LoadStatus::LoadFailed as i32;
            c.error_kind = check::error_kind(e).to_owned();
            c.error = e.to_string();
            c.failed_blocks = req.dest_blocks.clone();
        }
        Err(()) => {
            c.status = LoadStatus::LoadFailed as i32;
            c.error_kind = "stopped".into();
            c.error = "the transfer ended without a report (the node is stopping)".into();
            c.failed_blocks = req.dest_blocks.clone();
        }
    }
    c
}

#[tonic::async_trait]
impl Engine for EngineService {
    async fn capabilities(
        &self,
        _: Request<CapabilitiesRequest>,
    ) -> Result<Response<CapabilitiesResponse>, Status> {
        let node = &self.shared.node;
        let devices = node.devices();
        let kind = devices
            .first()
            .map(|d| d.kind())
            .unwrap_or(kvferry_gpu::DeviceKind::Host);
        let memory_kinds = match kind {
            kvferry_gpu::DeviceKind::Host => vec!["memfd".to_owned()],
            kvferry_gpu::DeviceKind::Cuda => vec!["dmabuf".to_owned()],
        };
        let o = &self.shared.options;
        let refusal = direct_refusal(node);
        Ok(Response::new(CapabilitiesResponse {
            node_id: node.config().node_id.clone(),
            version: VERSION.to_owned(),
            protocol: ENGINE_PROTOCOL,
            device_kind: kind.as_str().to_owned(),
            device_count: devices.len() as u32,
            device_names: devices.iter().map(|d| d.name()).collect(),
            providers: node
                .config()
                .cluster
                .iter()
                .map(|c| c.provider.clone())
                .collect(),
            direct_possible: refusal.is_none(),
            direct_reason: refusal.unwrap_or_default(),
            fd_socket: self.shared.fd_path.clone().unwrap_or_default(),
            memory_kinds,
            max_message_bytes: o.max_message_bytes as u64,
            completion_retention: o.completion_retention as u32,
            handle_ttl_ms: u64::try_from(o.handle_ttl.as_millis()).unwrap_or(u64::MAX),
            max_hashes: MAX_ENGINE_HASHES as u32,
            max_layers: MAX_ENGINE_LAYERS,
            max_regions: MAX_ENGINE_REGIONS as u32,
            max_blocks: MAX_ENGINE_BLOCKS as u32,
            max_hash_bytes: MAX_HASH_BYTES as u32,
            slot_bytes: node.config().pool.slot_bytes.0,
            max_mailboxes: MAX_ENGINE_MAILBOXES as u32,
            monotonic_ns: crate::fence::monotonic_ns(),
        }))
    }

    async fn register_instance(
        &self,
        req: Request<RegisterInstanceRequest>,
    ) -> Result<Response<RegisterInstanceResponse>, Status> {
        const M: &str = "RegisterInstance";
        let r = req.into_inner();
        let instance = check::instance(M, &r.instance)?;
        let shape = check::shape(M, r.shape.as_ref())?;
        check::fits_slot(M, &shape, self.shared.node.config().pool.slot_bytes.0)?;
        let (spec, plane_regions) = check::layout(M, r.layout.as_ref())?;
        if r.rank >= shape.tp_size() {
            return Err(Status::invalid_argument(format!(
                "{M}: rank {} is out of range for tp {}",
                r.rank,
                shape.tp_size()
            )));
        }
        let (regions, memory, handles) = self.regions_of(M, &r, &instance)?;
        let board = self.board_of(M, &r, &instance)?;
        let layout = check::place(M, spec, &plane_regions, &shape, &regions)?;
        let key = (instance.clone(), r.rank);
        let namespace = self
            .shared
            .node
            .register_instance_with(
                api::RegisterInstance {
                    instance,
                    model: r.model,
                    dtype: r.dtype,
                    shape,
                    rank: r.rank,
                    device: r.device,
                    layout,
                },
                memory,
            )
            .await
            .map_err(|e| status(M, e))?;
        // The registration holds the memory now.
        let mut table = self.shared.handles();
        for h in handles {
            table.take(h);
        }
        if let Some(board) = board {
            table.take(r.completion_board);
            self.shared.boards().insert(key, (board, shape.layers()));
        }
        Ok(Response::new(RegisterInstanceResponse {
            namespace: namespace.to_string(),
        }))
    }

    async fn unregister_instance(
        &self,
        req: Request<UnregisterInstanceRequest>,
    ) -> Result<Response<UnregisterInstanceResponse>, Status> {
        const M: &str = "UnregisterInstance";
        let instance = check::instance(M, &req.into_inner().instance)?;
        let released = self
            .shared
            .node
            .unregister_instance(instance.clone())
            .await
            .map_err(|e| status(M, e))?;
        self.shared.boards().retain(|(i, _), _| *i != instance);
        Ok(Response::new(UnregisterInstanceResponse {
            leases_released: released as u32,
        }))
    }

    async fn save(&self, req: Request<SaveRequest>) -> Result<Response<StoreResponse>, Status> {
        const M: &str = "Save";
        let r = req.into_inner();
        let instance = check::instance(M, &r.instance)?;
        let hashes = check::hashes(M, &r.hashes)?;
        if r.src_blocks.len() != hashes.len() {
            return Err(Status::invalid_argument(format!(
                "{M}: {} hashes but {} source blocks",
                hashes.len(),
                r.src_blocks.len()
            )));
        }
        let fence = self.fence(r.fence_ns);
        let rep = self
            .shared
            .node
            .save_fenced(
                api::SaveRequest {
                    instance,
                    rank: r.rank,
                    hashes,
                    src_blocks: r.src_blocks,
                },
                Some(fence),
            )
            .await
            .map_err(|e| status(M, e))?;
        Ok(Response::new(store_response(rep)))
    }

    async fn put_blocks(
        &self,
        req: Request<PutBlocksRequest>,
    ) -> Result<Response<StoreResponse>, Status> {
        const M: &str = "PutBlocks";
        let r = req.into_inner();
        let instance = check::instance(M, &r.instance)?;
        let hashes: Vec<Vec<u8>> = r.blocks.iter().map(|b| b.hash.clone()).collect();
        let hashes = check::hashes(M, &hashes)?;
        if let Some(i) = r.blocks.iter().position(|b| b.data.is_empty()) {
            return Err(Status::invalid_argument(format!(
                "{M}: block #{i} has no data"
            )));
        }
        let blocks = hashes
            .into_iter()
            .zip(r.blocks)
            .map(|(h, b)| (h, b.data))
            .collect();
        let fence = self.fence(r.fence_ns);
        let rep = self
            .shared
            .node
            .put_blocks_fenced(
                api::PutBlocks {
                    instance,
                    rank: r.rank,
                    blocks,
                },
                Some(fence),
            )
            .await
            .map_err(|e| status(M, e))?;
        Ok(Response::new(store_response(rep)))
    }

    async fn query(&self, req: Request<QueryRequest>) -> Result<Response<QueryResponse>, Status> {
        const M: &str = "Query";
        let r = req.into_inner();
        let instance = check::instance(M, &r.instance)?;
        let hashes = check::query_hashes(M, &r.hashes, &r.packed_hashes, r.hash_len)?;
        let fence = self.fence(r.fence_ns);
        let req = api::QueryRequest {
            instance,
            hashes,
            direct_gpu: r.direct_gpu,
        };
        let q = self.lease_handed_over(req, fence).await?;
        let (direct, direct_reason) = match q.direct {
            api::DirectGrant::NotRequested => (DirectGrant::DirectNotRequested, String::new()),
            api::DirectGrant::Granted => (DirectGrant::DirectGranted, String::new()),
            api::DirectGrant::Refused { reason } => (DirectGrant::DirectRefused, reason),
        };
        Ok(Response::new(QueryResponse {
            lease: q.lease.map(|l| l.to_hex()).unwrap_or_default(),
            namespace: q.namespace.to_string(),
            local_blocks: q.local_blocks as u32,
            remote_blocks: q.remote_blocks as u32,
            direct: direct as i32,
            direct_reason,
            ssd_blocks: q.ssd_blocks as u32,
        }))
    }

    async fn load(&self, req: Request<LoadRequest>) -> Result<Response<LoadResponse>, Status> {
        const M: &str = "Load";
        let r = req.into_inner();
        let lease = check::lease(M, &r.lease)?;
        let instance = check::instance(M, &r.instance)?;
        check::blocks(M, "destination blocks", &r.dest_blocks)?;
        let key = (instance.clone(), r.rank);
        if self.shared.book().running_for(&key) >= MAX_RUNNING_PER_RANK {
            return Err(Status::resource_exhausted(format!(
                "{M}: {MAX_RUNNING_PER_RANK} loads of {instance} rank {} are still running",
                r.rank
            )));
        }
        let board = match r.board_slot {
            None => None,
            Some(slot) => {
                let (board, layers) = self.shared.boards().get(&key).cloned().ok_or_else(|| {
                    Status::failed_precondition(format!(
                        "{M}: {instance} rank {} registered no completion board; register \
                         with one to name a board slot",
                        r.rank
                    ))
                })?;
                board
                    .begin(slot, r.board_tag, layers)
                    .map_err(|e| match e {
                        BoardError::SlotRange { .. } => {
                            Status::invalid_argument(format!("{M}: completion board: {e}"))
                        }
                        _ => Status::failed_precondition(format!("{M}: completion board: {e}")),
                    })?;
                Some((board, slot, r.board_tag))
            }
        };
        let load = api::LoadRequest {
            lease,
            instance,
            rank: r.rank,
            dest_blocks: r.dest_blocks,
        };
        // The id first: the watch reports into the book from the node's thread, and a small
        // load may end before `start_load_observed` returns.
        let load_id = self.shared.book().begin(key);
        let watch = Arc::new(LoadWatch {
            shared: Arc::clone(&self.shared),
            load_id,
            req: load.clone(),
            board,
            reported: AtomicBool::new(false),
        });
        let observer: Arc<dyn api::LoadObserver> = watch.clone();
        let fence = self.fence(r.fence_ns);
        let rx = match self
            .shared
            .node
            .start_load_fenced(load, observer, Some(fence))
            .await
        {
            Ok(rx) => rx,
            Err(e) => {
                // Refused: no result to keep, and the slot must not stay "running".
                self.shared.book().abandon(load_id);
                if let Some((b, slot, tag)) = &watch.board {
                    let blocks = u32::try_from(watch.req.dest_blocks.len()).unwrap_or(u32::MAX);
                    b.finish(*slot, *tag, Outcome::Failed { blocks });
                }
                return Err(status(M, e));
            }
        };
        tokio::spawn(async move {
            // The watch has reported unless the transfer ended without a report.
            let r = rx.await.map_err(|_| ());
            watch.report(r.as_ref().map_err(|_| ()));
        });
        Ok(Response::new(LoadResponse { load_id }))
    }

    async fn release(
        &self,
        req: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        const M: &str = "Release";
        let lease = check::lease(M, &req.into_inner().lease)?;
        self.shared
            .node
            .release(lease)
            .await
            .map_err(|e| status(M, e))?;
        Ok(Response::new(ReleaseResponse {}))
    }

    async fn health(&self, _: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        self.shared
            .node
            .stats()
            .await
            .map_err(|e| status("Health", e))?;
        Ok(Response::new(HealthResponse {
            serving: true,
            node_id: self.shared.node.config().node_id.clone(),
        }))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<StatsResponse>, Status> {
        let s = self
            .shared
            .node
            .stats()
            .await
            .map_err(|e| status("Stats", e))?;
        let e = crate::metrics::EngineProbe::engine_gauges(self.shared.as_ref());
        Ok(Response::new(StatsResponse {
            leases_live: s.leases_live as u64,
            leases_expired: s.leases_expired,
            blocks: s.blocks as u64,
            sealed_blocks: s.sealed_blocks as u64,
            pinned_blocks: s.pinned_blocks as u64,
            pins: s.pins,
            pool_slots: s.pool_slots as u64,
            evictions: s.evictions,
            instances: s.instances as u64,
            transfers_in_flight: s.transfers_in_flight as u64,
            loads_ok: s.loads_ok,
            loads_failed: s.loads_failed,
            bytes_loaded: s.bytes_loaded,
            sessions: e.sessions,
            memory_handles: e.memory_handles,
            loads_pending: e.loads_pending,
            completions_retained: e.completions_retained,
            completions_dropped: e.completions_dropped,
        }))
    }

    type SessionStream = EventStream<SessionEvent>;

    async fn session(
        &self,
        req: Request<Streaming<SessionRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        const M: &str = "Session";
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let shared = Arc::clone(&self.shared);
        let mut stop = self.shared.stop.clone();
        shared.sessions.fetch_add(1, Ordering::Relaxed);
        let service = self.clone();
        tokio::spawn(async move {
            let mut bound: Vec<InstanceId> = Vec::new();
            // Their threads end when this task does: the session's end detaches them.
            let mut mailboxes = Vec::new();
            loop {
                let msg = tokio::select! {
                    m = inbound.message() => m,
                    _ = stop.wait_for(|s| *s) => break,
                };
                // End of stream or a broken connection: the session ends. A message that does
                // not decode (or is too large) ends it with the status saying so.
                let m = match msg {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) => {
                        shared.end_session(std::mem::take(&mut bound)).await;
                        let _ = tx.send(Err(statuses::inbound(M, e))).await;
                        return;
                    }
                };
                let answer = match check::instance(M, &m.bind) {
                    _ if m.mailbox != 0 => service.attach_mailbox(m.mailbox).map(|t| {
                        mailboxes.push(t);
                        SessionEvent {
                            bound: String::new(),
                            mailbox: m.mailbox,
                        }
                    }),
                    Ok(instance) => match shared.node.check_registered(&instance, None).await {
                        Ok(()) => {
                            if !bound.contains(&instance) {
                                bound.push(instance.clone());
                            }
                            Ok(SessionEvent {
                                bound: instance.as_str().to_owned(),
                                mailbox: 0,
                            })
                        }
                        Err(e) => Err(status(M, e)),
                    },
                    Err(s) => Err(s),
                };
                match answer {
                    Ok(event) => {
                        if tx.send(Ok(event)).await.is_err() {
                            break;
                        }
                    }
                    Err(refused) => {
                        // The session ends on a refused bind; its cleanup is done by the
                        // time the client reads why.
                        shared.end_session(std::mem::take(&mut bound)).await;
                        let _ = tx.send(Err(refused)).await;
                        return;
                    }
                }
            }
            drop(tx);
            shared.end_session(bound).await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type CompletionsStream = EventStream<LoadCompletion>;

    async fn completions(
        &self,
        req: Request<CompletionsRequest>,
    ) -> Result<Response<Self::CompletionsStream>, Status> {
        const M: &str = "Completions";
        let r = req.into_inner();
        let instance = check::instance(M, &r.instance)?;
        self.shared
            .node
            .check_registered(&instance, Some(r.rank))
            .await
            .map_err(|e| status(M, e))?;
        // Ends when the book drops the sender: replaced, instance gone, node stopping.
        let rx = self.shared.book().subscribe((instance, r.rank));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn poll_load(
        &self,
        req: Request<PollLoadRequest>,
    ) -> Result<Response<PollLoadResponse>, Status> {
        let id = req.into_inner().load_id;
        match self.shared.book().poll(id) {
            LoadState::Running => Ok(Response::new(PollLoadResponse {
                completion: None,
                pending: true,
            })),
            LoadState::Done(c) => Ok(Response::new(PollLoadResponse {
                completion: Some(c),
                pending: false,
            })),
            LoadState::Unknown => Err(Status::not_found(format!(
                "PollLoad: load {id} is unknown, already delivered, or dropped"
            ))),
        }
    }
}

fn store_response(r: api::StoreReport) -> StoreResponse {
    StoreResponse {
        written: r.written as u32,
        present: r.present as u32,
        sealed: r.sealed as u32,
        bytes: r.bytes,
        seconds: r.seconds,
    }
}
