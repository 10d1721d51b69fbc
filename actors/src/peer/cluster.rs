//! An in-process cluster: nodes of one process sharing a directory, reaching each other's
//! pools over a chosen provider (loopback: the owner's own mapping; shm: the owner's memfd
//! passed over a Unix socket and mapped read-only; tcp: the transport's RC queue contract
//! over a TCP connection to the owner's server, driven by the requester's NIC worker).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use kvferry_transport::shm::{ShmConnector, ShmOwner};
use kvferry_transport::tcp::{TcpOwner, TcpOwnerOptions};
use kvferry_transport::{
    Access, DataAuth, HostRegion, MrHandle, MrTable, NicConfig, NodeId, ProviderKind, Reject,
    Rejections,
};

use crate::nic::runtime::NicRuntime;
use crate::peer::directory::{Directory, EmbeddedDirectory};
use crate::peer::error::LinkError;
use crate::peer::error::RemoteError;
use crate::peer::link::{Control, MappedLink, MappedView, PeerLink, ViewOwner};
use crate::peer::pin_service::PinService;
use crate::peer::rc_link::{RcEndpoints, RcLink};

/// Scatter entries per tcp read (the most a NIC config allows): a rank part of up to 32
/// layers x K/V in one request.
const TCP_MAX_SGE: u32 = 64;

/// How nodes of a cluster read each other's pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provider {
    Loopback,
    Shm,
    Tcp,
    /// RDMA NICs: QPs exchanged over the Peer RPC's Handshake, one-sided reads of the
    /// owner's pool MRs.
    Verbs,
}

impl Provider {
    pub fn parse(s: &str) -> Result<Self, LinkError> {
        match s {
            "loopback" => Ok(Provider::Loopback),
            "shm" => Ok(Provider::Shm),
            "tcp" => Ok(Provider::Tcp),
            "verbs" => Ok(Provider::Verbs),
            other => Err(LinkError::bad(format!(
                "provider {other:?} is not one of loopback, shm, tcp, verbs"
            ))),
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Provider::Loopback => "loopback",
            Provider::Shm => "shm",
            Provider::Tcp => "tcp",
            Provider::Verbs => "verbs",
        }
    }
}

/// Data-plane refusals, logged at most once a minute per reason (a scanner or a client
/// guessing keys retries at line rate); every one is counted in
/// `kvferry_data_rejected_total`.
static DATA_REJECTIONS: crate::log_limit::LogLimit =
    crate::log_limit::LogLimit::new(std::time::Duration::from_secs(60));

fn log_rejection(node: &str, from: Option<std::net::SocketAddr>, why: Reject) {
    if let Some(held_back) = DATA_REJECTIONS.allow(why.as_str()) {
        let from = from.map_or_else(|| "?".to_owned(), |a| a.to_string());
        tracing::warn!(
            node,
            from = %from,
            reason = why.as_str(),
            held_back,
            "tcp data plane refused a connection"
        );
    }
}

/// Data-plane refusals by reason, for a scrape.
#[derive(Clone, Debug)]
pub struct DataRejections(pub Arc<Rejections>);

impl crate::metrics::Sampled for DataRejections {
    fn record(&self) {
        for (reason, n) in self.0.labelled() {
            ::metrics::counter!(crate::metrics::DATA_REJECTED, "reason" => reason).absolute(n);
        }
    }
}

/// The transport node id of a kvferry node id.
pub fn transport_id(node: &str) -> NodeId {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node.hash(&mut h);
    NodeId(h.finish())
}

/// A node's tcp endpoints: the owner server for its pool, and its own NIC runtime (one tcp
/// NIC) with its pool registered for local write, for the reads it makes.
pub(crate) struct TcpSide {
    owner: Option<TcpOwner>,
    /// The data links the Peer service's Handshakes authorised; the server checks them.
    pub(crate) auth: DataAuth,
    pub(crate) rejections: Arc<Rejections>,
    pub(crate) addr: std::net::SocketAddr,
    pub(crate) pool_mr: MrHandle,
    pub(crate) max_sge: usize,
    pub(crate) qps: usize,
    pub(crate) nic: NicRuntime,
}

