//! Safe owners of rdma-core objects: an open device with its protection domain and completion
//! queue, memory registrations (split at the configured size), and RC QPs.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use thiserror::Error;

use super::config::VerbsConfig;
use super::ffi;
use super::gid::{choose_address, Gid, GidError, Mtu, PortAddress};
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

/// Names of the RDMA devices rdma-core sees; `NoDevice` (never a panic) when there is none.
pub fn device_names() -> Result<Vec<String>, DeviceError> {
    let names = ffi::device_names().map_err(|source| DeviceError::List { source })?;
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

/// An open device: context, one protection domain, one completion queue, the chosen port
/// address, and the key map of everything registered on it.
pub struct VerbsDevice {
    name: String,
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    cq: *mut ffi::ibv_cq,
    address: PortAddress,
    depth: ReadDepthLimits,
    keys: Mutex<KeyMap>,
    teardown_failures: AtomicU64,
}

// SAFETY: rdma-core contexts, PDs and CQs may be used from any thread; the only
// non-thread-safe operation (polling one CQ concurrently) is confined to the single poller
// thread of `VerbsNic`, and the key map is behind a mutex.
unsafe impl Send for VerbsDevice {}
// SAFETY: as above; shared access only reads immutable handles or goes through the mutex.
unsafe impl Sync for VerbsDevice {}

impl std::fmt::Debug for VerbsDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsDevice")
            .field("name", &self.name)
            .field("address", &self.address)
            .finish()
    }
}

