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

mod fabric;
pub mod profile;

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

pub use profile::SoftProfile;

use super::gid::{Gid, GidEntry, GidType, LinkLayer, PortInfo};
use super::ops::{AsyncEvent, DeviceAttr, Handle, PortAttr, QpCaps, VerbsOps, Wc};
use super::qp_attrs::{mask, Transition, VerbsQpState};
use super::registration::{ACCESS_LOCAL_WRITE, ACCESS_RELAXED_ORDERING, ACCESS_REMOTE_READ};
use super::sysfs::{Sysfs, SysfsError};
use super::work::{wc, ReadWr};

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

struct Ctx {
    name: String,
    profile: SoftProfile,
    gid: Gid,
    events: VecDeque<AsyncEvent>,
}

struct Cq {
    ctx: usize,
    cap: usize,
    entries: VecDeque<Wc>,
    overrun: bool,
}

struct Qp {
    ctx: usize,
    pd: usize,
    cq: usize,
    qpn: u32,
    caps: QpCaps,
    state: VerbsQpState,
    access: u32,
    mtu: u32,
    dest_qpn: u32,
    dest_gid: Gid,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    sq: VecDeque<ReadWr>,
}

struct Mr {
    ctx: usize,
    pd: usize,
    addr: u64,
    len: u64,
    access: u32,
    key: u32,
    /// Where the bytes of `addr` live in this process (differs from `addr` for DMA-BUF MRs,
    /// which are mapped here).
    host: u64,
    /// Keeps a DMA-BUF stand-in mapped while the MR lives.
    _map: Option<Mapping>,
    /// Where other processes find the bytes (remotely readable memfd-backed MRs).
    export: Option<fabric::Export>,
}

/// A DMA-BUF stand-in mapped into this process (a memfd or any mappable fd).
struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; it is only unmapped in `Drop`.
unsafe impl Send for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from a successful mmap and are unmapped once.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

enum Obj {
    Ctx(Ctx),
    Pd { ctx: usize },
    Cq(Cq),
    Qp(Box<Qp>),
    Mr(Mr),
}

#[derive(Default)]
struct Device {
    port_up: bool,
    vanished: bool,
    stalled: bool,
    /// (countdown, status) of injected completion errors.
    errors: Vec<(u64, u32)>,
}

#[derive(Default)]
struct State {
    objs: HashMap<usize, Obj>,
    next: usize,
    next_qpn: u32,
    next_key: u32,
    devices: HashMap<String, Device>,
    /// Reads executed, by device name (tests read it through [`SoftOps::reads`]).
    reads: HashMap<String, u64>,
    /// Other processes' memory mapped here.
    maps: fabric::Maps,
}

