//! The engine's client of `kvferry.v1.Engine`: typed calls with a deadline on each unary
//! call, memory sent on the node's fd socket, loads started without waiting and awaited on
//! the completion stream or by polling, and the session that ties instances to this client.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_transport::fd_passing;
use prost::Message;
use thiserror::Error;
use tokio::io::{AsyncBufReadExt, Interest};
use tokio::sync::{mpsc, OnceCell};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status, Streaming};

use super::fd_socket;
use super::mailbox::{self, Mailbox, MailboxError, Op};
use super::proto::engine_client::EngineClient as RawClient;
use super::proto::*;
use crate::api;
use crate::fence::Fence;
use crate::model::{BlockHash, InstanceId, LeaseId};

/// How often a mailbox wait looks whether the session holding the mailbox ended.
const ENDED_CHECK: Duration = Duration::from_millis(20);

/// Deadline of every unary call unless [`EngineClient::with_deadline`] says otherwise.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(10);

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EngineClientError {
    #[error("engine service at {addr}: {reason}")]
    Address { addr: String, reason: String },
    #[error("engine service at {addr}: connecting")]
    Connect {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("engine service at {addr}: no connection within {after:?}")]
    ConnectTimeout { addr: String, after: Duration },
    /// The node answered with an error status (or the call ran past its deadline:
    /// `DeadlineExceeded`, or the connection broke: `Unavailable`).
    #[error("engine service at {addr}: {method} failed: {code:?}: {message}")]
    Call {
        addr: String,
        method: &'static str,
        code: Code,
        message: String,
    },
    #[error("engine fd socket {path}: {what}")]
    FdSocket {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The fd socket refused the memory.
    #[error("engine fd socket {path}: refused: {code:?}: {message}")]
    FdRefused {
        path: PathBuf,
        code: Code,
        message: String,
    },
    #[error("engine service at {addr}: {method} answered a malformed response: {reason}")]
    Malformed {
        addr: String,
        method: &'static str,
        reason: String,
    },
    #[error("load {load_id}: no completion within {after:?}")]
    WaitTimeout { load_id: u64, after: Duration },
    #[error("no fd socket: connect with its path (Capabilities.fd_socket)")]
    NoFdSocket,
    /// The request mailbox failed (creating it, or waiting for an answer).
    #[error("engine service at {addr}: request mailbox")]
    Mailbox {
        addr: String,
        #[source]
        source: MailboxError,
    },
    /// The node took a completion board without saying it writes this build's version.
    #[error("engine service at {addr}: completion board {handle}")]
    Board {
        addr: String,
        handle: u64,
        #[source]
        source: super::board::BoardError,
    },
}

impl EngineClientError {
    /// The gRPC status code of a refused call or fd request.
    pub fn code(&self) -> Option<Code> {
        match self {
            EngineClientError::Call { code, .. } | EngineClientError::FdRefused { code, .. } => {
                Some(*code)
            }
            _ => None,
        }
    }
}

/// What a Query answered.
#[derive(Clone, Debug, PartialEq)]
pub struct QueryAnswer {
    /// Absent when nothing hit.
    pub lease: Option<LeaseId>,
    pub namespace: String,
    pub local_blocks: u32,
    /// How many of `local_blocks` came from the node's SSD tier.
    pub ssd_blocks: u32,
    pub remote_blocks: u32,
    pub direct: api::DirectGrant,
}

impl QueryAnswer {
    pub fn hit_blocks(&self) -> u32 {
        self.local_blocks + self.remote_blocks
    }
}

/// A connection to one node's engine service. Cloning shares the HTTP/2 connection.
#[derive(Clone, Debug)]
pub struct EngineClient {
    raw: RawClient<Channel>,
    addr: String,
    fd_socket: Option<PathBuf>,
    token: String,
    deadline: Duration,
    /// What the node's protocol offers this client (packed query hashes, fences): learnt
    /// from Capabilities on the first query or save of this handle (and its clones).
    traits: Arc<OnceCell<NodeTraits>>,
    /// The request mailbox Query, Load and Save go through once attached (this handle and its
    /// clones); detached when the last of them drops.
    mailbox: Arc<OnceCell<MailboxLink>>,
}

/// What a node's protocol offers, as far as this client uses it.
#[derive(Clone, Copy, Debug)]
struct NodeTraits {
    /// Packed query hashes (protocol 4).
    packed: bool,
    /// Fences (protocol 6) on a clock this process shares with the node.
    fences: bool,
}

/// How far the node's clock may lie outside the interval its Capabilities call took and
/// still count as this process's own (the same `CLOCK_MONOTONIC`).
const CLOCK_SLACK: Duration = Duration::from_millis(50);

/// How long an answer that arrives after its call gave up is still waited for, so a lease in
/// it is released (a node stalled longer: its lease expires by its TTL).
const LATE_ANSWER_WAIT: Duration = Duration::from_secs(120);

/// Codes with which the node answers a request it has finished with (it refused it or
/// it failed there); any other failure may leave the request still running on the node.
fn node_is_done_with(e: &EngineClientError) -> bool {
    matches!(
        e.code(),
        Some(
            Code::InvalidArgument
                | Code::NotFound
                | Code::AlreadyExists
                | Code::PermissionDenied
                | Code::ResourceExhausted
                | Code::FailedPrecondition
                | Code::OutOfRange
                | Code::Unimplemented
                | Code::Unauthenticated
        )
    )
}

/// An attached mailbox, held on the node by a session that a task of its own watches.
struct MailboxLink {
    mailbox: Arc<Mailbox>,
    /// The session ended (the node stopped, restarted or dropped it): its thread no longer
    /// serves the mailbox, so requests go as calls from then on.
    ended: Arc<std::sync::atomic::AtomicBool>,
    /// Dropped with the link: the watcher then ends the session.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl MailboxLink {
    fn ended(&self) -> bool {
        self.ended.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl std::fmt::Debug for MailboxLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MailboxLink")
            .field("slots", &self.mailbox.slots())
            .finish()
    }
}

impl Drop for MailboxLink {
    fn drop(&mut self) {
        // The node's thread ends now, not when it notices the session's end.
        self.mailbox.close();
    }
}

impl EngineClient {
    /// Connects to `addr` ("host:port"); `fd_socket` is the node's fd socket (None: this
    /// client sends no memory); `token` is the node's engine token ("" where none is set).
    pub async fn connect(
        addr: impl Into<String>,
        fd_socket: Option<PathBuf>,
        token: impl Into<String>,
    ) -> Result<Self, EngineClientError> {
        let addr = addr.into();
        let deadline = DEFAULT_DEADLINE;
        // No per-request timeout on the channel: sessions and completion streams stay open.
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| EngineClientError::Address {
                addr: addr.clone(),
                reason: e.to_string(),
            })?
            .connect_timeout(deadline)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(20))
            .keep_alive_while_idle(true);
        let channel = match tokio::time::timeout(deadline, endpoint.connect()).await {
            Ok(Ok(c)) => c,
            Ok(Err(source)) => return Err(EngineClientError::Connect { addr, source }),
            Err(_) => {
                return Err(EngineClientError::ConnectTimeout {
                    addr,
                    after: deadline,
                });
            }
        };
        Ok(Self {
            raw: RawClient::new(channel),
            addr,
            fd_socket,
            token: token.into(),
            deadline,
            traits: Arc::new(OnceCell::new()),
            mailbox: Arc::new(OnceCell::new()),
        })
    }

    /// Sets the deadline of every later unary call made through this handle.
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The generated client over the same connection, for requests this wrapper would
    /// refuse to build (tests of the node's validation). Add the token with
    /// [`Self::request`].
    pub fn raw(&self) -> RawClient<Channel> {
        self.raw.clone()
    }

    /// Wraps `msg` with this client's token and deadline.
    pub fn request<T>(&self, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        r.set_timeout(self.deadline);
        self.authorize(&mut r);
        r
    }

    fn authorize<T>(&self, r: &mut Request<T>) {
        if !self.token.is_empty() {
            if let Ok(v) = MetadataValue::try_from(format!("Bearer {}", self.token)) {
                r.metadata_mut().insert("authorization", v);
            }
        }
    }

    fn failed(&self, method: &'static str, s: Status) -> EngineClientError {
        EngineClientError::Call {
            addr: self.addr.clone(),
            method,
            code: caller_code(&s),
            message: s.message().to_owned(),
        }
    }

    /// Awaits a call, enforcing the deadline here too (a stalled connection never answers
    /// the node's deadline).
    async fn call<T>(
        &self,
        method: &'static str,
        fut: impl std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    ) -> Result<T, EngineClientError> {
        match tokio::time::timeout(self.deadline, fut).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(self.failed(method, s)),
            Err(_) => Err(self.failed(
                method,
                Status::deadline_exceeded(format!("no answer within {:?}", self.deadline)),
            )),
        }
    }

    pub async fn capabilities(&self) -> Result<CapabilitiesResponse, EngineClientError> {
        let req = self.request(CapabilitiesRequest {});
        self.call("Capabilities", self.raw.clone().capabilities(req))
            .await
    }

    /// Sends a memfd holding `len` bytes of host KV for `instance` rank `rank` (create it
    /// with `MFD_ALLOW_SEALING`: the node seals it against shrinking); returns the memory
    /// handle to register with.
    pub async fn send_memfd(
        &self,
        instance: &InstanceId,
        rank: u32,
        device: u32,
        fd: BorrowedFd<'_>,
        len: u64,
    ) -> Result<u64, EngineClientError> {
        let line = format!("memfd {instance} {rank} {device} {len}");
        self.send_fd(line, fd).await
    }

    /// Sends a DMA-BUF of GPU KV covering `[base, base + len)` as the node addresses it;
    /// returns the memory handle to register with.
    pub async fn send_dmabuf(
        &self,
        instance: &InstanceId,
        rank: u32,
        device: u32,
        fd: BorrowedFd<'_>,
        base: u64,
        len: u64,
    ) -> Result<u64, EngineClientError> {
        let line = format!("dmabuf {instance} {rank} {device} {len} {base}");
        self.send_fd(line, fd).await
    }

    /// Sends the POSIX fd of a VMM allocation holding GPU KV (vLLM 0.34's extensible KV
    /// cache: `cuMemExportToShareableHandle`), `len` bytes (its mapping's whole size); the node
    /// maps it on `device`, and layout offsets are from the allocation's byte 0. Returns the
    /// memory handle to register with.
    pub async fn send_vmm(
        &self,
        instance: &InstanceId,
        rank: u32,
        device: u32,
        fd: BorrowedFd<'_>,
        len: u64,
    ) -> Result<u64, EngineClientError> {
        let line = format!("vmm {instance} {rank} {device} {len}");
        self.send_fd(line, fd).await
    }

    /// Sends a completion board (see [`super::board`]) for `instance` rank `rank`; returns
    /// the handle to register with ([`Self::register_regions_with_board`]). Refused here
    /// (the handle unused: it expires on the node) unless the node says it took the board as
    /// this build's version, whose final words a client reads as outcomes.
    pub async fn send_board(
        &self,
        instance: &InstanceId,
        rank: u32,
        board: &super::board::Board,
    ) -> Result<u64, EngineClientError> {
        let line = format!("board {instance} {rank} 0 {}", board.len());
        let handle = self.send_fd(line, board.fd()).await?;
        board
            .accepted()
            .map_err(|source| EngineClientError::Board {
                addr: self.addr.clone(),
                handle,
                source,
            })?;
        Ok(handle)
    }

    /// Sends a request mailbox (see [`super::mailbox`]); returns the handle a session
    /// attaches ([`EngineSession::attach`]). [`Self::attach_mailbox`] does both.
    pub async fn send_mailbox(
        &self,
        instance: &InstanceId,
        mailbox: &Mailbox,
    ) -> Result<u64, EngineClientError> {
        let line = format!("mailbox {instance} 0 0 {}", mailbox.len());
        self.send_fd(line, mailbox.fd()).await
    }

    async fn send_fd(
        &self,
        mut line: String,
        fd: BorrowedFd<'_>,
    ) -> Result<u64, EngineClientError> {
        let path = self
            .fd_socket
            .as_ref()
            .ok_or(EngineClientError::NoFdSocket)?;
        if !self.token.is_empty() {
            line.push(' ');
            line.push_str(&self.token);
        }
        line.push('\n');
        let io = |what: &'static str| {
            let path = path.clone();
            move |source| EngineClientError::FdSocket { path, what, source }
        };
        let exchange = async {
            let stream = tokio::net::UnixStream::connect(path)
                .await
                .map_err(io("connecting"))?;
            loop {
                stream.writable().await.map_err(io("sending"))?;
                match stream.try_io(Interest::WRITABLE, || {
                    fd_passing::send_with_fds(stream.as_raw_fd(), line.as_bytes(), &[fd])
                }) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Err(io("sending")(e)),
                }
            }
            let mut answer = String::new();
            tokio::io::BufReader::new(stream)
                .read_line(&mut answer)
                .await
                .map_err(io("reading the answer"))?;
            Ok(answer)
        };
        let answer = tokio::time::timeout(self.deadline, exchange)
            .await
            .map_err(|_| {
                io("waiting for the answer")(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {:?}", self.deadline),
                ))
            })??;
        parse_fd_answer(path, answer.trim_end())
    }

    /// Registers one rank whose KV lies in the memory of `memory_handle`; the layout's
    /// addresses are offsets inside that memory. Returns the namespace.
    pub async fn register(
        &self,
        req: &api::RegisterInstance,
        memory_handle: u64,
    ) -> Result<String, EngineClientError> {
        self.register_with_board(req, memory_handle, 0).await
    }

    /// [`Self::register`] with a completion board (a handle from [`Self::send_board`]; 0:
    /// none).
    pub async fn register_with_board(
        &self,
        req: &api::RegisterInstance,
        memory_handle: u64,
        board: u64,
    ) -> Result<String, EngineClientError> {
        let mut msg = register_request(req, memory_handle);
        msg.completion_board = board;
        let r = self.request(msg);
        let resp = self
            .call("RegisterInstance", self.raw.clone().register_instance(r))
            .await?;
        Ok(resp.namespace)
    }

    /// Registers one rank whose KV lies in a CUDA allocation of another process (an engine
    /// worker's), named by its 64-byte IPC handle; the layout's addresses are offsets from
    /// the allocation's base. Returns the namespace.
    pub async fn register_cuda_ipc(
        &self,
        req: &api::RegisterInstance,
        ipc_handle: &[u8],
    ) -> Result<String, EngineClientError> {
        let mut msg = register_request(req, 0);
        msg.cuda_ipc_handle = ipc_handle.to_vec();
        let r = self.request(msg);
        let resp = self
            .call("RegisterInstance", self.raw.clone().register_instance(r))
            .await?;
        Ok(resp.namespace)
    }

    /// Registers one rank whose KV is spread over several memory regions (protocol 2): fd-socket
    /// handles and CUDA IPC handles, each plane naming its region. Returns the namespace.
    pub async fn register_regions(
        &self,
        req: &RegisterRegions,
    ) -> Result<String, EngineClientError> {
        self.register_regions_with_board(req, 0).await
    }

    /// [`Self::register_regions`] with a completion board (a handle from
    /// [`Self::send_board`]; 0: none) that loads naming its slots report to (protocol 3).
    pub async fn register_regions_with_board(
        &self,
        req: &RegisterRegions,
        board: u64,
    ) -> Result<String, EngineClientError> {
        let mut msg = register_regions_request(req);
        msg.completion_board = board;
        let r = self.request(msg);
        let resp = self
            .call("RegisterInstance", self.raw.clone().register_instance(r))
            .await?;
        Ok(resp.namespace)
    }

    /// Unregisters an instance; returns how many of its leases were released.
    pub async fn unregister(&self, instance: &InstanceId) -> Result<u32, EngineClientError> {
        let r = self.request(UnregisterInstanceRequest {
            instance: instance.as_str().to_owned(),
        });
        let resp = self
            .call(
                "UnregisterInstance",
                self.raw.clone().unregister_instance(r),
            )
            .await?;
        Ok(resp.leases_released)
    }

    /// Stores one rank's bytes of whole blocks; with a node of protocol 6, nothing is
    /// stored once this call has given up.
    pub async fn put_blocks(
        &self,
        req: &api::PutBlocks,
    ) -> Result<StoreResponse, EngineClientError> {
        let fence_ns = self.fence_ns().await?;
        let r = self.request(PutBlocksRequest {
            fence_ns,
            instance: req.instance.as_str().to_owned(),
            rank: req.rank,
            blocks: req
                .blocks
                .iter()
                .map(|(h, d)| PutBlock {
                    hash: h.as_bytes().to_vec(),
                    data: d.clone(),
                })
                .collect(),
        });
        self.call("PutBlocks", self.raw.clone().put_blocks(r)).await
    }

    /// Copies device blocks of one rank into host blocks. Returns only once the node is done
    /// reading the source blocks or can no longer seal them: on success, and on a failure
    /// after the node's answer, at once; on any other failure (the deadline, a lost
    /// connection, a broken mailbox) not before the request's fence has passed, so the
    /// caller may let its engine reuse the blocks whenever this returns. A node of protocol
    /// 6 discards copies that completed after the fence (see [`crate::fence`]); with an
    /// older node, or one whose clock is not this process's, a save given up on may still
    /// be sealed later.
    pub async fn save(&self, req: &api::SaveRequest) -> Result<StoreResponse, EngineClientError> {
        let mut msg = SaveRequest {
            instance: req.instance.as_str().to_owned(),
            rank: req.rank,
            hashes: req.hashes.iter().map(|h| h.as_bytes().to_vec()).collect(),
            src_blocks: req.src_blocks.clone(),
            fence_ns: 0,
        };
        let traits = self.traits().await?;
        // Before anything is sent: every wait below gives up at or after it.
        let fence = Fence::after(self.deadline);
        msg.fence_ns = if traits.fences { fence.as_ns() } else { 0 };
        let answer = match self.through_mailbox(Op::Save, "Save", &msg, None).await {
            Some(answer) => answer,
            None => {
                let r = self.request(msg);
                self.call("Save", self.raw.clone().save(r)).await
            }
        };
        if let Err(e) = &answer {
            if !node_is_done_with(e) {
                tokio::time::sleep(fence.left()).await;
            }
        }
        answer
    }

    /// A request's fence, one deadline from now (after the node's traits are known, so a
    /// first call's Capabilities is not counted against it), as the wire carries it: 0
    /// where the node takes no fences or its clock is not this process's.
    async fn fence_ns(&self) -> Result<u64, EngineClientError> {
        let fences = self.traits().await?.fences;
        let fence = Fence::after(self.deadline);
        Ok(if fences { fence.as_ns() } else { 0 })
    }

    /// Leases the longest held prefix of `hashes`. With `direct_gpu`, check
    /// [`QueryAnswer::direct`]: a refusal is never silent.
    pub async fn query(
        &self,
        instance: &InstanceId,
        hashes: &[BlockHash],
        direct_gpu: bool,
    ) -> Result<QueryAnswer, EngineClientError> {
        // One buffer for every hash: sent as it is where the node takes packed hashes and
        // they are all one length, otherwise each repeated field a slice of it.
        let mut all = Vec::with_capacity(hashes.iter().map(|h| h.as_bytes().len()).sum());
        let mut ends = Vec::with_capacity(hashes.len());
        for h in hashes {
            all.extend_from_slice(h.as_bytes());
            ends.push(all.len());
        }
        let all = prost::bytes::Bytes::from(all);
        let len = ends.first().copied().unwrap_or(0);
        let same_len = ends.iter().zip(0..).all(|(&end, i)| end == (i + 1) * len);
        let traits = self.traits().await?;
        let fence = Fence::after(self.deadline);
        let mut req = QueryRequest {
            instance: instance.as_str().to_owned(),
            direct_gpu,
            fence_ns: if traits.fences { fence.as_ns() } else { 0 },
            ..Default::default()
        };
        if same_len && len > 0 && traits.packed {
            req.packed_hashes = all;
            req.hash_len = len as u32;
        } else {
            let mut start = 0;
            req.hashes = ends
                .into_iter()
                .map(|end| {
                    let h = all.slice(start..end);
                    start = end;
                    h
                })
                .collect();
        }
        let late = self.release_late_lease();
        let q = match self
            .through_mailbox(Op::Query, "Query", &req, Some(late))
            .await
        {
            Some(answer) => answer?,
            None => self.query_call(req).await?,
        };
        let malformed = |reason: String| EngineClientError::Malformed {
            addr: self.addr.clone(),
            method: "Query",
            reason,
        };
        let lease = if q.lease.is_empty() {
            None
        } else {
            Some(LeaseId::from_hex(&q.lease).map_err(|e| malformed(e.to_string()))?)
        };
        let direct = match DirectGrant::try_from(q.direct) {
            Ok(DirectGrant::DirectNotRequested) => api::DirectGrant::NotRequested,
            Ok(DirectGrant::DirectGranted) => api::DirectGrant::Granted,
            Ok(DirectGrant::DirectRefused) => api::DirectGrant::Refused {
                reason: q.direct_reason,
            },
            Err(_) => return Err(malformed(format!("direct grant {}", q.direct))),
        };
        if lease.is_none() && q.local_blocks + q.remote_blocks > 0 {
            return Err(malformed("blocks hit without a lease".into()));
        }
        if q.ssd_blocks > q.local_blocks {
            return Err(malformed(format!(
                "{} SSD blocks of {} local ones",
                q.ssd_blocks, q.local_blocks
            )));
        }
        Ok(QueryAnswer {
            lease,
            namespace: q.namespace,
            local_blocks: q.local_blocks,
            ssd_blocks: q.ssd_blocks,
            remote_blocks: q.remote_blocks,
            direct,
        })
    }

    /// The Query call, run on a task of its own: an answer that comes after this call gave
    /// up is still awaited there (for [`LATE_ANSWER_WAIT`]), and a lease in it released.
    async fn query_call(&self, req: QueryRequest) -> Result<QueryResponse, EngineClientError> {
        let r = self.request(req);
        let mut raw = self.raw.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let client = self.clone();
        tokio::spawn(async move {
            let Ok(answer) = tokio::time::timeout(LATE_ANSWER_WAIT, raw.query(r)).await else {
                return;
            };
            if let Err(Ok(late)) = tx.send(answer) {
                client.release_late(&late.into_inner().lease).await;
            }
        });
        self.call("Query", async move {
            rx.await
                .unwrap_or_else(|_| Err(Status::cancelled("the query's task ended")))
        })
        .await
    }

    /// What a mailbox thread does with a Query answer that came after the call gave up.
    fn release_late_lease(&self) -> LateAnswer {
        let client = self.clone();
        let rt = tokio::runtime::Handle::current();
        Box::new(move |a: mailbox::Answer| {
            if a.code != 0 {
                return;
            }
            if let Ok(q) = QueryResponse::decode(&a.payload[..]) {
                rt.spawn(async move { client.release_late(&q.lease).await });
            }
        })
    }

    /// Releases the lease of an answer nobody waited for (empty: none).
    async fn release_late(&self, lease: &str) {
        if let Ok(lease) = LeaseId::from_hex(lease) {
            // Gone already (expired, its instance unregistered) is fine.
            let _ = self.release(lease).await;
        }
    }

    /// What the node offers; asked once per handle (a node of an older protocol would read
    /// a packed query as one without hashes). Fences are used only where the node's clock
    /// reads as this process's `CLOCK_MONOTONIC`: inside the interval its answer took.
    async fn traits(&self) -> Result<NodeTraits, EngineClientError> {
        self.traits
            .get_or_try_init(|| async {
                let before = crate::fence::monotonic_ns();
                let caps = self.capabilities().await?;
                let after = crate::fence::monotonic_ns();
                let slack = CLOCK_SLACK.as_nanos() as u64;
                let shared = caps.monotonic_ns.saturating_add(slack) >= before
                    && caps.monotonic_ns <= after.saturating_add(slack);
                Ok(NodeTraits {
                    packed: caps.protocol >= 4,
                    fences: caps.protocol >= 6 && shared,
                })
            })
            .await
            .copied()
    }

    /// Starts a load; returns its load id as soon as the node accepted it.
    pub async fn load(&self, req: &api::LoadRequest) -> Result<u64, EngineClientError> {
        self.load_on_board(req, None).await
    }

    /// [`Self::load`], reporting to `board` = `(slot, tag)` of the rank's completion board:
    /// wait on it with [`super::board::Board::wait`] (layers landed, or the end). Its final
    /// word is the outcome: a load that ended ok needs nothing more; a failed one's details
    /// (the error, which blocks) come from [`Self::poll_load`].
    pub async fn load_on_board(
        &self,
        req: &api::LoadRequest,
        board: Option<(u32, u32)>,
    ) -> Result<u64, EngineClientError> {
        let fence_ns = self.fence_ns().await?;
        let req = LoadRequest {
            lease: req.lease.to_hex(),
            instance: req.instance.as_str().to_owned(),
            rank: req.rank,
            dest_blocks: req.dest_blocks.clone(),
            board_slot: board.map(|b| b.0),
            board_tag: board.map(|b| b.1).unwrap_or(0),
            fence_ns,
        };
        if let Some(answer) = self
            .through_mailbox::<_, LoadResponse>(Op::Load, "Load", &req, None)
            .await
        {
            return Ok(answer?.load_id);
        }
        let r = self.request(req);
        Ok(self.call("Load", self.raw.clone().load(r)).await?.load_id)
    }

    /// Attaches a request mailbox (see [`super::mailbox`]): from then on Query, Load and Save of
    /// this handle and its clones go through it, and fall back to the gRPC call only where a
    /// request does not fit a slot or every slot is in flight. `instance` names the client
    /// on the fd socket. False (nothing attached) where the node's protocol is older than 5,
    /// and on a handle whose mailbox's session ended (the node stopped or restarted: requests
    /// go as calls; a new client attaches a new mailbox).
    pub async fn attach_mailbox(&self, instance: &InstanceId) -> Result<bool, EngineClientError> {
        if let Some(link) = self.mailbox.get() {
            return Ok(!link.ended());
        }
        if self.capabilities().await?.protocol < 5 {
            return Ok(false);
        }
        let failed = |source| EngineClientError::Mailbox {
            addr: self.addr.clone(),
            source,
        };
        let mailbox = Arc::new(
            Mailbox::create(mailbox::DEFAULT_SLOTS, mailbox::DEFAULT_SLOT_BYTES).map_err(failed)?,
        );
        let handle = self.send_mailbox(instance, &mailbox).await?;
        let mut session = self.open_session(&[]).await?;
        session.attach(handle).await?;
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let flag = Arc::clone(&ended);
        tokio::spawn(async move {
            tokio::select! {
                () = session.ended() => {}
                _ = stopped => {}
            }
            flag.store(true, std::sync::atomic::Ordering::Release);
        });
        let link = MailboxLink {
            mailbox,
            ended,
            _stop: stop,
        };
        // Two attaching at once: the second link drops, closing its own mailbox.
        let _ = self.mailbox.set(link);
        Ok(true)
    }

    /// Whether Query, Load and Save go through a mailbox: one is attached and the session
    /// holding it has not ended (a node that stopped or restarted ends it; a new client
    /// attaches a new one).
    pub fn has_mailbox(&self) -> bool {
        self.mailbox.get().is_some_and(|l| !l.ended())
    }

    /// Sends `req` through the attached mailbox and decodes the answer; `None` where there
    /// is none, the request does not fit a slot, or every slot is in flight (the caller
    /// makes the gRPC call). The answer is polled for on this thread for a moment (a query
    /// or a load's start is answered within it), then waited for on a blocking thread.
    ///
    /// `late` (if any) is given an answer that comes after the wait gave up: a thread keeps
    /// waiting for it for [`LATE_ANSWER_WAIT`] while the mailbox's session lasts.
    async fn through_mailbox<Req: Message, Resp: Message + Default>(
        &self,
        op: Op,
        method: &'static str,
        req: &Req,
        late: Option<LateAnswer>,
    ) -> Option<Result<Resp, EngineClientError>> {
        let link = self.mailbox.get().filter(|l| !l.ended())?;
        let ticket = match link.mailbox.post(op, &req.encode_to_vec()) {
            Ok(t) => t,
            // The node's thread for the mailbox stopped (its session is ending): the call goes
            // the usual way and meets whatever the node says there.
            Err(
                MailboxError::TooLarge { .. } | MailboxError::Full { .. } | MailboxError::Closed,
            ) => return None,
            Err(source) => {
                return Some(Err(EngineClientError::Mailbox {
                    addr: self.addr.clone(),
                    source,
                }));
            }
        };
        let (spin, deadline) = (mailbox::ANSWER_SPIN.min(self.deadline), self.deadline);
        let answer = match ticket.wait(spin, spin) {
            Err(MailboxError::TimedOut { .. }) if deadline > spin => {
                let end = Instant::now() + (deadline - spin);
                let ended = Arc::clone(&link.ended);
                // In slices, so a session that ends meanwhile (the node died) ends the wait.
                let waited = tokio::task::spawn_blocking(move || {
                    let answer = wait_ticket(&ticket, end, &ended);
                    if let (Err(MailboxError::TimedOut { .. }), Some(late)) = (&answer, late) {
                        // Given up on: the answer still lands in the slot; read it there.
                        std::thread::spawn(move || {
                            let until = Instant::now() + LATE_ANSWER_WAIT;
                            if let Ok(a) = wait_ticket(&ticket, until, &ended) {
                                late(a);
                            }
                        });
                    }
                    answer
                })
                .await;
                waited.unwrap_or(Err(MailboxError::TimedOut {
                    op: op.as_str(),
                    waited: deadline,
                }))
            }
            other => other,
        };
        if link.ended() && answer.is_err() {
            return Some(Err(self.failed(
                method,
                Status::unavailable(
                    "the session holding the request mailbox ended (the node stopped or \
                     restarted)",
                ),
            )));
        }
        Some(match answer {
            Ok(a) if a.code == 0 => {
                Resp::decode(&a.payload[..]).map_err(|e| EngineClientError::Malformed {
                    addr: self.addr.clone(),
                    method,
                    reason: format!("the mailbox answer does not decode: {e}"),
                })
            }
            Ok(a) => Err(self.failed(
                method,
                Status::new(
                    Code::from(a.code as i32),
                    String::from_utf8_lossy(&a.payload).into_owned(),
                ),
            )),
            Err(MailboxError::TimedOut { .. }) => Err(self.failed(
                method,
                Status::deadline_exceeded(format!("no answer within {deadline:?}")),
            )),
            Err(source) => Err(EngineClientError::Mailbox {
                addr: self.addr.clone(),
                source,
            }),
        })
    }

    /// The result of a load if it completed (consuming it), `None` while it runs.
    pub async fn poll_load(
        &self,
        load_id: u64,
    ) -> Result<Option<LoadCompletion>, EngineClientError> {
        let r = self.request(PollLoadRequest { load_id });
        let resp = self.call("PollLoad", self.raw.clone().poll_load(r)).await?;
        match (resp.pending, resp.completion) {
            (true, None) => Ok(None),
            (false, Some(c)) if c.load_id == load_id => Ok(Some(c)),
            _ => Err(EngineClientError::Malformed {
                addr: self.addr.clone(),
                method: "PollLoad",
                reason: format!("no completion for load {load_id} and not pending"),
            }),
        }
    }

    /// Polls every `every` until load `load_id` completed or `timeout` passed.
    pub async fn wait_polling(
        &self,
        load_id: u64,
        every: Duration,
        timeout: Duration,
    ) -> Result<LoadCompletion, EngineClientError> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(c) = self.poll_load(load_id).await? {
                return Ok(c);
            }
            if Instant::now() >= end {
                return Err(EngineClientError::WaitTimeout {
                    load_id,
                    after: timeout,
                });
            }
            tokio::time::sleep(every).await;
        }
    }

    /// Opens the completion stream of `instance` rank `rank` (replacing an older one).
    pub async fn completions(
        &self,
        instance: &InstanceId,
        rank: u32,
    ) -> Result<CompletionStream, EngineClientError> {
        let mut r = Request::new(CompletionsRequest {
            instance: instance.as_str().to_owned(),
            rank,
        });
        self.authorize(&mut r);
        let stream = self
            .call("Completions", self.raw.clone().completions(r))
            .await?;
        Ok(CompletionStream {
            stream,
            early: Vec::new(),
            addr: self.addr.clone(),
        })
    }

    /// Releases a lease whatever its ranks still owe.
    pub async fn release(&self, lease: LeaseId) -> Result<(), EngineClientError> {
        let r = self.request(ReleaseRequest {
            lease: lease.to_hex(),
        });
        self.call("Release", self.raw.clone().release(r)).await?;
        Ok(())
    }

    pub async fn health(&self) -> Result<HealthResponse, EngineClientError> {
        let r = self.request(HealthRequest {});
        self.call("Health", self.raw.clone().health(r)).await
    }

    pub async fn stats(&self) -> Result<StatsResponse, EngineClientError> {
        let r = self.request(StatsRequest {});
        self.call("Stats", self.raw.clone().stats(r)).await
    }

    /// Opens a session and binds `instances` to it: when the session is dropped (or this
    /// process dies), the node unregisters them and releases their leases.
    pub async fn open_session(
        &self,
        instances: &[InstanceId],
    ) -> Result<EngineSession, EngineClientError> {
        let (tx, rx) = mpsc::channel(16);
        let mut r = Request::new(ReceiverStream::new(rx));
        self.authorize(&mut r);
        let events = self.call("Session", self.raw.clone().session(r)).await?;
        let mut s = EngineSession {
            tx,
            events,
            addr: self.addr.clone(),
            deadline: self.deadline,
        };
        for i in instances {
            s.bind(i).await?;
        }
        Ok(s)
    }
}

