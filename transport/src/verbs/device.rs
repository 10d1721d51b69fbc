//! Safe owners of verbs objects, over either [`VerbsOps`] table: an open device with its
//! protection domain and completion queue, memory registrations (split at the configured
//! size, refcounted per range so concurrent users share one), and the device's limits.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use thiserror::Error;

use super::config::VerbsConfig;
use super::gid::{choose_address, Gid, GidError, Mtu, PortAddress};
use super::ops::{ops_for, AsyncEvent, DeviceAttr, Handle, QpCaps, VerbsOps, Wc};
use super::qp_attrs::{ReadDepthLimits, Transition};
use super::registration::{access_flags, split, Chunk, KeyMap, NicKeys, RegistrationError};
use super::sysfs::{Sysfs, SysfsError};
use crate::mr_table::MrKind;
use crate::region::HostRegion;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DeviceError {
    #[error("no RDMA device on this node")]
    NoDevice,
    #[error("RDMA device {nic} does not exist")]
    UnknownDevice { nic: String },
    #[error("RDMA device {nic}: this build has no rdma-core provider (cargo feature `verbs`)")]
    NotCompiled { nic: String },
    #[error("listing RDMA devices failed")]
    List {
        #[source]
        source: io::Error,
    },
    #[error("nic {nic}: {what} failed")]
    Verbs {
        nic: String,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("nic {nic}: reading sysfs failed")]
    Sysfs {
        nic: String,
        #[source]
        source: SysfsError,
    },
    #[error("nic {nic} has no usable port: {reasons}")]
    NoUsablePort { nic: String, reasons: String },
    #[error("nic {nic}: registration refused")]
    Registration {
        nic: String,
        #[source]
        source: RegistrationError,
    },
}

/// Names of the RDMA devices rdma-core sees; `NoDevice` (never a panic) when there is none
/// or the build has no rdma-core provider.
pub fn device_names() -> Result<Vec<String>, DeviceError> {
    let ops = ops_for("").ok_or(DeviceError::NoDevice)?;
    let names = ops
        .device_names()
        .map_err(|source| DeviceError::List { source })?;
    if names.is_empty() {
        Err(DeviceError::NoDevice)
    } else {
        Ok(names)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections are single map updates; poisoning carries no meaning.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Identity of a registration users share: range, access and (for DMA-BUFs) offset.
type RegKey = (u64, u64, u32, Option<u64>);

/// An open device: context, one protection domain, the completion queue QPs report to, the
/// chosen port address, its limits, and the key map of everything registered on it.
pub struct VerbsDevice {
    ops: Arc<dyn VerbsOps>,
    name: String,
    ctx: Handle,
    pd: Option<Handle>,
    /// The CQ new QPs use; CQs replaced after an overrun stay in `retired` until the device
    /// closes (their QPs may still be draining).
    cq: Mutex<Option<Handle>>,
    retired: Mutex<Vec<Handle>>,
    cqe: u32,
    address: PortAddress,
    attr: DeviceAttr,
    max_msg_sz: u64,
    keys: Mutex<KeyMap>,
    shared: Mutex<HashMap<RegKey, Weak<Registration>>>,
    teardown_failures: AtomicU64,
}

impl std::fmt::Debug for VerbsDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsDevice")
            .field("name", &self.name)
            .field("ops", &self.ops.kind())
            .field("address", &self.address)
            .finish()
    }
}

const NO_ATTR: DeviceAttr = DeviceAttr {
    max_qp: 0,
    max_qp_wr: 1,
    max_sge: 1,
    max_cq: 0,
    max_cqe: 1,
    max_mr: 0,
    max_mr_size: 0,
    max_qp_rd_atom: 1,
    max_qp_init_rd_atom: 1,
};

impl VerbsDevice {
    /// Opens `name` through the table that serves it (the software device for `soft_*`
    /// names, rdma-core otherwise), picks its first usable port (GID types from sysfs or
    /// the profile, the rest from the device), and creates a PD and a CQ of `cqe` entries,
    /// clamped to the device's `max_cqe`.
    pub fn open(name: &str, sysfs: &Sysfs, cqe: u32) -> Result<VerbsDevice, DeviceError> {
        let ops = ops_for(name).ok_or_else(|| DeviceError::NotCompiled {
            nic: name.to_string(),
        })?;
        Self::open_with(ops, name, sysfs, cqe)
    }

