//! The verbs provider: a [`VerbsNic`] (open device, completion poller thread, QP table) and
//! a [`VerbsConnector`] that brings RC QPs to ready-to-send and issues `IBV_WR_RDMA_READ`s,
//! over whichever [`super::ops::VerbsOps`] table serves the device (rdma-core or the software
//! device).
//!
//! One request of the RC queue contract may become several RDMA READs: a read is cut where
//! the owner's advertised MRs end (one READ names one rkey; the pool is registered in
//! `registration-chunk` pieces) and at the port's `max_msg_sz`. The parts share the request's
//! completion, reported once, when the last part completes (the first failure wins). Parts
//! wait in a backlog while the send queue is full, and are posted as completions free it.
//!
//! Completions are polled by one thread per NIC and pushed, one per request, into the QP's
//! [`CompletionSink`]. The same thread reads the device's asynchronous events: a CQ overrun
//! fails every request on that CQ as a transport error (their QPs are unusable; the worker
//! rebuilds them) and gives new QPs a fresh CQ, so the NIC recovers without a restart.
//! `abort` moves the QP to error, so every outstanding read completes flushed (the shared
//! drain contract); dropping a connection waits for that drain before destroying the QP.
//!
//! Reads land straight in the request's destination: the SGEs are the ranges the MR table
//! checked when the request was accepted (its resolved [`crate::Scatter`]), keyed by this
//! NIC's registrations of those regions. A destination the NIC has not registered is a post
//! error; nothing is staged and copied, so a direct load over verbs cannot fall back to host
//! memory.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::config::VerbsConfig;
use super::device::{DeviceError, Registration, VerbsDevice};
use super::ops::{AsyncEvent, Handle, QpCaps, Wc};
use super::qp_attrs::{connect_transitions, responder_depth, QpEndpoint, Transition};
use super::registration::{KeyMap, ACCESS_REMOTE_READ};
use super::sysfs::Sysfs;
use super::work::{build_read, completion_status, ReadWr};
use crate::completion::{CompletionSink, CompletionStatus, WorkCompletion};
use crate::config::NicConfig;
use crate::connection::{Connection, ConnectionError, Connector, WorkRequest};
use crate::qp_key::{NodeId, QpKey};
use crate::region::HostRegion;

const POLL_BATCH: usize = 32;
const IDLE_SLEEP: Duration = Duration::from_micros(50);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections are single map updates; poisoning carries no meaning.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub use super::nic::EndpointExchange;

/// An issued request: holding it holds its destination (the scatter pins the regions, so
/// they stay registered) until its last part completes.
struct Pending {
    wr: WorkRequest,
    parts_left: usize,
    status: CompletionStatus,
}

#[derive(Default)]
struct SendQueue {
    /// Part id → request wr_id.
    parts: HashMap<u64, u64>,
    /// Parts not yet posted (the send queue was full).
    backlog: VecDeque<ReadWr>,
    posted: usize,
    next_part: u64,
    /// The QP failed outside a completion (CQ overrun): nothing more is posted.
    broken: bool,
}

struct ConnShared {
    key: QpKey,
    peer: NodeId,
    qp: Handle,
    cq: Handle,
    device: Arc<VerbsDevice>,
    max_send_wr: usize,
    sink: Arc<dyn CompletionSink>,
    pending: Mutex<HashMap<u64, Pending>>,
    sq: Mutex<SendQueue>,
}

impl ConnShared {
    /// Posts backlogged parts while the send queue has room.
    fn pump(&self) {
        loop {
            let wr = {
                let mut sq = lock(&self.sq);
                if sq.broken || sq.posted >= self.max_send_wr {
                    return;
                }
                let Some(wr) = sq.backlog.pop_front() else {
                    return;
                };
                sq.posted += 1;
                wr
            };
            if let Err(e) = self.device.ops().post_read(self.qp, &wr) {
                tracing::warn!(peer = %self.peer, error = %e, "verbs: posting a read part failed");
                lock(&self.sq).posted -= 1;
                self.part_done(wr.wr_id, CompletionStatus::PostFailed, false);
            }
        }
    }

