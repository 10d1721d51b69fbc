//! `MrRegistry`: registers each region on every NIC's [`MrTable`], hands out refcounted
//! [`RegionHandles`], coalesces registrations of the same allocation into one, and counts its
//! failures by kind.
//!
//! Deregistration is the tables' job: the registry keeps only a weak reference to the handles
//! it handed out, so when the last user drops its [`RegionHandles`] every per-NIC handle drops
//! and the table defers the actual removal until reads using the region have drained.
//!
//! On a verbs NIC a host region peers may read (the pool) is also registered with the NIC
//! itself, split at the configured size ([`register_host_split`]); a verbs NIC that could not
//! be opened fails such registrations with its reason. Registrations and failures are
//! counted by NIC, kind (host/device) and failure reason for metrics.
//!
//! Registration stays inline in the handler: for the loopback, tcp and shm providers an
//! [`MrTable`] registration is a map insert under a mutex. `ibv_reg_mr` of the pool happens
//! once, at node start, before any load is accepted, so blocking there delays nothing.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Weak};

use actix::{Actor, Context, Handler, Message, MessageResult};
use kvferry_transport::verbs::{register_host_split, NicHostMr, RdmaNic};
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
    #[error("registering region {addr:#x}+{len} on rdma nic {nic} failed ({kind}): {reason}")]
    Rdma {
        nic: String,
        addr: u64,
        len: u64,
        /// Low-cardinality reason (`nic_unavailable`, `nic_refused`, `split`, `bad_range`).
        kind: &'static str,
        reason: String,
    },
}

impl RegistryError {
    /// The failure reason as a metrics label.
    pub fn reason(&self) -> &'static str {
        match self {
            RegistryError::BadRange { .. } => "bad_range",
            RegistryError::Conflict { .. } => "conflict",
            RegistryError::DeviceRemoteRead { .. } => "device_remote_read",
            RegistryError::Table { .. } => "table",
            RegistryError::Rdma { kind, .. } => kind,
        }
    }
}

/// Failures by kind since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegistryFailures {
    pub bad_range: u64,
    pub conflict: u64,
    pub device_remote_read: u64,
    pub table: u64,
    /// Registrations an RDMA NIC refused or could not take (device missing).
    pub rdma: u64,
}

impl RegistryFailures {
    pub fn total(&self) -> u64 {
        self.bad_range + self.conflict + self.device_remote_read + self.table + self.rdma
    }

    fn count(&mut self, e: &RegistryError) {
        match e {
            RegistryError::BadRange { .. } => self.bad_range += 1,
            RegistryError::Conflict { .. } => self.conflict += 1,
            RegistryError::DeviceRemoteRead { .. } => self.device_remote_read += 1,
            RegistryError::Table { .. } => self.table += 1,
            RegistryError::Rdma { .. } => self.rdma += 1,
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
    /// Index = NIC id: the NIC's own MRs of this region (verbs NICs, remotely readable host
    /// regions only).
    rdma: Vec<Option<NicHostMr>>,
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

    /// The RDMA NIC's own MRs of this region on `nic` (their rkeys are what peers read with).
    pub fn rdma(&self, nic: NicId) -> Option<&NicHostMr> {
        self.0.rdma.get(usize::from(nic.0)).and_then(Option::as_ref)
    }

    /// Users of this registration (clones alive).
    pub fn users(&self) -> usize {
        Arc::strong_count(&self.0)
    }
}

/// What a NIC is beyond its MR table.
#[derive(Clone)]
pub enum RdmaSlot {
    /// Not an RDMA NIC (loopback, tcp, shm): the table is all there is.
    None,
    /// An open RDMA NIC: remotely readable host regions are registered on it too.
    Open(Arc<dyn RdmaNic>),
    /// A verbs NIC that could not be opened; registrations that need it fail with this.
    Unavailable { reason: String },
}

impl std::fmt::Debug for RdmaSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RdmaSlot::None => f.write_str("None"),
            RdmaSlot::Open(n) => write!(f, "Open({})", n.name()),
            RdmaSlot::Unavailable { reason } => write!(f, "Unavailable({reason})"),
        }
    }
}

/// The metrics label of a kind of memory.
pub fn kind_label(kind: MrKind) -> &'static str {
    match kind {
        MrKind::Host => "host",
        MrKind::Device => "device",
    }
}

/// Label of failures that happen before any NIC is involved.
pub const ANY_NIC: &str = "any";

