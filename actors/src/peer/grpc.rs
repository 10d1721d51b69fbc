//! Peers in other processes: pins through their `kvferry.v1.Peer` service, data over tcp
//! (the owner's server, read through this node's NIC worker) or shm (the owner's memfd,
//! received over its Unix socket and mapped read-only).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};

use kvferry_transport::shm::ShmConnector;
use kvferry_transport::{HostRegion, MrKey};

use super::Peers;
use crate::peer::client::PeerClient;
use crate::peer::cluster::{transport_id, DataSide, Provider};
use crate::peer::data_tls::DataTls;
use crate::peer::directory::Directory;
use crate::peer::error::LinkError;
use crate::peer::error::RemoteError;
use crate::peer::link::{BoxFut, Control, MappedLink, MappedView, PeerLink, ViewOwner};
use crate::peer::pin_service::PinService;
use crate::peer::rc_link::{RcEndpoints, RcLink};
use crate::peer::{DataEndpoint, NicRegistration};

/// A node's view of peers in other processes.
pub struct GrpcPeers {
    node_id: String,
    provider: Provider,
    token: String,
    directory: Arc<dyn Directory>,
    /// Peer node id → its Peer service address.
    peers: HashMap<String, String>,
    shm_dir: PathBuf,
    data_listen: String,
    data_lanes: usize,
    side: Mutex<Option<DataSide>>,
    verbs: Mutex<Option<crate::nic::runtime::VerbsSide>>,
    links: Mutex<HashMap<String, Arc<dyn PeerLink>>>,
    /// The Peer client each link pins through: once it saw the owner restart, the link (its
    /// data connection or mapping, its keys) is of the old owner and is made again.
    clients: Mutex<HashMap<String, PeerClient>>,
    /// Links are built in futures that outlive the call that started them.
    me: Weak<GrpcPeers>,
    /// TLS to the peers' Peer services (`[tls]` with "peer"); none: plaintext.
    tls: Option<PeerTls>,
    /// TLS on the tcp data plane (`[tls]` with "data"); none: plaintext.
    data_tls: Option<DataTls>,
}

/// How a node calls its peers over TLS.
#[derive(Clone, Debug)]
struct PeerTls {
    ctx: crate::tls::TlsContext,
    config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for GrpcPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcPeers")
            .field("node", &self.node_id)
            .field("provider", &self.provider)
            .field("peers", &self.peers)
            .finish()
    }
}

/// How a [`GrpcPeers`] reaches the others and serves its own pool.
#[derive(Clone)]
pub struct GrpcPeersConfig {
    pub node_id: String,
    pub provider: Provider,
    pub token: String,
    /// `(node id, "host:port")` of every peer's Peer service.
    pub peers: Vec<(String, String)>,
    /// Where this node's shm socket goes.
    pub shm_dir: PathBuf,
    /// Where this node's tcp data server listens ("127.0.0.1:0" for any port).
    pub data_listen: String,
    /// Connections each tcp link opens to a peer's data port (`cluster.data-lanes`).
    pub data_lanes: u32,
}

// Written out so that the peer token never reaches a log line or a failed test's output;
// every field is listed, so a new one cannot be left out silently.
impl std::fmt::Debug for GrpcPeersConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let GrpcPeersConfig {
            node_id,
            provider,
            token,
            peers,
            shm_dir,
            data_listen,
            data_lanes,
        } = self;
        f.debug_struct("GrpcPeersConfig")
            .field("node_id", node_id)
            .field("provider", provider)
            .field("token", &crate::statuses::Redacted(token))
            .field("peers", peers)
            .field("shm_dir", shm_dir)
            .field("data_listen", data_listen)
            .field("data_lanes", data_lanes)
            .finish()
    }
}

/// How often a failing link to one peer is logged.
const LINK_FAILURE_LOG_PERIOD: std::time::Duration = std::time::Duration::from_secs(10);
static LINK_FAILURES: crate::log_limit::LogLimit =
    crate::log_limit::LogLimit::new(LINK_FAILURE_LOG_PERIOD);

