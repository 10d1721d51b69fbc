//! The requester's client of `kvferry.v1.Peer`. Every call has a deadline (sent to the owner
//! as `grpc-timeout` and enforced here), and every answer is checked before it is believed:
//! a pin answer must be a prefix of what was asked, in order.

use kvferry_transport::data_auth::SECRET_LEN;
use kvferry_transport::{LinkGrant, LinkSecret};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

use crate::model::{BlockHash, Namespace};
use crate::peer::endpoint::{check_answer, endpoints_from_proto, Role, VerbsPeerEndpoint};
use crate::peer::link::{PinnedRemote, RemoteBlock};
use crate::peer::Provider;
use kvferry_proto::v1::peer_client::PeerClient as RawClient;
use kvferry_proto::v1::{HandshakeRequest, HelloRequest, NodeInfo, PinBlocksRequest, UnpinRequest};
use kvferry_proto::{CAPABILITIES, PROTOCOL, VERSION};

/// Deadline of every call unless [`PeerClient::with_deadline`] says otherwise.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(5);

/// A peer that is down or stalled fails every call that names it: one line per peer per
/// this period.
const LOST_LOG_PERIOD: Duration = Duration::from_secs(10);
static LOST: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new(LOST_LOG_PERIOD);

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PeerClientError {
    #[error("peer at {addr}: {reason}")]
    Address { addr: String, reason: String },
    #[error("peer at {addr}: connecting")]
    Connect {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("peer at {addr}: no connection within {after:?}")]
    ConnectTimeout { addr: String, after: Duration },
    /// The owner answered with an error status (or the call ran past its deadline:
    /// `DeadlineExceeded`, or the connection broke: `Unavailable`).
    #[error("peer at {addr}: {method} failed: {code:?}: {message}")]
    Call {
        addr: String,
        method: &'static str,
        code: Code,
        message: String,
    },
    /// The owner answered something this client does not believe.
    #[error("peer at {addr}: {method} answered a malformed response: {reason}")]
    Malformed {
        addr: String,
        method: &'static str,
        reason: String,
    },
    /// The owner restarted since the handshake: what it described (pool, keys, data
    /// endpoint) is gone. The pin just taken was released; handshake again.
    #[error("peer at {addr}: restarted (incarnation {now:#x}, handshake saw {was:#x})")]
    Restarted { addr: String, was: u64, now: u64 },
}

impl PeerClientError {
    /// The gRPC status code of a failed call.
    pub fn code(&self) -> Option<Code> {
        match self {
            PeerClientError::Call { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// What a node says about itself in Hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    pub node_id: String,
    pub version: String,
    pub protocol: u32,
    pub capabilities: Vec<String>,
    pub providers: Vec<String>,
    pub nics: Vec<String>,
    /// The node's verbs ports (GID, LID, MTU per RDMA NIC), checked on receipt.
    pub verbs: Vec<VerbsPeerEndpoint>,
}

impl PeerInfo {
    /// This build's version, protocol and capabilities for `node_id`.
    pub fn local(node_id: &str, providers: &[Provider], nics: &[String]) -> Self {
        Self {
            node_id: node_id.to_owned(),
            version: VERSION.to_owned(),
            protocol: PROTOCOL,
            capabilities: CAPABILITIES.iter().map(|c| (*c).to_owned()).collect(),
            providers: providers.iter().map(|p| p.as_str().to_owned()).collect(),
            nics: nics.to_vec(),
            verbs: Vec::new(),
        }
    }

    fn into_proto(self) -> NodeInfo {
        NodeInfo {
            node_id: self.node_id,
            version: self.version,
            protocol: self.protocol,
            capabilities: self.capabilities,
            providers: self.providers,
            nics: self.nics,
            verbs: self.verbs.iter().map(VerbsPeerEndpoint::to_proto).collect(),
        }
    }

    fn from_proto(n: NodeInfo) -> Result<Self, crate::peer::EndpointError> {
        Ok(Self {
            verbs: endpoints_from_proto(&n.verbs, Role::Announce)?,
            node_id: n.node_id,
            version: n.version,
            protocol: n.protocol,
            capabilities: n.capabilities,
            providers: n.providers,
            nics: n.nics,
        })
    }
}

/// One registration of the owner's pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteRegion {
    pub nic: String,
    pub addr: u64,
    pub len: u64,
    pub rkey: u64,
}

/// Where and how the owner's pool is read over one provider.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerHandshake {
    /// The owner's incarnation (see [`PeerClientError::Restarted`]).
    pub incarnation: u64,
    pub provider: Provider,
    pub endpoint: String,
    pub regions: Vec<RemoteRegion>,
    /// Verbs: the owner's QPs and pool MRs per NIC, checked against what was asked.
    pub verbs: Vec<VerbsPeerEndpoint>,
    /// tcp: the data link this handshake authorised (its connections prove the secret).
    pub grant: Option<LinkGrant>,
}

/// One block pinned on the owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedBlockInfo {
    pub hash: BlockHash,
    pub addr: u64,
    pub len: u64,
}

