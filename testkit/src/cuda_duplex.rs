//! The duplex baseline of `kvferry bench engine`: the same bytes copied host→device and
//! device→host at once, one plain driver copy each on two streams, which is what the
//! PCIe link gives both directions together (about 100 GB/s on an H200 against 55 for one
//! direction alone). Like [`crate::bench_raw_h2d`], it goes straight through cudarc's
//! `result` layer and shares no code with the backend it is compared with.

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use kvferry_gpu::{Device, DeviceError};

use crate::cuda_bench::{host_len, RawContext};

use crate::stats::median;

/// Where the two copies of [`bench_raw_duplex`] go: `h2d_src` (host) to `h2d_dst` (device)
/// and `d2h_src` (device) to `d2h_dst` (host), `bytes` each.
#[derive(Clone, Copy, Debug)]
pub struct DuplexRanges {
    pub h2d_src: u64,
    pub h2d_dst: u64,
    pub d2h_src: u64,
    pub d2h_dst: u64,
    pub bytes: u64,
}

/// Median seconds from the start of both copies to the end of the later one, timed with
/// device events over `iters` runs after one warm-up. Pass pinned host memory.
///
/// # Safety
/// `[h2d_src, +bytes)` is readable and `[d2h_dst, +bytes)` writable host memory, both
/// mapped during the call and not otherwise used meanwhile. The device ranges are checked.
pub unsafe fn bench_raw_duplex(
    device: &dyn Device,
    r: DuplexRanges,
    iters: u32,
) -> Result<f64, DeviceError> {
    const WHAT: &str = "raw duplex benchmark";
    let raw = RawContext::open(device, WHAT)?;
    device.check_range(r.h2d_dst, r.bytes)?;
    device.check_range(r.d2h_src, r.bytes)?;
    let len = host_len(r.bytes, WHAT)?;
    let drv = |call| raw.drv(call);
    // SAFETY: the caller guarantees both host ranges for the call, and that nobody else
    // uses them meanwhile (so the mutable one is not aliased).
    let (src, dst) = unsafe {
        (
            std::slice::from_raw_parts(r.h2d_src as *const u8, len),
            std::slice::from_raw_parts_mut(r.d2h_dst as *mut u8, len),
        )
    };
    let mut streams = Vec::new();
    let mut events = Vec::new();
    let run = (|| {
        for _ in 0..2 {
            streams.push(
                cu::stream::create(cu::stream::StreamKind::NonBlocking)
                    .map_err(drv("cuStreamCreate"))?,
            );
        }
        for _ in 0..3 {
            events.push(
                cu::event::create(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC)
                    .map_err(drv("cuEventCreate"))?,
            );
        }
        let (up, down) = (streams[0], streams[1]);
        let (start, end_up, end_down) = (events[0], events[1], events[2]);
        let mut times = Vec::with_capacity(iters as usize);
        for i in 0..=iters {
            // SAFETY: host ranges are the caller's (see above), device ranges were checked;
            // streams and events are live; each run is waited for before the next and
            // before returning, so the host memory outlives every copy.
            unsafe {
                cu::event::record(start, up).map_err(drv("cuEventRecord"))?;
                cu::stream::wait_event(down, start, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                    .map_err(drv("cuStreamWaitEvent"))?;
                cu::memcpy_htod_async(r.h2d_dst, src, up).map_err(drv("cuMemcpyHtoDAsync"))?;
                cu::memcpy_dtoh_async(&mut *dst, r.d2h_src, down)
                    .map_err(drv("cuMemcpyDtoHAsync"))?;
                cu::event::record(end_up, up).map_err(drv("cuEventRecord"))?;
                cu::event::record(end_down, down).map_err(drv("cuEventRecord"))?;
                cu::event::synchronize(end_up).map_err(drv("cuEventSynchronize"))?;
                cu::event::synchronize(end_down).map_err(drv("cuEventSynchronize"))?;
                let a = cu::event::elapsed(start, end_up).map_err(drv("cuEventElapsedTime"))?;
                let b = cu::event::elapsed(start, end_down).map_err(drv("cuEventElapsedTime"))?;
                if i > 0 {
                    times.push(f64::from(a.max(b)) / 1e3);
                }
            }
        }
        Ok(median(&mut times))
    })();
    // SAFETY: every run on these streams was waited for (or, after an error, is waited for
    // here), so destroying them and the events frees nothing still in use.
    unsafe {
        for &s in &streams {
            let _ = cu::stream::synchronize(s);
        }
        for &e in &events {
            let _ = cu::event::destroy(e);
        }
        for &s in &streams {
            let _ = cu::stream::destroy(s);
        }
    }
    // `raw` releases the context.
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_device_is_refused_before_any_driver_call() {
        let dev = kvferry_gpu::HostDevice::new(0);
        let buf = dev.alloc(128).unwrap();
        let (src, mut dst) = ([0u8; 64], [0u8; 64]);
        let r = DuplexRanges {
            h2d_src: src.as_ptr() as u64,
            h2d_dst: buf.ptr(),
            d2h_src: buf.ptr() + 64,
            d2h_dst: dst.as_mut_ptr() as u64,
            bytes: 64,
        };
        // SAFETY: both host arrays live across the call.
        let r = unsafe { bench_raw_duplex(dev.as_ref(), r, 1) };
        assert!(matches!(r, Err(DeviceError::Unsupported { .. })), "{r:?}");
    }
}