fn remote(peer: &str, e: RemoteError) -> LinkError {
    LinkError::remote(peer, e)
}

impl GrpcPeers {
    pub fn new(cfg: GrpcPeersConfig, directory: Arc<dyn Directory>) -> Arc<Self> {
        Self::build(cfg, directory, None, None)
    }

    /// [`Self::new`] with the Peer calls over TLS: this node presents the certificate of
    /// `tls` and accepts only owners whose certificate the CA signed for their node id.
    pub fn new_with_tls(
        cfg: GrpcPeersConfig,
        directory: Arc<dyn Directory>,
        tls: crate::tls::TlsContext,
    ) -> Result<Arc<Self>, crate::tls::TlsError> {
        Self::new_secured(cfg, directory, tls, true, false)
    }

    /// [`Self::new`] with TLS from `tls` on the Peer calls (`peer`) and on the tcp data
    /// plane (`data`): the owner serves its data port requiring a certificate the CA signed,
    /// and dials owners expecting their node id in their certificate.
    pub fn new_secured(
        cfg: GrpcPeersConfig,
        directory: Arc<dyn Directory>,
        tls: crate::tls::TlsContext,
        peer: bool,
        data: bool,
    ) -> Result<Arc<Self>, crate::tls::TlsError> {
        let peer_tls = match peer {
            true => Some(PeerTls {
                ctx: tls.clone(),
                config: tls.client_config(&[crate::tls::ALPN_H2])?,
            }),
            false => None,
        };
        let data_tls = match data {
            true => Some(DataTls::new(tls)?),
            false => None,
        };
        Ok(Self::build(cfg, directory, peer_tls, data_tls))
    }

