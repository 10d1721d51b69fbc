//! The NIC actors: one `Arbiter` per NIC for its worker and one for the MR registry. In a node
//! they are Arbiters of the node's actix `System` (the node runs one System); started where no
//! System is current (tests, embedders without actix) they get a System of their own on a
//! named thread. `Addr`s are `Send + Sync`, so callers on any runtime send to them.

use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use actix::{Actor, Addr, Arbiter, System};
use kvferry_transport::verbs::{open_nic, RdmaNic, Sysfs};
use kvferry_transport::{
    Access, ConfigError, HostRegion, MrKey, MrTable, NicConfig, NicId, ProviderKind,
};
use thiserror::Error;

use crate::nic::config::{validate_node_nics, NicSection, VerbsSection};
use crate::nic::gate::verbs_refusal;
use crate::nic::metrics::NicMetrics;
use crate::nic::mr_registry::{
    GetRegistryCounts, MrRegistry, RdmaSlot, RegionHandles, RegionSpec, Registry, RegistryError,
};
use crate::nic::responder::{NicResponder, ServingNic};
use crate::nic::stripe::NicRouting;
use crate::nic::worker::{Gauges, NicWorker, WorkerError};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RuntimeError {
    #[error("starting the nic system thread failed")]
    Thread(#[source] std::io::Error),
    #[error("the nic system thread ended during start")]
    Lost,
    #[error("nic {nic} could not start")]
    Worker {
        nic: String,
        #[source]
        source: Box<WorkerError>,
    },
    #[error("nic {nic}: {reason}")]
    Config { nic: String, reason: String },
    #[error("nic {nic}: invalid settings")]
    Nic {
        nic: String,
        #[source]
        source: ConfigError,
    },
}

struct Started {
    registry: Addr<MrRegistry>,
    workers: Vec<Addr<NicWorker>>,
    arbiters: Vec<Arbiter>,
}

/// Where the NIC arbiters live.
enum Host {
    /// In the System that was current at start (the node's): stopping it stops them too.
    Shared,
    /// In a System of their own, on this thread.
    Own {
        system: System,
        thread: Option<JoinHandle<()>>,
    },
}

/// The running NIC actors. Dropping it stops every worker and the system, and joins the
/// system thread.
pub struct NicRuntime {
    pub registry: Addr<MrRegistry>,
    /// Index = NIC id.
    pub workers: Vec<Addr<NicWorker>>,
    /// Index = NIC id; the local MR table each worker checks destinations against.
    pub tables: Vec<MrTable>,
    /// Index = NIC id; the NICs' names (metrics labels).
    pub names: Vec<String>,
    /// Index = NIC id; each verbs NIC opened, or why it could not be.
    pub rdma: Vec<RdmaSlot>,
    host: Host,
    arbiters: Vec<Arbiter>,
}

impl std::fmt::Debug for NicRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NicRuntime")
            .field("nics", &self.workers.len())
            .finish()
    }
}

impl NicRuntime {
    /// NICs without RDMA devices (loopback, tcp, shm providers).
    pub fn start(nics: Vec<NicConfig>) -> Result<Self, RuntimeError> {
        let rdma = vec![RdmaSlot::None; nics.len()];
        Self::start_with_rdma(nics, rdma, u64::MAX)
    }

    /// Starts the actors with given RDMA slots (index = NIC id); host regions peers read are
    /// registered on open RDMA NICs in MRs of at most `chunk` bytes.
    pub fn start_with_rdma(
        nics: Vec<NicConfig>,
        rdma: Vec<RdmaSlot>,
        chunk: u64,
    ) -> Result<Self, RuntimeError> {
        Self::start_registered(nics, rdma, chunk, Vec::new()).map(|(rt, _)| rt)
    }

    /// As [`NicRuntime::start_with_rdma`], registering `initial` regions (the host pool)
    /// through the registry before its actor starts, so they are in place before any read;
    /// each registration's outcome comes back (failures are counted like any other).
    ///
    /// Called on a thread of an actix `System` (the node's), the actors run on new Arbiters
    /// of that System; elsewhere on a System of their own.
    pub fn start_registered(
        nics: Vec<NicConfig>,
        rdma: Vec<RdmaSlot>,
        chunk: u64,
        initial: Vec<RegionSpec>,
    ) -> Result<(Self, Vec<Result<RegionHandles, RegistryError>>), RuntimeError> {
        let (prepared, registered) = Self::prepare(nics, rdma, chunk, initial)?;
        Ok((prepared.start()?, registered))
    }