/// What becomes of a mailbox answer that arrives after its call gave up.
type LateAnswer = Box<dyn FnOnce(mailbox::Answer) + Send>;

/// Waits for a ticket's answer until `end`, in slices, so a session that ends meanwhile (the
/// node died) ends the wait.
fn wait_ticket(
    ticket: &mailbox::Ticket,
    end: Instant,
    ended: &std::sync::atomic::AtomicBool,
) -> Result<mailbox::Answer, MailboxError> {
    loop {
        let left = end.saturating_duration_since(Instant::now());
        match ticket.wait(Duration::ZERO, left.min(ENDED_CHECK)) {
            Err(MailboxError::TimedOut { .. })
                if !left.is_zero() && !ended.load(std::sync::atomic::Ordering::Acquire) => {}
            other => return other,
        }
    }
}

fn parse_fd_answer(path: &Path, answer: &str) -> Result<u64, EngineClientError> {
    let refused = |code, message: &str| EngineClientError::FdRefused {
        path: path.to_owned(),
        code,
        message: message.to_owned(),
    };
    if let Some(id) = answer.strip_prefix("ok ") {
        return id
            .parse()
            .map_err(|_| refused(Code::Unknown, &format!("malformed answer {answer:?}")));
    }
    if let Some(rest) = answer.strip_prefix("err ") {
        let (code, message) = rest.split_once(' ').unwrap_or((rest, ""));
        return Err(refused(fd_socket::code_from_name(code), message));
    }
    Err(refused(
        Code::Unknown,
        &format!("malformed answer {answer:?}"),
    ))
}

