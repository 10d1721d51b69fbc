//! The `Node` handle: the in-process embedding API. The actix system runs on its own named
//! thread; the handle only holds actor addresses, so it is `Send + Sync + Clone` and usable
//! from any async runtime.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use actix::{Actor, Addr};
use kvferry_gpu::{Device, HostRegistration};

use crate::api::{
    LoadObserver, LoadRequest, PutBlocks, QueryRequest, QueryResponse, RegisterInstance,
    SaveRequest, Stats, StoreReport, TransferReport,
};
use crate::clock::Clock;
use crate::config::NodeConfig;
use crate::error::NodeError;
use crate::fence::Fence;
use crate::lease::keeper::{
    self, LeaseKeeper, LeaseStats, Load, Query, Release, ReleaseInstance, Sweep,
};
use crate::lease::registry::{self, CountInstances, GetRank, InstanceRegistry, RankHandle};
use crate::metrics::Counters;
use crate::model::{BlockHash, InstanceId, LeaseId, Namespace};
use crate::peer::link::BoxFut;
use crate::peer::{LocalCluster, Peers, PinService, PinServiceError, PinnedRemote};
use crate::tier::pool::HostPool;
use crate::tier::store::{self, BlockStore, GetCacheStats};

struct Inner {
    keeper: Addr<LeaseKeeper>,
    store: Addr<BlockStore>,
    devices: Vec<Arc<dyn Device>>,
    counters: Arc<Counters>,
    config: NodeConfig,
    system: actix::System,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Closed when the actor thread ends, however it ends (see [`Node::actors_stopped`]).
    actors_alive: tokio::sync::watch::Receiver<()>,
    cluster: Option<Arc<dyn Peers>>,
    /// The host pool's `(addr, len)`, for the Peer service's descriptors.
    pool_region: (u64, u64),
    /// The `[[nic]]` actors and the pool's registration on them.
    nics: Option<crate::nic::NodeNics>,
    /// The KV event log (`[events]`) and its publisher, when configured.
    events: Option<Arc<crate::events::EventHub>>,
    publisher: Option<crate::events::EventPublisher>,
    /// The engine service serving this node, for its gauges in a scrape.
    engine: Mutex<Option<std::sync::Weak<dyn crate::metrics::EngineProbe>>>,
    /// The TLS counters of the listeners serving this node (`[tls]`), while attached.
    tls: Mutex<Option<Arc<crate::tls::TlsStats>>>,
    /// The tenant namespaces queries and saves have named (shared with the lease keeper).
    tenants: Arc<crate::lease::tenants::TenantBook>,
    _registrations: Vec<HostRegistration>,
}

/// A running node. Cloning shares it; it stops when `shutdown` is called or the last clone
/// drops.
#[derive(Clone)]
pub struct Node {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("node_id", &self.inner.config.node_id)
            .finish()
    }
}

/// Opens the devices a config names: `cuda` (a typed error without a driver), `host`
/// (emulated), or `auto` (the GPU where a driver and device are present, else emulated).
pub fn open_devices(config: &NodeConfig) -> Result<Vec<Arc<dyn Device>>, NodeError> {
    (0..config.device.count)
        .map(|i| {
            Ok(kvferry_gpu::open_device_with(
                &config.device.kind,
                i,
                config.device.cuda_options(),
            )?)
        })
        .collect()
}

impl Node {
    /// Starts a node with the devices its config names.
    pub fn start(config: NodeConfig) -> Result<Self, NodeError> {
        let devices = open_devices(&config)?;
        Self::start_with(config, devices, Clock::system())
    }

    /// Starts a node over given devices and clock (tests, embedding engines).
    pub fn start_with(
        config: NodeConfig,
        devices: Vec<Arc<dyn Device>>,
        clock: Clock,
    ) -> Result<Self, NodeError> {
        Self::start_in(config, devices, clock, None::<Arc<LocalCluster>>)
    }

