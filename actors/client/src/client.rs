//! The engine's client of `kvferry.v1.Engine`: typed calls with a deadline on each unary
//! call, memory sent on the node's fd socket, loads started without waiting and awaited on
//! their completion board or by `PollLoad` (which waits on the node), and the session that
//! ties instances to this client.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod fd;

pub use fd::KvFd;
mod mailbox_link;

use crate::error::EngineClientError;
use crate::register::{LoadOptions, Registration};
use crate::session::EngineSession;
use mailbox_link::{LateAnswer, MailboxLink};
use prost::Message;
use tokio::sync::{mpsc, OnceCell};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

use kvferry_proto::api;
use kvferry_proto::fence::{self, Fence};
use kvferry_proto::model::{BlockHash, InstanceId, LeaseId};
use kvferry_proto::shm::mailbox::{self, Op};
use kvferry_proto::v1::engine_client::EngineClient as RawClient;
use kvferry_proto::v1::*;

/// Deadline of every unary call unless [`EngineClient::with_deadline`] says otherwise.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(10);

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
    /// The node's engine protocol.
    protocol: u32,
}

/// The engine protocol of tenants in Query and Save, and of CancelLoad.
const PROTOCOL_TENANTS: u32 = 9;

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

/// TLS to a node's engine listener: the CA that signed the node's certificate, the name
/// the certificate must carry, and optionally a client certificate (for a node with
/// `engine-client-cert = "required"`). PEM throughout.
#[derive(Clone, Debug, Default)]
pub struct EngineTls {
    pub ca_pem: Vec<u8>,
    /// The name the node's certificate must carry; empty: the host part of the address.
    pub server_name: String,
    /// (certificate chain, private key) this client presents.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl EngineTls {
    /// Reads the CA (and the client certificate and key, if given) from PEM files.
    pub fn from_files(
        ca: &std::path::Path,
        server_name: &str,
        identity: Option<(&std::path::Path, &std::path::Path)>,
    ) -> std::io::Result<Self> {
        let identity = match identity {
            Some((c, k)) => Some((std::fs::read(c)?, std::fs::read(k)?)),
            None => None,
        };
        Ok(Self {
            ca_pem: std::fs::read(ca)?,
            server_name: server_name.to_owned(),
            identity,
        })
    }

