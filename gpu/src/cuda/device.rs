//! [`CudaDevice`]: one GPU through the driver API, with a dedicated stream and completion
//! thread per copy direction ([`super::lane`]); what it does beyond the trait's basics lives in
//! a file per concept beside this one (IPC, VMM fds, DMA-BUF, host registration, staging).

use std::collections::BTreeMap;
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use cudarc::driver::sys::CUdevice_attribute as Attr;

use crate::{
    CopyDirection, CopyEvent, CopyList, Device, DeviceBuffer, DeviceCaps, DeviceError, DeviceKind,
    DmaBuf, HostRegistration, Landed,
};

use super::context::Context;
use super::error::CudaError;
use super::ffi;
use super::kernel::GatherKernel;
use super::lane::Lane;
use super::options::CudaOptions;
use super::release::{CudaRelease, Held};

/// One NVIDIA GPU. Copies run on two non-blocking streams (host→device and device→host); a
/// thread per stream waits on each batch's event and completes its [`CopyEvent`], so no
/// caller ever blocks on the GPU. Large batches are planned and queued by a second thread per
/// stream, so no caller's thread spends long in a submission either.
pub struct CudaDevice {
    pub(super) inner: Arc<Context>,
    pub(super) lanes: [Lane; 2],
}

/// An allocation of `bytes` on device `ordinal`, plain or VMM: both refuse a zero-sized one
/// before any driver call and report a failure the same way.
#[derive(Clone, Copy)]
pub(super) struct AllocRequest {
    ordinal: u32,
    bytes: u64,
}

impl AllocRequest {
    pub(super) fn new(ordinal: u32, bytes: u64) -> Result<Self, DeviceError> {
        let req = Self { ordinal, bytes };
        if bytes == 0 {
            return Err(req.fail("zero-sized allocation".into()));
        }
        Ok(req)
    }

    pub(super) fn fail(self, reason: String) -> DeviceError {
        DeviceError::Alloc {
            ordinal: self.ordinal,
            bytes: self.bytes,
            reason,
        }
    }
}

fn no_driver(e: CudaError) -> DeviceError {
    DeviceError::NoDriver {
        reason: e.to_string(),
    }
}

/// True where the CUDA driver library can be loaded (says nothing about GPUs).
pub fn driver_present() -> bool {
    ffi::init().is_ok() || ffi::has_symbol("cuInit")
}

impl CudaDevice {
    /// Opens GPU `ordinal` with default options. Fails with [`DeviceError::NoDriver`] where
    /// no driver is installed and [`DeviceError::NoSuchDevice`] where the GPU is missing.
    pub fn open(ordinal: u32) -> Result<Arc<Self>, DeviceError> {
        Self::open_with(ordinal, CudaOptions::default())
    }

