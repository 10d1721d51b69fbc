//! VMM allocations shared by POSIX fd at the device level: importing an engine's (vLLM 0.34's
//! extensible KV cache), allocating and exporting our own, and knowing our mappings when
//! ranges are checked.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::{DeviceBuffer, DeviceError};

use super::context::Context;
use super::device::{AllocRequest, CudaDevice};
use super::ffi;
use super::release::{CudaRelease, Held};
use super::vmm::{self, VmmMap};

/// A POSIX fd of a VMM allocation of this process (the exporting side of
/// [`crate::Device::import_vmm_fd`]): the allocation's mapping is `[base, base + len)` here, and the
/// address asked about lies `offset` bytes into it. An importer maps all `len` bytes.
#[derive(Debug)]
pub struct VmmExport {
    pub fd: OwnedFd,
    pub base: u64,
    pub len: u64,
    pub offset: u64,
}

impl CudaDevice {
    /// Allocates `bytes` (rounded up to the allocation granularity) of VMM memory exportable
    /// as a POSIX fd ([`Self::export_vmm`]): device memory the way vLLM 0.34's extensible KV
    /// cache allocates it, for tests and embedders that share KV with another process.
    pub fn alloc_vmm(&self, bytes: u64) -> Result<DeviceBuffer, DeviceError> {
        let inner = &self.inner;
        inner.vmm_supported("VMM allocation")?;
        let ordinal = inner.ordinal;
        let req = AllocRequest::new(ordinal, bytes)?;
        let fail = |reason: String| req.fail(reason);
        inner.bind()?;
        let g = ffi::vmm_granularity(ordinal as i32).map_err(|e| fail(e.to_string()))? as u64;
        let size = bytes
            .checked_next_multiple_of(g.max(1))
            .ok_or_else(|| fail("size overflows".into()))?;
        let map =
            VmmMap::create(size, ordinal).map_err(|(call, e)| fail(format!("{call}: {e}")))?;
        Ok(inner.vmm_buffer(map))
    }

    /// A POSIX fd of the VMM allocation mapped at `ptr` in this process (the exporting side
    /// of [`crate::Device::import_vmm_fd`]; engine workers do the same through the driver).
    pub fn export_vmm(&self, ptr: u64) -> Result<VmmExport, DeviceError> {
        let inner = &self.inner;
        inner.vmm_supported("VMM fd export")?;
        inner.bind()?;
        let (fd, info) = vmm::export_fd(ptr).map_err(|(call, e)| {
            if e.is_not_supported() {
                DeviceError::Unsupported {
                    what: "VMM fd export",
                    reason: e.to_string(),
                }
            } else {
                inner.driver(call, e)
            }
        })?;
        Ok(VmmExport {
            fd,
            base: info.base,
            len: info.size,
            offset: ptr - info.base,
        })
    }
}

impl Context {
    /// The VMM mapping of this device holding all of `[ptr, ptr + len)`.
    pub(super) fn vmm_range(&self, ptr: u64, len: u64) -> Option<(u64, u64)> {
        let end = ptr.checked_add(len)?;
        let vmms = self.vmms.read().ok()?;
        let (&start, &stop) = vmms.range(..=ptr).next_back()?;
        (end <= stop).then_some((start, stop))
    }

    /// A buffer owning `map`, known to [`Self::vmm_range`] until it drops.
    pub(super) fn vmm_buffer(self: &Arc<Self>, map: VmmMap) -> DeviceBuffer {
        let (ptr, len) = (map.ptr(), map.size());
        if let Ok(mut vmms) = self.vmms.write() {
            vmms.insert(ptr, ptr + len);
        }
        let owner = CudaRelease {
            inner: Arc::clone(self),
            held: Some(Held::Vmm(map)),
        };
        DeviceBuffer::new(ptr, len, self.ordinal, Box::new(owner))
    }

    /// Refuses VMM sharing where the device cannot do it, naming why.
    pub(super) fn vmm_supported(&self, what: &'static str) -> Result<(), DeviceError> {
        if self.caps.vmm_import {
            return Ok(());
        }
        let reason = self
            .caps
            .notes
            .iter()
            .find(|n| n.starts_with("vmm"))
            .cloned()
            .unwrap_or_else(|| "unsupported".into());
        Err(DeviceError::Unsupported { what, reason })
    }

    pub(super) fn import_vmm_fd(
        self: &Arc<Self>,
        fd: OwnedFd,
        len: u64,
    ) -> Result<DeviceBuffer, DeviceError> {
        use std::os::fd::AsFd;
        let inner = self;
        let ordinal = inner.ordinal;
        let fail = |reason: String| DeviceError::Import {
            ordinal,
            what: "VMM allocation fd",
            reason,
        };
        inner.vmm_supported("VMM fd import")?;
        inner.bind()?;
        let g = ffi::vmm_granularity(ordinal as i32)
            .map_err(|e| inner.driver("cuMemGetAllocationGranularity", e))? as u64;
        if len == 0 || !len.is_multiple_of(g.max(1)) {
            return Err(fail(format!(
                "{len} bytes is not a nonzero multiple of the allocation granularity ({g}): \
                 send the mapping's whole size"
            )));
        }
        let map = VmmMap::import(fd.as_fd(), len, ordinal)
            .map_err(|(call, e)| fail(format!("{call}: {e}")))?;
        // The driver holds the allocation now; the fd is not needed any more.
        drop(fd);
        let ptr = map.ptr();
        // Dropping the buffer (here on error, or by its owner) unmaps and releases.
        let buf = inner.vmm_buffer(map);
        let info = ffi::pointer_info(ptr).unwrap_or_default();
        if info.memory_type == ffi::MEMORYTYPE_DEVICE
            && info.device_ordinal >= 0
            && info.device_ordinal != ordinal as i32
        {
            // Mapped, but the memory lives on another GPU: copies would cross to it.
            return Err(DeviceError::WrongDevice {
                ordinal,
                found: info.device_ordinal as u32,
                ptr,
                len,
            });
        }
        Ok(buf)
    }
}