    /// One part finished (`posted`: it had been posted, so it held a send-queue slot).
    fn part_done(&self, part: u64, status: CompletionStatus, posted: bool) {
        let wr_id = {
            let mut sq = lock(&self.sq);
            if posted {
                sq.posted = sq.posted.saturating_sub(1);
            }
            match sq.parts.remove(&part) {
                Some(w) => w,
                None => return,
            }
        };
        let finished = {
            let mut pending = lock(&self.pending);
            let Some(p) = pending.get_mut(&wr_id) else {
                return;
            };
            p.parts_left -= 1;
            if !status.is_success() && p.status.is_success() {
                p.status = status;
            }
            if p.parts_left == 0 {
                pending.remove(&wr_id)
            } else {
                None
            }
        };
        if let Some(p) = finished {
            self.complete(wr_id, p);
        }
    }

    /// Finishes one request: make device pieces visible on success, release the
    /// destination, then report.
    fn complete(&self, wr_id: u64, p: Pending) {
        let len = p.wr.remote.len;
        let status = if p.status.is_success() {
            match p.wr.scatter.finish() {
                Ok(()) => CompletionStatus::Success,
                Err(_) => CompletionStatus::LocalWriteError,
            }
        } else {
            p.status
        };
        drop(p);
        self.sink.push(WorkCompletion {
            qp: self.key,
            wr_id,
            status,
            bytes: if status.is_success() { len } else { 0 },
        });
    }

    /// Fails every outstanding request with `status` (the QP is unusable and nothing more
    /// will come from the device for it).
    fn fail_all(&self, status: CompletionStatus) {
        {
            let mut sq = lock(&self.sq);
            sq.broken = true;
            sq.backlog.clear();
            sq.parts.clear();
            sq.posted = 0;
        }
        let left: Vec<(u64, Pending)> = lock(&self.pending).drain().collect();
        for (wr_id, mut p) in left {
            p.status = status;
            self.complete(wr_id, p);
        }
    }
}

struct NicInner {
    device: Arc<VerbsDevice>,
    conns: Mutex<HashMap<u32, Arc<ConnShared>>>,
    stop: AtomicBool,
    async_events: AtomicU64,
    cq_overruns: AtomicU64,
}

/// One RDMA NIC in use: the device and its completion poller thread.
pub struct VerbsNic {
    inner: Arc<NicInner>,
    nic: NicConfig,
    cfg: VerbsConfig,
    poller: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for VerbsNic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsNic")
            .field("device", &self.inner.device)
            .finish()
    }
}

impl VerbsNic {
    /// Opens the device `name` and starts its poller. The CQ is sized for `qps` QPs of
    /// `nic.max_send_wr` each (clamped to the device's `max_cqe`).
    pub fn open(
        name: &str,
        sysfs: &Sysfs,
        nic: NicConfig,
        cfg: VerbsConfig,
        qps: u32,
    ) -> Result<Arc<VerbsNic>, DeviceError> {
        let cqe = nic.max_send_wr.saturating_mul(qps.max(1));
        let device = Arc::new(VerbsDevice::open(name, sysfs, cqe)?);
        let inner = Arc::new(NicInner {
            device,
            conns: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            async_events: AtomicU64::new(0),
            cq_overruns: AtomicU64::new(0),
        });
        let t = inner.clone();
        let poller = std::thread::Builder::new()
            .name(format!("kvf-verbs-{name}"))
            .spawn(move || poll_loop(&t))
            .map_err(|source| DeviceError::Verbs {
                nic: name.to_string(),
                what: "spawning the completion poller",
                source,
            })?;
        Ok(Arc::new(VerbsNic {
            inner,
            nic,
            cfg,
            poller: Some(poller),
        }))
    }

    pub fn device(&self) -> &Arc<VerbsDevice> {
        &self.inner.device
    }

    /// Asynchronous events read so far, and CQ overruns among them.
    pub fn async_events(&self) -> (u64, u64) {
        (
            self.inner.async_events.load(Ordering::Relaxed),
            self.inner.cq_overruns.load(Ordering::Relaxed),
        )
    }

    /// QPs (requester connections) alive on this NIC.
    pub fn connections(&self) -> usize {
        lock(&self.inner.conns).len()
    }

    /// Registers the host pool on this NIC for remote reads.
    pub fn register_host(&self, region: &HostRegion) -> Result<Registration, DeviceError> {
        self.inner.device.register_host(region, &self.cfg)
    }

    /// Registers host memory that only this NIC writes into (a requester's destination
    /// outside the pool): local write only, shared by everyone registering the same range.
    pub fn register_local(&self, region: &HostRegion) -> Result<Arc<Registration>, DeviceError> {
        self.inner.device.register_local(region, &self.cfg)
    }

