//! The verbs provider: a [`VerbsNic`] (open device, CQ poller thread, QP table) and a
//! [`VerbsConnector`] that brings RC QPs to ready-to-send and issues `IBV_WR_RDMA_READ`s.
//!
//! Completions are polled by one thread per NIC and pushed, one per request, into the QP's
//! [`CompletionSink`] (the NIC's `CompletionQueue`, which the actors' `CompletionPoller`
//! drains). `abort` moves the QP to error, so every outstanding read completes flushed (the
//! shared drain contract); dropping a connection waits for that drain before destroying the QP.
//!
//! Reads land straight in the request's destination: the SGEs are the ranges the MR table
//! checked when the request was accepted (its resolved [`crate::Scatter`]), keyed by this
//! NIC's registrations of those regions (the host pool at start, DMA-BUF device memory per
//! instance). A destination the NIC has not registered is a post error; nothing is staged
//! and copied, so a direct load over verbs cannot fall back to host memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::config::VerbsConfig;
use super::device::{DeviceError, Registration, VerbsDevice};
use super::ffi;
use super::qp_attrs::{connect_transitions, responder_depth, QpEndpoint, Transition};
use super::registration::{KeyMap, ACCESS_REMOTE_READ};
use super::sysfs::Sysfs;
use super::work::{build_read_into, completion_status};
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

/// An issued read: holding the request holds its destination (the scatter pins the regions,
/// so they stay registered) until the completion is handled.
struct Pending {
    wr: WorkRequest,
}

struct ConnShared {
    key: QpKey,
    sink: Arc<dyn CompletionSink>,
    pending: Mutex<HashMap<u64, Pending>>,
}

impl ConnShared {
    /// Finishes one request: make device pieces visible on success, release the
    /// destination, then report.
    fn complete(&self, wr_id: u64, status: CompletionStatus) {
        let Some(p) = lock(&self.pending).remove(&wr_id) else {
            return;
        };
        let len = p.wr.remote.len;
        let status = if status.is_success() {
            match p.wr.scatter.finish() {
                Ok(()) => CompletionStatus::Success,
                Err(_) => CompletionStatus::LocalWriteError,
            }
        } else {
            status
        };
        let qp = self.key;
        drop(p);
        self.sink.push(WorkCompletion {
            qp,
            wr_id,
            status,
            bytes: if status.is_success() { len } else { 0 },
        });
    }
}

struct NicInner {
    device: Arc<VerbsDevice>,
    conns: Mutex<HashMap<u32, Arc<ConnShared>>>,
    stop: AtomicBool,
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
    /// `nic.max_send_wr` each.
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

    /// Registers the host pool on this NIC for remote reads.
    pub fn register_host(&self, region: &HostRegion) -> Result<Registration, DeviceError> {
        self.inner.device.register_host(region, &self.cfg)
    }

    /// Registers host memory that only this NIC writes into (a requester's destination
    /// outside the pool): local write only.
    pub fn register_local(&self, region: &HostRegion) -> Result<Registration, DeviceError> {
        self.inner.device.register_local(region, &self.cfg)
    }

    /// Registers GPU memory (a DMA-BUF) on this NIC, local write only.
    pub fn register_dmabuf(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: u64,
        iova: u64,
    ) -> Result<Registration, DeviceError> {
        self.inner
            .device
            .register_dmabuf(fd, offset, len, iova, &self.cfg)
    }
}

impl super::nic::RdmaNic for VerbsNic {
    fn name(&self) -> &str {
        self.inner.device.name()
    }

    fn address(&self) -> super::gid::PortAddress {
        self.inner.device.address()
    }