impl TcpSide {
    fn kill(&mut self) {
        if let Some(o) = self.owner.take() {
            o.drop_connections();
            o.shutdown();
        }
    }
}

/// What makes a node's pool readable by peers over one provider, and what it reads them
/// with: its pool registered for remote read, plus the provider's server (shm socket or
/// tcp server and NIC runtime).
pub(crate) struct DataSide {
    pub(crate) memory: Arc<HostRegion>,
    _table: MrTable,
    pub(crate) mr: MrHandle,
    pub(crate) shm: Option<(PathBuf, ShmOwner)>,
    pub(crate) tcp: Option<TcpSide>,
}

impl DataSide {
    /// Registers and serves `memory`; shm sockets go in `dir`.
    pub(crate) fn start(
        node: &str,
        provider: Provider,
        memory: Arc<HostRegion>,
        dir: &std::path::Path,
        tcp_listen: &str,
        lanes: usize,
        tls: Option<&super::data_tls::DataTls>,
    ) -> Result<Self, LinkError> {
        let table = MrTable::new();
        let mr = table
            .register_host(Arc::clone(&memory), Access::REMOTE_READ)
            .map_err(|e| remote(node, RemoteError::local("registering the pool", e)))?;
        let shm = match provider {
            Provider::Shm => {
                // Another user who may write it could replace the socket with their own, and
                // requesters would map an impostor's pool.
                crate::private_fs::private_dir(dir).map_err(|e| {
                    remote(node, RemoteError::local("the shm socket's directory", e))
                })?;
                let path = dir.join(format!("{node}.sock"));
                let _ = std::fs::remove_file(&path);
                let listener = UnixListener::bind(&path).map_err(|e| {
                    remote(
                        node,
                        RemoteError::local(format!("binding {}", path.display()), e),
                    )
                })?;
                // Only this user may connect and receive the pool's descriptor.
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::Permissions::from_mode(crate::private_fs::FILE_MODE);
                std::fs::set_permissions(&path, mode).map_err(|e| {
                    remote(
                        node,
                        RemoteError::local(format!("setting {} to 0600", path.display()), e),
                    )
                })?;
                let owner =
                    ShmOwner::spawn(listener, transport_id(node), table.clone()).map_err(|e| {
                        remote(node, RemoteError::local("serving the pool over shm", e))
                    })?;
                Some((path, owner))
            }
            _ => None,
        };
        let tcp = match provider {
            Provider::Tcp => {
                let listener = std::net::TcpListener::bind(tcp_listen).map_err(|e| {
                    remote(node, RemoteError::local(format!("binding {tcp_listen}"), e))
                })?;
                let auth = DataAuth::new();
                let mut opts = TcpOwnerOptions::new(auth.clone());
                let me = node.to_owned();
                let stats = tls.map(|t| Arc::clone(t.ctx.stats()));
                opts.on_reject = Some(Arc::new(move |from, why| {
                    if let (Some(s), true) = (&stats, why.is_tls()) {
                        s.handshake_failed(crate::tls::TlsSide::Data);
                    }
                    log_rejection(&me, from, why)
                }));
                opts.tls = tls.map(|t| Arc::clone(&t.server));
                let owner = TcpOwner::spawn_with(listener, transport_id(node), table.clone(), opts)
                    .map_err(|e| {
                        remote(node, RemoteError::local("serving the pool over tcp", e))
                    })?;
                let addr = owner.local_addr();
                let rejections = owner.rejections();
                let nic_cfg = NicConfig {
                    name: format!("{node}-tcp0"),
                    provider: ProviderKind::Tcp,
                    // The scatter list stays on this side of a tcp read (the owner streams one
                    // range): no hardware limit, and a block's rank part (one piece per layer
                    // and K/V) is then one request instead of several.
                    max_sge: TCP_MAX_SGE,
                    qps_per_peer: u32::try_from(lanes.max(1)).unwrap_or(u32::MAX),
                    ..NicConfig::default()
                };
                let (max_sge, qps) = (nic_cfg.max_sge as usize, nic_cfg.qps_per_peer as usize);
                let nic = NicRuntime::start(vec![nic_cfg])
                    .map_err(|e| remote(node, RemoteError::local("starting the tcp nic", e)))?;
                let pool_mr = nic.tables[0]
                    .register_host(Arc::clone(&memory), Access::LOCAL_WRITE)
                    .map_err(|e| remote(node, RemoteError::local("registering the pool", e)))?;
                Some(TcpSide {
                    owner: Some(owner),
                    auth,
                    rejections,
                    addr,
                    pool_mr,
                    max_sge,
                    qps,
                    nic,
                })
            }
            _ => None,
        };
        Ok(Self {
            memory,
            _table: table,
            mr,
            shm,
            tcp,
        })
    }

