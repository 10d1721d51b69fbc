//! DMA-BUF: exporting device memory for a NIC's direct (GPUDirect RDMA) writes, and accepting
//! an fd the memory's owner exported.

use std::os::fd::OwnedFd;

use crate::{DeviceError, DmaBuf};

use super::context::Context;
use super::ffi;

impl Context {
    pub(super) fn export_dmabuf(&self, ptr: u64, len: u64) -> Result<DmaBuf, DeviceError> {
        let inner = self;
        if !inner.caps.dmabuf_export {
            let reason = inner
                .caps
                .notes
                .iter()
                .find(|n| n.starts_with("dmabuf"))
                .cloned();
            return Err(DeviceError::Unsupported {
                what: "DMA-BUF export",
                reason: reason.unwrap_or_else(|| "unsupported".into()),
            });
        }
        inner.bind()?;
        inner.check(ptr, len.max(1))?;
        // SAFETY: sysconf only reads a system constant.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as u64,
            _ => 4096,
        };
        let start = ptr & !(page - 1);
        let end = (ptr + len.max(1)).div_ceil(page) * page;
        match ffi::dmabuf_export(start, (end - start) as usize) {
            Ok(fd) => Ok(DmaBuf::new(fd, start, end - start, inner.ordinal)),
            Err(e) if e.is_not_supported() => Err(DeviceError::Unsupported {
                what: "DMA-BUF export",
                reason: e.to_string(),
            }),
            Err(e) => Err(inner.driver("cuMemGetHandleForAddressRange", e)),
        }
    }

    pub(super) fn import_dmabuf(
        &self,
        fd: OwnedFd,
        base: u64,
        len: u64,
    ) -> Result<DmaBuf, DeviceError> {
        use std::os::fd::AsFd;
        let ordinal = self.ordinal;
        let fail = |reason: String| DeviceError::Import {
            ordinal,
            what: "DMA-BUF fd",
            reason,
        };
        if !ffi::fd_is_dmabuf(fd.as_fd()) {
            return Err(fail("the fd is not a DMA-BUF".into()));
        }
        let size = ffi::dmabuf_size(fd.as_fd()).map_err(|e| fail(format!("size: {e}")))?;
        if size < len {
            return Err(fail(format!("the DMA-BUF has {size} bytes, {len} claimed")));
        }
        self.bind()?;
        self.check(base, len)?;
        Ok(DmaBuf::new(fd, base, len, ordinal))
    }
}