/// The wire form of a registration (addresses as given: offsets inside the memory).
pub fn register_request(
    req: &api::RegisterInstance,
    memory_handle: u64,
) -> RegisterInstanceRequest {
    let s = &req.shape;
    let l = &req.layout;
    RegisterInstanceRequest {
        instance: req.instance.as_str().to_owned(),
        model: req.model.clone(),
        dtype: req.dtype.clone(),
        shape: Some(KvShape {
            layers: s.layers(),
            tp_size: s.tp_size(),
            segments: s.segments(),
            segment_bytes: s.segment_bytes(),
        }),
        rank: req.rank,
        device: req.device,
        layout: Some(KvLayout {
            kind: match l.kind {
                kvferry_gpu::GroupKind::Attention => GroupKind::Attention,
                kvferry_gpu::GroupKind::CrossLayer => GroupKind::CrossLayer,
                kvferry_gpu::GroupKind::Recurrent => GroupKind::Recurrent,
            } as i32,
            layers: l
                .layers
                .iter()
                .map(|layer| LayerLayout {
                    layer: Some(match *layer {
                        kvferry_gpu::LayerLayout::Contiguous { base, kv_stride } => {
                            layer_layout::Layer::Contiguous(Contiguous {
                                base,
                                kv_stride,
                                region: 0,
                            })
                        }
                        kvferry_gpu::LayerLayout::Split { k_base, v_base } => {
                            layer_layout::Layer::Split(Split {
                                k_base,
                                v_base,
                                k_region: 0,
                                v_region: 0,
                            })
                        }
                    }),
                })
                .collect(),
            block_stride: l.block_stride,
            num_blocks: l.num_blocks,
            view_offset: l.view_offset,
        }),
        memory_handle,
        cuda_ipc_handle: Vec::new(),
        regions: Vec::new(),
        completion_board: 0,
    }
}

