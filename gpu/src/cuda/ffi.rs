//! CUDA driver calls, one thin wrapper each, turning return codes into [`CudaError`].
//!
//! This is the only file of the backend that calls into the driver. Where cudarc's `result`
//! layer has the call, the wrapper is that call with our error (the call's name and the
//! driver's error name); raw `sys` calls remain only for what `result` lacks:
//! `cuDriverGetVersion`, an event with combined flags (`result` takes one flag), the unified
//! `cuMemcpyAsync`, `cuMemcpyBatchAsync_v2`, several pointer attributes in one
//! `cuPointerGetAttributes`, host registration, CUDA IPC handles, the DMA-BUF export, the
//! GPUDirect RDMA flush and the virtual memory management calls (`cuMem*`: a VMM allocation
//! shared by POSIX fd, which is how vLLM 0.34's extensible KV cache is shared). cudarc loads `libcuda.so` lazily and panics when the library or a
//! symbol is missing, so [`init`] proves the library and every required symbol (those
//! `result` calls included) present before anything else here may be called, and optional
//! calls check [`has_symbol`] first. Functions that take raw handles or raw addresses are
//! `unsafe fn`: their callers vouch for the handles' liveness and for the memory the
//! addresses name.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;

pub use sys::{CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmodule, CUstream};

use super::error::CudaError;

/// Every driver symbol the backend calls unconditionally (the optional ones are checked
/// where they are used). All exist since CUDA 11.4; a driver lacking one is refused at init.
const REQUIRED: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyAsync",
    "cuMemcpyHtoDAsync_v2",
    "cuPointerGetAttributes",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuModuleGetFunction",
    "cuLaunchKernel",
];

static LIBRARY: OnceLock<bool> = OnceLock::new();

fn library_loaded() -> bool {
    *LIBRARY.get_or_init(|| {
        // SAFETY: loading libcuda runs its initialisers; this is the library cudarc itself
        // loads, and it is built to be loaded into any process.
        unsafe { sys::is_culib_present() }
    })
}

/// True where the driver library is loaded and exports `name`.
pub fn has_symbol(name: &str) -> bool {
    if !library_loaded() {
        return false;
    }
    // SAFETY: `culib` only panics when no library can be loaded, which `library_loaded` just
    // ruled out; looking a symbol up has no side effects, and the pointer is not used.
    unsafe { sys::culib().get::<*const c_void>(name.as_bytes()).is_ok() }
}

fn check(call: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(driver_error(call, r))
}

/// A `result` layer error as ours: the call and the driver's name for the code.
fn cu_err(call: &'static str) -> impl Fn(DriverError) -> CudaError {
    move |e| driver_error(call, e.0)
}

fn driver_error(call: &'static str, r: sys::CUresult) -> CudaError {
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorName only writes a pointer to a static string into `p`.
    let named = unsafe { sys::cuGetErrorName(r, &mut p) };
    let name = if named == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
        // SAFETY: the driver returned a NUL-terminated static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("{r:?}")
    };
    CudaError::Driver {
        call,
        code: r as u32,
        name,
    }
}

/// Loads the driver, proves every required symbol present and initialises it (idempotent).
pub fn init() -> Result<(), CudaError> {
    static INIT: OnceLock<Result<(), CudaError>> = OnceLock::new();
    INIT.get_or_init(|| {
        if !library_loaded() {
            return Err(CudaError::NoLibrary);
        }
        if let Some(symbol) = REQUIRED.iter().find(|s| !has_symbol(s)) {
            return Err(CudaError::MissingSymbol { symbol });
        }
        cu::init().map_err(cu_err("cuInit"))
    })
    .clone()
}

pub fn driver_version() -> Result<i32, CudaError> {
    let mut v: c_int = 0;
    // SAFETY: writes one int into `v`.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut v)
    })?;
    Ok(v)
}

pub fn device_count() -> Result<i32, CudaError> {
    cu::device::get_count().map_err(cu_err("cuDeviceGetCount"))
}

pub fn device_get(ordinal: i32) -> Result<CUdevice, CudaError> {
    cu::device::get(ordinal).map_err(cu_err("cuDeviceGet"))
}

