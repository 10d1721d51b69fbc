//! The device-memory trait every backend implements.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use thiserror::Error;
use tokio::sync::oneshot;

use crate::CopyList;

/// Which backend a device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// Emulated device memory in host RAM.
    Host,
    /// An NVIDIA GPU through the CUDA driver API.
    Cuda,
}

impl DeviceKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            DeviceKind::Host => "host",
            DeviceKind::Cuda => "cuda",
        }
    }
}

/// Direction of one copy batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDirection {
    HostToDevice,
    DeviceToHost,
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceError {
    #[error("no CUDA driver: {reason}")]
    NoDriver { reason: String },
    #[error("device {ordinal} does not exist ({count} present)")]
    NoSuchDevice { ordinal: u32, count: u32 },
    #[error("allocation of {bytes} bytes on device {ordinal} failed: {reason}")]
    Alloc {
        ordinal: u32,
        bytes: u64,
        reason: String,
    },
    #[error("range {ptr:#x}+{len} is not inside one allocation of device {ordinal}")]
    NotDeviceMemory { ordinal: u32, ptr: u64, len: u64 },
    #[error("range {ptr:#x}+{len} is device memory of ordinal {found}, expected {ordinal}")]
    WrongDevice {
        ordinal: u32,
        found: u32,
        ptr: u64,
        len: u64,
    },
    #[error("host registration of {addr:#x}+{len} failed: {reason}")]
    HostRegister { addr: u64, len: u64, reason: String },
    #[error("copy batch of {ops} ops failed on device {ordinal}: {reason}")]
    Copy {
        ordinal: u32,
        ops: usize,
        reason: String,
    },
    #[error("{what} is not supported by this device: {reason}")]
    Unsupported { what: &'static str, reason: String },
    #[error("device {ordinal} copy engine stopped")]
    Stopped { ordinal: u32 },
    #[error("device {ordinal}: {call} failed: {reason}")]
    Driver {
        ordinal: u32,
        call: &'static str,
        reason: String,
    },
    #[error("device {ordinal}: importing {what} failed: {reason}")]
    Import {
        ordinal: u32,
        what: &'static str,
        reason: String,
    },
}

/// What one completed batch did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CopyStats {
    pub bytes: u64,
    pub ops: usize,
    /// Seconds from submission to completion as seen by the device's completion path.
    pub seconds: f64,
}

/// Runs once a batch resolves, on the thread that resolves it (the backend's completion
/// thread, or the submitting one for a batch refused before it was queued), before the
/// batch's [`CopyEvent`] does. For reporting progress without waiting for the event's owner
/// to be scheduled; it must return at once.
pub type Landed = Box<dyn FnOnce(&Result<CopyStats, DeviceError>) + Send>;

/// The backend's side of a [`CopyEvent`]: resolves it, running the submitter's [`Landed`]
/// first.
pub struct CopyDone {
    tx: oneshot::Sender<Result<CopyStats, DeviceError>>,
    landed: Option<Landed>,
}

impl CopyDone {
    /// Attaches what runs when the batch resolves (see [`Landed`]).
    pub fn then(mut self, landed: Option<Landed>) -> Self {
        self.landed = landed;
        self
    }

    /// Resolves the event; false where its waiter has gone away (the hook ran anyway).
    pub fn send(self, r: Result<CopyStats, DeviceError>) -> bool {
        if let Some(f) = self.landed {
            f(&r);
        }
        self.tx.send(r).is_ok()
    }
}

impl fmt::Debug for CopyDone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyDone")
            .field("landed", &self.landed.is_some())
            .finish()
    }
}

/// Completion of one submitted batch: a future that resolves when every copy of the batch has
/// landed (or failed). Backends complete it from their own thread; awaiting never blocks a
/// thread.
pub struct CopyEvent {
    rx: oneshot::Receiver<Result<CopyStats, DeviceError>>,
    ordinal: u32,
}

impl CopyEvent {
    /// A pair: the sender the backend completes, and the event the caller awaits.
    pub fn channel(ordinal: u32) -> (CopyDone, Self) {
        let (tx, rx) = oneshot::channel();
        (CopyDone { tx, landed: None }, Self { rx, ordinal })
    }

    /// Non-blocking check; `None` while the batch is still running.
    pub fn try_complete(&mut self) -> Option<Result<CopyStats, DeviceError>> {
        match self.rx.try_recv() {
            Ok(r) => Some(r),
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => Some(Err(DeviceError::Stopped {
                ordinal: self.ordinal,
            })),
        }
    }
}

impl CopyEvent {
    /// Blocks the calling thread until the batch resolves. Only for threads outside any
    /// async runtime (draining a batch whose owner is being torn down).
    pub fn wait_blocking(self) -> Result<CopyStats, DeviceError> {
        let ordinal = self.ordinal;
        self.rx
            .blocking_recv()
            .unwrap_or(Err(DeviceError::Stopped { ordinal }))
    }
}