    fn build(
        cfg: GrpcPeersConfig,
        directory: Arc<dyn Directory>,
        tls: Option<PeerTls>,
        data_tls: Option<DataTls>,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            tls,
            data_tls,
            me: me.clone(),
            node_id: cfg.node_id,
            provider: cfg.provider,
            token: cfg.token,
            directory,
            peers: cfg.peers.into_iter().collect(),
            shm_dir: cfg.shm_dir,
            data_listen: cfg.data_listen,
            data_lanes: cfg.data_lanes.max(1) as usize,
            side: Mutex::new(None),
            verbs: Mutex::new(None),
            links: Mutex::new(HashMap::new()),
            clients: Mutex::new(HashMap::new()),
        })
    }

    /// This node's data path, for its Peer service's Hello and Handshake answers (after the
    /// node has joined).
    pub fn data_endpoint(&self) -> Option<DataEndpoint> {
        let side = self.side.lock().ok()?;
        let side = side.as_ref()?;
        Some(DataEndpoint {
            provider: self.provider,
            endpoint: side.endpoint()?,
            nics: vec![NicRegistration {
                nic: "pool".into(),
                rkey: side.mr.key().0,
            }],
            auth: side.tcp.as_ref().map(|t| t.auth.clone()),
        })
    }

    /// [`Self::link_to`] with its outcome logged: one line per link made, and failures
    /// at most every [`LINK_FAILURE_LOG_PERIOD`] per peer (a peer that is down fails every
    /// plan that names it).
    async fn connect(&self, from: &str, to: &str) -> Result<Arc<dyn PeerLink>, LinkError> {
        // Events of the handshake (the owner's incarnation, a lost peer) carry the link.
        let span = tracing::info_span!("peer_link", node = from, peer = to);
        match tracing::Instrument::instrument(self.link_to(from, to), span).await {
            Ok(link) => {
                tracing::info!(
                    node = from,
                    peer = to,
                    provider = self.provider.as_str(),
                    "peer linked"
                );
                Ok(link)
            }
            Err(e) => {
                if let Some(held_back) = LINK_FAILURES.allow(to) {
                    tracing::warn!(
                        node = from,
                        peer = to,
                        error = %e,
                        held_back,
                        "peer link failed; plans read its blocks from elsewhere or not at all"
                    );
                }
                Err(e)
            }
        }
    }

    async fn link_to(&self, from: &str, to: &str) -> Result<Arc<dyn PeerLink>, LinkError> {
        let addr = self
            .peers
            .get(to)
            .ok_or_else(|| remote(to, RemoteError::no_path("not in this node's peer list")))?;
        let dial = match &self.tls {
            Some(t) => Some(crate::tls::TlsDial {
                config: Arc::clone(&t.config),
                server_name: crate::tls::peer_server_name(to)
                    .map_err(|e| remote(to, RemoteError::connect("the Peer service's name", e)))?,
                stats: Arc::clone(t.ctx.stats()),
                side: crate::tls::TlsSide::PeerClient,
            }),
            None => None,
        };
        let client = PeerClient::connect_over(
            addr.clone(),
            self.token.clone(),
            crate::peer::client::DEFAULT_DEADLINE,
            dial,
        )
        .await
        .map_err(|e| remote(to, RemoteError::connect("the Peer service", e)))?;
        if let Ok(mut c) = self.clients.lock() {
            c.insert(to.to_owned(), client.clone());
        }
        if self.provider == Provider::Verbs {
            let side = self
                .verbs
                .lock()
                .map_err(|_| LinkError::Stopped { what: "peers" })?
                .clone()
                .ok_or_else(|| {
                    remote(
                        to,
                        RemoteError::no_path("this node has no usable RDMA nic to read with"),
                    )
                })?;
            let control = Control::Grpc {
                client: client.clone(),
                runtime: tokio::runtime::Handle::current(),
            };
            let link: Arc<dyn PeerLink> = Arc::new(crate::peer::verbs::connect_link(
                &side, from, to, control, &client,
            )?);
            if let Ok(mut l) = self.links.lock() {
                l.insert(to.to_owned(), Arc::clone(&link));
            }
            return Ok(link);
        }
        let hs = client
            .handshake(from, self.provider)
            .await
            .map_err(|e| remote(to, RemoteError::connect("the handshake", e)))?;
        let region = hs
            .regions
            .first()
            .ok_or_else(|| remote(to, RemoteError::refused("owner exports no pool")))?
            .clone();
        let control = Control::Grpc {
            client,
            runtime: tokio::runtime::Handle::current(),
        };
        let link: Arc<dyn PeerLink> = match self.provider {
            Provider::Shm => {
                let mapping = ShmConnector::new(transport_id(from), transport_id(to), &hs.endpoint)
                    .map_exports()
                    .map_err(|e| remote(to, RemoteError::connect("mapping the owner's pool", e)))?;
                let r = mapping
                    .regions()
                    .into_iter()
                    .find(|r| r.remote_addr == region.addr)
                    .ok_or_else(|| {
                        remote(
                            to,
                            RemoteError::refused("the shm socket exports another pool"),
                        )
                    })?;
                let view = MappedView {
                    holder: Arc::new(ViewOwner::Shm(mapping)),
                    remote_base: r.remote_addr,
                    local_base: r.local_addr,
                    len: r.len,
                };
                Arc::new(MappedLink::new(to.to_owned(), "shm", control, view))
            }
            Provider::Tcp => {
                let side = self
                    .side
                    .lock()
                    .map_err(|_| LinkError::Stopped { what: "peers" })?;
                let tcp = side.as_ref().and_then(|s| s.tcp.as_ref()).ok_or_else(|| {
                    remote(to, RemoteError::no_path("this node has no tcp data side"))
                })?;
                let addr = hs.endpoint.parse().map_err(|_| {
                    remote(
                        to,
                        RemoteError::refused(format!("bad tcp endpoint {:?}", hs.endpoint)),
                    )
                })?;
                // Over TLS the link dials with a connector of its own; its grant still goes
                // in the hello, inside TLS.
                let connector = match (&self.data_tls, &hs.grant) {
                    (Some(t), Some(g)) => Some(
                        t.connector(from, to, addr, g.clone())
                            .map_err(|e| remote(to, e))?,
                    ),
                    _ => None,
                };
                Arc::new(RcLink::new(
                    to.to_owned(),
                    RcEndpoints {
                        control,
                        rkey: MrKey(region.rkey),
                        local: transport_id(from),
                        peer: transport_id(to),
                        addr,
                        worker: tcp.nic.workers[0].clone(),
                        table: tcp.nic.tables[0].clone(),
                        pool_lkey: tcp.pool_mr.key(),
                        max_sge: tcp.max_sge,
                        qps: tcp.qps,
                        faults: Vec::new(),
                        connector,
                        rdma: None,
                        grant: hs.grant.clone(),
                    },
                ))
            }
            Provider::Loopback => {
                return Err(remote(
                    to,
                    RemoteError::no_path("loopback does not cross processes"),
                ))
            }
            Provider::Verbs => {
                return Err(remote(
                    to,
                    RemoteError::no_path("verbs links are made above"),
                ))
            }
        };
        if let Ok(mut l) = self.links.lock() {
            l.insert(to.to_owned(), Arc::clone(&link));
        }
        Ok(link)
    }
}

