//! The software verbs device: the [`VerbsOps`] calls the provider makes, executed in Rust under
//! the verbs rules, so the provider's code runs (and fails) as it would on a NIC, on any host.
//!
//! What it enforces, as a device does:
//! - the RC QP state machine (reset → init → RTR → RTS, any → error/reset) and, per
//!   transition, the attribute mask: every required bit present, nothing outside required ∪
//!   optional (`EINVAL` otherwise), values within the device (port, path MTU ≤ the port's,
//!   `max_rd_atomic` ≤ `max_qp_init_rd_atom`, `max_dest_rd_atomic` ≤ `max_qp_rd_atom`, 24-bit
//!   QPNs and PSNs, 3-bit retry counts);
//! - creation limits from the profile (`max_qp_wr`, `max_sge`, `max_cqe`, `max_qp`, `max_mr`);
//! - at post: the QP in RTS (or error, where requests flush), `num_sge ≤ max_send_sge`, the send
//!   queue not full (`ENOMEM`);
//! - while executing (completion statuses, the QP then moves to error and flushes the rest):
//!   messages over `max_msg_sz` (`LOC_LEN_ERR`), local SGEs inside an MR of the QP's PD with
//!   local write (`LOC_PROT_ERR`), the remote range inside one MR of the responder's PD with
//!   remote read and the responder QP granting remote read (`REM_ACCESS_ERR`), more reads
//!   arriving than the responder's `max_dest_rd_atomic` (`REM_INV_REQ_ERR`: the IBA resource
//!   rule), a responder or port that is gone (`RETRY_EXC_ERR`);
//! - CQ depth: a completion that finds its CQ full overruns it; the CQ then fails every poll,
//!   its QPs go to error and the context raises `CqError` on its async event queue.
//!
//! Requests execute when the CQ they report to is polled, at most `max_rd_atomic` per QP per
//! round; that is the device's progress engine (one poller thread per CQ in the provider).
//! Bytes move between the requester's and the responder's registered memory; responders are
//! found by (GID, QPN): in this process, or in another one through the shared-memory fabric
//! (`fabric.rs`: each process publishes its QPs and remotely readable MRs, and a requester
//! maps the owner's memfd read-only). Faults are injected per device name
//! ([`SoftOps::inject`]): completion errors, a vanished peer, a port going down.
//!
//! Each rule lives with the object it governs: the object table and per-name device state
//! (`state.rs`), the QP state machine and posting (`qp.rs`), CQ depth and polling (`cq.rs`),
//! MRs (`mr.rs`), the progress engine (`progress.rs`), who answers a read (`responder.rs`)
//! and what other processes see of this one (`publish.rs`).

mod cq;
mod fabric;
mod mr;
pub mod profile;
mod progress;
mod publish;
mod qp;
mod responder;
mod state;

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

pub use profile::SoftProfile;

use super::gid::{GidEntry, GidType, LinkLayer, PortInfo};
use super::ops::{AsyncEvent, DeviceAttr, Handle, PortAttr, QpCaps, VerbsOps, Wc};
use super::qp_attrs::Transition;
use super::registration::{ACCESS_LOCAL_WRITE, ACCESS_RELAXED_ORDERING, ACCESS_REMOTE_READ};
use super::sysfs::{Sysfs, SysfsError};
use super::work::ReadWr;
use mr::Mapping;
use state::{gid_of, Ctx, Device, Obj, State};

// The tests name these through `use super::*`, as they did before the split.
#[cfg(test)]
use super::{gid::Gid, qp_attrs::mask, work::wc};

const ACCESS_REMOTE_WRITE: u32 = 2;
const ACCESS_REMOTE_ATOMIC: u32 = 8;
const KNOWN_ACCESS: u32 = ACCESS_LOCAL_WRITE
    | ACCESS_REMOTE_WRITE
    | ACCESS_REMOTE_READ
    | ACCESS_REMOTE_ATOMIC
    | ACCESS_RELAXED_ORDERING;
const MASK_24: u32 = 0x00ff_ffff;

/// A fault injected into a software device (by device name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SoftFault {
    /// The `nth` read executed from now on (0: the next) completes with `status`.
    CompletionError {
        nth: u64,
        status: u32,
    },
    /// The device leaves the fabric: peers' reads of it fail with retry exceeded.
    Vanish,
    /// The port goes down: its QPs go to error, the context raises `PortError`.
    PortDown,
    /// The port comes back (`PortActive`); QPs in error stay there until rebuilt.
    PortUp,
    /// The device stops executing requests (they stay queued) until `Resume`: lets a test
    /// pile work up, as a busy NIC does, before it completes all at once.
    Stall,
    Resume,
}

