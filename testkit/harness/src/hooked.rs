//! The host device with its batch submission passed through a test's hook: tests that fail
//! batches on demand or watch how a transfer submits them, without writing the `Device`
//! delegation each time.

use std::fmt;
use std::sync::Arc;

use kvferry_gpu::{
    CopyDirection, CopyEvent, CopyList, Device, DeviceBuffer, DeviceError, DeviceKind, HostDevice,
    HostRegistration, Landed,
};

/// What a test does with each batch: refuse it, or submit it to `inner` and watch it.
pub trait SubmitHook: Send + Sync + 'static {
    /// Called for every batch in place of the host device's own submit.
    ///
    /// # Safety
    /// The contract of [`Device::submit`]: pass `list` on to `inner` only as the caller's
    /// ranges allow.
    unsafe fn submit(
        &self,
        inner: &HostDevice,
        dir: CopyDirection,
        list: CopyList,
        landed: Option<Landed>,
    ) -> Result<CopyEvent, DeviceError>;
}

/// A [`HostDevice`] whose every other call passes through unchanged.
pub struct HookedDevice<H> {
    pub inner: Arc<HostDevice>,
    pub hook: H,
}

impl<H: SubmitHook> HookedDevice<H> {
    pub fn new(hook: H) -> Arc<Self> {
        Arc::new(Self {
            inner: HostDevice::new(0),
            hook,
        })
    }
}

impl<H> fmt::Debug for HookedDevice<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HookedDevice")
            .field("inner", &self.inner)
            .finish()
    }
}

impl<H: SubmitHook> Device for HookedDevice<H> {
    fn kind(&self) -> DeviceKind {
        self.inner.kind()
    }

    fn ordinal(&self) -> u32 {
        self.inner.ordinal()
    }

    fn name(&self) -> String {
        self.inner.name()
    }

    fn check_range(&self, ptr: u64, len: u64) -> Result<(), DeviceError> {
        self.inner.check_range(ptr, len)
    }

    fn alloc(&self, bytes: u64) -> Result<DeviceBuffer, DeviceError> {
        self.inner.alloc(bytes)
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
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { self.hook.submit(&self.inner, dir, list, landed) }
    }

    fn write(&self, dst: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.inner.write(dst, data)
    }

    fn read(&self, src: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.inner.read(src, out)
    }

    fn import_memfd(
        &self,
        fd: std::os::fd::OwnedFd,
        len: u64,
    ) -> Result<DeviceBuffer, DeviceError> {
        self.inner.import_memfd(fd, len)
    }
}
