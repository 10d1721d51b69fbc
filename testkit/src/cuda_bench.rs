//! Baseline measurements for `kvferry bench`: what the raw driver does with the same bytes.
//!
//! The calls go straight through cudarc's `result` layer (the driver API with return codes
//! turned into `Result`): a baseline must not share code with the backend it is compared with.

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use kvferry_gpu::{Device, DeviceError, DeviceKind};

use crate::stats::median;

/// The raw driver's side of a baseline: `device`'s primary context, retained and current on
/// this thread, released on drop. Opened only for a CUDA device (whose open loaded the
/// driver library: cudarc panics on a missing library or symbol, so both are checked first).
pub(crate) struct RawContext {
    ordinal: u32,
    dev: sys::CUdevice,
}

impl RawContext {
    /// `what` names the baseline in the errors.
    pub(crate) fn open(device: &dyn Device, what: &'static str) -> Result<Self, DeviceError> {
        let ordinal = device.ordinal();
        let unsupported = |reason: String| DeviceError::Unsupported { what, reason };
        if device.kind() != DeviceKind::Cuda {
            return Err(unsupported(format!("{} device", device.kind().as_str())));
        }
        // CUDA 13 renamed cuEventElapsedTime to `_v2`, the name cudarc calls; an older
        // driver is refused here instead of reaching cudarc's panic.
        // SAFETY: a CUDA device is open, so the library is loaded; a lookup has no side
        // effects and the pointer is not used.
        let timing =
            unsafe { sys::culib().get::<*const std::ffi::c_void>(b"cuEventElapsedTime_v2") };
        if timing.is_err() {
            return Err(unsupported(
                "the driver has no cuEventElapsedTime_v2 (CUDA 13 or newer needed)".into(),
            ));
        }
        let drv = |call| driver_error(ordinal, call);
        cu::init().map_err(drv("cuInit"))?;
        let dev = cu::device::get(ordinal as i32).map_err(drv("cuDeviceGet"))?;
        // SAFETY: `dev` is a device handle just returned by the driver.
        let ctx =
            unsafe { cu::primary_ctx::retain(dev) }.map_err(drv("cuDevicePrimaryCtxRetain"))?;
        // From here on the drop balances the retain.
        let raw = Self { ordinal, dev };
        // SAFETY: retained just above.
        unsafe { cu::ctx::set_current(ctx) }.map_err(drv("cuCtxSetCurrent"))?;
        Ok(raw)
    }

    /// Turns a driver error of `call` into the device's error.
    pub(crate) fn drv(&self, call: &'static str) -> impl Fn(DriverError) -> DeviceError {
        driver_error(self.ordinal, call)
    }
}

impl Drop for RawContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`; whoever used the context waited for its
        // work before dropping this.
        let _ = unsafe { cu::primary_ctx::release(self.dev) };
    }
}

fn driver_error(ordinal: u32, call: &'static str) -> impl Fn(DriverError) -> DeviceError {
    move |e: DriverError| DeviceError::Driver {
        ordinal,
        call,
        reason: e.to_string(),
    }
}

/// Host bytes of a baseline as a `usize`, or why they do not fit.
pub(crate) fn host_len(bytes: u64, what: &'static str) -> Result<usize, DeviceError> {
    usize::try_from(bytes).map_err(|_| DeviceError::Unsupported {
        what,
        reason: format!("{bytes} bytes do not fit this host's address space"),
    })
}

/// Median seconds of one plain `cuMemcpyHtoDAsync` of `bytes` from `host_ptr` to `dev_ptr`,
/// timed with device events over `iters` runs after one warm-up. The baseline that batched
/// loads are compared with; pass pinned host memory for a meaningful number.
///
/// # Safety
/// `[host_ptr, host_ptr + bytes)` is readable host memory that stays mapped during the call.
/// The device range is checked.
pub unsafe fn bench_raw_h2d(
    device: &dyn Device,
    host_ptr: u64,
    dev_ptr: u64,
    bytes: u64,
    iters: u32,
) -> Result<f64, DeviceError> {
    const WHAT: &str = "raw H2D benchmark";
    let raw = RawContext::open(device, WHAT)?;
    device.check_range(dev_ptr, bytes)?;
    let len = host_len(bytes, WHAT)?;
    let drv = |call| raw.drv(call);
    // SAFETY: the caller guarantees `[host_ptr, host_ptr + len)` is readable for the call.
    let src = unsafe { std::slice::from_raw_parts(host_ptr as *const u8, len) };
    let r = (|| {
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(drv("cuStreamCreate"))?;
        let r = (|| {
            let timed = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC;
            let start = cu::event::create(timed).map_err(drv("cuEventCreate"))?;
            let end = match cu::event::create(timed) {
                Ok(e) => e,
                Err(e) => {
                    // SAFETY: created above, unused.
                    let _ = unsafe { cu::event::destroy(start) };
                    return Err(drv("cuEventCreate")(e));
                }
            };
            let mut times = Vec::with_capacity(iters as usize);
            let r = (|| {
                for i in 0..=iters {
                    // SAFETY: `src` is readable (caller), the device range was checked;
                    // events and stream are live; each run is waited for before the next and
                    // before returning, so `src` outlives every copy.
                    unsafe {
                        cu::event::record(start, stream).map_err(drv("cuEventRecord"))?;
                        cu::memcpy_htod_async(dev_ptr, src, stream)
                            .map_err(drv("cuMemcpyHtoDAsync"))?;
                        cu::event::record(end, stream).map_err(drv("cuEventRecord"))?;
                        cu::event::synchronize(end).map_err(drv("cuEventSynchronize"))?;
                        let ms =
                            cu::event::elapsed(start, end).map_err(drv("cuEventElapsedTime"))?;
                        if i > 0 {
                            times.push(f64::from(ms) / 1e3);
                        }
                    }
                }
                Ok(())
            })();
            // SAFETY: both events completed (or were never recorded) and are ours.
            unsafe {
                let _ = cu::event::destroy(start);
                let _ = cu::event::destroy(end);
            }
            r.map(|()| median(&mut times))
        })();
        // SAFETY: every run on it was waited for.
        let _ = unsafe { cu::stream::destroy(stream) };
        r
    })();
    // `raw` releases the context: every run on it was waited for.
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_device_is_refused_before_any_driver_call() {
        let dev = kvferry_gpu::HostDevice::new(0);
        let buf = dev.alloc(64).unwrap();
        let host = [0u8; 64];
        // SAFETY: `host` is readable for the call.
        let r = unsafe { bench_raw_h2d(dev.as_ref(), host.as_ptr() as u64, buf.ptr(), 64, 1) };
        assert!(matches!(r, Err(DeviceError::Unsupported { .. })), "{r:?}");
    }
}