pub fn device_name(dev: CUdevice) -> Result<String, CudaError> {
    cu::device::get_name(dev).map_err(cu_err("cuDeviceGetName"))
}

pub fn device_attribute(dev: CUdevice, attr: sys::CUdevice_attribute) -> Result<i32, CudaError> {
    // SAFETY: only reads an attribute; a handle that is no device, or an unknown attribute,
    // is an error code, not UB.
    unsafe { cu::device::get_attribute(dev, attr) }.map_err(cu_err("cuDeviceGetAttribute"))
}

pub fn primary_ctx_retain(dev: CUdevice) -> Result<CUcontext, CudaError> {
    // SAFETY: a handle that is no device is an error code; the caller releases the context
    // once.
    unsafe { cu::primary_ctx::retain(dev) }.map_err(cu_err("cuDevicePrimaryCtxRetain"))
}

/// # Safety
/// Balances exactly one successful [`primary_ctx_retain`] of `dev`; nothing of this retain
/// (streams, events, modules) may be used afterwards.
pub unsafe fn primary_ctx_release(dev: CUdevice) -> Result<(), CudaError> {
    // SAFETY: the caller balances one retain.
    unsafe { cu::primary_ctx::release(dev) }.map_err(cu_err("cuDevicePrimaryCtxRelease"))
}

/// # Safety
/// `ctx` is a live (retained) context.
pub unsafe fn ctx_set_current(ctx: CUcontext) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees `ctx` is retained; binding it to this thread is all this
    // does.
    unsafe { cu::ctx::set_current(ctx) }.map_err(cu_err("cuCtxSetCurrent"))
}

/// A non-blocking stream (no implicit synchronisation with the legacy default stream) in the
/// current context.
pub fn stream_create() -> Result<CUstream, CudaError> {
    cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(cu_err("cuStreamCreate"))
}

/// # Safety
/// `s` is a live stream of the current context, destroyed once.
pub unsafe fn stream_destroy(s: CUstream) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees `s` is live and not used afterwards.
    unsafe { cu::stream::destroy(s) }.map_err(cu_err("cuStreamDestroy"))
}

/// # Safety
/// `s` is a live stream.
pub unsafe fn stream_synchronize(s: CUstream) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees `s` is live.
    unsafe { cu::stream::synchronize(s) }.map_err(cu_err("cuStreamSynchronize"))
}

/// Makes all later work on `s` wait until the most recent record of `e` has completed (an
/// event never recorded counts as completed). The host does not wait.
///
/// # Safety
/// `s` and `e` are live handles of the same context.
pub unsafe fn stream_wait_event(s: CUstream, e: CUevent) -> Result<(), CudaError> {
    let flags = sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;
    // SAFETY: the caller guarantees both handles.
    unsafe { cu::stream::wait_event(s, e, flags) }.map_err(cu_err("cuStreamWaitEvent"))
}

/// An event; `timing` keeps timestamps (for benchmarks), otherwise they are disabled, which
/// makes record and wait cheaper. Waiting on it blocks the thread instead of spinning.
pub fn event_create(timing: bool) -> Result<CUevent, CudaError> {
    if timing {
        return cu::event::create(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC)
            .map_err(cu_err("cuEventCreate"));
    }
    // Raw: `result::event::create` takes one flag, and this event needs two.
    let mut e: CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as c_uint
        | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
    // SAFETY: writes one event handle into `e`.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut e, flags)
    })?;
    Ok(e)
}

/// # Safety
/// `e` is a live event, destroyed once.
pub unsafe fn event_destroy(e: CUevent) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees `e` is live and not used afterwards.
    unsafe { cu::event::destroy(e) }.map_err(cu_err("cuEventDestroy"))
}

/// # Safety
/// `e` and `s` are live and of the same context.
pub unsafe fn event_record(e: CUevent, s: CUstream) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees both handles.
    unsafe { cu::event::record(e, s) }.map_err(cu_err("cuEventRecord"))
}