    /// The part of [`NicRuntime::start_registered`] that starts no actor: checks the NICs and
    /// registers `initial` (which may take long: pinning a pool of gigabytes). Start the
    /// actors with [`PreparedRuntime::start`] on the thread of the System they should join.
    pub fn prepare(
        nics: Vec<NicConfig>,
        rdma: Vec<RdmaSlot>,
        chunk: u64,
        initial: Vec<RegionSpec>,
    ) -> Result<(PreparedRuntime, Vec<Result<RegionHandles, RegistryError>>), RuntimeError> {
        for n in &nics {
            n.validate().map_err(|source| RuntimeError::Nic {
                nic: n.name.clone(),
                source,
            })?;
        }
        let tables: Vec<MrTable> = nics.iter().map(|_| MrTable::new()).collect();
        let names: Vec<String> = nics.iter().map(|n| n.name.clone()).collect();
        let mut registry = Registry::with_nics(tables.clone(), names.clone(), rdma.clone(), chunk);
        let registered: Vec<_> = initial.into_iter().map(|s| registry.register(s)).collect();
        Ok((
            PreparedRuntime {
                nics,
                rdma,
                tables,
                names,
                registry,
            },
            registered,
        ))
    }
}

/// NICs checked and initial regions registered; no actor started yet.
pub struct PreparedRuntime {
    nics: Vec<NicConfig>,
    rdma: Vec<RdmaSlot>,
    tables: Vec<MrTable>,
    names: Vec<String>,
    registry: Registry,
}

impl std::fmt::Debug for PreparedRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedRuntime")
            .field("nics", &self.names)
            .finish()
    }
}

impl PreparedRuntime {
    /// Starts the actors: on a thread of an actix `System` (the node's), on new Arbiters of
    /// that System; elsewhere on a System of their own, on a named thread.
    pub fn start(self) -> Result<NicRuntime, RuntimeError> {
        let PreparedRuntime {
            nics,
            rdma,
            tables,
            names,
            registry,
        } = self;
        if System::try_current().is_some() {
            let started = start_actors(nics, tables.clone(), &rdma, registry)?;
            return Ok(NicRuntime {
                registry: started.registry,
                workers: started.workers,
                tables,
                names,
                rdma,
                host: Host::Shared,
                arbiters: started.arbiters,
            });
        }
        let tables_for_system = tables.clone();
        let rdma_for_system = rdma.clone();
        let (tx, rx) = mpsc::channel::<Result<(Started, System), RuntimeError>>();
        let thread = std::thread::Builder::new()
            .name("kvf-nic-system".into())
            .spawn(move || {
                let sys = System::new();
                sys.block_on(async move {
                    let started = start_actors(nics, tables_for_system, &rdma_for_system, registry)
                        .map(|s| (s, System::current()));
                    let _ = tx.send(started);
                });
                // Returns once `System::stop` is called.
                let _ = sys.run();
            })
            .map_err(RuntimeError::Thread)?;
        let (started, system) = match rx.recv() {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(RuntimeError::Lost);
            }
        };
        Ok(NicRuntime {
            registry: started.registry,
            workers: started.workers,
            tables,
            names,
            rdma,
            host: Host::Own {
                system,
                thread: Some(thread),
            },
            arbiters: started.arbiters,
        })
    }
}

/// Runs `f` on the main thread of `system` and waits for its result (`None` if the System
/// is gone). What `f` starts with actix (a data side's NIC workers) joins that System.
/// Never call it from that thread itself.
pub fn run_on_system<T: Send + 'static>(
    system: &System,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    let sent = system.arbiter().spawn_fn(move || {
        let _ = tx.send(f());
    });
    if !sent {
        return None;
    }
    rx.recv().ok()
}

impl NicRuntime {
    /// Registration counts and every worker's QP states and completion errors.
    pub async fn metrics(&self) -> NicMetrics {
        let registry = self
            .registry
            .send(GetRegistryCounts)
            .await
            .unwrap_or_default();
        let mut workers = Vec::with_capacity(self.workers.len());
        for (name, w) in self.names.iter().zip(&self.workers) {
            if let Ok(g) = w.send(Gauges).await {
                workers.push((name.clone(), g));
            }
        }
        NicMetrics { registry, workers }
    }

