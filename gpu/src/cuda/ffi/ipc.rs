//! CUDA IPC handles: one process's device allocation mapped into another.

use std::ffi::{c_char, c_uint};

use cudarc::driver::sys;

use super::{check, CUdeviceptr};
use crate::cuda::error::CudaError;

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