fn einval(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_string())
}

fn errno(code: i32, what: &str) -> io::Error {
    io::Error::new(
        io::Error::from_raw_os_error(code).kind(),
        format!("{what} ({})", io::Error::from_raw_os_error(code)),
    )
}
/// The software device. One per process ([`SoftOps::global`]): every soft context of the
/// process is on one fabric.
#[derive(Default)]
pub struct SoftOps {
    state: Mutex<State>,
}

impl std::fmt::Debug for SoftOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SoftOps")
    }
}
impl SoftOps {
    /// The process's software device.
    pub fn global() -> Arc<SoftOps> {
        static GLOBAL: OnceLock<Arc<SoftOps>> = OnceLock::new();
        GLOBAL.get_or_init(|| Arc::new(SoftOps::default())).clone()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Each critical section leaves the state consistent; poisoning carries no meaning.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Injects a fault into the device called `name` (whether or not it is open yet).
    pub fn inject(&self, name: &str, fault: SoftFault) {
        let mut st = self.lock();
        let dev = st
            .devices
            .entry(name.to_string())
            .or_insert_with(|| Device {
                port_up: true,
                ..Device::default()
            });
        match fault {
            SoftFault::CompletionError { nth, status } => dev.errors.push((nth, status)),
            SoftFault::Vanish => dev.vanished = true,
            SoftFault::PortDown => {
                dev.port_up = false;
                st.port_event(name, false);
            }
            SoftFault::PortUp => {
                dev.port_up = true;
                dev.vanished = false;
                st.port_event(name, true);
            }
            SoftFault::Stall => dev.stalled = true,
            SoftFault::Resume => dev.stalled = false,
        }
        st.publish_name(name);
    }

    /// Clears every fault of `name` (port up, present, no pending completion errors).
    pub fn heal(&self, name: &str) {
        let mut st = self.lock();
        if let Some(d) = st.devices.get_mut(name) {
            d.errors.clear();
            d.vanished = false;
            d.stalled = false;
            if !d.port_up {
                d.port_up = true;
                st.port_event(name, true);
            }
        }
        st.publish_name(name);
    }

    /// Reads executed by the device `name` so far (successful or not).
    pub fn reads(&self, name: &str) -> u64 {
        self.lock().reads.get(name).copied().unwrap_or(0)
    }

    /// QPs, MRs and CQs alive on contexts of `name` (teardown tests expect zeros).
    pub fn live(&self, name: &str) -> (usize, usize, usize) {
        let st = self.lock();
        let mine = |ctx: usize| matches!(st.objs.get(&ctx), Some(Obj::Ctx(c)) if c.name == name);
        let (mut q, mut m, mut c) = (0, 0, 0);
        for o in st.objs.values() {
            match o {
                Obj::Qp(x) if mine(x.ctx) => q += 1,
                Obj::Mr(x) if mine(x.ctx) => m += 1,
                Obj::Cq(x) if mine(x.ctx) => c += 1,
                _ => {}
            }
        }
        (q, m, c)
    }
}
// Every call takes the device lock once and holds it to the end, so each is atomic against
// the progress engine as a device's verbs are; the calls on QPs, CQs and MRs are checked in
// those objects' files.
impl VerbsOps for SoftOps {
    fn kind(&self) -> &'static str {
        "soft"
    }

    fn device_names(&self) -> io::Result<Vec<String>> {
        // Any `soft_<profile>_<n>` opens; these are the ones a listing shows.
        Ok(vec!["soft_mlx5_0".into(), "soft_small_0".into()])
    }

    fn open_device(&self, name: &str) -> io::Result<Option<Handle>> {
        let Some(profile) = SoftProfile::for_name(name) else {
            return Ok(None);
        };
        let mut st = self.lock();
        st.devices
            .entry(name.to_string())
            .or_insert_with(|| Device {
                port_up: true,
                ..Device::default()
            });
        let h = st.insert(Obj::Ctx(Ctx {
            name: name.to_string(),
            profile,
            gid: gid_of(name),
            events: VecDeque::new(),
        }));
        st.publish(gid_of(name));
        Ok(Some(h))
    }