    /// The first verbs NIC's refusal reason, if any verbs NIC could not be opened.
    pub fn rdma_refusal(&self) -> Option<String> {
        self.rdma.iter().find_map(|s| match s {
            RdmaSlot::Unavailable { reason } => Some(reason.clone()),
            _ => None,
        })
    }
}

fn start_actors(
    nics: Vec<NicConfig>,
    tables: Vec<MrTable>,
    rdma: &[RdmaSlot],
    registry: Registry,
) -> Result<Started, RuntimeError> {
    let mut workers = Vec::with_capacity(nics.len());
    let mut arbiters: Vec<Arbiter> = Vec::with_capacity(nics.len() + 1);
    for (i, (cfg, table)) in nics.into_iter().zip(tables).enumerate() {
        let nic = NicId(u16::try_from(i).unwrap_or(u16::MAX));
        let name = cfg.name.clone();
        let cq_depth = cq_depth(&cfg, rdma.get(i).unwrap_or(&RdmaSlot::None));
        let worker = match NicWorker::new(nic, cfg, table, cq_depth) {
            Ok(w) => w,
            Err(source) => {
                // Arbiters of a shared System would otherwise outlive the failed start.
                for a in arbiters {
                    a.stop();
                }
                return Err(RuntimeError::Worker {
                    nic: name,
                    source: Box::new(source),
                });
            }
        };
        let arbiter = Arbiter::new();
        workers.push(NicWorker::start_in_arbiter(&arbiter.handle(), move |_| {
            worker
        }));
        arbiters.push(arbiter);
    }
    // Registrations may take long (pinning gigabytes): not on a worker's or the node's thread.
    let arbiter = Arbiter::new();
    let registry = MrRegistry::start_in_arbiter(&arbiter.handle(), move |_| {
        MrRegistry::with_registry(registry)
    });
    arbiters.push(arbiter);
    Ok(Started {
        registry,
        workers,
        arbiters,
    })
}

impl Drop for NicRuntime {
    fn drop(&mut self) {
        for a in &self.arbiters {
            a.stop();
        }
        for a in self.arbiters.drain(..) {
            let _ = a.join();
        }
        if let Host::Own { system, thread } = &mut self.host {
            system.stop();
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// The NIC side of a node with `[[nic]]` config: the runtime, the host pool's registration on
/// every NIC (or why it failed: counted, and the node runs on without it), the `direct_gpu`
/// refusal when the config asks for verbs and verbs cannot serve, and the NIC routing of
/// direct remote loads when it can.
pub struct NodeNics {
    pub runtime: NicRuntime,
    pub pool: Result<RegionHandles, RegistryError>,
    pub direct_refusal: Option<String>,
    pub routing: Option<Arc<NicRouting>>,
    /// The owner side of verbs handshakes: the open RDMA NICs the pool is registered on.
    pub responder: Option<Arc<NicResponder>>,
    /// Index = NIC id.
    configs: Vec<NicConfig>,
}

impl std::fmt::Debug for NodeNics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeNics")
            .field("runtime", &self.runtime)
            .field("pool", &self.pool)
            .field("direct_refusal", &self.direct_refusal)
            .field("responder", &self.responder)
            .finish()
    }
}

/// What a node reads peers with over one of its RDMA NICs.
#[derive(Clone)]
pub struct VerbsNicSide {
    pub name: String,
    pub nic: Arc<dyn RdmaNic>,
    pub worker: Addr<NicWorker>,
    /// The NIC's MR table, which destinations are checked against.
    pub table: MrTable,
    /// The host pool's key in that table (staged reads land in pool slots).
    pub pool_lkey: MrKey,
    pub max_sge: usize,
    /// QPs opened to each peer (`qps-per-peer`).
    pub qps: usize,
}

/// Every RDMA NIC a node reads peers with (at least one).
#[derive(Clone)]
pub struct VerbsSide {
    pub nics: Vec<VerbsNicSide>,
}

impl std::fmt::Debug for VerbsSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.nics.iter().map(|n| n.name.as_str()).collect();
        f.debug_struct("VerbsSide").field("nics", &names).finish()
    }
}

/// QPs each verbs NIC's completion queue is sized for (times its `max-send-wr`).
const CQ_QPS: u32 = 64;