    /// Registers GPU memory (a DMA-BUF) on this NIC, local write only, shared by everyone
    /// registering the same planes.
    pub fn register_dmabuf(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: u64,
        iova: u64,
    ) -> Result<Arc<Registration>, DeviceError> {
        self.inner
            .device
            .register_dmabuf(fd, offset, len, iova, &self.cfg)
    }

    fn caps(&self) -> QpCaps {
        let limits = self.nic.queue_limits();
        self.inner
            .device
            .qp_caps(limits.max_send_wr, limits.max_sge)
    }

    /// The read depth this NIC lets a peer have outstanding: the configured depth within the
    /// device's `max_qp_rd_atom` (what Hello and Handshake must advertise).
    pub fn responder_depth(&self) -> u8 {
        responder_depth(self.nic.max_rd_atomic, self.inner.device.read_depth())
    }
}

impl super::nic::RdmaNic for VerbsNic {
    fn name(&self) -> &str {
        self.inner.device.name()
    }

    fn address(&self) -> super::gid::PortAddress {
        self.inner.device.address()
    }

    fn responder_depth(&self) -> Option<u8> {
        Some(VerbsNic::responder_depth(self))
    }

    fn pins_memory(&self) -> bool {
        // The software device registers nothing with the kernel.
        self.inner.device.ops().kind() != "soft"
    }

    fn limits(&self) -> Option<super::nic::NicLimits> {
        let a = self.inner.device.attr();
        Some(super::nic::NicLimits {
            max_sge: a.max_sge,
            max_qp_wr: a.max_qp_wr,
            max_qp_rd_atom: a.max_qp_rd_atom,
            max_msg_sz: self.inner.device.max_msg_sz(),
            mtu: self.inner.device.address().mtu,
            cq_entries: self.inner.device.cqe(),
        })
    }

    fn register_chunk(
        &self,
        region: &Arc<HostRegion>,
        chunk: super::registration::Chunk,
    ) -> Result<super::nic::ChunkMr, super::nic::RegistrarError> {
        let access = super::registration::access_flags(
            crate::mr_table::MrKind::Host,
            self.cfg.relaxed_ordering,
        );
        let reg = self
            .inner
            .device
            .register_host_chunk(region, chunk, access)
            .map_err(|e| match e {
                DeviceError::Verbs { nic, source, .. } => super::nic::RegistrarError::Register {
                    nic,
                    addr: chunk.addr,
                    len: chunk.len,
                    source,
                },
                other => super::nic::RegistrarError::Unavailable {
                    nic: self.inner.device.name().to_string(),
                    reason: other.to_string(),
                },
            })?;
        let keys = reg.advertised().first().map(|(_, k)| *k).ok_or_else(|| {
            super::nic::RegistrarError::Unavailable {
                nic: self.inner.device.name().to_string(),
                reason: "registration produced no MR".into(),
            }
        })?;
        // The registration and the region it covers drop together.
        Ok(super::nic::ChunkMr::new(chunk, keys, (reg, region.clone())))
    }

    fn register_device(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: u64,
        iova: u64,
    ) -> Result<Box<dyn std::any::Any + Send + Sync>, super::nic::RegistrarError> {
        self.register_dmabuf(fd, offset, len, iova)
            .map(|r| Box::new(r) as Box<dyn std::any::Any + Send + Sync>)
            .map_err(|e| super::nic::RegistrarError::Unavailable {
                nic: self.inner.device.name().to_string(),
                reason: e.to_string(),
            })
    }

    fn register_host_local(
        &self,
        addr: u64,
        len: u64,
    ) -> Result<Box<dyn std::any::Any + Send + Sync>, super::nic::RegistrarError> {
        if self.inner.device.ops().kind() != "soft" {
            // Only the software device stands host memory in for device memory.
            return Err(super::nic::RegistrarError::Unavailable {
                nic: self.inner.device.name().to_string(),
                reason: "device memory must be registered as a DMA-BUF".into(),
            });
        }
        self.inner
            .device
            .register_local_range(addr, len, &self.cfg)
            .map(|r| Box::new(r) as Box<dyn std::any::Any + Send + Sync>)
            .map_err(|e| super::nic::RegistrarError::Unavailable {
                nic: self.inner.device.name().to_string(),
                reason: e.to_string(),
            })
    }

    fn connector(
        self: Arc<Self>,
        peer: NodeId,
        exchange: Arc<dyn EndpointExchange>,
    ) -> Option<Arc<dyn Connector>> {
        Some(Arc::new(VerbsConnector::new(self, peer, exchange)))
    }