/// One piece of memory a rank's KV lies in, as a registration names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryRegion {
    /// A memory handle from the node's fd socket (a memfd or DMA-BUF sent for this rank).
    Handle(u64),
    /// A CUDA allocation of this process, by its IPC handle (64 bytes, or PyTorch's framed
    /// form); offsets are from the allocation's base.
    CudaIpc(Vec<u8>),
}

/// Where one plane (K, V, or MLA's single segment) of a layer starts: a byte offset of its
/// block 0 inside a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanePlacement {
    /// Index into [`RegisterRegions::regions`].
    pub region: u32,
    pub offset: u64,
}

/// One layer's planes: K and V, or (one segment) K alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionLayer {
    pub k: PlanePlacement,
    pub v: Option<PlanePlacement>,
}

/// A rank's KV spread over several memory regions (an engine's one tensor per layer): every
/// plane names its region and its offset inside it; planes share the block stride.
#[derive(Clone, Debug)]
pub struct RegisterRegions {
    pub instance: InstanceId,
    pub model: String,
    pub dtype: String,
    pub shape: kvferry_gpu::KvShape,
    pub rank: u32,
    pub device: u32,
    pub kind: kvferry_gpu::GroupKind,
    pub block_stride: u64,
    pub num_blocks: u32,
    pub regions: Vec<MemoryRegion>,
    pub layers: Vec<RegionLayer>,
}