impl Peers for GrpcPeers {
    fn directory(&self) -> &Arc<dyn Directory> {
        &self.directory
    }

    fn link(&self, from: &str, to: &str) -> BoxFut<Result<Arc<dyn PeerLink>, LinkError>> {
        let restarted = self
            .clients
            .lock()
            .ok()
            .and_then(|c| c.get(to).map(PeerClient::restarted))
            .unwrap_or(false);
        let stale = self
            .links
            .lock()
            .ok()
            .and_then(|l| l.get(to).map(|l| l.stale()))
            .unwrap_or(false);
        if stale && !restarted {
            tracing::warn!(
                node = from,
                peer = to,
                "the owner refused this node's data link (revoked or expired): re-linking"
            );
            if let Ok(mut l) = self.links.lock() {
                l.remove(to);
            }
        }
        if restarted {
            tracing::warn!(
                node = from,
                peer = to,
                "peer restarted (a new incarnation): re-linking"
            );
            // Transfers still reading through the old link hold it; new plans get a new one.
            if let Ok(mut l) = self.links.lock() {
                l.remove(to);
            }
            if let Ok(mut c) = self.clients.lock() {
                c.remove(to);
            }
        }
        if let Some(l) = self.links.lock().ok().and_then(|l| l.get(to).cloned()) {
            return Box::pin(async move { Ok(l) });
        }
        // The link is built once per owner; `self` lives as long as the node that holds it.
        let this = self.me.upgrade();
        let (from, to) = (from.to_owned(), to.to_owned());
        Box::pin(async move {
            match this {
                Some(p) => p.connect(&from, &to).await,
                None => Err(LinkError::Stopped { what: "peers" }),
            }
        })
    }

    fn join(
        &self,
        node: &str,
        _store: Arc<dyn PinService>,
        memory: Arc<HostRegion>,
    ) -> Result<(), LinkError> {
        let side = DataSide::start(
            node,
            self.provider,
            memory,
            &self.shm_dir,
            &self.data_listen,
            self.data_lanes,
            self.data_tls.as_ref(),
        )?;
        *self
            .side
            .lock()
            .map_err(|_| LinkError::Stopped { what: "peers" })? = Some(side);
        Ok(())
    }

    fn data_rejections(&self, _node: &str) -> Option<Arc<kvferry_transport::Rejections>> {
        let side = self.side.lock().ok()?;
        Some(side.as_ref()?.tcp.as_ref()?.rejections.clone())
    }

    fn attach_verbs(&self, side: crate::nic::runtime::VerbsSide) {
        if let Ok(mut v) = self.verbs.lock() {
            *v = Some(side);
        }
    }

    fn leave(&self, node: &str) {
        self.directory.withdraw_node(node);
        if let Ok(mut l) = self.links.lock() {
            l.clear();
        }
        if let Some(side) = self.side.lock().ok().and_then(|mut s| s.take()) {
            side.stop();
        }
    }
}
