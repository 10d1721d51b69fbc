//! Copies between host and device: synchronous, asynchronous, and batched where CUDA 13
//! has the call.

use std::ffi::c_void;

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::{check, cu_err, has_symbol, CUdeviceptr, CUstream};
use crate::cuda::error::CudaError;

/// Synchronous host → device copy.
///
/// # Safety
/// `src` is readable host memory of `len` bytes; `dst..dst+len` is device memory of the
/// current context.
pub unsafe fn memcpy_htod(
    dst: CUdeviceptr,
    src: *const c_void,
    len: usize,
) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees `len` readable bytes at `src` for the (synchronous) call
    // and the device range.
    unsafe {
        let src = std::slice::from_raw_parts(src.cast::<u8>(), len);
        cu::memcpy_htod_sync(dst, src)
    }
    .map_err(cu_err("cuMemcpyHtoD"))
}

/// Synchronous device → host copy.
///
/// # Safety
/// `dst` is writable host memory of `len` bytes; `src..src+len` is device memory.
pub unsafe fn memcpy_dtoh(dst: *mut c_void, src: CUdeviceptr, len: usize) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees `len` writable bytes at `dst`, used by nothing else during
    // the (synchronous) call, and the device range.
    unsafe {
        let dst = std::slice::from_raw_parts_mut(dst.cast::<u8>(), len);
        cu::memcpy_dtoh_sync(dst, src)
    }
    .map_err(cu_err("cuMemcpyDtoH"))
}

/// Asynchronous copy between two unified addresses (host or device, the driver infers which).
///
/// # Safety
/// Both ranges stay valid until the work on `s` completes; `s` is live.
pub unsafe fn memcpy_async(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    len: usize,
    s: CUstream,
) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees both ranges and the stream.
    check("cuMemcpyAsync", unsafe {
        sys::cuMemcpyAsync(dst, src, len, s)
    })
}

/// True where the batched copy call of CUDA 13 exists.
pub fn has_memcpy_batch() -> bool {
    has_symbol("cuMemcpyBatchAsync_v2")
}

/// One batched submission of `dsts.len()` copies with a single attribute set that says the
/// sources are only read in stream order.
///
/// # Safety
/// Every `(dst, src, size)` triple names valid memory (host memory pinned or not, device
/// memory of this context) that stays valid until the work on `s` completes; `s` is live;
/// [`has_memcpy_batch`] returned true.
pub unsafe fn memcpy_batch_async(
    dsts: &mut [CUdeviceptr],
    srcs: &mut [CUdeviceptr],
    sizes: &mut [usize],
    s: CUstream,
) -> Result<(), CudaError> {
    if dsts.len() != srcs.len() || dsts.len() != sizes.len() {
        return Err(CudaError::Driver {
            call: "cuMemcpyBatchAsync",
            code: 1,
            name: "mismatched batch arrays".into(),
        });
    }
    // SAFETY: all-zero is a valid bit pattern for this plain C struct of enums-as-u32
    // (location type 0 = invalid, i.e. "no hint") and integers.
    let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    let mut attr_idx: usize = 0;
    // SAFETY: the arrays have `count` entries each (checked above), one attribute applies from
    // index 0; the caller guarantees the ranges, the stream and the symbol.
    let r = unsafe {
        sys::cuMemcpyBatchAsync_v2(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            dsts.len(),
            &mut attr,
            &mut attr_idx,
            1,
            s,
        )
    };
    check("cuMemcpyBatchAsync", r)
}
