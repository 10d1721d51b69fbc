//! Devices, their attributes, and the primary context bound to a thread.

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::{cu_err, CUcontext, CUdevice};
use crate::cuda::error::CudaError;

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
