//! CUDA driver calls, one thin wrapper each, turning return codes into [`CudaError`].
//!
//! This module is the only place of the backend that calls into the driver: this file holds the
//! symbol table and the probe, and `ffi/` one file of wrappers per area of the driver API (devices,
//! streams and events, memory, copies, IPC, DMA-BUF, VMM, modules). Where cudarc's `result` layer
//! has the call, the wrapper is that call with our error (the call's name and the driver's error
//! name); raw `sys` calls remain only for what `result` lacks: `cuDriverGetVersion`, an event with
//! combined flags (`result` takes one flag), the unified `cuMemcpyAsync`, `cuMemcpyBatchAsync_v2`,
//! several pointer attributes in one `cuPointerGetAttributes`, host registration, CUDA IPC handles,
//! the DMA-BUF export, the GPUDirect RDMA flush and the virtual memory management calls (`cuMem*`:
//! a VMM allocation shared by POSIX fd, which is how vLLM 0.34's extensible KV cache is shared).
//! cudarc loads `libcuda.so` lazily and panics when the library or a symbol is missing, so [`init`]
//! proves the library and every required symbol (those `result` calls included) present before
//! anything else here may be called, and optional calls check [`has_symbol`] first. Functions that
//! take raw handles or raw addresses are `unsafe fn`: their callers vouch for the handles' liveness
//! and for the memory the addresses name.

mod copy;
mod device;
mod dmabuf;
mod ipc;
mod memory;
mod module;
mod stream;
mod vmm;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;

pub use sys::{CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmodule, CUstream};

use super::error::CudaError;

pub use copy::{has_memcpy_batch, memcpy_async, memcpy_batch_async, memcpy_dtoh, memcpy_htod};
pub use device::{
    ctx_set_current, device_attribute, device_count, device_get, device_name, primary_ctx_release,
    primary_ctx_retain,
};
pub use dmabuf::{dmabuf_export, dmabuf_size, fd_is_dmabuf, flush_gpudirect_rdma_writes};
pub use ipc::{ipc_close, ipc_get_handle, ipc_open};
pub use memory::{
    mem_alloc, mem_free, mem_free_host, mem_host_alloc, mem_host_register, mem_host_unregister,
    pointer_info, MEMORYTYPE_DEVICE, MEMORYTYPE_HOST,
};
pub use module::{launch_kernel, module_get_function, module_load_data, module_unload};
pub use stream::{
    event_create, event_destroy, event_query, event_record, event_synchronize, stream_create,
    stream_destroy, stream_synchronize, stream_wait_event,
};
pub use vmm::{
    pointer_mapping, vmm_address_free, vmm_address_reserve, vmm_create, vmm_export_fd,
    vmm_granularity, vmm_import_fd, vmm_map, vmm_missing, vmm_release, vmm_retain, vmm_set_access,
    vmm_unmap, MappingInfo, MemHandle,
};

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