    /// Starts a node that is a member of an in-process cluster: it advertises its blocks in
    /// the cluster's directory, serves its pool to the other members over the cluster's
    /// provider, and reads remote suffixes from them.
    pub fn start_in<P: Peers + 'static>(
        config: NodeConfig,
        devices: Vec<Arc<dyn Device>>,
        clock: Clock,
        cluster: Option<Arc<P>>,
    ) -> Result<Self, NodeError> {
        let cluster: Option<Arc<dyn Peers>> = cluster.map(|c| c as Arc<dyn Peers>);
        config.validate()?;
        let pool = HostPool::new(
            config.pool.size.0,
            config.pool.slot_bytes.0,
            config.pool.hugepages,
        )?;
        let mut registrations = Vec::with_capacity(devices.len());
        for d in &devices {
            registrations.push(d.register_host(pool.base(), pool.memory().len() as u64, false)?);
        }
        let pool_region = (pool.base(), pool.memory().len() as u64);
        let nics = crate::nic::NodeNics::prepare(
            &config.nic,
            config.verbs.as_ref(),
            Arc::clone(pool.memory()),
        )
        .map_err(|e| NodeError::bad(format!("starting the nic actors: {e}")))?;
        let verbs_side = nics
            .as_ref()
            .map(|n| (n.direct_refusal.clone(), n.routing.clone()));
        // Scans the SSD directories before the actors start: a warm restart serves what it finds.
        let ssd = match &config.ssd {
            Some(c) => {
                let slot = config.pool.slot_bytes.0;
                Some(
                    crate::tier::ssd::SsdTier::open(c, slot)?
                        .with_write_backlog(c.backlog_bytes(config.pool.size.0, slot)),
                )
            }
            None => None,
        };
        let events = config
            .events
            .as_ref()
            .map(|c| crate::events::EventHub::new(c.buffer_events));
        // First of all (sequence 0, before what a warm restart finds on disk): a router that
        // kept a view of this node's earlier run drops it.
        if let Some(hub) = &events {
            hub.record_cleared(std::time::SystemTime::now());
        }
        let publisher = match (&config.events, &events) {
            (Some(c), Some(hub)) if !c.publish.is_empty() => Some(
                crate::events::EventPublisher::start(c, Arc::clone(hub)).map_err(|e| {
                    NodeError::bad(format!(
                        "starting the event publisher: {e}: {:?}",
                        std::error::Error::source(&e)
                    ))
                })?,
            ),
            _ => None,
        };
        let store_events = events.clone();
        let counters = Arc::new(Counters::default());
        counters.set_namespace_labels(config.tenants.metric_namespaces);
        let (tx, rx) = std::sync::mpsc::channel();
        let tenants = Arc::new(crate::lease::tenants::TenantBook::default());
        let keeper_tenants = Arc::clone(&tenants);
        let cfg = config.clone();
        let devs = devices.clone();
        let ctrs = Arc::clone(&counters);
        let memory = Arc::clone(pool.memory());
        let directory = cluster.as_ref().map(|c| Arc::clone(c.directory()));
        let member = cluster.clone();
        let (alive, actors_alive) = tokio::sync::watch::channel(());
        let thread = std::thread::Builder::new()
            .name("kvferry-actix".into())
            .spawn(move || {
                // Dropped when this thread returns or unwinds: the node's owner learns that
                // its actors are gone.
                let _alive = alive;
                let sys = actix::System::new();
                sys.block_on(async move {
                    // The NIC workers run on Arbiters of this System: the node runs one.
                    let nics = nics.map(crate::nic::PreparedNics::start).transpose();
                    // Stops with the System; its transfers drain as any stopped transfer.
                    let saves = actix::Arbiter::new();
                    let store = BlockStore::new(
                        pool,
                        Arc::clone(&ctrs),
                        cfg.node_id.clone(),
                        directory,
                        clock.clone(),
                        cfg.lease.peer_pin_ttl(),
                    )
                    .with_ssd(ssd)
                    .with_quotas(cfg.tenants.rules())
                    .with_events(store_events)
                    .with_save_arbiter(Some(saves.handle()))
                    .start();
                    let keeper = LeaseKeeper::new(
                        cfg.lease.ttl(),
                        cfg.lease.sweep_interval(),
                        clock,
                        store.clone(),
                        InstanceRegistry::new(devs),
                        ctrs,
                        cfg.node_id.clone(),
                        member,
                    )
                    .with_tenants(keeper_tenants);
                    let keeper = match verbs_side {
                        Some((refusal, routing)) => keeper.with_verbs(refusal, routing),
                        None => keeper,
                    }
                    .start();
                    let _ = tx.send((keeper, store, actix::System::current(), nics));
                });
                let _ = sys.run();
            })
            .map_err(|_| NodeError::Stopped {
                what: "could not start the actor thread",
            })?;
        let (keeper, store, system, nics) = rx.recv().map_err(|_| NodeError::Stopped {
            what: "actor system failed to start",
        })?;
        let nics = match nics {
            Ok(n) => n,
            Err(e) => {
                system.stop();
                let _ = thread.join();
                return Err(NodeError::bad(format!("starting the nic actors: {e}")));
            }
        };
        if let Some(c) = &cluster {
            // On the actor thread: what the data side starts with actix (its NIC workers)
            // joins this node's System.
            let joined = {
                let store: Arc<dyn PinService> = Arc::new(store.clone());
                let (c, id) = (Arc::clone(c), config.node_id.clone());
                crate::nic::run_on_system(&system, move || c.join(&id, store, memory)).unwrap_or(
                    Err(crate::peer::LinkError::Stopped {
                        what: "the actor system stopped during start",
                    }),
                )
            };
            if let Err(e) = joined {
                system.stop();
                let _ = thread.join();
                return Err(e.into());
            }
            if let Some(side) = nics.as_ref().and_then(|n| n.verbs_side()) {
                c.attach_verbs(side);
            }
        }
        tracing::info!(
            node = %config.node_id,
            slots = config.pool.size.0.checked_div(config.pool.slot_bytes.0).unwrap_or(0),
            slot_bytes = config.pool.slot_bytes.0,
            devices = devices.len(),
            in_cluster = cluster.is_some(),
            "node started"
        );
        Ok(Self {
            inner: Arc::new(Inner {
                keeper,
                store,
                devices,
                counters,
                config,
                system,
                thread: Mutex::new(Some(thread)),
                actors_alive,
                cluster,
                pool_region,
                nics,
                events,
                publisher,
                engine: Mutex::new(None),
                tls: Mutex::new(None),
                tenants,
                _registrations: registrations,
            }),
        })
    }

    pub fn config(&self) -> &NodeConfig {
        &self.inner.config
    }

    pub fn device(&self, ordinal: u32) -> Option<Arc<dyn Device>> {
        self.inner.devices.get(ordinal as usize).cloned()
    }

    pub fn devices(&self) -> &[Arc<dyn Device>] {
        &self.inner.devices
    }

    /// Registers one TP rank's GPU KV; returns the instance's namespace.
    pub async fn register_instance(&self, req: RegisterInstance) -> Result<Namespace, NodeError> {
        self.register_instance_with(req, Vec::new()).await
    }

    /// Registers one TP rank whose KV lies in `memory` (clients' memfds mapped as device
    /// memory, imported DMA-BUFs or CUDA IPC allocations, one per region): the registration
    /// keeps them alive until the rank is unregistered and the last transfer using it has
    /// drained.
    pub async fn register_instance_with(
        &self,
        req: RegisterInstance,
        memory: Vec<registry::Memory>,
    ) -> Result<Namespace, NodeError> {
        self.inner
            .keeper
            .send(registry::Register(req, memory))
            .await?
    }

    /// Checks that `instance` (and `rank` of it, if given) is registered.
    pub async fn check_registered(
        &self,
        instance: &InstanceId,
        rank: Option<u32>,
    ) -> Result<(), NodeError> {
        match rank {
            Some(rank) => {
                self.rank(instance.clone(), rank).await?;
            }
            None => {
                self.inner
                    .keeper
                    .send(registry::GetInstance(instance.clone()))
                    .await??;
            }
        }
        Ok(())
    }

    /// What the node counts (the engine service adds what it decides itself).
    pub(crate) fn counters(&self) -> &Counters {
        &self.inner.counters
    }

    /// Whether this node reads remote suffixes from peers (direct loads need them).
    pub fn has_peers(&self) -> bool {
        self.inner.cluster.is_some()
    }

    /// Unregisters an instance: no new load can start, its leases are released, and this
    /// returns once every transfer using it has drained. Replies with the leases released.
    pub async fn unregister_instance(&self, instance: InstanceId) -> Result<usize, NodeError> {
        let drains = self
            .inner
            .keeper
            .send(registry::Unregister(instance.clone()))
            .await??;
        let released = self.inner.keeper.send(ReleaseInstance(instance)).await?;
        for d in drains {
            // An error means the sender dropped: drained all the same.
            let _ = d.await;
        }
        Ok(released)
    }

    /// The handle of a registered rank (`NotFound` if there is none).
    async fn rank(&self, instance: InstanceId, rank: u32) -> Result<Arc<RankHandle>, NodeError> {
        self.inner.keeper.send(GetRank { instance, rank }).await?
    }

    /// Puts one rank's bytes of whole blocks from host memory. With `ssd.write-through`,
    /// answered once the blocks it sealed are on disk ([`NodeError::NotDurable`] if not).
    pub async fn put_blocks(&self, req: PutBlocks) -> Result<StoreReport, NodeError> {
        self.put_blocks_fenced(req, None).await
    }

    /// [`Self::put_blocks`], refused with [`NodeError::DeadlinePassed`] (nothing written)
    /// if it reaches the store after `fence`.
    pub async fn put_blocks_fenced(
        &self,
        req: PutBlocks,
        fence: Option<Fence>,
    ) -> Result<StoreReport, NodeError> {
        let handle = self.rank(req.instance, req.rank).await?;
        Ok(self
            .inner
            .store
            .send(store::Put {
                namespace: handle.namespace.clone(),
                shape: handle.shape,
                rank: handle.rank,
                blocks: req.blocks,
                fence,
            })
            .await??)
    }

    /// Saves one rank's device KV blocks into host blocks. With `ssd.write-through`,
    /// answered once the blocks it sealed are on disk ([`NodeError::NotDurable`] if not).
    pub async fn save(&self, req: SaveRequest) -> Result<StoreReport, NodeError> {
        self.save_fenced(req, None).await
    }

    /// [`Self::save`] whose copies are sealed only if they completed before `fence` (the
    /// moment the client gives up, see [`crate::fence`]); past it the copied blocks are
    /// discarded and the answer is [`NodeError::DeadlinePassed`].
    pub async fn save_fenced(
        &self,
        req: SaveRequest,
        fence: Option<Fence>,
    ) -> Result<StoreReport, NodeError> {
        let handle = self.rank(req.instance, req.rank).await?;
        let namespace = self
            .inner
            .tenants
            .namespace(&handle.namespace, req.tenant.as_deref())?;
        let args = crate::load::save::SaveArgs {
            namespace,
            handle,
            hashes: req.hashes,
            src_blocks: req.src_blocks,
            fence,
        };
        crate::load::save::save(&self.inner.store, &self.inner.counters, args).await
    }

    /// Looks up a prompt's blocks and leases the hit.
    pub async fn query(&self, req: QueryRequest) -> Result<QueryResponse, NodeError> {
        self.query_fenced(req, None).await
    }

    /// [`Self::query`] that leases nothing once `fence` has passed (the pins it took are
    /// released and the answer is [`NodeError::DeadlinePassed`]).
    pub async fn query_fenced(
        &self,
        req: QueryRequest,
        fence: Option<Fence>,
    ) -> Result<QueryResponse, NodeError> {
        self.inner.keeper.send(Query(req, fence)).await?
    }

    /// Starts a load and returns once it is accepted; the receiver yields its report.
    pub async fn start_load(&self, req: LoadRequest) -> Result<keeper::ReportRx, NodeError> {
        self.inner.keeper.send(Load(req, None, None)).await?
    }

    /// [`Self::start_load`], with `observer` told as the load's layers land (in layer order;
    /// all at once where the plan copies a block in one piece or a remote suffix is read).
    pub async fn start_load_observed(
        &self,
        req: LoadRequest,
        observer: Arc<dyn LoadObserver>,
    ) -> Result<keeper::ReportRx, NodeError> {
        self.start_load_fenced(req, observer, None).await
    }

    /// [`Self::start_load_observed`], refused with [`NodeError::DeadlinePassed`] (nothing
    /// consumed, nothing written) if the keeper gets to it after `fence`.
    pub async fn start_load_fenced(
        &self,
        req: LoadRequest,
        observer: Arc<dyn LoadObserver>,
        fence: Option<Fence>,
    ) -> Result<keeper::ReportRx, NodeError> {
        self.inner
            .keeper
            .send(Load(req, Some(observer), fence))
            .await?
    }

    /// Loads one rank's share and waits for the transfer to finish.
    pub async fn load(&self, req: LoadRequest) -> Result<TransferReport, NodeError> {
        let rx = self.start_load(req).await?;
        rx.await
            .map_err(|_| NodeError::Stopped { what: "transfer" })?
    }

    /// Releases a lease whatever its ranks still owe.
    pub async fn release(&self, lease: LeaseId) -> Result<(), NodeError> {
        self.inner.keeper.send(Release(lease)).await?
    }

    /// Expires due leases now (the sweeper does so periodically); returns how many.
    pub async fn sweep(&self) -> Result<usize, NodeError> {
        Ok(self.inner.keeper.send(Sweep).await?)
    }

    pub async fn stats(&self) -> Result<Stats, NodeError> {
        use std::sync::atomic::Ordering::Relaxed;
        let (leases_live, leases_expired) = self.inner.keeper.send(LeaseStats).await?;
        let cache = self.inner.store.send(GetCacheStats).await?;
        let instances = self.inner.keeper.send(CountInstances).await?;
        let c = &self.inner.counters;
        Ok(Stats {
            leases_live,
            leases_expired,
            blocks: cache.blocks,
            sealed_blocks: cache.sealed,
            pinned_blocks: cache.pinned_blocks,
            pins: cache.pins,
            pool_slots: cache.capacity,
            evictions: cache.evictions,
            instances,
            transfers_in_flight: c.transfers_in_flight.load(Relaxed),
            loads_ok: c.loads_ok.load(Relaxed),
            loads_failed: c.loads_failed.load(Relaxed),
            bytes_loaded: c.bytes_loaded.load(Relaxed),
        })
    }

    /// Shows `probe`'s engine gauges in this node's scrapes while it lives (the engine
    /// service calls it when it starts serving).
    pub fn attach_engine(&self, probe: std::sync::Weak<dyn crate::metrics::EngineProbe>) {
        if let Ok(mut e) = self.inner.engine.lock() {
            *e = Some(probe);
        }
    }

    /// Shows the TLS counters of `stats` (failed handshakes, reloads) in this node's scrapes.
    pub fn attach_tls(&self, stats: Arc<crate::tls::TlsStats>) {
        if let Ok(mut t) = self.inner.tls.lock() {
            *t = Some(stats);
        }
    }

    /// Whether an engine service's gauges are attached (it has started serving).
    pub fn engine_attached(&self) -> bool {
        self.inner
            .engine
            .lock()
            .ok()
            .is_some_and(|e| e.as_ref().is_some_and(|w| w.strong_count() > 0))
    }

    /// Everything an operator scrapes, in the Prometheus text format.
    pub async fn metrics_text(&self) -> Result<String, NodeError> {
        let stats = self.stats().await?;
        let mut sampled: Vec<Box<dyn crate::metrics::Sampled>> = Vec::new();
        if let Some(c) = &self.inner.cluster {
            sampled.push(Box::new(c.directory().stats()));
            if let Some(r) = c.data_rejections(&self.inner.config.node_id) {
                sampled.push(Box::new(crate::peer::cluster::DataRejections(r)));
            }
        }
        if let Some(n) = &self.inner.nics {
            sampled.push(Box::new(n.runtime.metrics().await));
        }
        if let Some(s) = self.ssd_stats().await? {
            sampled.push(Box::new(s));
        }
        let usage = self.inner.store.send(store::GetNamespaceUsage).await?;
        sampled.push(Box::new(self.inner.counters.namespace_usage(&usage)));
        if let Some(usage) = self.inner.store.send(store::GetSsdNamespaceUsage).await? {
            sampled.push(Box::new(self.inner.counters.namespace_ssd_usage(&usage)));
        }
        if let Some(t) = self.inner.tls.lock().ok().and_then(|t| t.clone()) {
            sampled.push(Box::new(t.sample()));
        }
        if let Some(ev) = &self.inner.events {
            sampled.push(Box::new(ev.stats().totals()));
        }
        let extra = crate::metrics::Extra {
            peer_pins: self.peer_pins().await?,
            engine: self
                .inner
                .engine
                .lock()
                .ok()
                .and_then(|e| e.as_ref().and_then(std::sync::Weak::upgrade))
                .map(|p| p.engine_gauges()),
            sampled,
        };
        Ok(crate::metrics::render(&stats, &self.inner.counters, extra))
    }

    /// The `[[nic]]` actors and the host pool's registration on them (none without `[[nic]]`
    /// config).
    pub fn nics(&self) -> Option<&crate::nic::NodeNics> {
        self.inner.nics.as_ref()
    }

    /// Live pins this node holds for peers.
    pub async fn peer_pins(&self) -> Result<usize, NodeError> {
        Ok(self.inner.store.send(store::PeerPinCount).await?)
    }

    /// Expires due peer pins now (the store sweeps every second); returns how many.
    pub async fn sweep_peer_pins(&self) -> Result<usize, NodeError> {
        Ok(self.inner.store.send(store::SweepPeerPins).await?)
    }

    /// The longest prefix of `hashes` each node holds, longest first: the directory's view
    /// where this node has peers (it advertises itself there too), else this node's RAM and
    /// SSD tier.
    pub async fn lookup(
        &self,
        ns: &crate::model::Namespace,
        hashes: &[crate::model::BlockHash],
    ) -> Result<Vec<(String, usize)>, NodeError> {
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(c) = &self.inner.cluster {
            let owners = c.directory().owners(ns, hashes, "").await;
            return Ok(crate::peer::directory::prefix_per_node(&owners));
        }
        let n = self
            .inner
            .store
            .send(store::PrefixLen {
                namespace: ns.clone(),
                hashes: hashes.to_vec(),
            })
            .await?;
        Ok(if n == 0 {
            Vec::new()
        } else {
            vec![(self.inner.config.node_id.clone(), n)]
        })
    }

    /// The node's KV event log, when `[events]` is configured.
    pub fn events(&self) -> Option<&Arc<crate::events::EventHub>> {
        self.inner.events.as_ref()
    }

    /// The PUB and ROUTER endpoints the event publisher bound (ports resolved).
    pub fn event_endpoints(&self) -> Option<(&str, Option<&str>)> {
        self.inner
            .publisher
            .as_ref()
            .map(|p| (p.publish_endpoint(), p.replay_endpoint()))
    }

    /// The SSD tier's counters and gauges; None without `[ssd]`.
    pub async fn ssd_stats(&self) -> Result<Option<crate::tier::ssd::SsdStats>, NodeError> {
        Ok(self.inner.store.send(store::GetSsdStats).await?)
    }

    /// Waits until every SSD write and read queued so far is done.
    pub async fn ssd_sync(&self) -> Result<(), NodeError> {
        Ok(self.inner.store.send(store::SsdSync).await?)
    }

    /// Evicts every unpinned fetched copy; returns how many.
    pub async fn drop_reclaimable(&self) -> Result<usize, NodeError> {
        Ok(self.inner.store.send(store::DropReclaimable).await?)
    }

    /// Resolves when the actor thread has ended — after [`Node::shutdown`], or because the
    /// actor system stopped or its thread died. A service waits on it beside its shutdown
    /// signal, so a node without actors does not stay up answering UNAVAILABLE.
    pub async fn actors_stopped(&self) {
        let mut rx = self.inner.actors_alive.clone();
        while rx.changed().await.is_ok() {}
    }

    /// The actor system's arbiter; the `kvferry` binary's crash tests run a panicking task
    /// on it.
    #[doc(hidden)]
    pub fn actor_arbiter(&self) -> actix::ArbiterHandle {
        self.inner.system.arbiter().clone()
    }

    /// Stops the actor system and waits for its thread.
    pub fn shutdown(&self) {
        self.inner.stop();
    }
}

