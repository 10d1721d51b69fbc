//! `MrRegistry`: registers each region on every NIC's [`MrTable`], hands out refcounted
//! [`RegionHandles`], coalesces registrations of the same allocation into one, and counts its
//! failures by kind.
//!
//! Deregistration is the tables' job: the registry keeps only a weak reference to the handles
//! it handed out, so when the last user drops its [`RegionHandles`] every per-NIC handle drops
//! and the table defers the actual removal until reads using the region have drained.
//!
//! Registration stays inline in the handler: for the loopback, tcp and shm providers an
//! [`MrTable`] registration is a map insert under a mutex, with no pinning or kernel call. The
//! verbs provider's `ibv_reg_mr` would block and belongs on a `SyncArbiter`; that provider is
//! not wired here yet.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use actix::{Actor, Context, Handler, Message, MessageResult};
use kvferry_transport::{
    Access, DeviceSink, HostRegion, MrError, MrGauges, MrHandle, MrKey, MrKind, MrTable, NicId,
};
use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegistryError {
    #[error("region {addr:#x}+{len} is empty or wraps")]
    BadRange { addr: u64, len: u64 },
    #[error("region {addr:#x}+{len} is already registered with different access")]
    Conflict { addr: u64, len: u64 },
    #[error("device region {addr:#x}+{len} cannot be remotely readable")]
    DeviceRemoteRead { addr: u64, len: u64 },
    #[error("registering region {addr:#x}+{len} on nic {nic} failed")]
    Table {
        nic: u16,
        addr: u64,
        len: u64,
        #[source]
        source: MrError,
    },
}

/// Failures by kind since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegistryFailures {
    pub bad_range: u64,
    pub conflict: u64,
    pub device_remote_read: u64,
    pub table: u64,
}

impl RegistryFailures {
    pub fn total(&self) -> u64 {
        self.bad_range + self.conflict + self.device_remote_read + self.table
    }

    fn count(&mut self, e: &RegistryError) {
        match e {
            RegistryError::BadRange { .. } => self.bad_range += 1,
            RegistryError::Conflict { .. } => self.conflict += 1,
            RegistryError::DeviceRemoteRead { .. } => self.device_remote_read += 1,
            RegistryError::Table { .. } => self.table += 1,
        }
    }
}

/// What to register.
#[derive(Clone)]
pub enum RegionSpec {
    Host {
        region: Arc<HostRegion>,
        access: Access,
    },
    /// Device memory written through `sink`; local write only (design rule 6).
    Device {
        base: u64,
        len: u64,
        sink: Arc<dyn DeviceSink>,
        access: Access,
    },
}

/// Identity of an allocation: registrations with the same identity are one registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionId {
    pub addr: u64,
    pub len: u64,
    pub kind: MrKind,
}

impl RegionSpec {
    pub fn id(&self) -> RegionId {
        match self {
            RegionSpec::Host { region, .. } => RegionId {
                addr: region.addr(),
                len: region.len() as u64,
                kind: MrKind::Host,
            },
            RegionSpec::Device { base, len, .. } => RegionId {
                addr: *base,
                len: *len,
                kind: MrKind::Device,
            },
        }
    }

    fn access(&self) -> Access {
        match self {
            RegionSpec::Host { access, .. } | RegionSpec::Device { access, .. } => *access,
        }
    }
}

struct Registered {
    id: RegionId,
    access: Access,
    /// Index = NIC id.
    handles: Vec<MrHandle>,
}

/// One registration on every NIC. Cloning shares it; dropping the last clone drops every
/// per-NIC handle (deregistration deferred by the tables until reads drain).
#[derive(Clone)]
pub struct RegionHandles(Arc<Registered>);

impl std::fmt::Debug for RegionHandles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionHandles")
            .field("id", &self.0.id)
            .field("keys", &self.keys())
            .finish()
    }
}

impl RegionHandles {
    pub fn id(&self) -> RegionId {
        self.0.id
    }

    pub fn handle(&self, nic: NicId) -> Option<&MrHandle> {
        self.0.handles.get(usize::from(nic.0))
    }

    /// The local (and, for host regions, remote) key on `nic`.
    pub fn key(&self, nic: NicId) -> Option<MrKey> {
        self.handle(nic).map(MrHandle::key)
    }

    pub fn keys(&self) -> Vec<MrKey> {
        self.0.handles.iter().map(MrHandle::key).collect()
    }