    fn accept(
        self: Arc<Self>,
        remote: QpEndpoint,
    ) -> Result<(QpEndpoint, Box<dyn std::any::Any + Send + Sync>), super::nic::AcceptError> {
        let nic = self.inner.device.name().to_string();
        let setup = |what: &'static str, reason: String| super::nic::AcceptError::Setup {
            nic: nic.clone(),
            what,
            reason,
        };
        let dev = self.inner.device.clone();
        // The responder posts nothing: the smallest send queue the device takes.
        let caps = dev.qp_caps(1, 1);
        let (raw, qpn, _) = dev
            .create_qp(caps)
            .map_err(|e| setup("creating the responder QP", e.to_string()))?;
        let responder = ResponderQp {
            nic: self.clone(),
            qp: raw,
        };
        let local = local_endpoint(&dev, qpn, self.nic.max_rd_atomic);
        let (addr, psn) = (dev.address(), local.psn);
        let steps = connect_transitions(
            &self.cfg,
            self.nic.max_rd_atomic,
            dev.read_depth(),
            &addr,
            &remote,
            psn,
            // The requester reads the pool through this QP: remote read, nothing else.
            ACCESS_REMOTE_READ,
        );
        for t in &steps {
            dev.modify(raw, t)
                .map_err(|e| setup("bringing the responder QP to ready-to-send", e.to_string()))?;
        }
        Ok((local, Box::new(responder)))
    }
}

/// The owner's end of a requester's RC connection: it only answers the requester's reads
/// (the NIC serves them from the pool's MRs), so it posts nothing and completes nothing.
struct ResponderQp {
    nic: Arc<VerbsNic>,
    qp: Handle,
}

impl Drop for ResponderQp {
    fn drop(&mut self) {
        let _ = self.nic.inner.device.modify(self.qp, &Transition::error());
        self.nic.inner.device.destroy_qp(self.qp);
    }
}

impl Drop for VerbsNic {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.poller.take() {
            let _ = t.join();
        }
    }
}

fn poll_loop(inner: &NicInner) {
    let mut wcs = vec![Wc::default(); POLL_BATCH];
    while !inner.stop.load(Ordering::Relaxed) {
        let mut got = 0;
        for cq in inner.device.cqs() {
            match inner.device.poll(cq, &mut wcs) {
                Ok(n) => {
                    got += n;
                    for wc in &wcs[..n] {
                        let conn = lock(&inner.conns).get(&wc.qp_num).cloned();
                        if let Some(c) = conn {
                            c.part_done(wc.wr_id, completion_status(wc.status), true);
                            c.pump();
                        }
                    }
                }
                Err(e) => cq_failed(inner, cq, &e.to_string()),
            }
        }
        while let Ok(Some(ev)) = inner.device.async_event() {
            inner.async_events.fetch_add(1, Ordering::Relaxed);
            got += 1;
            match ev {
                AsyncEvent::CqError => {
                    tracing::warn!(nic = %inner.device.name(), "verbs: CQ error event");
                    for cq in inner.device.cqs() {
                        // The failed CQ answers its next poll with an error; find it.
                        if inner.device.poll(cq, &mut []).is_err() {
                            cq_failed(inner, cq, "CQ error event");
                        }
                    }
                }
                AsyncEvent::PortError { port } => {
                    tracing::warn!(nic = %inner.device.name(), port, "verbs: port down")
                }
                AsyncEvent::PortActive { port } => {
                    tracing::info!(nic = %inner.device.name(), port, "verbs: port active")
                }
                other => {
                    tracing::warn!(nic = %inner.device.name(), event = other.as_str(), "verbs: async event")
                }
            }
        }
        if got == 0 {
            std::thread::sleep(IDLE_SLEEP);
        }
    }
}

/// A CQ overran: every request of its QPs fails (transport error, the worker rebuilds the
/// QPs) and new QPs get a fresh CQ.
fn cq_failed(inner: &NicInner, cq: Handle, why: &str) {
    let victims: Vec<Arc<ConnShared>> = lock(&inner.conns)
        .values()
        .filter(|c| c.cq == cq && !lock(&c.sq).broken)
        .cloned()
        .collect();
    if victims.is_empty() && !inner.device.cqs().last().is_some_and(|c| *c == cq) {
        return;
    }
    if inner.device.cq() == cq {
        inner.cq_overruns.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            nic = %inner.device.name(),
            qps = victims.len(),
            reason = why,
            "verbs: completion queue failed; its QPs are rebuilt on a fresh CQ"
        );
        if let Err(e) = inner.device.replace_cq(cq) {
            tracing::warn!(nic = %inner.device.name(), error = %e, "verbs: replacing the CQ failed");
        }
    }
    for c in victims {
        c.fail_all(CompletionStatus::TransportError);
    }
}