    fn close_device(&self, ctx: Handle) -> io::Result<()> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        let used = st.objs.values().any(|o| match o {
            Obj::Pd { ctx: c } => *c == ctx.0,
            Obj::Cq(q) => q.ctx == ctx.0,
            Obj::Qp(q) => q.ctx == ctx.0,
            Obj::Mr(m) => m.ctx == ctx.0,
            Obj::Ctx(_) => false,
        });
        if used {
            return Err(errno(libc::EBUSY, "ibv_close_device: objects still alive"));
        }
        let gid = st.gid_of_ctx(ctx.0);
        st.objs.remove(&ctx.0);
        if let Some(g) = gid {
            st.publish(g);
        }
        Ok(())
    }

    fn query_device(&self, ctx: Handle) -> io::Result<DeviceAttr> {
        Ok(self.lock().ctx(ctx)?.profile.attr)
    }

    fn query_port(&self, ctx: Handle, port: u8) -> io::Result<PortAttr> {
        let st = self.lock();
        let c = st.ctx(ctx)?;
        if port != 1 {
            return Err(einval("ibv_query_port: the device has port 1 only"));
        }
        let (up, _) = st.device(&c.name);
        Ok(c.profile.port(up))
    }

    fn query_gid(&self, ctx: Handle, port: u8, index: u8) -> io::Result<[u8; 16]> {
        let st = self.lock();
        let c = st.ctx(ctx)?;
        if port != 1 || index != 0 {
            return Err(einval("ibv_query_gid: port 1 has GID index 0 only"));
        }
        Ok(c.gid.0)
    }

    fn ports(&self, name: &str, _sysfs: &Sysfs) -> Result<Vec<PortInfo>, SysfsError> {
        let profile = SoftProfile::for_name(name).ok_or_else(|| SysfsError::NoDevice {
            path: format!("soft verbs device {name}").into(),
        })?;
        Ok(vec![PortInfo {
            port: 1,
            link_layer: LinkLayer::Ethernet,
            active: true,
            lid: 0,
            active_mtu: profile.mtu,
            gids: vec![GidEntry {
                index: 0,
                gid: gid_of(name),
                kind: GidType::RoceV2,
            }],
        }])
    }

    fn alloc_pd(&self, ctx: Handle) -> io::Result<Handle> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        Ok(st.insert(Obj::Pd { ctx: ctx.0 }))
    }

    fn dealloc_pd(&self, pd: Handle) -> io::Result<()> {
        let mut st = self.lock();
        st.ctx_of_pd(pd)?;
        let used = st.objs.values().any(|o| match o {
            Obj::Qp(q) => q.pd == pd.0,
            Obj::Mr(m) => m.pd == pd.0,
            _ => false,
        });
        if used {
            return Err(errno(
                libc::EBUSY,
                "ibv_dealloc_pd: MRs or QPs still use it",
            ));
        }
        st.objs.remove(&pd.0);
        Ok(())
    }

    fn create_cq(&self, ctx: Handle, cqe: u32) -> io::Result<Handle> {
        self.lock().create_cq(ctx, cqe)
    }

    fn destroy_cq(&self, cq: Handle) -> io::Result<()> {
        self.lock().destroy_cq(cq)
    }

    fn create_qp(&self, pd: Handle, cq: Handle, caps: QpCaps) -> io::Result<(Handle, u32)> {
        self.lock().create_qp(pd, cq, caps)
    }

    fn modify_qp(&self, qp: Handle, t: &Transition) -> io::Result<()> {
        self.lock().modify_qp(qp, t)
    }

    fn destroy_qp(&self, qp: Handle) -> io::Result<()> {
        self.lock().destroy_qp(qp)
    }

    fn reg_mr(
        &self,
        pd: Handle,
        addr: u64,
        len: u64,
        access: u32,
    ) -> io::Result<(Handle, u32, u32)> {
        self.register(pd, addr, len, access, addr, None)
    }

    fn reg_dmabuf_mr(
        &self,
        pd: Handle,
        offset: u64,
        len: u64,
        iova: u64,
        fd: i32,
        access: u32,
    ) -> io::Result<(Handle, u32, u32)> {
        // The DMA-BUF stand-in: the fd is mapped here and the NIC addresses it at `iova`.
        let map = Mapping::map(fd, offset, len)?;
        self.register(pd, iova, len, access, map.host(), Some(map))
    }

    fn dereg_mr(&self, mr: Handle) -> io::Result<()> {
        self.lock().dereg_mr(mr)
    }

    fn post_read(&self, qp: Handle, wr: &ReadWr) -> io::Result<()> {
        self.lock().post_read(qp, wr)
    }

    fn poll_cq(&self, cq: Handle, out: &mut [Wc]) -> io::Result<usize> {
        self.lock().poll_cq(cq, out)
    }

    fn next_async_event(&self, ctx: Handle) -> io::Result<Option<AsyncEvent>> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        Ok(st.ctx_mut(ctx.0).and_then(|c| c.events.pop_front()))
    }
}

#[cfg(test)]
mod tests;