/// The plain registry; [`MrRegistry`] drives it.
pub struct Registry {
    tables: Vec<MrTable>,
    names: Vec<String>,
    rdma: Vec<RdmaSlot>,
    chunk: u64,
    live: HashMap<RegionId, Weak<Registered>>,
    failures: RegistryFailures,
    coalesced: u64,
    /// (nic, kind) → registrations made.
    made: BTreeMap<(String, &'static str), u64>,
    /// (nic, kind, reason) → registrations refused.
    failed: BTreeMap<(String, &'static str, &'static str), u64>,
}

impl Registry {
    /// `tables[i]` is NIC `i`'s table; no RDMA NICs, NICs labelled by index.
    pub fn new(tables: Vec<MrTable>) -> Self {
        let names = (0..tables.len()).map(|i| format!("nic{i}")).collect();
        let rdma = vec![RdmaSlot::None; tables.len()];
        Self::with_nics(tables, names, rdma, u64::MAX)
    }

    /// `tables[i]`, `names[i]` and `rdma[i]` describe NIC `i`; RDMA registrations are split
    /// at `chunk` bytes.
    pub fn with_nics(
        tables: Vec<MrTable>,
        names: Vec<String>,
        rdma: Vec<RdmaSlot>,
        chunk: u64,
    ) -> Self {
        Registry {
            tables,
            names,
            rdma,
            chunk,
            live: HashMap::new(),
            failures: RegistryFailures::default(),
            coalesced: 0,
            made: BTreeMap::new(),
            failed: BTreeMap::new(),
        }
    }

    fn name(&self, nic: usize) -> String {
        self.names
            .get(nic)
            .cloned()
            .unwrap_or_else(|| format!("nic{nic}"))
    }

    pub fn register(&mut self, spec: RegionSpec) -> Result<RegionHandles, RegistryError> {
        let kind = kind_label(spec.id().kind);
        let r = self.try_register(spec);
        if let Err(e) = &r {
            self.failures.count(e);
            let nic = match e {
                RegistryError::Table { nic, .. } => self.name(usize::from(*nic)),
                RegistryError::Rdma { nic, .. } => nic.clone(),
                _ => ANY_NIC.to_string(),
            };
            *self.failed.entry((nic, kind, e.reason())).or_default() += 1;
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
        let mut rdma = Vec::with_capacity(self.tables.len());
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
            rdma.push(self.register_rdma(nic, &spec)?);
        }
        for nic in 0..self.tables.len() {
            *self
                .made
                .entry((self.name(nic), kind_label(id.kind)))
                .or_default() += 1;
        }
        let reg = Arc::new(Registered {
            id,
            access,
            handles,
            rdma,
        });
        self.live.insert(id, Arc::downgrade(&reg));
        Ok(RegionHandles(reg))
    }

    /// The NIC's own registration of a region peers read (the host pool); nothing for other
    /// regions or NICs without RDMA.
    fn register_rdma(
        &self,
        nic: usize,
        spec: &RegionSpec,
    ) -> Result<Option<NicHostMr>, RegistryError> {
        let RegionSpec::Host { region, access } = spec else {
            return Ok(None);
        };
        if !access.contains(Access::REMOTE_READ) {
            return Ok(None);
        }
        let (addr, len) = (region.addr(), region.len() as u64);
        match self.rdma.get(nic) {
            None | Some(RdmaSlot::None) => Ok(None),
            Some(RdmaSlot::Unavailable { reason }) => Err(RegistryError::Rdma {
                nic: self.name(nic),
                addr,
                len,
                kind: "nic_unavailable",
                reason: reason.clone(),
            }),
            Some(RdmaSlot::Open(dev)) => register_host_split(dev.as_ref(), region, self.chunk)
                .map(Some)
                .map_err(|e| RegistryError::Rdma {
                    nic: self.name(nic),
                    addr,
                    len,
                    kind: e.kind(),
                    reason: e.to_string(),
                }),
        }
    }

    /// Registrations made, by (nic, kind), and refused, by (nic, kind, reason).
    pub fn counts(&self) -> RegistryCounts {
        RegistryCounts {
            made: self
                .made
                .iter()
                .map(|((n, k), v)| (n.clone(), *k, *v))
                .collect(),
            failed: self
                .failed
                .iter()
                .map(|((n, k, r), v)| (n.clone(), *k, *r, *v))
                .collect(),
            registered: self
                .names
                .iter()
                .cloned()
                .zip(self.tables.iter().map(|t| t.gauges().registered))
                .collect(),
        }
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

/// Registration counts for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegistryCounts {
    /// (nic, kind, registrations made).
    pub made: Vec<(String, &'static str, u64)>,
    /// (nic, kind, reason, registrations refused).
    pub failed: Vec<(String, &'static str, &'static str, u64)>,
    /// (nic, registrations in its table now).
    pub registered: Vec<(String, usize)>,
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

    pub fn with_registry(registry: Registry) -> Self {
        MrRegistry { registry }
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

/// Registration counts by NIC, kind and failure reason.
#[derive(Message)]
#[rtype(result = "RegistryCounts")]
pub struct GetRegistryCounts;

impl Handler<GetRegistryCounts> for MrRegistry {
    type Result = MessageResult<GetRegistryCounts>;

    fn handle(&mut self, _: GetRegistryCounts, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.registry.counts())
    }
}