    fn to_tonic(&self, addr: &str) -> tonic::transport::ClientTlsConfig {
        let name = if self.server_name.is_empty() {
            // "host:port", "[v6]:port": the host without brackets.
            let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
            host.trim_matches(|c| c == '[' || c == ']').to_owned()
        } else {
            self.server_name.clone()
        };
        let mut c = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&self.ca_pem))
            .domain_name(name);
        if let Some((cert, key)) = &self.identity {
            c = c.identity(tonic::transport::Identity::from_pem(cert, key));
        }
        c
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
        Self::connect_tls(addr, fd_socket, token, None).await
    }

    /// [`Self::connect`], over TLS where `tls` is given (a node whose `[tls]` puts TLS on
    /// the engine listener).
    pub async fn connect_tls(
        addr: impl Into<String>,
        fd_socket: Option<PathBuf>,
        token: impl Into<String>,
        tls: Option<&EngineTls>,
    ) -> Result<Self, EngineClientError> {
        let addr = addr.into();
        let deadline = DEFAULT_DEADLINE;
        // No per-request timeout on the channel: sessions stay open, and a waiting PollLoad
        // sets its own.
        let scheme = if tls.is_some() { "https" } else { "http" };
        let endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| EngineClientError::Address {
                addr: addr.clone(),
                reason: e.to_string(),
            })?
            .connect_timeout(deadline)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(20))
            .keep_alive_while_idle(true);
        let endpoint = match tls {
            Some(t) => endpoint.tls_config(t.to_tonic(&addr)).map_err(|source| {
                EngineClientError::Connect {
                    addr: addr.clone(),
                    source,
                }
            })?,
            None => endpoint,
        };
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
        self.call_within(method, self.deadline, fut).await
    }

    /// [`Self::call`] with a deadline of its own (a call the node may hold longer).
    async fn call_within<T>(
        &self,
        method: &'static str,
        deadline: Duration,
        fut: impl std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    ) -> Result<T, EngineClientError> {
        match tokio::time::timeout(deadline, fut).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(self.failed(method, s)),
            Err(_) => Err(self.failed(
                method,
                Status::deadline_exceeded(format!("no answer within {deadline:?}")),
            )),
        }
    }

    pub async fn capabilities(&self) -> Result<CapabilitiesResponse, EngineClientError> {
        let req = self.request(CapabilitiesRequest {});
        self.call("Capabilities", self.raw.clone().capabilities(req))
            .await
    }

    /// Registers one rank (see [`Registration`] for where its KV may lie and a completion
    /// board); returns the namespace its blocks are kept under.
    pub async fn register(&self, r: Registration<'_>) -> Result<String, EngineClientError> {
        let mut msg = r.request();
        msg.completion_board = r.board;
        let req = self.request(msg);
        let resp = self
            .call("RegisterInstance", self.raw.clone().register_instance(req))
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
    /// 6 discards copies that completed after the fence (see [`kvferry_proto::fence`]); with an
    /// older node, or one whose clock is not this process's, a save given up on may still
    /// be sealed later.
    pub async fn save(&self, req: &api::SaveRequest) -> Result<StoreResponse, EngineClientError> {
        let mut msg = SaveRequest {
            instance: req.instance.as_str().to_owned(),
            rank: req.rank,
            hashes: req.hashes.iter().map(|h| h.as_bytes().to_vec()).collect(),
            src_blocks: req.src_blocks.clone(),
            fence_ns: 0,
            tenant: req.tenant.clone().unwrap_or_default(),
        };
        let traits = self.traits().await?;
        self.check_tenant(req.tenant.as_deref(), &traits)?;
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
        self.query_tenant(instance, hashes, direct_gpu, None).await
    }

    /// [`Self::query`] of one tenant's blocks (see [`kvferry_proto::Namespace::with_tenant`]);
    /// refused here, before anything is sent, where the node is older than protocol 9.
    pub async fn query_tenant(
        &self,
        instance: &InstanceId,
        hashes: &[BlockHash],
        direct_gpu: bool,
        tenant: Option<&str>,
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
        self.check_tenant(tenant, &traits)?;
        let fence = Fence::after(self.deadline);
        let mut req = QueryRequest {
            instance: instance.as_str().to_owned(),
            direct_gpu,
            fence_ns: if traits.fences { fence.as_ns() } else { 0 },
            tenant: tenant.unwrap_or_default().to_owned(),
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

    /// Refuses here what the node's protocol lacks (`needs`), so it is never served
    /// without it: an older node would read a tenant's query as the model's own.
    fn require(
        &self,
        traits: &NodeTraits,
        what: &'static str,
        needs: u32,
    ) -> Result<(), EngineClientError> {
        if traits.protocol < needs {
            return Err(EngineClientError::Unsupported {
                addr: self.addr.clone(),
                what,
                needs,
                protocol: traits.protocol,
            });
        }
        Ok(())
    }

    /// A tenant goes only to a node that keeps tenants apart (protocol 9).
    fn check_tenant(
        &self,
        tenant: Option<&str>,
        traits: &NodeTraits,
    ) -> Result<(), EngineClientError> {
        match tenant {
            Some(_) => self.require(traits, "a tenant", PROTOCOL_TENANTS),
            None => Ok(()),
        }
    }

    /// What the node offers; asked once per handle (a node of an older protocol would read
    /// a packed query as one without hashes). Fences are used only where the node's clock
    /// reads as this process's `CLOCK_MONOTONIC`: inside the interval its answer took.
    async fn traits(&self) -> Result<NodeTraits, EngineClientError> {
        self.traits
            .get_or_try_init(|| async {
                let before = fence::monotonic_ns();
                let caps = self.capabilities().await?;
                let after = fence::monotonic_ns();
                let slack = CLOCK_SLACK.as_nanos() as u64;
                let shared = caps.monotonic_ns.saturating_add(slack) >= before
                    && caps.monotonic_ns <= after.saturating_add(slack);
                Ok(NodeTraits {
                    packed: caps.protocol >= 4,
                    fences: caps.protocol >= 6 && shared,
                    protocol: caps.protocol,
                })
            })
            .await
            .copied()
    }

    /// Starts a load; returns its load id as soon as the node accepted it. With
    /// [`LoadOptions::on_board`] the load reports to that slot of the rank's completion board:
    /// wait on it with [`kvferry_proto::shm::board::Board::wait`] (layers landed, or the
    /// end). Its final word is the outcome: a load that ended ok needs nothing more; a failed
    /// one's details (the error, which blocks) come from [`Self::poll_load`].
    pub async fn load(
        &self,
        req: &api::LoadRequest,
        options: LoadOptions,
    ) -> Result<u64, EngineClientError> {
        let board = options.board;
        let fence_ns = self.fence_ns().await?;
        let req = LoadRequest {
            lease: req.lease.to_hex(),
            instance: req.instance.as_str().to_owned(),
            rank: req.rank,
            dest_blocks: req.dest_blocks.clone(),
            board_slot: board.map(|b| b.0),
            board_tag: board.map(|b| b.1).unwrap_or(0),
            fence_ns,
            per_layer: req.per_layer,
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

    /// The result of a load if it completed (consuming it), `None` while it runs.
    pub async fn poll_load(
        &self,
        load_id: u64,
    ) -> Result<Option<LoadCompletion>, EngineClientError> {
        self.poll_waiting(load_id, Duration::ZERO).await
    }

    /// Waits up to `timeout` for load `load_id` to end and returns its result (consuming
    /// it): the way to learn a load's outcome without a completion board. The node holds
    /// each `PollLoad` until the load ends or up to `Capabilities.max_poll_wait_ms`, so a
    /// result arrives as soon as it is booked, with a call per that many ms at most.
    pub async fn wait_load(
        &self,
        load_id: u64,
        timeout: Duration,
    ) -> Result<LoadCompletion, EngineClientError> {
        let end = Instant::now() + timeout;
        let most = Duration::from_millis(kvferry_proto::MAX_POLL_WAIT_MS.into());
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if let Some(c) = self.poll_waiting(load_id, left.min(most)).await? {
                return Ok(c);
            }
            if Instant::now() >= end {
                return Err(EngineClientError::WaitTimeout {
                    load_id,
                    after: timeout,
                });
            }
        }
    }

    /// One `PollLoad` that the node may hold for `wait`; its deadline is the client's on
    /// top of the wait.
    /// Asks running load `load_id` of `instance`'s `rank` to stop: it submits no more
    /// copies and ends failed ("cancelled") once what it submitted has drained; its end
    /// reaches the board and PollLoad as any load's does. True where the load was running.
    /// A node older than protocol 9 has no CancelLoad: refused here.
    pub async fn cancel_load(
        &self,
        instance: &InstanceId,
        rank: u32,
        load_id: u64,
    ) -> Result<bool, EngineClientError> {
        let traits = self.traits().await?;
        self.require(&traits, "CancelLoad", PROTOCOL_TENANTS)?;
        let r = self.request(CancelLoadRequest {
            instance: instance.as_str().to_owned(),
            rank,
            load_id,
        });
        let resp = self
            .call("CancelLoad", self.raw.clone().cancel_load(r))
            .await?;
        Ok(resp.running)
    }

    async fn poll_waiting(
        &self,
        load_id: u64,
        wait: Duration,
    ) -> Result<Option<LoadCompletion>, EngineClientError> {
        let wait_ms = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX);
        let wait_ms = wait_ms.min(kvferry_proto::MAX_POLL_WAIT_MS);
        let deadline = self.deadline + Duration::from_millis(wait_ms.into());
        let mut r = Request::new(PollLoadRequest { load_id, wait_ms });
        r.set_timeout(deadline);
        self.authorize(&mut r);
        let mut raw = self.raw.clone();
        let resp = self
            .call_within("PollLoad", deadline, raw.poll_load(r))
            .await?;
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

    /// The longest prefix of `hashes` each node holds (`namespace`: model/dtype/fingerprint);
    /// at most `Capabilities.max_lookup_hashes` hashes (`MAX_LOOKUP_HASHES`), past it
    /// RESOURCE_EXHAUSTED.
    pub async fn lookup(
        &self,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<LookupResponse, EngineClientError> {
        let r = self.request(LookupRequest {
            namespace: namespace.to_owned(),
            hashes: hashes.to_vec(),
        });
        self.call("Lookup", self.raw.clone().lookup(r)).await
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