/// Where a read's bytes come from.
enum Src {
    /// No responder answers (gone, unconnected, port down).
    None,
    Local {
        ctx: usize,
        pd: usize,
        access: u32,
    },
    Remote {
        pid: u32,
        pd: usize,
        access: u32,
        mrs: Vec<fabric::RemoteMr>,
    },
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

/// The GID a device name has on this host: fixed per (process, name), never link-local.
fn gid_of(name: &str) -> Gid {
    let mut g = [0u8; 16];
    g[0] = 0xfd;
    g[1] = 0x6b;
    g[2..6].copy_from_slice(&std::process::id().to_be_bytes());
    // FNV-1a of the name: distinct devices get distinct GIDs.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    g[6..14].copy_from_slice(&h.to_be_bytes());
    g[15] = 1;
    Gid(g)
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

impl State {
    /// Republishes every GID of the device `name` (after a port or presence change).
    fn publish_name(&self, name: &str) {
        let gids: Vec<Gid> = self
            .objs
            .values()
            .filter_map(|o| match o {
                Obj::Ctx(c) if c.name == name => Some(c.gid),
                _ => None,
            })
            .collect();
        for g in gids {
            self.publish(g);
        }
        if let Some(p) = SoftProfile::for_name(name).map(|_| gid_of(name)) {
            self.publish(p);
        }
    }

    /// Republishes what other processes must check about `gid`: its ready QPs and its
    /// exported MRs (nothing, once no context of it is open).
    fn publish(&self, gid: Gid) {
        let ctxs: Vec<(usize, &Ctx)> = self
            .objs
            .iter()
            .filter_map(|(id, o)| match o {
                Obj::Ctx(c) if c.gid == gid => Some((*id, c)),
                _ => None,
            })
            .collect();
        let Some((_, first)) = ctxs.first() else {
            fabric::publish(&gid, None);
            return;
        };
        let (up, vanished) = self.device(&first.name);
        let mine = |ctx: usize| ctxs.iter().any(|(id, _)| *id == ctx);
        let mut p = fabric::Published {
            pid: std::process::id(),
            up: up && !vanished,
            ..fabric::Published::default()
        };
        for o in self.objs.values() {
            match o {
                Obj::Qp(q) if mine(q.ctx) => p.qps.push(fabric::RemoteQp {
                    qpn: q.qpn,
                    ready: matches!(
                        q.state,
                        VerbsQpState::ReadyToReceive | VerbsQpState::ReadyToSend
                    ),
                    access: q.access,
                    dest_qpn: q.dest_qpn,
                    dest_gid: q.dest_gid,
                    depth: q.max_dest_rd_atomic,
                    pd: q.pd,
                }),
                Obj::Mr(m) if mine(m.ctx) => {
                    if let Some(export) = m.export {
                        p.mrs.push(fabric::RemoteMr {
                            key: m.key,
                            pd: m.pd,
                            addr: m.addr,
                            len: m.len,
                            access: m.access,
                            export,
                        });
                    }
                }
                _ => {}
            }
        }
        fabric::publish(&gid, Some(&p));
    }

    fn gid_of_ctx(&self, ctx: usize) -> Option<Gid> {
        match self.objs.get(&ctx) {
            Some(Obj::Ctx(c)) => Some(c.gid),
            _ => None,
        }
    }

    /// A responder in another process, through the fabric.
    fn remote_responder(&self, gid: Gid, qpn: u32, from_gid: Gid, from_qpn: u32) -> (Src, usize) {
        let Some(p) = fabric::lookup(&gid) else {
            return (Src::None, 0);
        };
        if !p.up {
            return (Src::None, 0);
        }
        let Some(q) = p
            .qps
            .iter()
            .find(|q| q.qpn == qpn && q.ready && q.dest_qpn == from_qpn && q.dest_gid == from_gid)
        else {
            return (Src::None, 0);
        };
        let (pd, access, depth) = (q.pd, q.access, usize::from(q.depth));
        (
            Src::Remote {
                pid: p.pid,
                pd,
                access,
                mrs: p.mrs,
            },
            depth,
        )
    }

    fn insert(&mut self, o: Obj) -> Handle {
        self.next += 1;
        self.objs.insert(self.next, o);
        Handle(self.next)
    }

    fn ctx(&self, h: Handle) -> io::Result<&Ctx> {
        match self.objs.get(&h.0) {
            Some(Obj::Ctx(c)) => Ok(c),
            _ => Err(einval("not a device context")),
        }
    }

    fn ctx_mut(&mut self, id: usize) -> Option<&mut Ctx> {
        match self.objs.get_mut(&id) {
            Some(Obj::Ctx(c)) => Some(c),
            _ => None,
        }
    }

    fn ctx_of_pd(&self, pd: Handle) -> io::Result<usize> {
        match self.objs.get(&pd.0) {
            Some(Obj::Pd { ctx }) => Ok(*ctx),
            _ => Err(einval("not a protection domain")),
        }
    }

    fn qp_mut(&mut self, h: Handle) -> io::Result<&mut Qp> {
        match self.objs.get_mut(&h.0) {
            Some(Obj::Qp(q)) => Ok(q),
            _ => Err(einval("not a queue pair")),
        }
    }

    fn device(&self, name: &str) -> (bool, bool) {
        self.devices
            .get(name)
            .map_or((true, false), |d| (d.port_up, d.vanished))
    }

    fn port_event(&mut self, name: &str, up: bool) {
        let ctxs: Vec<usize> = self
            .objs
            .iter()
            .filter_map(|(id, o)| match o {
                Obj::Ctx(c) if c.name == name => Some(*id),
                _ => None,
            })
            .collect();
        for id in &ctxs {
            if let Some(c) = self.ctx_mut(*id) {
                c.events.push_back(if up {
                    AsyncEvent::PortActive { port: 1 }
                } else {
                    AsyncEvent::PortError { port: 1 }
                });
            }
        }
        if !up {
            // A port that goes down takes its connected QPs to error (their sends flush).
            let qps: Vec<usize> = self
                .objs
                .iter()
                .filter_map(|(id, o)| match o {
                    Obj::Qp(q) if ctxs.contains(&q.ctx) => Some(*id),
                    _ => None,
                })
                .collect();
            for q in qps {
                self.fail_qp(q);
            }
        }
    }

    /// Moves a QP to error and flushes its send queue.
    fn fail_qp(&mut self, qp: usize) {
        let Some(Obj::Qp(q)) = self.objs.get_mut(&qp) else {
            return;
        };
        q.state = VerbsQpState::Error;
        let (cq, qpn) = (q.cq, q.qpn);
        let flushed: Vec<u64> = q.sq.drain(..).map(|w| w.wr_id).collect();
        for wr_id in flushed {
            self.push_cqe(
                cq,
                Wc {
                    wr_id,
                    status: wc::WR_FLUSH_ERR,
                    qp_num: qpn,
                    byte_len: 0,
                },
            );
        }
    }

    /// Delivers a completion; a full CQ overruns: it fails from now on, its QPs go to error
    /// (without completions: there is nowhere to put them) and the context hears `CqError`.
    fn push_cqe(&mut self, cq: usize, e: Wc) {
        let Some(Obj::Cq(c)) = self.objs.get_mut(&cq) else {
            return;
        };
        if c.overrun {
            return;
        }
        if c.entries.len() < c.cap {
            c.entries.push_back(e);
            return;
        }
        c.overrun = true;
        let ctx = c.ctx;
        tracing::warn!(cq, cap = c.cap, "soft verbs: completion queue overrun");
        if let Some(x) = self.ctx_mut(ctx) {
            x.events.push_back(AsyncEvent::CqError);
        }
        for o in self.objs.values_mut() {
            if let Obj::Qp(q) = o {
                if q.cq == cq {
                    q.state = VerbsQpState::Error;
                    q.sq.clear();
                }
            }
        }
    }

    /// Finds an MR of `ctx`/`pd` by key covering `addr..addr+len`.
    fn mr_covering(&self, ctx: usize, pd: usize, key: u32, addr: u64, len: u64) -> Option<&Mr> {
        self.objs.values().find_map(|o| match o {
            Obj::Mr(m)
                if m.ctx == ctx
                    && m.pd == pd
                    && m.key == key
                    && addr >= m.addr
                    && addr
                        .checked_add(len)
                        .is_some_and(|e| e <= m.addr.saturating_add(m.len)) =>
            {
                Some(m)
            }
            _ => None,
        })
    }

    /// The responder QP a requester QP is connected to: same GID, QPN, connected back.
    fn responder(&self, gid: Gid, qpn: u32, from_gid: Gid, from_qpn: u32) -> Option<usize> {
        self.objs.iter().find_map(|(id, o)| match o {
            Obj::Qp(q) if q.qpn == qpn => {
                let Some(Obj::Ctx(c)) = self.objs.get(&q.ctx) else {
                    return None;
                };
                let (up, vanished) = self.device(&c.name);
                (c.gid == gid
                    && up
                    && !vanished
                    && q.dest_qpn == from_qpn
                    && q.dest_gid == from_gid
                    && matches!(
                        q.state,
                        VerbsQpState::ReadyToReceive | VerbsQpState::ReadyToSend
                    ))
                .then_some(*id)
            }
            _ => None,
        })
    }

    /// One round of the progress engine for every QP reporting to `cq`.
    fn progress(&mut self, cq: usize) {
        let qps: Vec<usize> = self
            .objs
            .iter()
            .filter_map(|(id, o)| match o {
                Obj::Qp(q)
                    if q.cq == cq && q.state == VerbsQpState::ReadyToSend && !q.sq.is_empty() =>
                {
                    Some(*id)
                }
                _ => None,
            })
            .collect();
        for id in qps {
            self.progress_qp(id);
        }
    }

    fn progress_qp(&mut self, id: usize) {
        let Some(Obj::Qp(q)) = self.objs.get(&id) else {
            return;
        };
        let (ctx, pd, cq, qpn) = (q.ctx, q.pd, q.cq, q.qpn);
        let (dest_gid, dest_qpn) = (q.dest_gid, q.dest_qpn);
        let batch = usize::from(q.max_rd_atomic).min(q.sq.len());
        let Some(Obj::Ctx(c)) = self.objs.get(&ctx) else {
            return;
        };
        let (name, gid, max_msg) = (c.name.clone(), c.gid, c.profile.max_msg_sz);
        if self.devices.get(&name).is_some_and(|d| d.stalled) {
            return;
        }
        let (port_up, _) = self.device(&name);
        let local = if port_up {
            self.responder(dest_gid, dest_qpn, gid, qpn)
        } else {
            None
        };
        // The responder sees the whole batch in flight at once.
        let (src, depth) = match local.and_then(|r| self.objs.get(&r)) {
            Some(Obj::Qp(r)) => (
                Src::Local {
                    ctx: r.ctx,
                    pd: r.pd,
                    access: r.access,
                },
                usize::from(r.max_dest_rd_atomic),
            ),
            _ if port_up => self.remote_responder(dest_gid, dest_qpn, gid, qpn),
            _ => (Src::None, 0),
        };
        for i in 0..batch {
            let Some(Obj::Qp(q)) = self.objs.get_mut(&id) else {
                return;
            };
            let Some(wr) = q.sq.pop_front() else {
                return;
            };
            *self.reads.entry(name.clone()).or_default() += 1;
            let status = self.execute(&name, (ctx, pd), &src, i >= depth, max_msg, &wr);
            let len: u64 = wr.sges.iter().map(|s| u64::from(s.len)).sum();
            self.push_cqe(
                cq,
                Wc {
                    wr_id: wr.wr_id,
                    status,
                    qp_num: qpn,
                    byte_len: if status == wc::SUCCESS { len as u32 } else { 0 },
                },
            );
            if status != wc::SUCCESS {
                self.fail_qp(id);
                return;
            }
        }
    }

    /// Executes one read; the completion status.
    fn execute(
        &mut self,
        name: &str,
        (ctx, pd): (usize, usize),
        src: &Src,
        over_depth: bool,
        max_msg: u64,
        wr: &ReadWr,
    ) -> u32 {
        if let Some(d) = self.devices.get_mut(name) {
            let mut hit = None;
            for (i, (left, status)) in d.errors.iter_mut().enumerate() {
                if *left == 0 {
                    hit = Some((i, *status));
                    break;
                }
                *left -= 1;
            }
            if let Some((i, status)) = hit {
                d.errors.remove(i);
                return status;
            }
        }
        let r_access = match src {
            Src::None => return wc::RETRY_EXC_ERR,
            Src::Local { access, .. } | Src::Remote { access, .. } => *access,
        };
        if over_depth {
            return wc::REM_INV_REQ_ERR;
        }
        let len: u64 = wr.sges.iter().map(|s| u64::from(s.len)).sum();
        if len > max_msg {
            return wc::LOC_LEN_ERR;
        }
        if r_access & ACCESS_REMOTE_READ == 0 {
            return wc::REM_ACCESS_ERR;
        }
        let (addr, rkey) = (wr.remote_addr, wr.rkey);
        let found = match src {
            Src::None => None,
            Src::Local { ctx, pd, .. } => self
                .mr_covering(*ctx, *pd, rkey, addr, len)
                .filter(|m| m.access & ACCESS_REMOTE_READ != 0)
                .map(|m| m.host + (addr - m.addr)),
            Src::Remote { pid, pd, mrs, .. } => mrs
                .iter()
                .find(|m| {
                    m.key == rkey
                        && m.pd == *pd
                        && m.access & ACCESS_REMOTE_READ != 0
                        && addr >= m.addr
                        && addr
                            .checked_add(len)
                            .is_some_and(|e| e <= m.addr.saturating_add(m.len))
                })
                .and_then(|m| {
                    let e = m.export;
                    self.maps
                        .get(*pid, &e)
                        .and_then(|map| map.at(e.offset + (addr - m.addr), len))
                }),
        };
        let Some(src) = found else {
            return wc::REM_ACCESS_ERR;
        };
        let mut dsts = Vec::with_capacity(wr.sges.len());
        for s in &wr.sges {
            match self
                .mr_covering(ctx, pd, s.lkey, s.addr, u64::from(s.len))
                .filter(|m| m.access & ACCESS_LOCAL_WRITE != 0)
            {
                Some(m) => dsts.push((m.host + (s.addr - m.addr), s.len as usize)),
                None => return wc::LOC_PROT_ERR,
            }
        }
        let mut at = src;
        for (dst, n) in dsts {
            // SAFETY: both ranges lie inside live MRs (checked above, under the fabric lock),
            // whose memory the registrants keep mapped until they deregister; source and
            // destination may alias only if a test reads a region into itself, which
            // `copy` (memmove) allows.
            unsafe { std::ptr::copy(at as *const u8, dst as *mut u8, n) };
            at += n as u64;
        }
        wc::SUCCESS
    }
}

/// Required and optional attribute bits of each RC transition (IBA 11.2.4.2, as rdma-core's
/// `ibv_modify_qp` man page lists them).
fn transition_masks(from: VerbsQpState, to: VerbsQpState) -> Option<(u32, u32)> {
    use VerbsQpState::*;
    let s = mask::STATE;
    match (from, to) {
        (_, Reset) | (_, Error) => Some((s, 0)),
        (Reset, Init) => Some((s | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS, 0)),
        (Init, Init) => Some((s, mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS)),
        (Init, ReadyToReceive) => Some((
            s | mask::AV
                | mask::PATH_MTU
                | mask::DEST_QPN
                | mask::RQ_PSN
                | mask::MAX_DEST_RD_ATOMIC
                | mask::MIN_RNR_TIMER,
            mask::ACCESS_FLAGS | mask::PKEY_INDEX,
        )),
        (ReadyToReceive, ReadyToSend) => Some((
            s | mask::SQ_PSN
                | mask::TIMEOUT
                | mask::RETRY_CNT
                | mask::RNR_RETRY
                | mask::MAX_QP_RD_ATOMIC,
            mask::ACCESS_FLAGS | mask::MIN_RNR_TIMER,
        )),
        (ReadyToSend, ReadyToSend) => Some((s, mask::ACCESS_FLAGS | mask::MIN_RNR_TIMER)),
        _ => None,
    }
}

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
        let mut st = self.lock();
        let max = st.ctx(ctx)?.profile.attr.max_cqe;
        if cqe == 0 || cqe > max {
            return Err(einval(&format!(
                "ibv_create_cq: {cqe} entries, the device takes 1..={max}"
            )));
        }
        Ok(st.insert(Obj::Cq(Cq {
            ctx: ctx.0,
            cap: cqe as usize,
            entries: VecDeque::new(),
            overrun: false,
        })))
    }