/// The entries of a NIC's completion queue: what a verbs NIC's CQ really has (the device
/// clamps what `open_nic` asks for to its `max_cqe`), and `max-send-wr × 64` for the other
/// providers, whose queue is the worker's own. The worker admits reads so that the QPs never
/// owe more completions than this.
fn cq_depth(nic: &NicConfig, rdma: &RdmaSlot) -> usize {
    let asked = (nic.max_send_wr as usize).saturating_mul(CQ_QPS as usize);
    match rdma {
        RdmaSlot::Open(n) => n
            .limits()
            .map_or(asked, |l| asked.min(l.cq_entries as usize)),
        _ => asked,
    }
}

/// A node's NICs opened and its pool registered on them, the actors not started yet: what
/// the node decides before its actors exist (the `direct_gpu` refusal, the routing), and
/// [`PreparedNics::start`] to run on the node's System thread.
pub struct PreparedNics {
    runtime: PreparedRuntime,
    pub pool: Result<RegionHandles, RegistryError>,
    pub direct_refusal: Option<String>,
    pub routing: Option<Arc<NicRouting>>,
    configs: Vec<NicConfig>,
}

impl std::fmt::Debug for PreparedNics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedNics")
            .field("runtime", &self.runtime)
            .field("pool", &self.pool)
            .field("direct_refusal", &self.direct_refusal)
            .finish()
    }
}

impl PreparedNics {
    /// Starts the NIC actors (on Arbiters of the current System, where there is one).
    pub fn start(self) -> Result<NodeNics, RuntimeError> {
        let runtime = self.runtime.start()?;
        let mut nics = NodeNics {
            runtime,
            pool: self.pool,
            direct_refusal: self.direct_refusal,
            routing: self.routing,
            responder: None,
            configs: self.configs,
        };
        nics.responder = nics.serving().and_then(NicResponder::new).map(Arc::new);
        Ok(nics)
    }
}

impl NodeNics {
    /// Starts the NIC actors of `nics` (none: `Ok(None)`) and registers `pool` on every NIC
    /// for remote read (and local write, for staged reads into it).
    pub fn start(
        nics: &[NicSection],
        verbs: Option<&VerbsSection>,
        pool: Arc<HostRegion>,
    ) -> Result<Option<Self>, RuntimeError> {
        Self::prepare(nics, verbs, pool)?
            .map(PreparedNics::start)
            .transpose()
    }

    /// Opens the NICs of `nics` (none: `Ok(None)`) and registers `pool` on every NIC; starts
    /// no actor.
    pub fn prepare(
        nics: &[NicSection],
        verbs: Option<&VerbsSection>,
        pool: Arc<HostRegion>,
    ) -> Result<Option<PreparedNics>, RuntimeError> {
        if nics.is_empty() {
            return Ok(None);
        }
        let (cfgs, verbs_cfg) =
            validate_node_nics(nics, verbs).map_err(|(key, reason)| RuntimeError::Config {
                nic: key.to_string(),
                reason,
            })?;
        let section = verbs.cloned().unwrap_or_default();
        let sysfs = Sysfs::new(&section.sysfs_root);
        let verbs_names: Vec<String> = cfgs
            .iter()
            .filter(|c| c.provider == ProviderKind::Verbs)
            .map(|c| c.name.clone())
            .collect();
        let rdma: Vec<RdmaSlot> = cfgs
            .iter()
            .map(|n| match n.provider {
                ProviderKind::Verbs => match open_nic(&sysfs, n.clone(), verbs_cfg.clone(), CQ_QPS)
                {
                    Ok(dev) => RdmaSlot::Open(dev),
                    Err(e) => RdmaSlot::Unavailable {
                        reason: e.to_string(),
                    },
                },
                _ => RdmaSlot::None,
            })
            .collect();
        let open_failures: Vec<(String, String)> = cfgs
            .iter()
            .zip(&rdma)
            .filter_map(|(c, s)| match s {
                RdmaSlot::Unavailable { reason } => Some((c.name.clone(), reason.clone())),
                _ => None,
            })
            .collect();
        let cap = kvferry_transport::verbs::probe(&sysfs);
        // A routing that cannot be built (a `gpu-pci` sysfs does not know) refuses direct
        // loads over verbs like a missing device would: never a silent fallback.
        let (direct_refusal, routing) = match verbs_refusal(&verbs_names, &cap, &open_failures) {
            Some(r) => (Some(r), None),
            None if verbs_names.is_empty() => (None, None),
            None => match NicRouting::discover(
                &sysfs,
                &verbs_names,
                &section.gpu_pci,
                verbs_cfg.clone(),
            ) {
                Ok(r) => (None, Some(Arc::new(r))),
                Err(e) => (
                    Some(format!(
                        "direct GPU loads over verbs are unavailable on this node: {e}"
                    )),
                    None,
                ),
            },
        };
        let spec = RegionSpec::Host {
            region: pool,
            access: Access::LOCAL_WRITE.union(Access::REMOTE_READ),
        };
        let (runtime, mut registered) =
            NicRuntime::prepare(cfgs.clone(), rdma, verbs_cfg.registration_chunk, vec![spec])?;
        let pool = registered
            .pop()
            .unwrap_or(Err(RegistryError::BadRange { addr: 0, len: 0 }));
        Ok(Some(PreparedNics {
            runtime,
            pool,
            direct_refusal,
            routing,
            configs: cfgs,
        }))
    }

