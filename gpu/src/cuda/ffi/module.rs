//! Modules loaded from PTX and the kernels launched from them.

use std::ffi::{c_void, CStr};

use cudarc::driver::result as cu;

use super::{cu_err, CUfunction, CUmodule, CUstream};
use crate::cuda::error::CudaError;

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