    fn destroy_cq(&self, cq: Handle) -> io::Result<()> {
        let mut st = self.lock();
        if !matches!(st.objs.get(&cq.0), Some(Obj::Cq(_))) {
            return Err(einval("not a completion queue"));
        }
        if st
            .objs
            .values()
            .any(|o| matches!(o, Obj::Qp(q) if q.cq == cq.0))
        {
            return Err(errno(libc::EBUSY, "ibv_destroy_cq: QPs still use it"));
        }
        st.objs.remove(&cq.0);
        Ok(())
    }

    fn create_qp(&self, pd: Handle, cq: Handle, caps: QpCaps) -> io::Result<(Handle, u32)> {
        let mut st = self.lock();
        let ctx = st.ctx_of_pd(pd)?;
        match st.objs.get(&cq.0) {
            Some(Obj::Cq(c)) if c.ctx == ctx => {}
            _ => return Err(einval("ibv_create_qp: CQ of another context")),
        }
        let attr = st.ctx(Handle(ctx))?.profile.attr;
        if caps.max_send_wr == 0 || caps.max_send_wr > attr.max_qp_wr {
            return Err(einval(&format!(
                "ibv_create_qp: max_send_wr {} exceeds the device's max_qp_wr {}",
                caps.max_send_wr, attr.max_qp_wr
            )));
        }
        if caps.max_send_sge == 0 || caps.max_send_sge > attr.max_sge {
            return Err(einval(&format!(
                "ibv_create_qp: max_send_sge {} exceeds the device's max_sge {}",
                caps.max_send_sge, attr.max_sge
            )));
        }
        let live = st
            .objs
            .values()
            .filter(|o| matches!(o, Obj::Qp(q) if q.ctx == ctx))
            .count();
        if live >= attr.max_qp as usize {
            return Err(errno(libc::ENOMEM, "ibv_create_qp: max_qp reached"));
        }
        st.next_qpn = (st.next_qpn % (MASK_24 - 0x100)) + 1;
        let qpn = 0x100 + st.next_qpn;
        let h = st.insert(Obj::Qp(Box::new(Qp {
            ctx,
            pd: pd.0,
            cq: cq.0,
            qpn,
            caps,
            state: VerbsQpState::Reset,
            access: 0,
            mtu: 0,
            dest_qpn: 0,
            dest_gid: Gid::default(),
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            sq: VecDeque::new(),
        })));
        Ok((h, qpn))
    }

