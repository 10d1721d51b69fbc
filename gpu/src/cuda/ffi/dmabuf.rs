//! Device memory a NIC reaches directly: exported as a DMA-BUF, recognised as one, and the
//! GPUDirect RDMA flush that makes the NIC's writes visible.

use std::ffi::c_int;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::{check, has_symbol, CUdeviceptr};
use crate::cuda::error::CudaError;

/// Exports `[ptr, ptr + len)` of device memory as a DMA-BUF file descriptor (flags 0).
/// Both must be aligned to the host page size.
pub fn dmabuf_export(ptr: CUdeviceptr, len: usize) -> Result<OwnedFd, CudaError> {
    if !has_symbol("cuMemGetHandleForAddressRange") {
        return Err(CudaError::MissingSymbol {
            symbol: "cuMemGetHandleForAddressRange",
        });
    }
    let mut fd: c_int = -1;
    let ty = sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD;
    // SAFETY: for the DMA-BUF handle type the driver writes one int (the fd) into `handle`;
    // the range is only looked up (a bad one is an error code); the symbol exists.
    let r = unsafe {
        sys::cuMemGetHandleForAddressRange((&mut fd as *mut c_int).cast(), ptr, len, ty, 0)
    };
    check("cuMemGetHandleForAddressRange", r)?;
    // SAFETY: on success the driver handed us a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Makes earlier GPUDirect RDMA writes into the current context's memory visible to work
/// launched after this call.
pub fn flush_gpudirect_rdma_writes() -> Result<(), CudaError> {
    if !has_symbol("cuFlushGPUDirectRDMAWrites") {
        return Err(CudaError::MissingSymbol {
            symbol: "cuFlushGPUDirectRDMAWrites",
        });
    }
    let target =
        sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX;
    let scope = sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER;
    // SAFETY: takes two enums and acts on the current context; the symbol exists.
    check("cuFlushGPUDirectRDMAWrites", unsafe {
        sys::cuFlushGPUDirectRDMAWrites(target, scope)
    })
}

/// True where `fd` is a DMA-BUF (the kernel names its inode `dmabuf`).
pub fn fd_is_dmabuf(fd: BorrowedFd<'_>) -> bool {
    match std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())) {
        Ok(target) => {
            let t = target.to_string_lossy();
            t.starts_with("anon_inode:dmabuf") || t.starts_with("/dmabuf:")
        }
        Err(_) => false,
    }
}

/// Size of a DMA-BUF in bytes (DMA-BUFs answer `SEEK_END` with their size).
pub fn dmabuf_size(fd: BorrowedFd<'_>) -> Result<u64, std::io::Error> {
    // SAFETY: lseek only reads the fd's state; `fd` is open for the borrow's lifetime.
    let end = unsafe { libc::lseek(fd.as_raw_fd(), 0, libc::SEEK_END) };
    if end < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above; puts the offset back where importers expect it.
    unsafe { libc::lseek(fd.as_raw_fd(), 0, libc::SEEK_SET) };
    Ok(end as u64)
}