/// The wire form of a registration over several regions (protocol 2).
pub fn register_regions_request(r: &RegisterRegions) -> RegisterInstanceRequest {
    let spec = kvferry_gpu::KvLayoutSpec {
        kind: r.kind,
        layers: Vec::new(),
        block_stride: r.block_stride,
        num_blocks: r.num_blocks,
        view_offset: 0,
    };
    let mut msg = register_request(
        &api::RegisterInstance {
            instance: r.instance.clone(),
            model: r.model.clone(),
            dtype: r.dtype.clone(),
            shape: r.shape,
            rank: r.rank,
            device: r.device,
            layout: spec,
        },
        0,
    );
    if let Some(layout) = msg.layout.as_mut() {
        layout.layers = r
            .layers
            .iter()
            .map(|l| {
                let v = l.v.unwrap_or(l.k);
                LayerLayout {
                    layer: Some(layer_layout::Layer::Split(Split {
                        k_base: l.k.offset,
                        v_base: v.offset,
                        k_region: l.k.region,
                        v_region: v.region,
                    })),
                }
            })
            .collect();
        // Split planes need two segments; with one, the layer is its K plane alone.
        if r.shape.segments() == 1 {
            for (wire, l) in layout.layers.iter_mut().zip(&r.layers) {
                wire.layer = Some(layer_layout::Layer::Contiguous(Contiguous {
                    base: l.k.offset,
                    kv_stride: 0,
                    region: l.k.region,
                }));
            }
        }
    }
    msg.regions = r
        .regions
        .iter()
        .map(|g| super::proto::MemoryRegion {
            memory: Some(match g {
                MemoryRegion::Handle(h) => memory_region::Memory::MemoryHandle(*h),
                MemoryRegion::CudaIpc(ipc) => memory_region::Memory::CudaIpcHandle(ipc.clone()),
            }),
        })
        .collect();
    msg
}