    fn modify_qp(&self, qp: Handle, t: &Transition) -> io::Result<()> {
        let mut st = self.lock();
        let q = st.qp_mut(qp)?;
        let ctx = q.ctx;
        let from = q.state;
        let Some((required, optional)) = transition_masks(from, t.state) else {
            return Err(einval(&format!(
                "ibv_modify_qp: {from:?} -> {:?} is not a transition",
                t.state
            )));
        };
        if t.mask & required != required {
            return Err(einval(&format!(
                "ibv_modify_qp {from:?} -> {:?}: attribute mask {:#x} lacks required {:#x}",
                t.state,
                t.mask,
                required & !t.mask
            )));
        }
        if t.mask & !(required | optional) != 0 {
            return Err(einval(&format!(
                "ibv_modify_qp {from:?} -> {:?}: attribute mask bits {:#x} are not allowed",
                t.state,
                t.mask & !(required | optional)
            )));
        }
        let c = match st.objs.get(&ctx) {
            Some(Obj::Ctx(c)) => c,
            _ => return Err(einval("context closed")),
        };
        let profile = c.profile;
        let has = |b: u32| t.mask & b != 0;
        if has(mask::PORT) && t.port != 1 {
            return Err(einval("ibv_modify_qp: port_num must be 1"));
        }
        if has(mask::ACCESS_FLAGS) && t.access_flags & !KNOWN_ACCESS != 0 {
            return Err(einval("ibv_modify_qp: unknown access flags"));
        }
        if has(mask::PATH_MTU) && t.path_mtu > profile.mtu {
            return Err(einval(&format!(
                "ibv_modify_qp: path MTU {} exceeds the port's {}",
                t.path_mtu.bytes(),
                profile.mtu.bytes()
            )));
        }
        if has(mask::DEST_QPN) && (t.dest_qpn == 0 || t.dest_qpn > MASK_24) {
            return Err(einval(
                "ibv_modify_qp: dest_qp_num is zero or wider than 24 bits",
            ));
        }
        if (has(mask::RQ_PSN) && t.rq_psn > MASK_24) || (has(mask::SQ_PSN) && t.sq_psn > MASK_24) {
            return Err(einval("ibv_modify_qp: PSN wider than 24 bits"));
        }
        if has(mask::MAX_DEST_RD_ATOMIC)
            && u32::from(t.max_dest_rd_atomic) > profile.attr.max_qp_rd_atom
        {
            return Err(einval(&format!(
                "ibv_modify_qp: max_dest_rd_atomic {} exceeds the device's max_qp_rd_atom {}",
                t.max_dest_rd_atomic, profile.attr.max_qp_rd_atom
            )));
        }
        if has(mask::MAX_QP_RD_ATOMIC)
            && u32::from(t.max_rd_atomic) > profile.attr.max_qp_init_rd_atom
        {
            return Err(einval(&format!(
                "ibv_modify_qp: max_rd_atomic {} exceeds the device's max_qp_init_rd_atom {}",
                t.max_rd_atomic, profile.attr.max_qp_init_rd_atom
            )));
        }
        if (has(mask::RETRY_CNT) && t.retry_cnt > 7)
            || (has(mask::RNR_RETRY) && t.rnr_retry > 7)
            || (has(mask::TIMEOUT) && t.timeout > 31)
        {
            return Err(einval("ibv_modify_qp: retry or timeout out of range"));
        }
        if has(mask::AV) {
            if t.av.port != 1 {
                return Err(einval("ibv_modify_qp: address vector port must be 1"));
            }
            if !t.av.is_global || t.av.dgid.is_zero() || t.av.sgid_index != 0 {
                return Err(einval(
                    "ibv_modify_qp: a RoCE port needs a global route with a GID (index 0)",
                ));
            }
        }
        let gid = st.gid_of_ctx(ctx);
        if t.state == VerbsQpState::Error {
            st.fail_qp(qp.0);
            if let Some(g) = gid {
                st.publish(g);
            }
            return Ok(());
        }
        let q = st.qp_mut(qp)?;
        if has(mask::ACCESS_FLAGS) {
            q.access = t.access_flags;
        }
        if has(mask::PATH_MTU) {
            q.mtu = t.path_mtu.bytes();
        }
        if has(mask::DEST_QPN) {
            q.dest_qpn = t.dest_qpn;
        }
        if has(mask::AV) {
            q.dest_gid = t.av.dgid;
        }
        if has(mask::MAX_DEST_RD_ATOMIC) {
            q.max_dest_rd_atomic = t.max_dest_rd_atomic;
        }
        if has(mask::MAX_QP_RD_ATOMIC) {
            q.max_rd_atomic = t.max_rd_atomic;
        }
        if t.state == VerbsQpState::Reset {
            q.sq.clear();
            q.access = 0;
            q.dest_qpn = 0;
            q.dest_gid = Gid::default();
        }
        q.state = t.state;
        if let Some(g) = gid {
            st.publish(g);
        }
        Ok(())
    }