    fn register_chunk(
        &self,
        region: &Arc<HostRegion>,
        chunk: super::registration::Chunk,
    ) -> Result<super::nic::ChunkMr, super::nic::RegistrarError> {
        let reg = self
            .inner
            .device
            .register_host_chunk(region, chunk, &self.cfg)
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
        let limits = self.nic.queue_limits();
        // SAFETY: PD and CQ belong to `dev`, which the responder keeps alive.
        let raw =
            unsafe { ffi::create_rc_qp(dev.pd(), dev.cq(), limits.max_send_wr, limits.max_sge) }
                .map_err(|e| setup("creating the responder QP", e.to_string()))?;
        let responder = ResponderQp {
            nic: self.clone(),
            qp: raw,
        };
        // SAFETY: `raw` is alive (owned by `responder`).
        let qpn = unsafe { ffi::qp_num(raw) };
        let local = local_endpoint(&dev, qpn, limits.max_rd_atomic);
        let (addr, psn) = (dev.address(), local.psn);
        let steps = connect_transitions(
            &self.cfg,
            limits.max_rd_atomic,
            dev.read_depth(),
            &addr,
            &remote,
            psn,
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
    qp: *mut ffi::ibv_qp,
}

// SAFETY: an `ibv_qp` may be modified and destroyed from any thread; the struct only does so
// in `Drop`, with exclusive access.
unsafe impl Send for ResponderQp {}
// SAFETY: shared access reads nothing through the pointer.
unsafe impl Sync for ResponderQp {}

impl Drop for ResponderQp {
    fn drop(&mut self) {
        let _ = self.nic.inner.device.modify(self.qp, &Transition::error());
        // SAFETY: created by `accept`, never handed out; no work requests were posted on it.
        let r = unsafe { ffi::destroy_qp(self.qp) };
        self.nic.inner.device.record_teardown(r);
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
    // SAFETY: `ibv_wc` is plain integers; all-zero is a valid value.
    let mut wcs: Vec<ffi::ibv_wc> = vec![unsafe { std::mem::zeroed() }; POLL_BATCH];
    while !inner.stop.load(Ordering::Relaxed) {
        // SAFETY: the CQ lives as long as the device (held by `inner`); this thread is its
        // only poller.
        let n: usize = unsafe { ffi::poll_cq(inner.device.cq(), &mut wcs) }.unwrap_or_default();
        if n == 0 {
            std::thread::sleep(IDLE_SLEEP);
            continue;
        }
        for wc in &wcs[..n] {
            let code = wc.error().map(|(s, _)| s).unwrap_or(0);
            let conn = lock(&inner.conns).get(&wc.qp_num).cloned();
            if let Some(c) = conn {
                c.complete(wc.wr_id(), completion_status(code));
            }
        }
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
        let limits = self.nic.nic.queue_limits();
        // SAFETY: PD and CQ belong to `dev`, which the connection keeps alive.
        let raw =
            unsafe { ffi::create_rc_qp(dev.pd(), dev.cq(), limits.max_send_wr, limits.max_sge) }
                .map_err(|source| ConnectionError::Setup {
                    peer,
                    what: "RC queue pair",
                    source,
                })?;
        let mut conn = VerbsConnection {
            nic: self.nic.clone(),
            qp: raw,
            shared: Arc::new(ConnShared {
                key: qp,
                sink,
                pending: Mutex::new(HashMap::new()),
            }),
            remote_keys: KeyMap::new(),
            peer,
            aborted: false,
        };
        // SAFETY: `raw` is alive.
        let qpn = unsafe { ffi::qp_num(raw) };
        let local = local_endpoint(&dev, qpn, limits.max_rd_atomic);
        let (addr, psn) = (dev.address(), local.psn);
        let (remote, keys) = self.exchange.exchange(qp, local)?;
        conn.remote_keys = keys;
        let steps = connect_transitions(
            &self.nic.cfg,
            limits.max_rd_atomic,
            dev.read_depth(),
            &addr,
            &remote,
            psn,
            // Peers read our host pool through their QP to this one.
            ACCESS_REMOTE_READ,
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
    qp: *mut ffi::ibv_qp,
    shared: Arc<ConnShared>,
    remote_keys: KeyMap,
    peer: NodeId,
    aborted: bool,
}

// SAFETY: an `ibv_qp` may be posted to and modified from any thread; the connection is used by
// one owner at a time (`&mut self`), and the poller only touches `shared` (behind mutexes).
unsafe impl Send for VerbsConnection {}

impl Connection for VerbsConnection {
    fn peer(&self) -> NodeId {
        self.peer
    }

    fn issue(&mut self, wr: WorkRequest) -> Result<(), ConnectionError> {
        let peer = self.peer;
        let wr_id = wr.wr_id;
        if self.aborted {
            return Err(ConnectionError::ConnectionLost { peer });
        }
        let post_err = |reason: String| ConnectionError::Post {
            peer,
            wr_id,
            reason,
        };
        let dev = &self.nic.inner.device;
        let rwr = build_read_into(
            wr_id,
            &wr.remote,
            &wr.scatter,
            &self.remote_keys,
            &dev.local_keys(),
            self.nic.nic.max_sge,
        )
        .map_err(|e| post_err(e.to_string()))?;
        lock(&self.shared.pending).insert(wr_id, Pending { wr });
        // SAFETY: the QP is alive; the SGEs name destination ranges that the request's scatter
        // (held in `pending` until the completion is handled) keeps registered in the MR table
        // and, through it, on this NIC.
        if let Err(e) = unsafe { ffi::post_read(self.qp, &rwr) } {
            lock(&self.shared.pending).remove(&wr_id);
            return Err(post_err(e.to_string()));
        }
        Ok(())
    }

    fn abort(&mut self) {
        if self.aborted {
            return;
        }
        self.aborted = true;
        // Error state flushes every outstanding read; if even that fails the drop path
        // reports them flushed itself.
        let _ = self.nic.inner.device.modify(self.qp, &Transition::error());
    }
}

impl Drop for VerbsConnection {
    fn drop(&mut self) {
        self.abort();
        let deadline = Instant::now() + self.nic.nic.completion_timeout;
        while !lock(&self.shared.pending).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: the QP is alive.
        let qpn = unsafe { ffi::qp_num(self.qp) };
        lock(&self.nic.inner.conns).remove(&qpn);
        // SAFETY: the QP is in error and no longer in the poller's table.
        let r = unsafe { ffi::destroy_qp(self.qp) };
        self.nic.inner.device.record_teardown(r);
        // Whatever the NIC never flushed still completes exactly once.
        let left: Vec<u64> = lock(&self.shared.pending).keys().copied().collect();
        for wr_id in left {
            self.shared.complete(wr_id, CompletionStatus::Flushed);
        }
    }
}