impl fmt::Debug for CopyEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyEvent")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl Future for CopyEvent {
    type Output = Result<CopyStats, DeviceError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let ordinal = self.ordinal;
        Pin::new(&mut self.rx)
            .poll(cx)
            .map(|r| r.unwrap_or(Err(DeviceError::Stopped { ordinal })))
    }
}

/// Frees what a [`DeviceBuffer`] or [`HostRegistration`] holds when dropped.
pub trait Release: Send + Sync {
    fn release(&mut self);
}

/// Device memory owned by this process (tests, the demo, benchmarks and embedding engines that
/// let kvferry allocate). Freed on drop.
pub struct DeviceBuffer {
    ptr: u64,
    len: u64,
    ordinal: u32,
    owner: Box<dyn Release>,
}

impl DeviceBuffer {
    pub fn new(ptr: u64, len: u64, ordinal: u32, owner: Box<dyn Release>) -> Self {
        Self {
            ptr,
            len,
            ordinal,
            owner,
        }
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        self.owner.release();
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

/// Host memory made usable by a device (pinned for DMA where the backend needs it); the
/// registration is undone on drop.
pub struct HostRegistration {
    owner: Option<Box<dyn Release>>,
}

impl HostRegistration {
    /// A registration with nothing to undo (backends whose host memory needs no pinning).
    pub fn noop() -> Self {
        Self { owner: None }
    }

    pub fn new(owner: Box<dyn Release>) -> Self {
        Self { owner: Some(owner) }
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if let Some(o) = self.owner.as_mut() {
            o.release();
        }
    }
}

impl fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegistration")
            .field("active", &self.owner.is_some())
            .finish()
    }
}

/// What a device can do beyond the basics every backend has. Missing capabilities are not
/// errors: callers pick another path (staged instead of direct loads, say) and log `notes`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceCaps {
    /// Device memory can be exported as a DMA-BUF fd ([`Device::export_dmabuf`]).
    pub dmabuf_export: bool,
    /// Allocations of other processes can be mapped by CUDA IPC handle ([`Device::import_ipc`]).
    pub ipc_import: bool,
    /// VMM allocations of other processes can be mapped by POSIX fd
    /// ([`Device::import_vmm_fd`]).
    pub vmm_import: bool,
    /// Host memory can be registered read-only (same-host peer pools).
    pub read_only_host_register: bool,
    /// Fragmented batches run as one gather/scatter kernel launch.
    pub gather_kernel: bool,
    /// The driver's batched copy call is available.
    pub batch_copy: bool,
    /// [`Device::flush_direct_writes`] does work on this device (otherwise a no-op).
    pub direct_write_flush: bool,
    /// Why capabilities are missing, one line each.
    pub notes: Vec<String>,
}

/// A DMA-BUF fd covering `[base, base + len)` of device memory, as this process addresses it;
/// what a NIC registers for direct (GPUDirect RDMA) writes. Closing happens on drop.
#[derive(Debug)]
pub struct DmaBuf {
    fd: std::os::fd::OwnedFd,
    base: u64,
    len: u64,
    ordinal: u32,
}

impl DmaBuf {
    pub fn new(fd: std::os::fd::OwnedFd, base: u64, len: u64, ordinal: u32) -> Self {
        Self {
            fd,
            base,
            len,
            ordinal,
        }
    }

    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// Device address of byte 0 of the buffer.
    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Offset inside the buffer of `[ptr, ptr + len)`, where the range lies inside it (the
    /// `offset` argument of `ibv_reg_dmabuf_mr`).
    pub fn offset_of(&self, ptr: u64, len: u64) -> Option<u64> {
        let end = ptr.checked_add(len)?;
        (ptr >= self.base && end <= self.base + self.len).then(|| ptr - self.base)
    }
}

/// One device: memory validation, allocation, host registration and batched async copies.
pub trait Device: Send + Sync + fmt::Debug {
    fn kind(&self) -> DeviceKind;

    fn ordinal(&self) -> u32;

    /// A human-readable name ("host-emulated #0", "NVIDIA H200 #0").
    fn name(&self) -> String;

    /// Checks that `[ptr, ptr + len)` is memory of this device inside one allocation.
    fn check_range(&self, ptr: u64, len: u64) -> Result<(), DeviceError>;

    /// Allocates `bytes` of device memory.
    fn alloc(&self, bytes: u64) -> Result<DeviceBuffer, DeviceError>;

    /// Makes `[addr, addr + len)` of host memory usable as a copy source or destination.
    fn register_host(
        &self,
        addr: u64,
        len: u64,
        read_only: bool,
    ) -> Result<HostRegistration, DeviceError>;