    fn destroy_qp(&self, qp: Handle) -> io::Result<()> {
        let mut st = self.lock();
        let ctx = st.qp_mut(qp)?.ctx;
        st.objs.remove(&qp.0);
        if let Some(g) = st.gid_of_ctx(ctx) {
            st.publish(g);
        }
        Ok(())
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
        let n = usize::try_from(len).map_err(|_| einval("ibv_reg_dmabuf_mr: length"))?;
        let off = libc::off_t::try_from(offset).map_err(|_| einval("ibv_reg_dmabuf_mr: offset"))?;
        // SAFETY: a new shared mapping of `fd`; nothing existing is affected. Failure is
        // checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                off,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let map = Mapping { ptr, len: n };
        self.register(pd, iova, len, access, ptr as u64, Some(map))
    }

    fn dereg_mr(&self, mr: Handle) -> io::Result<()> {
        let mut st = self.lock();
        match st.objs.remove(&mr.0) {
            Some(Obj::Mr(m)) => {
                if m.export.is_some() {
                    if let Some(g) = st.gid_of_ctx(m.ctx) {
                        st.publish(g);
                    }
                }
                Ok(())
            }
            Some(other) => {
                st.objs.insert(mr.0, other);
                Err(einval("not a memory region"))
            }
            None => Err(einval("not a memory region")),
        }
    }