/// Completed loads of one instance rank, as the node delivers them.
pub struct CompletionStream {
    stream: Streaming<LoadCompletion>,
    /// Completions that arrived while waiting for another one.
    early: Vec<LoadCompletion>,
    addr: String,
}

impl std::fmt::Debug for CompletionStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionStream")
            .field("addr", &self.addr)
            .field("early", &self.early.len())
            .finish()
    }
}

impl CompletionStream {
    /// The next completion; `None` when the node ended the stream.
    pub async fn next(&mut self) -> Result<Option<LoadCompletion>, EngineClientError> {
        if !self.early.is_empty() {
            return Ok(Some(self.early.remove(0)));
        }
        self.stream
            .message()
            .await
            .map_err(|s| EngineClientError::Call {
                addr: self.addr.clone(),
                method: "Completions",
                code: s.code(),
                message: s.message().to_owned(),
            })
    }

    /// Waits up to `timeout` for the completion of `load_id`, keeping the others for
    /// [`Self::next`].
    pub async fn wait_for(
        &mut self,
        load_id: u64,
        timeout: Duration,
    ) -> Result<LoadCompletion, EngineClientError> {
        if let Some(i) = self.early.iter().position(|c| c.load_id == load_id) {
            return Ok(self.early.remove(i));
        }
        let wait = async {
            loop {
                match self.stream.message().await {
                    Ok(Some(c)) if c.load_id == load_id => return Ok(c),
                    Ok(Some(c)) => self.early.push(c),
                    Ok(None) => {
                        return Err(EngineClientError::Call {
                            addr: self.addr.clone(),
                            method: "Completions",
                            code: Code::Unavailable,
                            message: "the node ended the stream".into(),
                        });
                    }
                    Err(s) => {
                        return Err(EngineClientError::Call {
                            addr: self.addr.clone(),
                            method: "Completions",
                            code: s.code(),
                            message: s.message().to_owned(),
                        });
                    }
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| EngineClientError::WaitTimeout {
                load_id,
                after: timeout,
            })?
    }
}

/// An open session: dropping it (or [`Self::close`]) ends it, and the node unregisters
/// the bound instances.
pub struct EngineSession {
    tx: mpsc::Sender<SessionRequest>,
    events: Streaming<SessionEvent>,
    addr: String,
    deadline: Duration,
}

impl std::fmt::Debug for EngineSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSession")
            .field("addr", &self.addr)
            .finish()
    }
}