    pub fn open_with(ordinal: u32, options: CudaOptions) -> Result<Arc<Self>, DeviceError> {
        ffi::init().map_err(no_driver)?;
        let count = ffi::device_count().map_err(no_driver)?;
        if ordinal >= count.max(0) as u32 {
            return Err(DeviceError::NoSuchDevice {
                ordinal,
                count: count.max(0) as u32,
            });
        }
        let drv = |call: &'static str| {
            move |e: CudaError| DeviceError::Driver {
                ordinal,
                call,
                reason: e.to_string(),
            }
        };
        let dev = ffi::device_get(ordinal as i32).map_err(drv("cuDeviceGet"))?;
        let name = ffi::device_name(dev).map_err(drv("cuDeviceGetName"))?;
        let sm_count = ffi::device_attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("cuDeviceGetAttribute"))? as u32;
        let ctx = ffi::primary_ctx_retain(dev).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        let mut inner = Context {
            ordinal,
            ctx,
            dev,
            name,
            sm_count,
            caps: DeviceCaps::default(),
            options,
            kernel: None,
            streams: Vec::new(),
            events: Mutex::new(Vec::new()),
            descs: Mutex::new(Vec::new()),
            hosts: RwLock::new(BTreeMap::new()),
            vmms: RwLock::new(BTreeMap::new()),
            client_maps: RwLock::new(BTreeMap::new()),
            teardown: Mutex::new(Vec::new()),
            staging: [Mutex::new(None), Mutex::new(None)],
            staged_batches: AtomicU64::new(0),
        };
        // From here on, dropping `inner` releases whatever was set up.
        inner.bind()?;
        for _ in 0..2 {
            inner
                .streams
                .push(ffi::stream_create().map_err(drv("cuStreamCreate"))?);
        }
        inner.caps = probe_caps(dev);
        match GatherKernel::load() {
            Ok(k) => {
                inner.kernel = Some(k);
                inner.caps.gather_kernel = true;
            }
            Err(e) => inner
                .caps
                .notes
                .push(format!("gather kernel unavailable: {e}")),
        }
        let inner = Arc::new(inner);
        let lanes = [Lane::start(&inner, 0)?, Lane::start(&inner, 1)?];
        Ok(Arc::new(Self { inner, lanes }))
    }

    /// Errors that teardown (freeing, unmapping, unregistering) met since the last call.
    pub fn take_teardown_errors(&self) -> Vec<DeviceError> {
        match self.inner.teardown.lock() {
            Ok(mut v) => std::mem::take(&mut *v),
            Err(p) => std::mem::take(&mut *p.into_inner()),
        }
    }

    /// The driver's CUDA version (13000 for 13.0).
    pub fn driver_version(&self) -> Result<i32, DeviceError> {
        ffi::driver_version().map_err(|e| self.inner.driver("cuDriverGetVersion", e))
    }

    pub fn options(&self) -> CudaOptions {
        self.inner.options
    }

    /// Number of streaming multiprocessors (sizes the gather kernel's grid).
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }

    /// Batches that took the staged path since the device opened.
    pub fn staged_batches(&self) -> u64 {
        self.inner.staged_batches.load(Ordering::Relaxed)
    }
}

fn probe_caps(dev: ffi::CUdevice) -> DeviceCaps {
    let mut caps = DeviceCaps {
        ipc_import: true,
        ..DeviceCaps::default()
    };
    let attr = |a: Attr| ffi::device_attribute(dev, a).unwrap_or(0);
    if !ffi::has_symbol("cuMemGetHandleForAddressRange") {
        caps.notes
            .push("dmabuf: driver lacks cuMemGetHandleForAddressRange".into());
    } else if attr(Attr::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) != 1 {
        caps.notes
            .push("dmabuf: the device does not support DMA-BUF export".into());
    } else {
        caps.dmabuf_export = true;
    }
    caps.read_only_host_register =
        attr(Attr::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED) == 1;
    if !caps.read_only_host_register {
        caps.notes
            .push("read-only host registration unsupported".into());
    }
    caps.batch_copy = ffi::has_memcpy_batch();
    if !caps.batch_copy {
        caps.notes
            .push("batched copies need a CUDA 13 driver".into());
    }
    match ffi::vmm_missing() {
        Err(e) => caps.notes.push(format!("vmm fd import: {e}")),
        Ok(()) if attr(Attr::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) != 1 => caps
            .notes
            .push("vmm fd import: the device does not support virtual memory management".into()),
        Ok(())
            if attr(Attr::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) != 1 =>
        {
            caps.notes
                .push("vmm fd import: the device cannot share allocations by POSIX fd".into())
        }
        Ok(()) => caps.vmm_import = true,
    }
    // Bit 0: CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST (cuFlushGPUDirectRDMAWrites works).
    caps.direct_write_flush = ffi::has_symbol("cuFlushGPUDirectRDMAWrites")
        && attr(Attr::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS) & 1 == 1;
    caps
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("options", &self.inner.options)
            .finish()
    }
}