    /// As [`VerbsDevice::open`] over a given table.
    pub fn open_with(
        ops: Arc<dyn VerbsOps>,
        name: &str,
        sysfs: &Sysfs,
        cqe: u32,
    ) -> Result<VerbsDevice, DeviceError> {
        let verr = |what, source| DeviceError::Verbs {
            nic: name.to_string(),
            what,
            source,
        };
        let ctx = ops
            .open_device(name)
            .map_err(|e| verr("ibv_open_device", e))?
            .ok_or_else(|| DeviceError::UnknownDevice {
                nic: name.to_string(),
            })?;
        let mut dev = VerbsDevice {
            ops: ops.clone(),
            name: name.to_string(),
            ctx,
            pd: None,
            cq: Mutex::new(None),
            retired: Mutex::new(Vec::new()),
            cqe: 1,
            address: PortAddress {
                port: 1,
                gid_index: 0,
                gid: Gid::default(),
                lid: 0,
                global: false,
                mtu: Mtu::M1024,
            },
            attr: NO_ATTR,
            max_msg_sz: 1 << 30,
            keys: Mutex::new(KeyMap::new()),
            shared: Mutex::new(HashMap::new()),
            teardown_failures: AtomicU64::new(0),
        };
        // From here `dev`'s Drop releases whatever was created.
        dev.attr = ops
            .query_device(ctx)
            .map_err(|e| verr("ibv_query_device", e))?;
        let ports = ops
            .ports(name, sysfs)
            .map_err(|source| DeviceError::Sysfs {
                nic: name.to_string(),
                source,
            })?;
        let mut reasons = Vec::new();
        let mut chosen = None;
        for mut port in ports {
            let pa = ops
                .query_port(ctx, port.port)
                .map_err(|e| verr("ibv_query_port", e))?;
            port.active = pa.active;
            port.lid = pa.lid;
            port.active_mtu = pa.active_mtu;
            for e in &mut port.gids {
                // The device's table is authoritative; sysfs gave the types.
                if let Ok(raw) = ops.query_gid(ctx, port.port, e.index) {
                    e.gid = Gid(raw);
                }
            }
            match choose_address(&port) {
                Ok(a) => {
                    chosen = Some(a);
                    dev.max_msg_sz = pa.max_msg_sz.max(1);
                    break;
                }
                Err(e) => reasons.push(e),
            }
        }
        dev.address = chosen.ok_or_else(|| DeviceError::NoUsablePort {
            nic: name.to_string(),
            reasons: reasons
                .iter()
                .map(GidError::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        })?;
        dev.pd = Some(ops.alloc_pd(ctx).map_err(|e| verr("ibv_alloc_pd", e))?);
        // A CQ larger than the device takes fails every open: ask for what it has.
        dev.cqe = cqe.clamp(1, dev.attr.max_cqe.max(1));
        let cq = ops
            .create_cq(ctx, dev.cqe)
            .map_err(|e| verr("ibv_create_cq", e))?;
        *lock(&dev.cq) = Some(cq);
        Ok(dev)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn ops(&self) -> &Arc<dyn VerbsOps> {
        &self.ops
    }

    pub fn address(&self) -> PortAddress {
        self.address
    }

    /// What `ibv_query_device` reported.
    pub fn attr(&self) -> DeviceAttr {
        self.attr
    }

    /// The port's `max_msg_sz`: the longest read one work request may carry.
    pub fn max_msg_sz(&self) -> u64 {
        self.max_msg_sz
    }

    /// Entries of the CQ (the requested size clamped to the device).
    pub fn cqe(&self) -> u32 {
        self.cqe
    }

    pub fn read_depth(&self) -> ReadDepthLimits {
        ReadDepthLimits {
            initiator: self.attr.max_qp_init_rd_atom.max(1),
            responder: self.attr.max_qp_rd_atom.max(1),
        }
    }

    /// QP capacities for a configured window and SGE count, clamped to the device (a QP
    /// asking for more than `max_qp_wr`/`max_sge` is refused by `ibv_create_qp`).
    pub fn qp_caps(&self, max_send_wr: u32, max_sge: u32) -> QpCaps {
        let caps = QpCaps {
            max_send_wr: max_send_wr.clamp(1, self.attr.max_qp_wr.max(1)),
            max_send_sge: max_sge.clamp(1, self.attr.max_sge.max(1)),
        };
        if caps.max_send_wr != max_send_wr || caps.max_send_sge != max_sge {
            tracing::warn!(
                nic = %self.name,
                max_send_wr,
                max_sge,
                device_max_qp_wr = self.attr.max_qp_wr,
                device_max_sge = self.attr.max_sge,
                "verbs: QP capacities clamped to the device's limits"
            );
        }
        caps
    }

    /// Failed deregistrations/destroys so far (teardown never panics).
    pub fn teardown_failures(&self) -> u64 {
        self.teardown_failures.load(Ordering::Relaxed)
    }

    pub(crate) fn local_keys(&self) -> MutexGuard<'_, KeyMap> {
        lock(&self.keys)
    }

    pub(crate) fn pd(&self) -> Handle {
        self.pd.unwrap_or(Handle(0))
    }

    /// The CQ new QPs report to.
    pub(crate) fn cq(&self) -> Handle {
        lock(&self.cq).unwrap_or(Handle(0))
    }

    /// Every CQ that may still hold completions: the current one and the retired ones.
    pub(crate) fn cqs(&self) -> Vec<Handle> {
        let mut v: Vec<Handle> = lock(&self.retired).clone();
        v.extend(*lock(&self.cq));
        v
    }

    /// After an overrun: new QPs get a fresh CQ; the failed one is kept until close (its
    /// QPs are destroyed as their connections drop).
    pub(crate) fn replace_cq(&self, failed: Handle) -> Result<(), DeviceError> {
        let mut cur = lock(&self.cq);
        if *cur != Some(failed) {
            return Ok(());
        }
        let fresh = self
            .ops
            .create_cq(self.ctx, self.cqe)
            .map_err(|e| self.verr("ibv_create_cq", e))?;
        lock(&self.retired).push(failed);
        *cur = Some(fresh);
        Ok(())
    }

    pub(crate) fn poll(&self, cq: Handle, out: &mut [Wc]) -> io::Result<usize> {
        self.ops.poll_cq(cq, out)
    }

    pub(crate) fn async_event(&self) -> io::Result<Option<AsyncEvent>> {
        self.ops.next_async_event(self.ctx)
    }

    pub(crate) fn record_teardown(&self, r: io::Result<()>) {
        if let Err(e) = r {
            tracing::warn!(nic = %self.name, error = %e, "verbs: teardown call failed");
            self.teardown_failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn verr(&self, what: &'static str, source: io::Error) -> DeviceError {
        DeviceError::Verbs {
            nic: self.name.clone(),
            what,
            source,
        }
    }

    fn reg_chunks(
        self: &Arc<Self>,
        addr: u64,
        len: u64,
        chunk: u64,
        mut reg: impl FnMut(Chunk) -> io::Result<(Handle, u32, u32)>,
    ) -> Result<Registration, DeviceError> {
        let chunks = split(addr, len, chunk).map_err(|source| DeviceError::Registration {
            nic: self.name.clone(),
            source,
        })?;
        let mut out = Registration {
            device: self.clone(),
            mrs: Vec::with_capacity(chunks.len()),
        };
        for c in chunks {
            let (mr, lkey, rkey) = reg(c).map_err(|e| self.verr("memory registration", e))?;
            let keys = NicKeys { lkey, rkey };
            // Only keys this registration inserted are removed when it drops: a range that
            // another registration already covers keeps that one's keys.
            let inserted = self.local_keys().insert(c, keys);
            out.mrs.push(RegisteredMr {
                chunk: c,
                keys,
                mr,
                inserted: inserted.is_ok(),
            });
            inserted.map_err(|source| DeviceError::Registration {
                nic: self.name.clone(),
                source,
            })?;
        }
        Ok(out)
    }

    /// Registers host memory (the pool): local write and remote read, split at the configured
    /// chunk size. The region must outlive the registration (hold an `Arc` beside it).
    pub fn register_host(
        self: &Arc<Self>,
        region: &HostRegion,
        cfg: &VerbsConfig,
    ) -> Result<Registration, DeviceError> {
        let access = access_flags(MrKind::Host, cfg.relaxed_ordering);
        let (ops, pd) = (self.ops.clone(), self.pd());
        self.reg_chunks(
            region.addr(),
            region.len() as u64,
            cfg.registration_chunk,
            |c| ops.reg_mr(pd, c.addr, c.len, access),
        )
    }

    /// Registers one chunk of host memory (a piece of the pool) with `access`, as one MR.
    /// The chunk must lie inside `region`, which must outlive the registration.
    pub fn register_host_chunk(
        self: &Arc<Self>,
        region: &HostRegion,
        chunk: Chunk,
        access: u32,
    ) -> Result<Registration, DeviceError> {
        super::nic::check_chunk(&self.name, region, chunk).map_err(|_| {
            DeviceError::Registration {
                nic: self.name.clone(),
                source: RegistrationError::BadRange {
                    addr: chunk.addr,
                    len: chunk.len,
                },
            }
        })?;
        let (ops, pd) = (self.ops.clone(), self.pd());
        self.reg_chunks(chunk.addr, chunk.len, chunk.len, |c| {
            ops.reg_mr(pd, c.addr, c.len, access)
        })
    }

    /// The registration users of `key` share, or a new one made by `make`.
    fn shared(
        self: &Arc<Self>,
        key: RegKey,
        make: impl FnOnce() -> Result<Registration, DeviceError>,
    ) -> Result<Arc<Registration>, DeviceError> {
        let mut shared = lock(&self.shared);
        shared.retain(|_, w| w.strong_count() > 0);
        if let Some(r) = shared.get(&key).and_then(Weak::upgrade) {
            return Ok(r);
        }
        let r = Arc::new(make()?);
        shared.insert(key, Arc::downgrade(&r));
        Ok(r)
    }

    /// Registers host memory that only this NIC writes into (a read destination outside the
    /// pool): local write only. Registrations of the same range are shared (refcounted).
    pub fn register_local(
        self: &Arc<Self>,
        region: &HostRegion,
        cfg: &VerbsConfig,
    ) -> Result<Arc<Registration>, DeviceError> {
        self.register_local_range(region.addr(), region.len() as u64, cfg)
    }

    /// As [`VerbsDevice::register_local`] for a range the caller keeps mapped.
    pub fn register_local_range(
        self: &Arc<Self>,
        addr: u64,
        len: u64,
        cfg: &VerbsConfig,
    ) -> Result<Arc<Registration>, DeviceError> {
        let access = access_flags(MrKind::Device, cfg.relaxed_ordering);
        let (ops, pd) = (self.ops.clone(), self.pd());
        self.shared((addr, len, access, None), || {
            self.reg_chunks(addr, len, cfg.registration_chunk, |c| {
                ops.reg_mr(pd, c.addr, c.len, access)
            })
        })
    }

    /// Registers GPU memory exported as a DMA-BUF: local write only (peers can never name it),
    /// addressed by the NIC at `iova` (the device address), split at the chunk size. Loads
    /// into the same planes share one registration (refcounted): registering a range twice
    /// on one NIC is refused by the key map, and the failed copy's cleanup used to remove
    /// the live one's keys.
    pub fn register_dmabuf(
        self: &Arc<Self>,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: u64,
        iova: u64,
        cfg: &VerbsConfig,
    ) -> Result<Arc<Registration>, DeviceError> {
        use std::os::fd::AsRawFd;
        let access = access_flags(MrKind::Device, cfg.relaxed_ordering);
        let (ops, pd, raw) = (self.ops.clone(), self.pd(), fd.as_raw_fd());
        self.shared((iova, len, access, Some(offset)), || {
            self.reg_chunks(iova, len, cfg.registration_chunk, |c| {
                let chunk_offset = offset + (c.addr - iova);
                ops.reg_dmabuf_mr(pd, chunk_offset, c.len, c.addr, raw, access)
            })
        })
    }

    /// Creates an RC QP on the current CQ; returns it with its number.
    pub(crate) fn create_qp(&self, caps: QpCaps) -> Result<(Handle, u32, Handle), DeviceError> {
        let cq = self.cq();
        let (qp, qpn) = self
            .ops
            .create_qp(self.pd(), cq, caps)
            .map_err(|e| self.verr("ibv_create_qp", e))?;
        Ok((qp, qpn, cq))
    }

    /// Applies one QP transition.
    pub(crate) fn modify(&self, qp: Handle, t: &Transition) -> Result<(), DeviceError> {
        self.ops
            .modify_qp(qp, t)
            .map_err(|e| self.verr("ibv_modify_qp", e))
    }

    pub(crate) fn destroy_qp(&self, qp: Handle) {
        let r = self.ops.destroy_qp(qp);
        self.record_teardown(r);
    }
}

impl Drop for VerbsDevice {
    fn drop(&mut self) {
        // Registrations and QPs hold an `Arc` to the device, so none is left here.
        for cq in self.cqs() {
            let r = self.ops.destroy_cq(cq);
            self.record_teardown(r);
        }
        if let Some(pd) = self.pd.take() {
            let r = self.ops.dealloc_pd(pd);
            self.record_teardown(r);
        }
        let r = self.ops.close_device(self.ctx);
        self.record_teardown(r);
    }
}

struct RegisteredMr {
    chunk: Chunk,
    keys: NicKeys,
    mr: Handle,
    /// Whether this registration put the chunk's keys into the device's key map.
    inserted: bool,
}

/// One region registered on one device, possibly as several MRs. Dropping it removes the keys
/// it inserted from the device's map and deregisters; callers drop it only after reads using
/// it drained.
pub struct Registration {
    device: Arc<VerbsDevice>,
    mrs: Vec<RegisteredMr>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("nic", &self.device.name)
            .field("mrs", &self.mrs.len())
            .finish()
    }
}

impl Registration {
    /// What a peer needs to read this region: each MR's range and keys.
    pub fn advertised(&self) -> Vec<(Chunk, NicKeys)> {
        self.mrs.iter().map(|m| (m.chunk, m.keys)).collect()
    }

    pub fn chunks(&self) -> usize {
        self.mrs.len()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut keys = self.device.local_keys();
        for m in self.mrs.drain(..) {
            if m.inserted {
                keys.remove(m.chunk.addr);
            }
            let r = self.device.ops.dereg_mr(m.mr);
            self.device.record_teardown(r);
        }
    }
}