/// Connects QPs to one peer over one NIC.
pub struct VerbsConnector {
    nic: Arc<VerbsNic>,
    peer: NodeId,
    exchange: Arc<dyn EndpointExchange>,
}

impl VerbsConnector {
    pub fn new(nic: Arc<VerbsNic>, peer: NodeId, exchange: Arc<dyn EndpointExchange>) -> Self {
        VerbsConnector {
            nic,
            peer,
            exchange,
        }
    }
}

/// What this side of a new QP tells its peer: the QP number, a fresh PSN, the port's
/// address and how many reads it lets the peer have outstanding.
fn local_endpoint(dev: &VerbsDevice, qpn: u32, max_rd_atomic: u32) -> QpEndpoint {
    let addr = dev.address();
    QpEndpoint {
        qpn,
        psn: psn_seed(qpn),
        lid: addr.lid,
        gid: addr.gid,
        mtu: addr.mtu,
        responder_depth: responder_depth(max_rd_atomic, dev.read_depth()),
    }
}

fn psn_seed(qpn: u32) -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (nanos ^ qpn.rotate_left(8)) & 0x00ff_ffff
}

impl Connector for VerbsConnector {
    fn connect(
        &self,
        qp: QpKey,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<Box<dyn Connection>, ConnectionError> {
        let peer = self.peer;
        let setup = |what: &'static str, e: DeviceError| ConnectionError::Handshake {
            peer,
            reason: format!("{what}: {e}"),
        };
        let dev = self.nic.inner.device.clone();
        let caps = self.nic.caps();
        let (raw, qpn, cq) = dev.create_qp(caps).map_err(|e| ConnectionError::Setup {
            peer,
            what: "RC queue pair",
            source: std::io::Error::other(e.to_string()),
        })?;
        let shared = Arc::new(ConnShared {
            key: qp,
            peer,
            qp: raw,
            cq,
            device: dev.clone(),
            max_send_wr: caps.max_send_wr as usize,
            sink,
            pending: Mutex::new(HashMap::new()),
            sq: Mutex::new(SendQueue::default()),
        });
        let mut conn = VerbsConnection {
            nic: self.nic.clone(),
            shared,
            qpn,
            remote_keys: KeyMap::new(),
            max_sge: caps.max_send_sge,
            max_msg: dev.max_msg_sz(),
            peer,
            aborted: false,
        };
        let local = local_endpoint(&dev, qpn, self.nic.nic.max_rd_atomic);
        let (addr, psn) = (dev.address(), local.psn);
        let (remote, keys) = self.exchange.exchange(qp, local)?;
        conn.remote_keys = keys;
        let steps = connect_transitions(
            &self.nic.cfg,
            self.nic.nic.max_rd_atomic,
            dev.read_depth(),
            &addr,
            &remote,
            psn,
            // Least privilege: the requester's QP only issues reads; nobody reads through it.
            0,
        );
        for t in &steps {
            dev.modify(raw, t)
                .map_err(|e| setup("bringing the QP to ready-to-send", e))?;
        }
        lock(&self.nic.inner.conns).insert(qpn, conn.shared.clone());
        Ok(Box::new(conn))
    }
}

/// One RC QP to a peer.
pub struct VerbsConnection {
    nic: Arc<VerbsNic>,
    shared: Arc<ConnShared>,
    qpn: u32,
    remote_keys: KeyMap,
    max_sge: u32,
    max_msg: u64,
    peer: NodeId,
    aborted: bool,
}

