//! Baseline measurements for `kvferry bench`: what the raw driver does with the same bytes.
//!
//! The calls go straight through cudarc's `result` layer (the driver API with return codes
//! turned into `Result`): a baseline must not share code with the backend it is compared with.

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use kvferry_gpu::{Device, DeviceError, DeviceKind};

use crate::stats::median;

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
    let ordinal = device.ordinal();
    // A CUDA device was opened, so the driver library is loaded: cudarc's calls below do not
    // reach its panic for a missing library.
    if device.kind() != DeviceKind::Cuda {
        return Err(DeviceError::Unsupported {
            what: "raw H2D benchmark",
            reason: format!("{} device", device.kind().as_str()),
        });
    }
    device.check_range(dev_ptr, bytes)?;
    let len = usize::try_from(bytes).map_err(|_| DeviceError::Unsupported {
        what: "raw H2D benchmark",
        reason: format!("{bytes} bytes do not fit this host's address space"),
    })?;
    let drv = |call: &'static str| {
        move |e: DriverError| DeviceError::Driver {
            ordinal,
            call,
            reason: e.to_string(),
        }
    };
    // CUDA 13 renamed cuEventElapsedTime to `_v2`, the name cudarc calls; cudarc panics on a
    // symbol the driver lacks, so an older driver is refused here instead.
    // SAFETY: a CUDA device is open, so the library is loaded; a lookup has no side effects
    // and the pointer is not used.
    let timing = unsafe { sys::culib().get::<*const std::ffi::c_void>(b"cuEventElapsedTime_v2") };
    if timing.is_err() {
        return Err(DeviceError::Unsupported {
            what: "raw H2D benchmark",
            reason: "the driver has no cuEventElapsedTime_v2 (CUDA 13 or newer needed)".into(),
        });
    }
    cu::init().map_err(drv("cuInit"))?;
    let dev = cu::device::get(ordinal as i32).map_err(drv("cuDeviceGet"))?;
    // SAFETY: `dev` is a device handle just returned by the driver.
    let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(drv("cuDevicePrimaryCtxRetain"))?;
    // SAFETY: the caller guarantees `[host_ptr, host_ptr + len)` is readable for the call.
    let src = unsafe { std::slice::from_raw_parts(host_ptr as *const u8, len) };
    let r = (|| {
        // SAFETY: retained just above.
        unsafe { cu::ctx::set_current(ctx) }.map_err(drv("cuCtxSetCurrent"))?;
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
    // SAFETY: balances the retain above; nothing of this context is used afterwards.
    let _ = unsafe { cu::primary_ctx::release(dev) };
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