    /// Where peers reach this side: the tcp server's address or the shm socket path.
    pub(crate) fn endpoint(&self) -> Option<String> {
        if let Some(t) = &self.tcp {
            return Some(t.addr.to_string());
        }
        self.shm.as_ref().map(|(p, _)| p.display().to_string())
    }

    pub(crate) fn stop(mut self) {
        if let Some((path, owner)) = self.shm.take() {
            owner.shutdown();
            let _ = std::fs::remove_file(path);
        }
        if let Some(mut t) = self.tcp.take() {
            t.kill();
        }
    }

    pub(crate) fn kill_server(&mut self) {
        if let Some(t) = self.tcp.as_mut() {
            t.kill();
        }
    }

    /// Data connections the tcp server is serving now (0 without one).
    pub(crate) fn data_connections(&self) -> usize {
        self.tcp
            .as_ref()
            .and_then(|t| t.owner.as_ref())
            .map_or(0, |o| o.connections())
    }
}

struct Member {
    store: Arc<dyn PinService>,
    side: DataSide,
}

/// Nodes of one process.
pub struct LocalCluster {
    directory: Arc<dyn Directory>,
    provider: Provider,
    members: Mutex<HashMap<String, Member>>,
    links: Mutex<HashMap<(String, String), Arc<dyn PeerLink>>>,
    faults: Mutex<HashMap<String, Vec<kvferry_transport::fault::Fault>>>,
    dir: PathBuf,
    /// TLS on the tcp data plane between the members; none: in clear.
    data_tls: Option<super::data_tls::DataTls>,
    /// Connections per tcp link of members that join from now on.
    data_lanes: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for LocalCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCluster")
            .field("provider", &self.provider)
            .finish()
    }
}

fn remote(peer: &str, e: RemoteError) -> LinkError {
    LinkError::remote(peer, e)
}

impl LocalCluster {
    pub fn new(provider: Provider) -> Arc<Self> {
        Self::with_directory(provider, Arc::new(EmbeddedDirectory::new()))
    }

    pub fn with_directory(provider: Provider, directory: Arc<dyn Directory>) -> Arc<Self> {
        Self::build(provider, directory, None)
    }

    /// A tcp cluster whose members serve and read the data plane over mutual TLS with the
    /// certificate and CA of `tls` (one identity for the process: its certificate must name
    /// every member's node id, as each member checks the owner it dials).
    pub fn with_tls(
        provider: Provider,
        tls: crate::tls::TlsContext,
    ) -> Result<Arc<Self>, crate::tls::TlsError> {
        let data_tls = super::data_tls::DataTls::new(tls)?;
        Ok(Self::build(
            provider,
            Arc::new(EmbeddedDirectory::new()),
            Some(data_tls),
        ))
    }

