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
//! [`CompletionSink`](crate::CompletionSink). The same thread reads the device's asynchronous events: a CQ overrun
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
//!
//! Here: the NIC (device, registrations, the responder side of a peer's connection). Beside
//! it: the requester's connector (`connector.rs`) and connection (`connection.rs`), the
//! outstanding work they share with the poller (`send_queue.rs`) and the poller (`poller.rs`).

mod connection;
mod connector;
mod poller;
mod send_queue;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use super::config::VerbsConfig;
use super::device::{DeviceError, Registration, VerbsDevice};
use super::ops::{Handle, QpCaps};
use super::qp_attrs::{connect_transitions, responder_depth, QpEndpoint, Transition};
use super::registration::ACCESS_REMOTE_READ;
use super::sysfs::Sysfs;
use crate::config::NicConfig;
use crate::connection::Connector;
use crate::qp_key::NodeId;
use crate::region::HostRegion;
use connector::local_endpoint;
use poller::poll_loop;
use send_queue::ConnShared;

pub use super::nic::EndpointExchange;
pub use connection::VerbsConnection;
pub use connector::VerbsConnector;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections are single map updates; poisoning carries no meaning.
    m.lock().unwrap_or_else(PoisonError::into_inner)
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
    ) -> Result<super::nic::LocalMr, super::nic::RegistrarError> {
        self.register_dmabuf(fd, offset, len, iova)
            .map(super::nic::LocalMr::new)
            .map_err(|e| super::nic::RegistrarError::Unavailable {
                nic: self.inner.device.name().to_string(),
                reason: e.to_string(),
            })
    }

    fn register_host_local(
        &self,
        addr: u64,
        len: u64,
    ) -> Result<super::nic::LocalMr, super::nic::RegistrarError> {
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
            .map(super::nic::LocalMr::new)
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