    /// `(NIC id, device)` of every open RDMA NIC, when the pool is registered on them.
    fn open_rdma(&self) -> Vec<(usize, Arc<dyn kvferry_transport::verbs::RdmaNic>)> {
        if self.pool.is_err() {
            return Vec::new();
        }
        self.runtime
            .rdma
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                RdmaSlot::Open(n) => Some((i, Arc::clone(n))),
                _ => None,
            })
            .collect()
    }

    fn serving(&self) -> Option<Vec<ServingNic>> {
        let pool = self.pool.as_ref().ok()?;
        let nics = self
            .open_rdma()
            .into_iter()
            .filter_map(|(i, nic)| {
                let mr = pool.rdma(NicId(u16::try_from(i).ok()?))?;
                let depth = self.configs.get(i).map_or(16, |c| c.max_rd_atomic);
                Some(ServingNic {
                    nic,
                    regions: mr
                        .advertised()
                        .into_iter()
                        .map(|(c, k)| (c, k.rkey))
                        .collect(),
                    responder_depth: u8::try_from(depth).unwrap_or(u8::MAX),
                })
            })
            .collect();
        Some(nics)
    }

    /// What this node reads peers with over verbs; `None` without an open RDMA NIC holding
    /// the pool.
    pub fn verbs_side(&self) -> Option<VerbsSide> {
        let pool = self.pool.as_ref().ok()?;
        let nics: Vec<VerbsNicSide> = self
            .open_rdma()
            .into_iter()
            .filter_map(|(i, nic)| {
                let id = NicId(u16::try_from(i).ok()?);
                Some(VerbsNicSide {
                    name: self.runtime.names.get(i)?.clone(),
                    nic,
                    worker: self.runtime.workers.get(i)?.clone(),
                    table: self.runtime.tables.get(i)?.clone(),
                    pool_lkey: pool.key(id)?,
                    max_sge: self.configs.get(i).map_or(1, |c| c.max_sge as usize),
                    qps: self.configs.get(i).map_or(1, |c| c.qps_per_peer as usize),
                })
            })
            .collect();
        (!nics.is_empty()).then_some(VerbsSide { nics })
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::config::NodeConfig;

    /// The node runs one actix System: its NIC workers are Arbiters of it, so stopping the
    /// node's System stops them (a System of their own would keep them running).
    #[test]
    fn nic_workers_run_on_the_nodes_system() {
        let mut cfg = NodeConfig::default();
        cfg.device.kind = "host".into();
        cfg.pool.size = crate::config::ByteSize(4 << 20);
        cfg.nic = vec![NicSection {
            name: "lo0".into(),
            provider: "loopback".into(),
            ..NicSection::default()
        }];
        let node = crate::Node::start(cfg).unwrap();
        let nics = node.nics().expect("the [[nic]] actors run");
        let worker = nics.runtime.workers[0].clone();
        let registry = nics.runtime.registry.clone();
        assert!(matches!(nics.runtime.host, Host::Shared));
        assert!(worker.connected() && registry.connected());
        node.shutdown();
        let end = Instant::now() + Duration::from_secs(5);
        while (worker.connected() || registry.connected()) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            !worker.connected(),
            "the NIC worker outlived the node's System"
        );
        assert!(
            !registry.connected(),
            "the MR registry outlived the node's System"
        );
    }
}