    fn post_read(&self, qp: Handle, wr: &ReadWr) -> io::Result<()> {
        let mut st = self.lock();
        let q = st.qp_mut(qp)?;
        if wr.sges.len() > q.caps.max_send_sge as usize {
            return Err(einval(&format!(
                "ibv_post_send: {} SGEs, the QP takes {}",
                wr.sges.len(),
                q.caps.max_send_sge
            )));
        }
        match q.state {
            VerbsQpState::ReadyToSend => {}
            VerbsQpState::Error => {
                let (cq, qpn) = (q.cq, q.qpn);
                st.push_cqe(
                    cq,
                    Wc {
                        wr_id: wr.wr_id,
                        status: wc::WR_FLUSH_ERR,
                        qp_num: qpn,
                        byte_len: 0,
                    },
                );
                return Ok(());
            }
            s => {
                return Err(einval(&format!(
                    "ibv_post_send: the QP is in {s:?}, sends need RTS"
                )))
            }
        }
        if q.sq.len() >= q.caps.max_send_wr as usize {
            return Err(errno(libc::ENOMEM, "ibv_post_send: send queue full"));
        }
        q.sq.push_back(wr.clone());
        Ok(())
    }

    fn poll_cq(&self, cq: Handle, out: &mut [Wc]) -> io::Result<usize> {
        let mut st = self.lock();
        match st.objs.get(&cq.0) {
            Some(Obj::Cq(c)) if c.overrun => {
                return Err(io::Error::other("ibv_poll_cq: the CQ overran"));
            }
            Some(Obj::Cq(_)) => {}
            _ => return Err(einval("not a completion queue")),
        }
        st.progress(cq.0);
        let Some(Obj::Cq(c)) = st.objs.get_mut(&cq.0) else {
            return Err(einval("not a completion queue"));
        };
        if c.overrun {
            return Err(io::Error::other("ibv_poll_cq: the CQ overran"));
        }
        let mut n = 0;
        while n < out.len() {
            let Some(e) = c.entries.pop_front() else {
                break;
            };
            out[n] = e;
            n += 1;
        }
        Ok(n)
    }