impl VerbsConnection {
    /// Cuts `wr` into READs: at the owner's MR boundaries and at `max_msg_sz`.
    fn parts(&self, wr: &WorkRequest) -> Result<Vec<ReadWr>, String> {
        let ranges = wr.scatter.ranges();
        let (start, len) = (wr.remote.addr, wr.remote.len);
        let end = start
            .checked_add(len)
            .ok_or_else(|| format!("remote range {start:#x}+{len} wraps"))?;
        let mut out = Vec::new();
        let mut at = start;
        // Position in the local ranges: (index, offset into it).
        let (mut li, mut lo) = (0usize, 0u64);
        let local_keys = self.nic.inner.device.local_keys();
        while at < end {
            let region_end = self
                .remote_keys
                .region_end(at)
                .ok_or_else(|| format!("remote {at:#x} is in no region the owner advertised"))?;
            let part_end = end.min(region_end).min(at.saturating_add(self.max_msg));
            let mut want = part_end - at;
            let mut local = Vec::new();
            while want > 0 {
                let (addr, rlen) = *ranges
                    .get(li)
                    .ok_or_else(|| "the destination is shorter than the read".to_string())?;
                let n = (rlen - lo).min(want);
                local.push((addr + lo, n));
                want -= n;
                lo += n;
                if lo == rlen {
                    li += 1;
                    lo = 0;
                }
            }
            let rd = crate::descriptor::RemoteDescriptor {
                addr: at,
                len: part_end - at,
                rkey: wr.remote.rkey,
            };
            let r = build_read(
                0,
                &rd,
                &local,
                &self.remote_keys,
                &local_keys,
                self.max_sge,
                self.max_msg,
            )
            .map_err(|e| e.to_string())?;
            out.push(r);
            at = part_end;
        }
        if out.is_empty() {
            return Err("a read of zero bytes".into());
        }
        Ok(out)
    }
}

impl Connection for VerbsConnection {
    fn peer(&self) -> NodeId {
        self.peer
    }

    fn issue(&mut self, wr: WorkRequest) -> Result<(), ConnectionError> {
        let peer = self.peer;
        let wr_id = wr.wr_id;
        if self.aborted || lock(&self.shared.sq).broken {
            return Err(ConnectionError::ConnectionLost { peer });
        }
        let post_err = |reason: String| ConnectionError::Post {
            peer,
            wr_id,
            reason,
        };
        let mut parts = self.parts(&wr).map_err(post_err)?;
        {
            let mut pending = lock(&self.shared.pending);
            if pending.contains_key(&wr_id) {
                // Two requests under one id would complete as one: refuse the second.
                return Err(post_err(format!("wr_id {wr_id} is already outstanding")));
            }
            pending.insert(
                wr_id,
                Pending {
                    wr,
                    parts_left: parts.len(),
                    status: CompletionStatus::Success,
                },
            );
        }
        // The first part is posted here when nothing waits before it, so that a refusal is
        // the caller's error; the rest (and everything behind a backlog) wait their turn.
        let first = {
            let mut sq = lock(&self.shared.sq);
            for p in &mut parts {
                sq.next_part += 1;
                p.wr_id = sq.next_part;
                sq.parts.insert(p.wr_id, wr_id);
            }
            let direct = sq.backlog.is_empty() && sq.posted < self.shared.max_send_wr;
            let first = if direct {
                sq.posted += 1;
                Some(parts.remove(0))
            } else {
                None
            };
            sq.backlog.extend(parts);
            first
        };
        if let Some(p) = first {
            if let Err(e) = self.nic.inner.device.ops().post_read(self.shared.qp, &p) {
                let mut sq = lock(&self.shared.sq);
                sq.posted -= 1;
                // Nothing of this request is posted: undo it whole.
                let ids: Vec<u64> = sq
                    .parts
                    .iter()
                    .filter(|(_, w)| **w == wr_id)
                    .map(|(p, _)| *p)
                    .collect();
                for id in &ids {
                    sq.parts.remove(id);
                }
                sq.backlog.retain(|b| !ids.contains(&b.wr_id));
                drop(sq);
                lock(&self.shared.pending).remove(&wr_id);
                return Err(post_err(e.to_string()));
            }
        }
        self.shared.pump();
        Ok(())
    }

    fn abort(&mut self) {
        if self.aborted {
            return;
        }
        self.aborted = true;
        // Error state flushes every outstanding read; parts never posted fail here.
        let _ = self
            .nic
            .inner
            .device
            .modify(self.shared.qp, &Transition::error());
        let unposted: Vec<u64> = {
            let mut sq = lock(&self.shared.sq);
            sq.broken = true;
            sq.backlog.drain(..).map(|w| w.wr_id).collect()
        };
        for part in unposted {
            self.shared
                .part_done(part, CompletionStatus::Flushed, false);
        }
    }
}

impl Drop for VerbsConnection {
    fn drop(&mut self) {
        self.abort();
        let deadline = Instant::now() + self.nic.nic.completion_timeout;
        while !lock(&self.shared.pending).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        lock(&self.nic.inner.conns).remove(&self.qpn);
        self.nic.inner.device.destroy_qp(self.shared.qp);
        // Whatever the NIC never flushed still completes exactly once.
        self.shared.fail_all(CompletionStatus::Flushed);
    }
}
