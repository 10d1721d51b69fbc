//! Device and pinned host allocations, host registration, and what the driver knows about an
//! address.

use std::ffi::{c_int, c_uint, c_void};

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::{check, cu_err, CUdeviceptr};
use crate::cuda::error::CudaError;

pub fn mem_alloc(bytes: usize) -> Result<CUdeviceptr, CudaError> {
    // SAFETY: returns fresh, uninitialised device memory that nothing reads before it is
    // written; needs a current context, which every caller sets first (without one the
    // driver returns an error code).
    unsafe { cu::malloc_sync(bytes) }.map_err(cu_err("cuMemAlloc"))
}

/// # Safety
/// `p` came from [`mem_alloc`], is freed once, and no queued work still uses it.
pub unsafe fn mem_free(p: CUdeviceptr) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees ownership and that no work is pending on it.
    unsafe { cu::free_sync(p) }.map_err(cu_err("cuMemFree"))
}

/// Page-locked host memory, mapped into the device address space and usable from every
/// context.
pub fn mem_host_alloc(bytes: usize) -> Result<*mut c_void, CudaError> {
    let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
    // SAFETY: returns fresh pinned memory; callers write it before reading it.
    unsafe { cu::malloc_host(bytes, flags) }.map_err(cu_err("cuMemHostAlloc"))
}

/// # Safety
/// `p` came from [`mem_host_alloc`], is freed once, and no queued work still uses it.
pub unsafe fn mem_free_host(p: *mut c_void) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees ownership and that no work is pending on it.
    unsafe { cu::free_host(p) }.map_err(cu_err("cuMemFreeHost"))
}

/// Pins `[p, p + len)` and maps it for every context (`read_only` for mappings the process
/// may not write, such as a peer's pool).
///
/// # Safety
/// The range is mapped host memory that stays mapped until [`mem_host_unregister`].
pub unsafe fn mem_host_register(
    p: *mut c_void,
    len: usize,
    read_only: bool,
) -> Result<(), CudaError> {
    let mut flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    if read_only {
        flags |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
    }
    // SAFETY: the caller guarantees the range stays mapped while registered.
    check("cuMemHostRegister", unsafe {
        sys::cuMemHostRegister_v2(p, len, flags)
    })
}

/// # Safety
/// `p` is the base of a live registration and no queued work still uses it.
pub unsafe fn mem_host_unregister(p: *mut c_void) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees a live registration with no pending work.
    check("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(p)
    })
}

/// What the driver knows about one address.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PointerInfo {
    /// `CU_MEMORYTYPE_*` (1 host, 2 device, 0 unknown to CUDA).
    pub memory_type: u32,
    pub device_ordinal: i32,
    /// The allocation that holds the address.
    pub range_start: u64,
    pub range_size: u64,
    /// For host memory: where the device sees it (0 where not mapped).
    pub device_pointer: u64,
}

pub const MEMORYTYPE_HOST: u32 = sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32;
pub const MEMORYTYPE_DEVICE: u32 = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;

/// Attributes of `ptr`; an address CUDA does not know is not an error but has memory type 0.
pub fn pointer_info(ptr: u64) -> Result<PointerInfo, CudaError> {
    use sys::CUpointer_attribute as A;
    let mut memory_type: c_uint = 0;
    let mut ordinal: c_int = -1;
    let mut start: u64 = 0;
    let mut size: usize = 0;
    let mut dev_ptr: u64 = 0;
    let mut attrs = [
        A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        A::CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
    ];
    let mut data: [*mut c_void; 5] = [
        (&mut memory_type as *mut c_uint).cast(),
        (&mut ordinal as *mut c_int).cast(),
        (&mut start as *mut u64).cast(),
        (&mut size as *mut usize).cast(),
        (&mut dev_ptr as *mut u64).cast(),
    ];
    // SAFETY: five attributes, each with a pointer to storage of the type the driver writes
    // for it (unsigned int, int, CUdeviceptr, size_t, CUdeviceptr); the address itself is
    // only looked up, never dereferenced.
    let r = unsafe { sys::cuPointerGetAttributes(5, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
    check("cuPointerGetAttributes", r)?;
    Ok(PointerInfo {
        memory_type,
        device_ordinal: ordinal,
        range_start: start,
        range_size: size as u64,
        device_pointer: dev_ptr,
    })
}