/// Whether the work before `e` has completed: `Ok(false)` while it runs.
///
/// # Safety
/// `e` is a live event.
pub unsafe fn event_query(e: CUevent) -> Result<bool, CudaError> {
    // SAFETY: the caller guarantees `e` is live; the query has no side effects.
    let r = unsafe { sys::cuEventQuery(e) };
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        r => Err(driver_error("cuEventQuery", r)),
    }
}

/// # Safety
/// `e` is a live event.
pub unsafe fn event_synchronize(e: CUevent) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees `e` is live.
    unsafe { cu::event::synchronize(e) }.map_err(cu_err("cuEventSynchronize"))
}

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

pub fn ipc_get_handle(ptr: CUdeviceptr) -> Result<[u8; 64], CudaError> {
    // SAFETY: all-zero is a valid handle value (64 opaque bytes).
    let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: writes 64 bytes into `h`; an address that is no device allocation is an error
    // code.
    check("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(&mut h, ptr)
    })?;
    Ok(h.reserved.map(|c| c as u8))
}

/// Maps another process's allocation into this one; the returned base is the start of the
/// exporter's whole allocation.
pub fn ipc_open(handle: &[u8; 64]) -> Result<CUdeviceptr, CudaError> {
    let h = sys::CUipcMemHandle {
        reserved: handle.map(|b| b as c_char),
    };
    let mut p: CUdeviceptr = 0;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
    // SAFETY: the handle is passed by value and only interpreted by the driver (a forged one is
    // an error code); writes one pointer into `p`.
    check("cuIpcOpenMemHandle", unsafe {
        sys::cuIpcOpenMemHandle_v2(&mut p, h, flags)
    })?;
    Ok(p)
}

/// # Safety
/// `p` came from [`ipc_open`], is closed once, and no queued work still uses it.
pub unsafe fn ipc_close(p: CUdeviceptr) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees ownership and that no work is pending on it.
    check("cuIpcCloseMemHandle", unsafe {
        sys::cuIpcCloseMemHandle(p)
    })
}

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

/// The driver calls of VMM sharing ([`vmm_import_fd`] and its exporting counterparts), all
/// optional (CUDA 10.2+): where one is missing those wrappers answer
/// [`CudaError::MissingSymbol`] before touching the driver.
pub const VMM_SYMBOLS: &[&str] = &[
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemRetainAllocationHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
];

/// A VMM physical allocation handle (`CUmemGenericAllocationHandle`).
pub type MemHandle = sys::CUmemGenericAllocationHandle;

/// The first VMM call the loaded driver lacks, as the error every VMM wrapper returns then.
pub fn vmm_missing() -> Result<(), CudaError> {
    if !library_loaded() {
        return Err(CudaError::NoLibrary);
    }
    match VMM_SYMBOLS.iter().find(|s| !has_symbol(s)) {
        Some(symbol) => Err(CudaError::MissingSymbol { symbol }),
        None => Ok(()),
    }
}

/// Pinned device memory on `ordinal` that may be exported as a POSIX fd.
fn vmm_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: all-zero is a valid value of this plain C struct (enums as u32 with 0 a valid
    // "none"/"invalid" value, a null pointer, integers).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    prop
}

/// The granularity VMM sizes and addresses on `ordinal` must be multiples of (2 MiB on
/// today's GPUs).
pub fn vmm_granularity(ordinal: i32) -> Result<usize, CudaError> {
    vmm_missing()?;
    let prop = vmm_prop(ordinal);
    let mut g: usize = 0;
    let flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: reads `prop` and writes one size_t; the symbol exists (checked above).
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(&mut g, &prop, flag)
    })?;
    Ok(g)
}

/// A new physical allocation of `size` bytes (a multiple of [`vmm_granularity`]) on
/// `ordinal`, exportable as a POSIX fd. The caller releases it once ([`vmm_release`]).
pub fn vmm_create(ordinal: i32, size: usize) -> Result<MemHandle, CudaError> {
    vmm_missing()?;
    let prop = vmm_prop(ordinal);
    let mut h: MemHandle = 0;
    // SAFETY: reads `prop`, writes one handle; the symbol exists (checked above).
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(&mut h, size, &prop, 0)
    })?;
    Ok(h)
}