    /// Users of this registration (clones alive).
    pub fn users(&self) -> usize {
        Arc::strong_count(&self.0)
    }
}

/// The plain registry; [`MrRegistry`] drives it.
pub struct Registry {
    tables: Vec<MrTable>,
    live: HashMap<RegionId, Weak<Registered>>,
    failures: RegistryFailures,
    coalesced: u64,
}

impl Registry {
    /// `tables[i]` is NIC `i`'s table.
    pub fn new(tables: Vec<MrTable>) -> Self {
        Registry {
            tables,
            live: HashMap::new(),
            failures: RegistryFailures::default(),
            coalesced: 0,
        }
    }

    pub fn register(&mut self, spec: RegionSpec) -> Result<RegionHandles, RegistryError> {
        let r = self.try_register(spec);
        if let Err(e) = &r {
            self.failures.count(e);
        }
        r
    }

    fn try_register(&mut self, spec: RegionSpec) -> Result<RegionHandles, RegistryError> {
        let id = spec.id();
        let access = spec.access();
        let (addr, len) = (id.addr, id.len);
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(RegistryError::BadRange { addr, len });
        }
        if id.kind == MrKind::Device && access.contains(Access::REMOTE_READ) {
            return Err(RegistryError::DeviceRemoteRead { addr, len });
        }
        self.live.retain(|_, w| w.strong_count() > 0);
        if let Some(existing) = self.live.get(&id).and_then(Weak::upgrade) {
            if existing.access != access {
                return Err(RegistryError::Conflict { addr, len });
            }
            self.coalesced += 1;
            return Ok(RegionHandles(existing));
        }
        let mut handles = Vec::with_capacity(self.tables.len());
        for (nic, table) in self.tables.iter().enumerate() {
            let r = match &spec {
                RegionSpec::Host { region, access } => table.register_host(region.clone(), *access),
                RegionSpec::Device {
                    base, len, sink, ..
                } => table.register_device(*base, *len, sink.clone()),
            };
            // On failure the handles registered so far drop here, undoing the partial work.
            handles.push(r.map_err(|source| RegistryError::Table {
                nic: u16::try_from(nic).unwrap_or(u16::MAX),
                addr,
                len,
                source,
            })?);
        }
        let reg = Arc::new(Registered {
            id,
            access,
            handles,
        });
        self.live.insert(id, Arc::downgrade(&reg));
        Ok(RegionHandles(reg))
    }

    pub fn gauges(&self) -> RegistryGaugeValues {
        RegistryGaugeValues {
            per_nic: self.tables.iter().map(MrTable::gauges).collect(),
            live: self.live.values().filter(|w| w.strong_count() > 0).count(),
            coalesced: self.coalesced,
            failures: self.failures,
        }
    }
}

/// A snapshot of the registry and its tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegistryGaugeValues {
    /// Index = NIC id.
    pub per_nic: Vec<MrGauges>,
    /// Registrations with at least one user.
    pub live: usize,
    /// Registrations answered with an existing registration.
    pub coalesced: u64,
    pub failures: RegistryFailures,
}

/// The actor: a thin driver around [`Registry`].
pub struct MrRegistry {
    registry: Registry,
}

impl MrRegistry {
    pub fn new(tables: Vec<MrTable>) -> Self {
        MrRegistry {
            registry: Registry::new(tables),
        }
    }
}

impl Actor for MrRegistry {
    type Context = Context<Self>;
}

/// Registers a region on every NIC, or joins the live registration of the same allocation.
#[derive(Message)]
#[rtype(result = "Result<RegionHandles, RegistryError>")]
pub struct RegisterRegion {
    pub spec: RegionSpec,
}

impl Handler<RegisterRegion> for MrRegistry {
    type Result = Result<RegionHandles, RegistryError>;

    fn handle(&mut self, msg: RegisterRegion, _: &mut Context<Self>) -> Self::Result {
        self.registry.register(msg.spec)
    }
}

/// Per-NIC table gauges, live registrations and failures by kind.
#[derive(Message)]
#[rtype(result = "RegistryGaugeValues")]
pub struct RegistryGauges;

impl Handler<RegistryGauges> for MrRegistry {
    type Result = MessageResult<RegistryGauges>;

    fn handle(&mut self, _: RegistryGauges, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.registry.gauges())
    }
}
