//! [`Context`]: the retained primary context of one GPU and everything queued work uses (streams,
//! pools, the registration and mapping tables), shared by the device handle, its lanes and
//! every buffer or registration still alive; torn down with the last of them.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, RwLock};

use crate::{DeviceCaps, DeviceError};

use super::enqueue::PinnedDescs;
use super::error::CudaError;
use super::ffi;
use super::kernel::GatherKernel;
use super::options::CudaOptions;
use super::plan::{HostMap, Resolver};
use super::staging::Staging;

/// Everything that must outlive the device handle while buffers, registrations or in-flight
/// batches still use it; dropped (streams destroyed, context released) with the last of them.
pub(super) struct Context {
    pub(super) ordinal: u32,
    pub(super) ctx: ffi::CUcontext,
    pub(super) dev: ffi::CUdevice,
    pub(super) name: String,
    pub(super) sm_count: u32,
    pub(super) caps: DeviceCaps,
    pub(super) options: CudaOptions,
    pub(super) kernel: Option<GatherKernel>,
    pub(super) streams: Vec<ffi::CUstream>,
    pub(super) events: Mutex<Vec<ffi::CUevent>>,
    pub(super) descs: Mutex<Vec<PinnedDescs>>,
    /// Registered host spans: start → mapping.
    pub(super) hosts: RwLock<BTreeMap<u64, HostMap>>,
    /// VMM mappings this device made (imported or allocated): start → end. Checked before
    /// the driver's pointer attributes, whose allocation range is not the mapping's.
    pub(super) vmms: RwLock<BTreeMap<u64, u64>>,
    /// Client memfds mapped and registered as pinned host memory (`import_memfd`): start →
    /// end. Range checks accept them as this device's memory.
    pub(super) client_maps: RwLock<BTreeMap<u64, u64>>,
    /// Errors of teardown (frees, unregistrations) that had no caller to return them to.
    pub(super) teardown: Mutex<Vec<DeviceError>>,
    /// Staging buffers per lane, allocated on the lane's first fragmented batch. Only used
    /// under the lane's sender lock, so batches of one lane never share them concurrently.
    pub(super) staging: [Mutex<Option<Staging>>; 2],
    pub(super) staged_batches: AtomicU64,
}

// SAFETY: the raw handles (context, streams, events, module) are driver objects usable from
// any thread once the context is bound there, which every entry point does first (`bind`);
// the mutable collections are behind locks; streams are only enqueued under the lane lock.
unsafe impl Send for Context {}
// SAFETY: as above; shared access only reads the handles or goes through the locks.
unsafe impl Sync for Context {}

impl Context {
    pub(super) fn bind(&self) -> Result<(), DeviceError> {
        // SAFETY: `ctx` stays retained for as long as `self` lives.
        unsafe { ffi::ctx_set_current(self.ctx) }.map_err(|e| self.driver("cuCtxSetCurrent", e))
    }

    pub(super) fn driver(&self, call: &'static str, e: CudaError) -> DeviceError {
        DeviceError::Driver {
            ordinal: self.ordinal,
            call,
            reason: e.to_string(),
        }
    }

    pub(super) fn record_teardown(&self, e: DeviceError) {
        match self.teardown.lock() {
            Ok(mut v) => v.push(e),
            Err(p) => p.into_inner().push(e),
        }
    }

    pub(super) fn check(&self, ptr: u64, len: u64) -> Result<(), DeviceError> {
        self.device_alloc(ptr, len).map(|_| ())
    }
}

impl Resolver for Context {
    fn device_alloc(&self, ptr: u64, len: u64) -> Result<(u64, u64), DeviceError> {
        let ordinal = self.ordinal;
        let not_dev = || DeviceError::NotDeviceMemory { ordinal, ptr, len };
        if let Some(found) = self.vmm_range(ptr, len) {
            return Ok(found);
        }
        if let Some(found) = self.client_map_range(ptr, len) {
            return Ok(found);
        }
        let info = ffi::pointer_info(ptr).map_err(|_| not_dev())?;
        if info.memory_type != ffi::MEMORYTYPE_DEVICE {
            return Err(not_dev());
        }
        if info.device_ordinal != ordinal as i32 {
            return Err(DeviceError::WrongDevice {
                ordinal,
                found: info.device_ordinal.max(0) as u32,
                ptr,
                len,
            });
        }
        let end = info
            .range_start
            .checked_add(info.range_size)
            .ok_or_else(not_dev)?;
        match ptr.checked_add(len) {
            Some(e) if ptr >= info.range_start && e <= end => Ok((info.range_start, end)),
            _ => Err(not_dev()),
        }
    }

    fn host_map(&self, addr: u64, len: u64) -> Option<HostMap> {
        let end = addr.checked_add(len)?;
        if let Ok(hosts) = self.hosts.read() {
            if let Some((_, m)) = hosts.range(..=addr).next_back() {
                if end <= m.end {
                    return Some(*m);
                }
            }
        }
        // Pinned memory CUDA allocated itself (cuMemHostAlloc) or registered elsewhere.
        let info = ffi::pointer_info(addr).ok()?;
        if info.memory_type != ffi::MEMORYTYPE_HOST || info.device_pointer == 0 {
            return None;
        }
        if info.range_size > 0 {
            let m = HostMap {
                start: info.range_start,
                end: info.range_start + info.range_size,
                device: info.device_pointer - (addr - info.range_start),
            };
            return (addr >= m.start && end <= m.end).then_some(m);
        }
        let last = ffi::pointer_info(end - 1).ok()?;
        (last.device_pointer == info.device_pointer + (len - 1)).then_some(HostMap {
            start: addr,
            end,
            device: info.device_pointer,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // Nothing can report these any more; teardown is best-effort once the handle is gone.
        if self.bind().is_err() {
            return;
        }
        for &s in &self.streams {
            // SAFETY: streams are ours; the lanes are gone, so nothing enqueues any more.
            unsafe {
                let _ = ffi::stream_synchronize(s);
                let _ = ffi::stream_destroy(s);
            }
        }
        for st in &mut self.staging {
            let st = match st.get_mut() {
                Ok(s) => s.take(),
                Err(p) => p.into_inner().take(),
            };
            if let Some(mut st) = st {
                st.destroy();
            }
        }
        if let Some(k) = &self.kernel {
            // SAFETY: the streams were drained above, so no launch is running.
            let _ = unsafe { k.unload() };
        }
        for e in self
            .events
            .get_mut()
            .map(std::mem::take)
            .unwrap_or_default()
        {
            // SAFETY: pooled events are idle and ours.
            let _ = unsafe { ffi::event_destroy(e) };
        }
        for d in self.descs.get_mut().map(std::mem::take).unwrap_or_default() {
            // SAFETY: pooled descriptor buffers are idle and ours.
            let _ = unsafe { ffi::mem_free_host(d.host.cast()) };
        }
        // SAFETY: balances the retain in `open_with`; nothing of this device is used after.
        let _ = unsafe { ffi::primary_ctx_release(self.dev) };
    }
}