    fn next_async_event(&self, ctx: Handle) -> io::Result<Option<AsyncEvent>> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        Ok(st.ctx_mut(ctx.0).and_then(|c| c.events.pop_front()))
    }
}

impl SoftOps {
    fn register(
        &self,
        pd: Handle,
        addr: u64,
        len: u64,
        access: u32,
        host: u64,
        map: Option<Mapping>,
    ) -> io::Result<(Handle, u32, u32)> {
        let mut st = self.lock();
        let ctx = st.ctx_of_pd(pd)?;
        let attr = st.ctx(Handle(ctx))?.profile.attr;
        if len == 0 || addr.checked_add(len).is_none() || len > attr.max_mr_size {
            return Err(einval("ibv_reg_mr: empty, wrapping or too long"));
        }
        if access & !KNOWN_ACCESS != 0 {
            return Err(einval("ibv_reg_mr: unknown access flags"));
        }
        // IBA: remote write or atomic access needs local write.
        if access & (ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC) != 0
            && access & ACCESS_LOCAL_WRITE == 0
        {
            return Err(einval("ibv_reg_mr: remote write needs local write"));
        }
        let live = st
            .objs
            .values()
            .filter(|o| matches!(o, Obj::Mr(m) if m.ctx == ctx))
            .count();
        if live >= attr.max_mr as usize {
            return Err(errno(libc::ENOMEM, "ibv_reg_mr: max_mr reached"));
        }
        // Keys: an index in the high 24 bits and a varying low byte, as hardware keys look.
        st.next_key = st.next_key.wrapping_add(1);
        let key = (st.next_key << 8) | (st.next_key.wrapping_mul(37) & 0xff);
        // Remotely readable host memory is offered to other processes where a memfd holds it.
        let export = (access & ACCESS_REMOTE_READ != 0 && map.is_none())
            .then(|| fabric::export_of(addr, len))
            .flatten();
        let h = st.insert(Obj::Mr(Mr {
            ctx,
            pd: pd.0,
            addr,
            len,
            access,
            key,
            host,
            _map: map,
            export,
        }));
        if export.is_some() {
            if let Some(g) = st.gid_of_ctx(ctx) {
                st.publish(g);
            }
        }
        Ok((h, key, key))
    }
}

#[cfg(test)]
mod tests;