/// # Safety
/// `h` came from [`vmm_create`], [`vmm_import_fd`] or [`vmm_retain`] and is released once;
/// the memory stays alive while a mapping of it remains (the driver counts those).
pub unsafe fn vmm_release(h: MemHandle) -> Result<(), CudaError> {
    vmm_missing()?;
    // SAFETY: the caller releases a live handle once; the symbol exists.
    check("cuMemRelease", unsafe { sys::cuMemRelease(h) })
}

/// A new POSIX fd naming the allocation `h` (created exportable as one), owned by the caller.
pub fn vmm_export_fd(h: MemHandle) -> Result<OwnedFd, CudaError> {
    vmm_missing()?;
    let mut fd: c_int = -1;
    let ty = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: for the POSIX fd type the driver writes one int into the handle argument; a
    // handle that is not live or not exportable is an error code; the symbol exists.
    check("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle((&mut fd as *mut c_int).cast(), h, ty, 0)
    })?;
    if fd < 0 {
        return Err(CudaError::Driver {
            call: "cuMemExportToShareableHandle",
            code: 1,
            name: format!("returned fd {fd}"),
        });
    }
    // SAFETY: on success the driver handed us a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The allocation another process exported as the POSIX fd `fd`; the fd stays the caller's
/// (the driver does not take it) and may be closed once this returns.
pub fn vmm_import_fd(fd: BorrowedFd<'_>) -> Result<MemHandle, CudaError> {
    vmm_missing()?;
    let mut h: MemHandle = 0;
    let ty = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // For the POSIX fd type the "OS handle" argument is the fd's value itself, cast to a
    // pointer, not a pointer to it.
    let os_handle = fd.as_raw_fd() as usize as *mut c_void;
    // SAFETY: the driver reads the fd (open for the borrow) and writes one handle; an fd that
    // names no exported allocation is an error code; the symbol exists.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(&mut h, os_handle, ty)
    })?;
    Ok(h)
}

/// A new reference to the allocation mapped at `ptr` (any address inside the mapping),
/// released once by the caller.
pub fn vmm_retain(ptr: CUdeviceptr) -> Result<MemHandle, CudaError> {
    vmm_missing()?;
    let mut h: MemHandle = 0;
    // SAFETY: the address is only looked up (one not mapped by cuMemMap is an error code);
    // writes one handle; the symbol exists.
    check("cuMemRetainAllocationHandle", unsafe {
        sys::cuMemRetainAllocationHandle(&mut h, ptr as usize as *mut c_void)
    })?;
    Ok(h)
}

/// Reserves `size` bytes of device address space aligned to `align`; the caller frees it
/// once ([`vmm_address_free`]).
pub fn vmm_address_reserve(size: usize, align: usize) -> Result<CUdeviceptr, CudaError> {
    vmm_missing()?;
    let mut p: CUdeviceptr = 0;
    // SAFETY: writes one pointer; no fixed address is asked for; the symbol exists.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut p, size, align, 0, 0)
    })?;
    Ok(p)
}

/// # Safety
/// `[p, p + size)` is exactly one reservation of [`vmm_address_reserve`] with nothing mapped
/// in it any more, freed once.
pub unsafe fn vmm_address_free(p: CUdeviceptr, size: usize) -> Result<(), CudaError> {
    vmm_missing()?;
    // SAFETY: the caller guarantees an unmapped reservation freed once; the symbol exists.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(p, size)
    })
}

/// # Safety
/// `[p, p + size)` lies in a reservation of this process with nothing mapped there; `h` is
/// live and at least `size` bytes long.
pub unsafe fn vmm_map(p: CUdeviceptr, size: usize, h: MemHandle) -> Result<(), CudaError> {
    vmm_missing()?;
    // SAFETY: the caller guarantees the range and the handle; offset 0 (the only one the
    // driver accepts); the symbol exists.
    check("cuMemMap", unsafe { sys::cuMemMap(p, size, 0, h, 0) })
}