impl Device for CudaDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn ordinal(&self) -> u32 {
        self.inner.ordinal
    }

    fn name(&self) -> String {
        format!("{} #{}", self.inner.name, self.inner.ordinal)
    }

    fn check_range(&self, ptr: u64, len: u64) -> Result<(), DeviceError> {
        self.inner.bind()?;
        self.inner.check(ptr, len)
    }

    fn alloc(&self, bytes: u64) -> Result<DeviceBuffer, DeviceError> {
        let ordinal = self.inner.ordinal;
        let req = AllocRequest::new(ordinal, bytes)?;
        let size = usize::try_from(bytes)
            .map_err(|_| req.fail("size exceeds the address space".into()))?;
        self.inner.bind()?;
        let ptr = ffi::mem_alloc(size).map_err(|e| req.fail(e.to_string()))?;
        let owner = CudaRelease {
            inner: Arc::clone(&self.inner),
            held: Some(Held::Alloc(ptr)),
        };
        Ok(DeviceBuffer::new(ptr, bytes, ordinal, Box::new(owner)))
    }

    fn register_host(
        &self,
        addr: u64,
        len: u64,
        read_only: bool,
    ) -> Result<HostRegistration, DeviceError> {
        self.inner.register_host(addr, len, read_only)
    }

    unsafe fn submit_then(
        &self,
        dir: CopyDirection,
        list: CopyList,
        landed: Option<Landed>,
    ) -> Result<CopyEvent, DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.submit_on(dir, list, landed, false) }
    }

    unsafe fn submit_detached(
        &self,
        dir: CopyDirection,
        list: CopyList,
    ) -> Result<CopyEvent, DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.submit_on(dir, list, None, true) }
    }

    fn write(&self, dst: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.inner.bind()?;
        self.inner.check(dst, data.len() as u64)?;
        // SAFETY: the destination lies inside one allocation of this device (checked), and
        // `data` is a live slice for the duration of this synchronous call.
        unsafe { ffi::memcpy_htod(dst, data.as_ptr().cast(), data.len()) }
            .map_err(|e| self.inner.driver("cuMemcpyHtoD", e))
    }

    fn read(&self, src: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.inner.bind()?;
        self.inner.check(src, out.len() as u64)?;
        // SAFETY: the source lies inside one allocation of this device (checked), and `out`
        // is a live, exclusively borrowed slice for the duration of this synchronous call.
        unsafe { ffi::memcpy_dtoh(out.as_mut_ptr().cast(), src, out.len()) }
            .map_err(|e| self.inner.driver("cuMemcpyDtoH", e))
    }

    fn capabilities(&self) -> DeviceCaps {
        self.inner.caps.clone()
    }

    fn import_ipc(&self, handle: &[u8]) -> Result<DeviceBuffer, DeviceError> {
        self.inner.import_ipc(handle)
    }

    fn import_vmm_fd(&self, fd: OwnedFd, len: u64) -> Result<DeviceBuffer, DeviceError> {
        self.inner.import_vmm_fd(fd, len)
    }

    fn import_memfd(&self, fd: OwnedFd, len: u64) -> Result<DeviceBuffer, DeviceError> {
        self.inner.import_memfd(fd, len)
    }

    fn export_dmabuf(&self, ptr: u64, len: u64) -> Result<DmaBuf, DeviceError> {
        self.inner.export_dmabuf(ptr, len)
    }

    fn import_dmabuf(&self, fd: OwnedFd, base: u64, len: u64) -> Result<DmaBuf, DeviceError> {
        self.inner.import_dmabuf(fd, base, len)
    }

    fn flush_direct_writes(&self) -> Result<(), DeviceError> {
        if !self.inner.caps.direct_write_flush {
            return Ok(());
        }
        self.inner.bind()?;
        ffi::flush_gpudirect_rdma_writes()
            .map_err(|e| self.inner.driver("cuFlushGPUDirectRDMAWrites", e))
    }
}
