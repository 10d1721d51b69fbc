//! Baseline measurements for `kvferry bench`: what the raw driver does with the same bytes.

use crate::{Device, DeviceError, DeviceKind};

use super::ffi;

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
    if device.kind() != DeviceKind::Cuda {
        return Err(DeviceError::Unsupported {
            what: "raw H2D benchmark",
            reason: format!("{} device", device.kind().as_str()),
        });
    }
    device.check_range(dev_ptr, bytes)?;
    let drv = |call: &'static str| {
        move |e: super::CudaError| DeviceError::Driver {
            ordinal,
            call,
            reason: e.to_string(),
        }
    };
    let dev = ffi::device_get(ordinal as i32).map_err(drv("cuDeviceGet"))?;
    let ctx = ffi::primary_ctx_retain(dev).map_err(drv("cuDevicePrimaryCtxRetain"))?;
    let r = (|| {
        // SAFETY: retained just above.
        unsafe { ffi::ctx_set_current(ctx) }.map_err(drv("cuCtxSetCurrent"))?;
        let stream = ffi::stream_create().map_err(drv("cuStreamCreate"))?;
        let r = (|| {
            let start = ffi::event_create(true).map_err(drv("cuEventCreate"))?;
            let end = match ffi::event_create(true) {
                Ok(e) => e,
                Err(e) => {
                    // SAFETY: created above, unused.
                    let _ = unsafe { ffi::event_destroy(start) };
                    return Err(drv("cuEventCreate")(e));
                }
            };
            let mut times = Vec::with_capacity(iters as usize);
            let r = (|| {
                for i in 0..=iters {
                    // SAFETY: the caller guarantees the host range, the device range was
                    // checked; events and stream are live; each run is waited for before the
                    // next and before returning.
                    unsafe {
                        ffi::event_record(start, stream).map_err(drv("cuEventRecord"))?;
                        ffi::memcpy_htod_async(
                            dev_ptr,
                            host_ptr as *const std::ffi::c_void,
                            bytes as usize,
                            stream,
                        )
                        .map_err(drv("cuMemcpyHtoDAsync"))?;
                        ffi::event_record(end, stream).map_err(drv("cuEventRecord"))?;
                        ffi::event_synchronize(end).map_err(drv("cuEventSynchronize"))?;
                        let ms =
                            ffi::event_elapsed_ms(start, end).map_err(drv("cuEventElapsedTime"))?;
                        if i > 0 {
                            times.push(f64::from(ms) / 1e3);
                        }
                    }
                }
                Ok(())
            })();
            // SAFETY: both events completed (or were never recorded) and are ours.
            unsafe {
                let _ = ffi::event_destroy(start);
                let _ = ffi::event_destroy(end);
            }
            r.map(|()| median(&mut times))
        })();
        // SAFETY: every run on it was waited for.
        let _ = unsafe { ffi::stream_destroy(stream) };
        r
    })();
    // SAFETY: balances the retain above; nothing of this context is used afterwards.
    let _ = unsafe { ffi::primary_ctx_release(dev) };
    r
}

/// Median of `v` (0 for an empty list).
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
