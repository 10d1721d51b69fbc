//! Streams and the events that order work on them and tell the host it is done.

use std::ffi::c_uint;

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::{check, cu_err, driver_error, CUevent, CUstream};
use crate::cuda::error::CudaError;

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