/// # Safety
/// `[p, p + size)` is exactly one mapping of [`vmm_map`], unmapped once, with no queued
/// work still using it.
pub unsafe fn vmm_unmap(p: CUdeviceptr, size: usize) -> Result<(), CudaError> {
    vmm_missing()?;
    // SAFETY: the caller guarantees an idle mapping unmapped once; the symbol exists.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(p, size) })
}

/// Lets device `ordinal` read and write `[p, p + size)` (mapped memory has no access until
/// then).
///
/// # Safety
/// `[p, p + size)` is mapped by [`vmm_map`].
pub unsafe fn vmm_set_access(p: CUdeviceptr, size: usize, ordinal: i32) -> Result<(), CudaError> {
    vmm_missing()?;
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = ordinal;
    desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // SAFETY: one descriptor, read during the call; the caller guarantees the mapping; the
    // symbol exists.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(p, size, &desc, 1)
    })
}

/// The VMM mapping holding an address: where it starts, how long it is, and whether its
/// allocation may be exported as a POSIX fd.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MappingInfo {
    pub base: u64,
    pub size: u64,
    pub posix_fd: bool,
}

/// The mapping `ptr` lies in; `size` 0 where the address is in no VMM mapping (an address
/// CUDA does not know is not an error).
pub fn pointer_mapping(ptr: u64) -> Result<MappingInfo, CudaError> {
    use sys::CUpointer_attribute as A;
    // Callable before any device is opened (an exporter's first call): prove the library.
    init()?;
    let (mut base, mut size, mut types) = (0u64, 0u64, 0u64);
    let mut attrs = [
        A::CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
        A::CU_POINTER_ATTRIBUTE_MAPPING_SIZE,
        A::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
    ];
    let mut data: [*mut c_void; 3] = [
        (&mut base as *mut u64).cast(),
        (&mut size as *mut u64).cast(),
        (&mut types as *mut u64).cast(),
    ];
    // SAFETY: three attributes, each with 8 zeroed bytes of storage, at least what the driver
    // writes for each (a pointer, a size_t, a bitmask of at most 64 bits); the address is
    // only looked up.
    let r = unsafe { sys::cuPointerGetAttributes(3, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
    check("cuPointerGetAttributes", r)?;
    let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0 as u64;
    Ok(MappingInfo {
        base,
        size,
        posix_fd: types & posix != 0,
    })
}

/// Loads a module from a NUL-terminated PTX image into the current context (JIT compiled
/// for the device).
pub fn module_load_data(image: &CStr) -> Result<CUmodule, CudaError> {
    // SAFETY: `image` is a NUL-terminated PTX text the driver only reads during the call.
    unsafe { cu::module::load_data(image.as_ptr().cast()) }.map_err(cu_err("cuModuleLoadData"))
}

/// # Safety
/// `m` is a live module, unloaded once, with no kernel of it still running.
pub unsafe fn module_unload(m: CUmodule) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees the module is live and idle.
    unsafe { cu::module::unload(m) }.map_err(cu_err("cuModuleUnload"))
}

/// # Safety
/// `m` is a live module.
pub unsafe fn module_get_function(m: CUmodule, name: &CStr) -> Result<CUfunction, CudaError> {
    // SAFETY: the caller guarantees `m`.
    unsafe { cu::module::get_function(m, name.to_owned()) }.map_err(cu_err("cuModuleGetFunction"))
}

/// Launches a 1-D grid.
///
/// # Safety
/// `f` is a live function whose parameter list matches `params` (each entry points to one
/// argument of the right type), every address the kernel will touch stays valid until the
/// work on `s` completes, and `s` is live.
pub unsafe fn launch_kernel(
    f: CUfunction,
    grid: u32,
    block: u32,
    s: CUstream,
    params: &mut [*mut c_void],
) -> Result<(), CudaError> {
    // SAFETY: the caller guarantees the function, the arguments and the stream; no dynamic
    // shared memory.
    unsafe { cu::launch_kernel(f, (grid, 1, 1), (block, 1, 1), 0, s, params) }
        .map_err(cu_err("cuLaunchKernel"))
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