    /// Submits one batch of copies and returns its completion event. Device-side ranges are
    /// validated before anything is copied; a batch that fails validation copies nothing.
    ///
    /// # Safety
    /// Every host-side range in `list` must stay valid (mapped, and not written by anyone else
    /// for a device-to-host batch) until the returned event has resolved.
    unsafe fn submit(&self, dir: CopyDirection, list: CopyList) -> Result<CopyEvent, DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.submit_then(dir, list, None) }
    }

    /// [`Device::submit`] for a caller whose thread must return at once (a receive thread
    /// that keeps a socket drained): a backend that plans batches on a thread of its own
    /// hands this one there whatever its size. By default, as [`Device::submit`].
    ///
    /// # Safety
    /// As for [`Device::submit`].
    unsafe fn submit_detached(
        &self,
        dir: CopyDirection,
        list: CopyList,
    ) -> Result<CopyEvent, DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.submit(dir, list) }
    }

    /// [`Device::submit`], with `landed` run when the batch resolves, before the returned
    /// event does, on the thread that resolves it (not run where this returns an error).
    ///
    /// # Safety
    /// As for [`Device::submit`].
    unsafe fn submit_then(
        &self,
        dir: CopyDirection,
        list: CopyList,
        landed: Option<Landed>,
    ) -> Result<CopyEvent, DeviceError>;

    /// Synchronous write into device memory (setup and verification, not the data path).
    fn write(&self, dst: u64, data: &[u8]) -> Result<(), DeviceError>;

    /// Synchronous read of device memory (setup and verification, not the data path).
    fn read(&self, src: u64, out: &mut [u8]) -> Result<(), DeviceError>;

    /// What this device supports beyond the required methods.
    fn capabilities(&self) -> DeviceCaps {
        DeviceCaps::default()
    }

    /// Maps an allocation that another process exported with a CUDA IPC handle (64 bytes).
    /// The buffer starts at the exporter's allocation base (add the exporter's offset) and
    /// unmaps on drop.
    fn import_ipc(&self, _handle: &[u8]) -> Result<DeviceBuffer, DeviceError> {
        Err(DeviceError::Unsupported {
            what: "CUDA IPC import",
            reason: self.kind().as_str().into(),
        })
    }

    /// Maps a VMM allocation (`cuMemCreate`) that another process exported as a POSIX fd
    /// (`cuMemExportToShareableHandle`), all `len` bytes of it (the exporter's mapping size, a
    /// multiple of the allocation granularity), into a range of this process with read-write
    /// access for this device. The fd is closed once mapped; the buffer starts at byte 0 of
    /// the allocation and unmaps, releases and frees its range on drop.
    fn import_vmm_fd(
        &self,
        _fd: std::os::fd::OwnedFd,
        _len: u64,
    ) -> Result<DeviceBuffer, DeviceError> {
        Err(DeviceError::Unsupported {
            what: "VMM fd import",
            reason: format!(
                "only a CUDA device maps VMM allocations; this is a {} device",
                self.kind().as_str()
            ),
        })
    }

    /// Exports device memory this process owns as a DMA-BUF: the returned buffer covers the
    /// page-aligned span around `[ptr, ptr + len)` inside one allocation.
    fn export_dmabuf(&self, _ptr: u64, _len: u64) -> Result<DmaBuf, DeviceError> {
        Err(DeviceError::Unsupported {
            what: "DMA-BUF export",
            reason: self.kind().as_str().into(),
        })
    }

    /// Accepts a DMA-BUF fd exported by the process that owns the memory, covering
    /// `[base, base + len)` as this process addresses it (an IPC mapping, say). The fd is
    /// checked to be a DMA-BUF of at least `len` bytes and the range to be this device's.
    fn import_dmabuf(
        &self,
        _fd: std::os::fd::OwnedFd,
        _base: u64,
        _len: u64,
    ) -> Result<DmaBuf, DeviceError> {
        Err(DeviceError::Unsupported {
            what: "DMA-BUF import",
            reason: self.kind().as_str().into(),
        })
    }

    /// Maps a memfd that a client without a GPU holds its KV in, shared and read-write, and
    /// treats `[0, len)` of it as memory of this device: copies may target it and
    /// `check_range` accepts it. The node seals the memfd against shrinking first (a shrunk
    /// mapping would fault on access), so the client must have created it with
    /// `MFD_ALLOW_SEALING` or sealed it `F_SEAL_SHRINK` itself. Unmapped on drop. A CUDA
    /// device registers the mapping as pinned host memory, so its copies reach it by DMA.
    fn import_memfd(
        &self,
        _fd: std::os::fd::OwnedFd,
        _len: u64,
    ) -> Result<DeviceBuffer, DeviceError> {
        Err(DeviceError::Unsupported {
            what: "memfd import (host KV as device memory)",
            reason: format!(
                "only the host and CUDA devices map client memory; this is a {} device",
                self.kind().as_str()
            ),
        })
    }

    /// Makes direct (GPUDirect RDMA) writes that have completed at the NIC visible to device
    /// work submitted afterwards. Call after a direct load's last completion, before telling
    /// the engine. A no-op where the platform needs none.
    fn flush_direct_writes(&self) -> Result<(), DeviceError> {
        Ok(())
    }
}