impl Inner {
    fn stop(&self) {
        if let Some(c) = &self.cluster {
            c.leave(&self.config.node_id);
        }
        self.system.stop();
        let t = self.thread.lock().ok().and_then(|mut g| g.take());
        if let Some(t) = t {
            // Once per node: a later stop (the last handle dropping) finds no thread.
            tracing::info!(node = %self.config.node_id, "node stopping: its actors end");
            if std::thread::current().id() != t.thread().id() {
                let _ = t.join();
            }
            tracing::info!(node = %self.config.node_id, "node stopped");
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Node {
    /// What the owner side of `kvferry.v1.Peer` needs from this node (store, id, pool, peer
    /// pin TTL). Whoever serves the pool's data path adds it with
    /// [`crate::peer::PeerBackend::with_endpoint`].
    pub fn peer_backend(&self) -> crate::peer::PeerBackend {
        let i = &self.inner;
        let backend = crate::peer::PeerBackend::new(
            Arc::new(i.store.clone()),
            i.config.node_id.clone(),
            i.pool_region,
            i.config.pool.slot_bytes.0,
            i.config.lease.peer_pin_ttl(),
        );
        // Verbs handshakes are answered where the pool is registered on an open RDMA NIC.
        match i.nics.as_ref().and_then(|n| n.responder.clone()) {
            Some(r) => backend.with_verbs(r),
            None => backend,
        }
    }
}

/// Peers pin through the store's mailbox. Each message is sent when its future is first
/// polled, as the peer side's callers expect of a lazy future.
impl PinService for Addr<BlockStore> {
    fn pin(
        &self,
        namespace: Namespace,
        hashes: Vec<BlockHash>,
    ) -> BoxFut<Result<PinnedRemote, PinServiceError>> {
        let store = self.clone();
        Box::pin(async move {
            store
                .send(store::PinForPeer { namespace, hashes })
                .await
                .map_err(|_| PinServiceError::PinStopped)
        })
    }

    fn unpin(&self, pin_id: u64) -> BoxFut<Result<(), PinServiceError>> {
        let store = self.clone();
        Box::pin(async move {
            store
                .send(store::UnpinForPeer(pin_id))
                .await
                .map_err(|_| PinServiceError::UnpinStopped { pin_id })
        })
    }

    fn unpin_detached(&self, pin_id: u64) {
        self.do_send(store::UnpinForPeer(pin_id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A service waits on `actors_stopped` beside its shutdown signal: it resolves once the
    /// actor thread has ended, and not before.
    #[test]
    fn actors_stopped_resolves_when_the_actor_thread_ends() {
        let mut cfg = NodeConfig::default();
        cfg.device.kind = "host".into();
        cfg.pool.size = crate::config::ByteSize(4 << 20);
        let node = Node::start(cfg).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let early =
                tokio::time::timeout(std::time::Duration::from_millis(50), node.actors_stopped())
                    .await;
            assert!(early.is_err(), "resolved while the actors run");
            node.shutdown();
            tokio::time::timeout(std::time::Duration::from_secs(5), node.actors_stopped())
                .await
                .expect("the actor thread ended");
        });
    }
}
