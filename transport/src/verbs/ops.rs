//! The one boundary between the provider and a verbs implementation: the ~20 `ibv_*` calls
//! the provider makes, as a table of functions ([`VerbsOps`]). Two tables exist: the real one
//! over rdma-core (`ffi::RealOps`, cargo feature `verbs`) and the software device
//! ([`super::soft::SoftOps`], every build), which executes the same calls under the verbs
//! rules. [`ops_for`] picks one by device name at run time, so `[[nic]] name = "soft_mlx5_0"`
//! runs the provider over the software device and `name = "mlx5_0"` over hardware.
//!
//! Objects are named by opaque [`Handle`]s that only a table makes; the owning types in
//! [`super::device`] and [`super::provider`] keep every handle alive for as long as it is
//! used, which is what the real table's `SAFETY` arguments rest on.

use std::io;
use std::sync::Arc;

use super::gid::{Mtu, PortInfo};
use super::qp_attrs::Transition;
use super::sysfs::{Sysfs, SysfsError};
use super::work::ReadWr;

/// An object made by a [`VerbsOps`] table (context, PD, CQ, QP or MR). Only tables construct
/// one, so a handle always names an object its table made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle(pub(crate) usize);

/// The device limits the provider sizes its queues by (`ibv_device_attr`, the fields used).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceAttr {
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_mr_size: u64,
    /// Reads one QP may have outstanding as responder (`max_qp_rd_atom`).
    pub max_qp_rd_atom: u32,
    /// Reads one QP may issue as initiator (`max_qp_init_rd_atom`).
    pub max_qp_init_rd_atom: u32,
}

/// What `ibv_query_port` says (the fields used).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAttr {
    pub active: bool,
    pub lid: u16,
    pub active_mtu: Mtu,
    /// The largest message one work request may carry.
    pub max_msg_sz: u64,
}

/// Capacities asked of `ibv_create_qp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_send_sge: u32,
}

/// One polled completion (`ibv_wc`, the fields used).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Wc {
    pub wr_id: u64,
    /// `ibv_wc_status` (see [`super::work::wc`]).
    pub status: u32,
    pub qp_num: u32,
    pub byte_len: u32,
}

/// An asynchronous event (`ibv_get_async_event`), already acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncEvent {
    /// The CQ overran: it is unusable, and so is every QP reporting to it.
    CqError,
    /// A QP hit a fatal error outside a completion.
    QpFatal {
        qpn: u32,
    },
    PortActive {
        port: u8,
    },
    PortError {
        port: u8,
    },
    DeviceFatal,
    Other {
        code: u32,
    },
}

impl AsyncEvent {
    /// The `ibv_event_type` codes of `verbs.h`.
    pub fn from_code(code: u32, qpn: u32, port: u8) -> AsyncEvent {
        match code {
            0 => AsyncEvent::CqError,
            1..=3 => AsyncEvent::QpFatal { qpn },
            9 => AsyncEvent::PortActive { port },
            10 => AsyncEvent::PortError { port },
            8 => AsyncEvent::DeviceFatal,
            other => AsyncEvent::Other { code: other },
        }
    }

    /// A low-cardinality label for logs and metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            AsyncEvent::CqError => "cq_error",
            AsyncEvent::QpFatal { .. } => "qp_fatal",
            AsyncEvent::PortActive { .. } => "port_active",
            AsyncEvent::PortError { .. } => "port_error",
            AsyncEvent::DeviceFatal => "device_fatal",
            AsyncEvent::Other { .. } => "other",
        }
    }
}

/// The verbs calls the provider makes. Errors are what the call returns (`errno`); every
/// rule a device enforces at post time is an `Err`, every rule it enforces while executing
/// is a completion status.
pub trait VerbsOps: Send + Sync + std::fmt::Debug {
    /// `"rdma-core"` or `"soft"`.
    fn kind(&self) -> &'static str;
    fn device_names(&self) -> io::Result<Vec<String>>;
    /// `ibv_open_device` of the device called `name`; `Ok(None)` when there is none.
    fn open_device(&self, name: &str) -> io::Result<Option<Handle>>;
    fn close_device(&self, ctx: Handle) -> io::Result<()>;
    fn query_device(&self, ctx: Handle) -> io::Result<DeviceAttr>;
    fn query_port(&self, ctx: Handle, port: u8) -> io::Result<PortAttr>;
    fn query_gid(&self, ctx: Handle, port: u8, index: u8) -> io::Result<[u8; 16]>;
    /// The device's ports with their GID types (sysfs on a real host, the profile on the
    /// software device); `query_port`/`query_gid` then fill in the live values.
    fn ports(&self, name: &str, sysfs: &Sysfs) -> Result<Vec<PortInfo>, SysfsError>;
    fn alloc_pd(&self, ctx: Handle) -> io::Result<Handle>;
    fn dealloc_pd(&self, pd: Handle) -> io::Result<()>;
    fn create_cq(&self, ctx: Handle, cqe: u32) -> io::Result<Handle>;
    fn destroy_cq(&self, cq: Handle) -> io::Result<()>;
    /// An RC QP, every send signaled, send and receive completions on `cq`; returns the QP
    /// and its number.
    fn create_qp(&self, pd: Handle, cq: Handle, caps: QpCaps) -> io::Result<(Handle, u32)>;
    fn modify_qp(&self, qp: Handle, t: &Transition) -> io::Result<()>;
    fn destroy_qp(&self, qp: Handle) -> io::Result<()>;
    /// `ibv_reg_mr`; returns the MR and its (lkey, rkey). The memory must stay mapped until
    /// `dereg_mr`.
    fn reg_mr(
        &self,
        pd: Handle,
        addr: u64,
        len: u64,
        access: u32,
    ) -> io::Result<(Handle, u32, u32)>;
    /// `ibv_reg_dmabuf_mr` of `len` bytes at `offset` of DMA-BUF `fd`, addressed at `iova`.
    fn reg_dmabuf_mr(
        &self,
        pd: Handle,
        offset: u64,
        len: u64,
        iova: u64,
        fd: i32,
        access: u32,
    ) -> io::Result<(Handle, u32, u32)>;
    fn dereg_mr(&self, mr: Handle) -> io::Result<()>;
    /// Posts one signaled RDMA READ. The SGEs' memory must stay registered until it
    /// completes.
    fn post_read(&self, qp: Handle, wr: &ReadWr) -> io::Result<()>;
    /// Polls up to `out.len()` completions; an `Err` means the CQ itself failed (overrun).
    fn poll_cq(&self, cq: Handle, out: &mut [Wc]) -> io::Result<usize>;
    /// The next asynchronous event, acknowledged, without blocking.
    fn next_async_event(&self, ctx: Handle) -> io::Result<Option<AsyncEvent>>;
}

/// Device names the software device serves: `soft_<profile>_<n>` (`soft_mlx5_0`,
/// `soft_small_1`).
pub fn is_soft_name(name: &str) -> bool {
    name.starts_with("soft_")
}

/// The table that serves the device `name`: the software device for its names, rdma-core
/// otherwise (`None` when this build has no rdma-core provider).
pub fn ops_for(name: &str) -> Option<Arc<dyn VerbsOps>> {
    if is_soft_name(name) {
        return Some(super::soft::SoftOps::global());
    }
    real_ops()
}

#[cfg(feature = "verbs")]
fn real_ops() -> Option<Arc<dyn VerbsOps>> {
    Some(Arc::new(super::ffi::RealOps))
}

#[cfg(not(feature = "verbs"))]
fn real_ops() -> Option<Arc<dyn VerbsOps>> {
    None
}