/// A pin on the owner: the present prefix of the requested hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerPin {
    /// 0 when nothing was pinned (nothing to unpin).
    pub pin_id: u64,
    /// The owner drops the pin on its own after this long.
    pub ttl: Duration,
    pub blocks: Vec<PinnedBlockInfo>,
}

impl PeerPin {
    /// The form `PeerLink::pin` answers in.
    pub fn to_remote(&self) -> PinnedRemote {
        PinnedRemote {
            pin_id: self.pin_id,
            blocks: self
                .blocks
                .iter()
                .map(|b| RemoteBlock {
                    hash: b.hash,
                    addr: b.addr,
                })
                .collect(),
        }
    }
}

/// A connection to one owner's Peer service. Cloning shares the HTTP/2 connection; the
/// handle is one pointer, so links can hold it inline.
#[derive(Clone, Debug)]
pub struct PeerClient {
    inner: Arc<Inner>,
}

#[derive(Clone, Debug)]
struct Inner {
    raw: RawClient<Channel>,
    addr: String,
    token: String,
    deadline: Duration,
    /// Shared by every copy of this client (one owner, one life as seen from here).
    life: Arc<OwnerLife>,
}

/// What this client knows of the owner's incarnation.
#[derive(Debug, Default)]
struct OwnerLife {
    /// The owner's incarnation from the last handshake (0: none yet).
    incarnation: std::sync::atomic::AtomicU64,
    /// Set once a PinBlocks answer came from another incarnation.
    restarted: std::sync::atomic::AtomicBool,
}

impl PeerClient {
    /// Connects to `addr` ("host:port") with the default deadline for the connection and
    /// every call.
    pub async fn connect(
        addr: impl Into<String>,
        token: impl Into<String>,
    ) -> Result<Self, PeerClientError> {
        Self::connect_with_deadline(addr, token, DEFAULT_DEADLINE).await
    }

    /// Connects to `addr` ("host:port"); `deadline` bounds the connection and every call.
    pub async fn connect_with_deadline(
        addr: impl Into<String>,
        token: impl Into<String>,
        deadline: Duration,
    ) -> Result<Self, PeerClientError> {
        Self::connect_over(addr, token, deadline, None).await
    }