impl VerbsDevice {
    /// Opens `name`, picks its first usable port (GID types from sysfs, the rest from the
    /// device), and creates a PD and a CQ of `cqe` entries.
    pub fn open(name: &str, sysfs: &Sysfs, cqe: u32) -> Result<VerbsDevice, DeviceError> {
        let verr = |what, source| DeviceError::Verbs {
            nic: name.to_string(),
            what,
            source,
        };
        let ctx = ffi::open_device(name)
            .map_err(|e| verr("ibv_open_device", e))?
            .ok_or_else(|| DeviceError::UnknownDevice {
                nic: name.to_string(),
            })?;
        let mut dev = VerbsDevice {
            name: name.to_string(),
            ctx,
            pd: std::ptr::null_mut(),
            cq: std::ptr::null_mut(),
            address: PortAddress {
                port: 1,
                gid_index: 0,
                gid: Gid::default(),
                lid: 0,
                global: false,
                mtu: Mtu::M1024,
            },
            depth: ReadDepthLimits {
                initiator: 1,
                responder: 1,
            },
            keys: Mutex::new(KeyMap::new()),
            teardown_failures: AtomicU64::new(0),
        };
        // From here `dev`'s Drop releases whatever was created.
        // SAFETY: `ctx` is open.
        let attr = unsafe { ffi::query_device(ctx) }.map_err(|e| verr("ibv_query_device", e))?;
        dev.depth = ReadDepthLimits {
            initiator: attr.max_qp_init_rd_atom.max(1) as u32,
            responder: attr.max_qp_rd_atom.max(1) as u32,
        };
        let info = sysfs.nic(name).map_err(|source| DeviceError::Sysfs {
            nic: name.to_string(),
            source,
        })?;
        let mut reasons = Vec::new();
        let mut chosen = None;
        for mut port in info.ports {
            // SAFETY: `ctx` is open.
            let pa = unsafe { ffi::query_port(ctx, port.port) }
                .map_err(|e| verr("ibv_query_port", e))?;
            port.active = pa.state == 4;
            port.lid = pa.lid;
            port.active_mtu = Mtu::from_code(pa.active_mtu).unwrap_or(Mtu::M1024);
            for e in &mut port.gids {
                // The device's table is authoritative; sysfs gave the types.
                // SAFETY: `ctx` is open.
                if let Ok(raw) = unsafe { ffi::query_gid(ctx, port.port, e.index.into()) } {
                    e.gid = Gid(raw);
                }
            }
            match choose_address(&port) {
                Ok(a) => {
                    chosen = Some(a);
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
        // SAFETY: `ctx` is open.
        dev.pd = unsafe { ffi::alloc_pd(ctx) }.map_err(|e| verr("ibv_alloc_pd", e))?;
        // SAFETY: `ctx` is open.
        dev.cq = unsafe { ffi::create_cq(ctx, cqe.clamp(1, i32::MAX as u32) as i32) }
            .map_err(|e| verr("ibv_create_cq", e))?;
        Ok(dev)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn address(&self) -> PortAddress {
        self.address
    }

    pub fn read_depth(&self) -> ReadDepthLimits {
        self.depth
    }

    /// Failed `ibv_dereg_mr`/`ibv_destroy_*` calls so far (teardown never panics).
    pub fn teardown_failures(&self) -> u64 {
        self.teardown_failures.load(Ordering::Relaxed)
    }

    pub(crate) fn local_keys(&self) -> MutexGuard<'_, KeyMap> {
        lock(&self.keys)
    }

    pub(crate) fn pd(&self) -> *mut ffi::ibv_pd {
        self.pd
    }

    pub(crate) fn cq(&self) -> *mut ffi::ibv_cq {
        self.cq
    }

    pub(crate) fn record_teardown(&self, r: io::Result<()>) {
        if r.is_err() {
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
        cfg: &VerbsConfig,
        mut reg: impl FnMut(Chunk) -> io::Result<*mut ffi::ibv_mr>,
    ) -> Result<Registration, DeviceError> {
        let chunks = split(addr, len, cfg.registration_chunk).map_err(|source| {
            DeviceError::Registration {
                nic: self.name.clone(),
                source,
            }
        })?;
        let mut out = Registration {
            device: self.clone(),
            mrs: Vec::with_capacity(chunks.len()),
        };
        for c in chunks {
            let mr = reg(c).map_err(|e| self.verr("memory registration", e))?;
            // SAFETY: `mr` was just registered.
            let (lkey, rkey) = unsafe { ffi::mr_keys(mr) };
            let keys = NicKeys { lkey, rkey };
            out.mrs.push((c, keys, mr));
            self.local_keys()
                .insert(c, keys)
                .map_err(|source| DeviceError::Registration {
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
        let pd = self.pd;
        self.reg_chunks(region.addr(), region.len() as u64, cfg, |c| {
            // SAFETY: the chunk lies inside the mapped region, which the caller keeps alive
            // for as long as the registration.
            unsafe { ffi::reg_mr(pd, c.addr, c.len, access) }
        })
    }

    /// Registers one chunk of host memory (a piece of the pool) for local write and remote
    /// read, as one MR. The chunk must lie inside `region`, which must outlive the
    /// registration.
    pub fn register_host_chunk(
        self: &Arc<Self>,
        region: &HostRegion,
        chunk: Chunk,
        cfg: &VerbsConfig,
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
        let access = access_flags(MrKind::Host, cfg.relaxed_ordering);
        let pd = self.pd;
        // One MR: the chunk is at most the configured size already.
        let one = VerbsConfig {
            registration_chunk: chunk.len,
            ..cfg.clone()
        };
        self.reg_chunks(chunk.addr, chunk.len, &one, |c| {
            // SAFETY: the chunk lies inside the mapped region (checked above), which the
            // caller keeps alive for as long as the registration.
            unsafe { ffi::reg_mr(pd, c.addr, c.len, access) }
        })
    }

    /// Registers host memory that only this NIC writes into (a read destination outside the
    /// pool): local write only.
    pub fn register_local(
        self: &Arc<Self>,
        region: &HostRegion,
        cfg: &VerbsConfig,
    ) -> Result<Registration, DeviceError> {
        let access = access_flags(MrKind::Device, cfg.relaxed_ordering);
        let pd = self.pd;
        self.reg_chunks(region.addr(), region.len() as u64, cfg, |c| {
            // SAFETY: the chunk lies inside the mapped region, which the caller keeps alive
            // for as long as the registration.
            unsafe { ffi::reg_mr(pd, c.addr, c.len, access) }
        })
    }

    /// Registers GPU memory exported as a DMA-BUF: local write only (peers can never name it),
    /// addressed by the NIC at `iova` (the device address), split at the chunk size.
    pub fn register_dmabuf(
        self: &Arc<Self>,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: u64,
        iova: u64,
        cfg: &VerbsConfig,
    ) -> Result<Registration, DeviceError> {
        use std::os::fd::AsRawFd;
        let access = access_flags(MrKind::Device, cfg.relaxed_ordering);
        let (pd, raw) = (self.pd, fd.as_raw_fd());
        self.reg_chunks(iova, len, cfg, |c| {
            let chunk_offset = offset + (c.addr - iova);
            // SAFETY: `fd` is a live DMA-BUF (borrowed for this call; the kernel keeps its own
            // reference) and the chunk lies inside `offset..offset+len` of it.
            unsafe { ffi::reg_dmabuf_mr(pd, chunk_offset, c.len, c.addr, raw, access) }
        })
    }

    /// Applies one QP transition.
    pub(crate) fn modify(&self, qp: *mut ffi::ibv_qp, t: &Transition) -> Result<(), DeviceError> {
        // SAFETY: callers pass a QP created on this device and still alive.
        unsafe { ffi::modify_qp(qp, t) }.map_err(|e| self.verr("ibv_modify_qp", e))
    }
}

impl Drop for VerbsDevice {
    fn drop(&mut self) {
        // Registrations and QPs hold an `Arc` to the device, so none is left here.
        if !self.cq.is_null() {
            // SAFETY: no QP uses the CQ any more (they hold the device alive).
            let r = unsafe { ffi::destroy_cq(self.cq) };
            self.record_teardown(r);
        }
        if !self.pd.is_null() {
            // SAFETY: no MR or QP uses the PD any more.
            let r = unsafe { ffi::dealloc_pd(self.pd) };
            self.record_teardown(r);
        }
        // SAFETY: everything created on the context is gone.
        let _ = unsafe { ffi::close_device(self.ctx) };
    }
}

/// One region registered on one device, possibly as several MRs. Dropping it removes the keys
/// from the device's map and deregisters; callers drop it only after reads using it drained.
pub struct Registration {
    device: Arc<VerbsDevice>,
    mrs: Vec<(Chunk, NicKeys, *mut ffi::ibv_mr)>,
}

// SAFETY: MR handles are plain kernel object references, usable and deregistrable from any
// thread; the struct has no interior mutability.
unsafe impl Send for Registration {}
// SAFETY: shared access only reads the chunk list.
unsafe impl Sync for Registration {}

impl Registration {
    /// What a peer needs to read this region: each MR's range and keys.
    pub fn advertised(&self) -> Vec<(Chunk, NicKeys)> {
        self.mrs.iter().map(|(c, k, _)| (*c, *k)).collect()
    }

    pub fn chunks(&self) -> usize {
        self.mrs.len()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut keys = self.device.local_keys();
        for (c, _, mr) in self.mrs.drain(..) {
            keys.remove(c.addr);
            // SAFETY: registered by us; the owner dropped us only after its reads drained.
            let r = unsafe { ffi::dereg_mr(mr) };
            self.device.record_teardown(r);
        }
    }
}