    fn build(
        provider: Provider,
        directory: Arc<dyn Directory>,
        data_tls: Option<super::data_tls::DataTls>,
    ) -> Arc<Self> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kvferry-{}-{n}", std::process::id()));
        Arc::new(Self {
            directory,
            provider,
            members: Mutex::new(HashMap::new()),
            links: Mutex::new(HashMap::new()),
            faults: Mutex::new(HashMap::new()),
            dir,
            data_tls,
            data_lanes: std::sync::atomic::AtomicUsize::new(
                crate::peer::rc_link::DEFAULT_DATA_LANES as usize,
            ),
        })
    }

    pub fn provider(&self) -> Provider {
        self.provider
    }

    /// Connections each tcp link of members that join from now on opens to an owner (as
    /// `cluster.data-lanes` sets for a node; at least 1).
    pub fn set_data_lanes(&self, lanes: usize) {
        self.data_lanes
            .store(lanes.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// Simulates the death of a member's data path: its tcp server drops every connection
    /// and stops, while its node keeps running (its pins stay until they expire).
    pub fn kill_server(&self, node: &str) {
        if let Ok(mut m) = self.members.lock() {
            if let Some(mem) = m.get_mut(node) {
                mem.side.kill_server();
            }
        }
    }

    /// Data connections a member's tcp server is serving now (what its requesters' lanes
    /// opened; 0 for an unknown member or one without a tcp server).
    pub fn data_connections(&self, node: &str) -> usize {
        self.members
            .lock()
            .ok()
            .and_then(|m| m.get(node).map(|mem| mem.side.data_connections()))
            .unwrap_or(0)
    }

    /// Injects transport faults into tcp links made to `node` from now on (request numbers
    /// count across reconnects; each fault fires once). For fault tests.
    pub fn inject_faults(&self, node: &str, faults: Vec<kvferry_transport::fault::Fault>) {
        if let Ok(mut f) = self.faults.lock() {
            f.insert(node.to_owned(), faults);
        }
    }

    /// Adds a node: its pool is registered for remote read and served on the provider.
    fn join_member(
        &self,
        node: &str,
        store: Arc<dyn PinService>,
        memory: Arc<HostRegion>,
    ) -> Result<(), LinkError> {
        let side = DataSide::start(
            node,
            self.provider,
            memory,
            &self.dir,
            "127.0.0.1:0",
            self.data_lanes.load(std::sync::atomic::Ordering::Relaxed),
            self.data_tls.as_ref(),
        )?;
        self.members
            .lock()
            .map_err(|_| LinkError::Stopped { what: "cluster" })?
            .insert(node.to_owned(), Member { store, side });
        Ok(())
    }

    /// Removes a node: its entries leave the directory and links to it are dropped.
    fn leave_member(&self, node: &str) {
        self.directory.withdraw_node(node);
        if let Ok(mut l) = self.links.lock() {
            l.retain(|(a, b), _| a != node && b != node);
        }
        let gone = self.members.lock().ok().and_then(|mut m| m.remove(node));
        if let Some(m) = gone {
            m.side.stop();
        }
    }

    /// A link from `from` to `to`, made once and shared.
    fn link_to(&self, from: &str, to: &str) -> Result<Arc<dyn PeerLink>, LinkError> {
        let key = (from.to_owned(), to.to_owned());
        if let Some(l) = self.links.lock().ok().and_then(|l| l.get(&key).cloned()) {
            return Ok(l);
        }
        let link: Arc<dyn PeerLink> = {
            let members = self
                .members
                .lock()
                .map_err(|_| LinkError::Stopped { what: "cluster" })?;
            let m = members
                .get(to)
                .ok_or_else(|| remote(to, RemoteError::no_path("not a member of this cluster")))?;
            match (&self.provider, &m.side.shm, &m.side.tcp) {
                (Provider::Tcp, _, Some(t)) => {
                    let me = members
                        .get(from)
                        .and_then(|f| f.side.tcp.as_ref())
                        .ok_or_else(|| {
                            remote(
                                to,
                                RemoteError::no_path(format!("{from} has no tcp endpoint")),
                            )
                        })?;
                    // In one process the owner's grant is issued directly.
                    let grant = t.auth.issue(transport_id(from)).map_err(|e| {
                        remote(to, RemoteError::local("authorising the data link", e))
                    })?;
                    let connector = match &self.data_tls {
                        Some(tls) => Some(
                            tls.connector(from, to, t.addr, grant.clone())
                                .map_err(|e| remote(to, e))?,
                        ),
                        None => None,
                    };
                    Arc::new(RcLink::new(
                        to.to_owned(),
                        RcEndpoints {
                            control: Control::Local(Arc::clone(&m.store)),
                            rkey: m.side.mr.key(),
                            local: transport_id(from),
                            peer: transport_id(to),
                            addr: t.addr,
                            worker: me.nic.workers[0].clone(),
                            table: me.nic.tables[0].clone(),
                            pool_lkey: me.pool_mr.key(),
                            max_sge: me.max_sge,
                            qps: me.qps,
                            faults: self
                                .faults
                                .lock()
                                .ok()
                                .and_then(|f| f.get(to).cloned())
                                .unwrap_or_default(),
                            connector,
                            rdma: None,
                            grant: Some(grant),
                        },
                    ))
                }
                (Provider::Shm, Some((path, _)), _) => {
                    let mapping = ShmConnector::new(transport_id(from), transport_id(to), path)
                        .map_exports()
                        .map_err(|e| {
                            remote(to, RemoteError::connect("mapping the owner's pool", e))
                        })?;
                    let r = mapping
                        .regions()
                        .into_iter()
                        .find(|r| r.remote_addr == m.side.memory.addr())
                        .ok_or_else(|| remote(to, RemoteError::refused("owner exports no pool")))?;
                    let view = MappedView {
                        holder: Arc::new(ViewOwner::Shm(mapping)),
                        remote_base: r.remote_addr,
                        local_base: r.local_addr,
                        len: r.len,
                    };
                    Arc::new(MappedLink::new(
                        to.to_owned(),
                        "shm",
                        Control::Local(Arc::clone(&m.store)),
                        view,
                    ))
                }
                (Provider::Loopback, _, _) => {
                    let view = MappedView {
                        holder: Arc::new(ViewOwner::Pool(Arc::clone(&m.side.memory))),
                        remote_base: m.side.memory.addr(),
                        local_base: m.side.memory.addr(),
                        len: m.side.memory.len() as u64,
                    };
                    Arc::new(MappedLink::new(
                        to.to_owned(),
                        "loopback",
                        Control::Local(Arc::clone(&m.store)),
                        view,
                    ))
                }
                _ => {
                    return Err(remote(
                        to,
                        RemoteError::no_path("no server for this provider"),
                    ))
                }
            }
        };
        if let Ok(mut l) = self.links.lock() {
            l.insert(key, Arc::clone(&link));
        }
        Ok(link)
    }
}

impl super::Peers for LocalCluster {
    fn directory(&self) -> &Arc<dyn Directory> {
        &self.directory
    }

    fn data_rejections(&self, node: &str) -> Option<Arc<Rejections>> {
        let members = self.members.lock().ok()?;
        Some(members.get(node)?.side.tcp.as_ref()?.rejections.clone())
    }

    fn link(
        &self,
        from: &str,
        to: &str,
    ) -> crate::peer::link::BoxFut<Result<Arc<dyn PeerLink>, LinkError>> {
        let r = self.link_to(from, to);
        Box::pin(async move { r })
    }

    fn join(
        &self,
        node: &str,
        store: Arc<dyn PinService>,
        memory: Arc<HostRegion>,
    ) -> Result<(), LinkError> {
        self.join_member(node, store, memory)
    }

    fn leave(&self, node: &str) {
        self.leave_member(node)
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