    /// [`Self::connect_with_deadline`], over TLS where `tls` is given: this node presents
    /// its certificate and checks the owner's against the cluster CA and the name in `tls`.
    pub async fn connect_over(
        addr: impl Into<String>,
        token: impl Into<String>,
        deadline: Duration,
        tls: Option<crate::tls::TlsDial>,
    ) -> Result<Self, PeerClientError> {
        let addr = addr.into();
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| PeerClientError::Address {
                addr: addr.clone(),
                reason: e.to_string(),
            })?
            .connect_timeout(deadline)
            .timeout(deadline)
            .tcp_nodelay(true);
        let connect = async {
            match tls {
                Some(dial) => crate::tls::connect_tls(endpoint, dial).await,
                None => endpoint.connect().await,
            }
        };
        let channel = match tokio::time::timeout(deadline, connect).await {
            Ok(Ok(c)) => c,
            Ok(Err(source)) => {
                return Err(PeerClientError::Connect {
                    addr: addr.clone(),
                    source,
                })
            }
            Err(_) => {
                return Err(PeerClientError::ConnectTimeout {
                    addr: addr.clone(),
                    after: deadline,
                })
            }
        };
        Ok(Self {
            inner: Arc::new(Inner {
                raw: RawClient::new(channel),
                addr,
                token: token.into(),
                deadline,
                life: Arc::default(),
            }),
        })
    }

    /// Whether a PinBlocks answer showed that the owner restarted since the handshake: what
    /// was built on that handshake (data links, mappings) must be rebuilt.
    pub fn restarted(&self) -> bool {
        self.inner
            .life
            .restarted
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Sets the deadline of every later call made through this handle.
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        Arc::make_mut(&mut self.inner).deadline = deadline;
        self
    }

    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// The generated client over the same connection, for requests this wrapper would
    /// refuse to build (tests of the owner's validation).
    pub fn raw(&self) -> RawClient<Channel> {
        self.inner.raw.clone()
    }

    fn request<T>(&self, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        r.set_timeout(self.inner.deadline);
        r
    }

    fn failed(&self, method: &'static str, s: Status) -> PeerClientError {
        // Unavailable: the connection broke or the peer is not there; DeadlineExceeded: it
        // stalled. Other codes are answers (refusals) that the caller reports.
        if matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded) {
            if let Some(held_back) = LOST.allow(&self.inner.addr) {
                tracing::warn!(
                    peer = %self.inner.addr,
                    method,
                    code = ?s.code(),
                    error = s.message(),
                    held_back,
                    "peer lost or stalled"
                );
            }
        }
        PeerClientError::Call {
            addr: self.inner.addr.clone(),
            method,
            code: s.code(),
            message: s.message().to_owned(),
        }
    }

    fn malformed(&self, method: &'static str, reason: impl Into<String>) -> PeerClientError {
        PeerClientError::Malformed {
            addr: self.inner.addr.clone(),
            method,
            reason: reason.into(),
        }
    }

    /// Awaits a call, enforcing the deadline here too (a stalled connection never answers
    /// the owner's deadline).
    async fn call<T>(
        &self,
        method: &'static str,
        fut: impl std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    ) -> Result<T, PeerClientError> {
        match tokio::time::timeout(self.inner.deadline, fut).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(self.failed(method, s)),
            Err(_) => Err(self.failed(
                method,
                Status::deadline_exceeded(format!("no answer within {:?}", self.inner.deadline)),
            )),
        }
    }

    /// Exchanges versions and capabilities; refuses an owner of another protocol revision.
    pub async fn hello(&self, me: PeerInfo) -> Result<PeerInfo, PeerClientError> {
        let req = self.request(HelloRequest {
            token: self.inner.token.clone(),
            node: Some(me.into_proto()),
        });
        let mut raw = self.inner.raw.clone();
        let resp = self.call("Hello", raw.hello(req)).await?;
        let node = resp
            .node
            .ok_or_else(|| self.malformed("Hello", "no node info"))?;
        if node.protocol != PROTOCOL {
            return Err(self.malformed(
                "Hello",
                format!(
                    "owner {} speaks peer protocol {}; this node speaks {PROTOCOL}",
                    node.node_id, node.protocol
                ),
            ));
        }
        PeerInfo::from_proto(node).map_err(|e| self.malformed("Hello", e.to_string()))
    }

    /// Asks where the owner's pool is read over `provider`.
    pub async fn handshake(
        &self,
        node_id: &str,
        provider: Provider,
    ) -> Result<PeerHandshake, PeerClientError> {
        self.handshake_with(node_id, provider, &[]).await
    }

    /// A verbs Handshake: offers this node's QPs per NIC (`mine`, with QPs and without
    /// regions) and gets the owner's, each checked field by field and against the offer,
    /// ready for bringing the local QPs to ready-to-receive and ready-to-send.
    pub async fn handshake_verbs(
        &self,
        node_id: &str,
        mine: &[VerbsPeerEndpoint],
    ) -> Result<PeerHandshake, PeerClientError> {
        self.handshake_with(node_id, Provider::Verbs, mine).await
    }

    async fn handshake_with(
        &self,
        node_id: &str,
        provider: Provider,
        mine: &[VerbsPeerEndpoint],
    ) -> Result<PeerHandshake, PeerClientError> {
        let req = self.request(HandshakeRequest {
            token: self.inner.token.clone(),
            node_id: node_id.to_owned(),
            provider: provider.as_str().to_owned(),
            verbs: mine.iter().map(VerbsPeerEndpoint::to_proto).collect(),
        });
        let mut raw = self.inner.raw.clone();
        let resp = self.call("Handshake", raw.handshake(req)).await?;
        let got = Provider::parse(&resp.provider)
            .map_err(|e| self.malformed("Handshake", e.to_string()))?;
        if got != provider {
            return Err(self.malformed(
                "Handshake",
                format!("asked for {}, answered {}", provider.as_str(), got.as_str()),
            ));
        }
        let role = if provider == Provider::Verbs {
            Role::Answer
        } else {
            Role::Announce
        };
        let verbs = endpoints_from_proto(&resp.verbs, role)
            .map_err(|e| self.malformed("Handshake", e.to_string()))?;
        if provider == Provider::Verbs {
            if verbs.is_empty() {
                return Err(self.malformed("Handshake", "a verbs answer names no nic"));
            }
            check_answer(mine, &verbs).map_err(|e| self.malformed("Handshake", e.to_string()))?;
        } else if !verbs.is_empty() {
            return Err(self.malformed(
                "Handshake",
                format!("verbs endpoints in a {} answer", provider.as_str()),
            ));
        }
        if resp.incarnation == 0 {
            return Err(self.malformed("Handshake", "no incarnation"));
        }
        let grant = match (provider, resp.data_link) {
            (Provider::Tcp, 0) => {
                return Err(self.malformed(
                    "Handshake",
                    "a tcp answer authorises no data link (an owner of an older release?)",
                ))
            }
            (Provider::Tcp, link) => Some(LinkGrant {
                link,
                secret: LinkSecret::from_bytes(&resp.data_secret).ok_or_else(|| {
                    self.malformed(
                        "Handshake",
                        format!(
                            "a data link secret of {} bytes, not {SECRET_LEN}",
                            resp.data_secret.len()
                        ),
                    )
                })?,
            }),
            _ => None,
        };
        let was = self
            .inner
            .life
            .incarnation
            .swap(resp.incarnation, std::sync::atomic::Ordering::AcqRel);
        tracing::info!(
            peer = %self.inner.addr,
            provider = provider.as_str(),
            incarnation = format_args!("{:#x}", resp.incarnation),
            previous = format_args!("{was:#x}"),
            "peer handshake"
        );
        Ok(PeerHandshake {
            incarnation: resp.incarnation,
            provider,
            grant,
            verbs,
            endpoint: resp.endpoint,
            regions: resp
                .regions
                .into_iter()
                .map(|r| RemoteRegion {
                    nic: r.nic,
                    addr: r.addr,
                    len: r.len,
                    rkey: r.rkey,
                })
                .collect(),
        })
    }

    /// Pins the present prefix of `hashes` on the owner.
    pub async fn pin_blocks(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<PeerPin, PeerClientError> {
        let req = self.request(PinBlocksRequest {
            token: self.inner.token.clone(),
            namespace: namespace.as_str().to_owned(),
            hashes: hashes.iter().map(|h| h.as_bytes().to_vec()).collect(),
        });
        let mut raw = self.inner.raw.clone();
        let resp = self.call("PinBlocks", raw.pin_blocks(req)).await?;
        let was = self
            .inner
            .life
            .incarnation
            .load(std::sync::atomic::Ordering::Acquire);
        if was != 0 && resp.incarnation != was {
            // Another life of the owner: its addresses mean nothing to what the handshake
            // set up. Give the pin back and say so; the caller handshakes again.
            self.inner
                .life
                .restarted
                .store(true, std::sync::atomic::Ordering::Release);
            tracing::warn!(
                peer = %self.inner.addr,
                incarnation = format_args!("{:#x}", resp.incarnation),
                previous = format_args!("{was:#x}"),
                "peer restarted: links built on the old handshake are rebuilt"
            );
            let _ = self.unpin(resp.pin_id).await;
            return Err(PeerClientError::Restarted {
                addr: self.inner.addr.clone(),
                was,
                now: resp.incarnation,
            });
        }
        if resp.blocks.len() > hashes.len() {
            return Err(self.malformed(
                "PinBlocks",
                format!("{} blocks for {} hashes", resp.blocks.len(), hashes.len()),
            ));
        }
        if resp.pin_id == 0 && !resp.blocks.is_empty() {
            return Err(self.malformed("PinBlocks", "blocks without a pin id"));
        }
        let mut blocks = Vec::with_capacity(resp.blocks.len());
        for (i, (b, asked)) in resp.blocks.iter().zip(hashes).enumerate() {
            let hash = BlockHash::at(i, &b.hash)
                .map_err(|e| self.malformed("PinBlocks", e.to_string()))?;
            if hash != *asked {
                return Err(self.malformed(
                    "PinBlocks",
                    format!("block #{i} is {hash:?}, asked for {asked:?}"),
                ));
            }
            blocks.push(PinnedBlockInfo {
                hash,
                addr: b.addr,
                len: b.len,
            });
        }
        Ok(PeerPin {
            pin_id: resp.pin_id,
            ttl: Duration::from_millis(resp.ttl_ms),
            blocks,
        })
    }

    /// Releases a pin (0 and unknown ids are no-ops on the owner).
    pub async fn unpin(&self, pin_id: u64) -> Result<(), PeerClientError> {
        let req = self.request(UnpinRequest {
            token: self.inner.token.clone(),
            pin_id,
        });
        let mut raw = self.inner.raw.clone();
        self.call("Unpin", raw.unpin(req)).await?;
        Ok(())
    }
}