impl EngineSession {
    /// Binds a registered instance to this session.
    pub async fn bind(&mut self, instance: &InstanceId) -> Result<(), EngineClientError> {
        let req = SessionRequest {
            bind: instance.as_str().to_owned(),
            mailbox: 0,
        };
        self.exchange(req, |e| e.bound == instance.as_str()).await
    }

    /// Attaches the mailbox of fd-socket handle `handle` (what
    /// [`EngineClient::attach_mailbox`] does); the node serves it until the session ends.
    pub async fn attach(&mut self, handle: u64) -> Result<(), EngineClientError> {
        let req = SessionRequest {
            bind: String::new(),
            mailbox: handle,
        };
        self.exchange(req, |e| e.mailbox == handle).await
    }

    /// Resolves when the session ends: the node ended it (stopping, or refusing a message) or
    /// the connection broke.
    pub async fn ended(&mut self) {
        while let Ok(Some(_)) = self.events.message().await {}
    }

    async fn exchange(
        &mut self,
        req: SessionRequest,
        answers: impl Fn(&SessionEvent) -> bool,
    ) -> Result<(), EngineClientError> {
        let failed = |code, message: String| EngineClientError::Call {
            addr: self.addr.clone(),
            method: "Session",
            code,
            message,
        };
        let asked = format!("{req:?}");
        let exchange = async {
            self.tx
                .send(req)
                .await
                .map_err(|_| failed(Code::Unavailable, "the session has ended".into()))?;
            match self.events.message().await {
                Ok(Some(e)) if answers(&e) => Ok(()),
                Ok(Some(e)) => Err(failed(
                    Code::Internal,
                    format!("answered {e:?}, asked {asked}"),
                )),
                Ok(None) => Err(failed(Code::Unavailable, "the session has ended".into())),
                Err(s) => Err(failed(s.code(), s.message().to_owned())),
            }
        };
        tokio::time::timeout(self.deadline, exchange)
            .await
            .map_err(|_| failed(Code::DeadlineExceeded, format!("no answer to {asked}")))?
    }

    /// Ends the session (the node unregisters its instances).
    pub fn close(self) {}
}

/// The code a caller sees for a failed call. The node never answers CANCELLED and this client
/// never cancels a call it still awaits, so a CANCELLED status is made on this side by tonic:
/// the request's own timeout ("Timeout expired"), which is the deadline passing, as when the
/// node says so; or the connection going away under the call (a node that stopped or
/// restarted), which is the node being unavailable — the code a caller retries or fails over
/// on — not a cancellation it asked for.
fn caller_code(s: &Status) -> Code {
    match s.code() {
        Code::Cancelled if s.message().contains("Timeout expired") => Code::DeadlineExceeded,
        Code::Cancelled => Code::Unavailable,
        c => c,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_made_by_tonic_read_as_what_happened_to_the_call() {
        let timeout = Status::cancelled("Timeout expired");
        assert_eq!(caller_code(&timeout), Code::DeadlineExceeded);
        let gone = Status::cancelled("operation was canceled: connection closed");
        assert_eq!(caller_code(&gone), Code::Unavailable);
        for c in [
            Code::NotFound,
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::Internal,
        ] {
            assert_eq!(caller_code(&Status::new(c, "x")), c);
        }
    }
}
