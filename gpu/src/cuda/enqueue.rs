//! One batch's work on its lane's stream: planned into engine copies, a gather/scatter launch
//! or the staged path, with the pooled events and descriptor buffers it uses.

use std::sync::atomic::Ordering;

use crate::{CopyDirection, CopyList, DeviceError};

use super::context::Context;
use super::ffi;
use super::kernel::Desc;
use super::lane::{lane_index, Pending};
use super::plan::{plan, CopyPath, Paths, Plan, ENGINE_MAX_OPS};

/// A pinned, device-mapped array of kernel descriptors, reused across batches.
pub(super) struct PinnedDescs {
    pub(super) host: *mut Desc,
    pub(super) cap: usize,
    pub(super) device: u64,
}

// SAFETY: plain pinned memory owned by exactly one batch (or the pool) at a time; moving it
// between the submitting thread and the lane thread is the hand-over.
unsafe impl Send for PinnedDescs {}

impl Context {
    pub(super) fn take_event(&self) -> Result<ffi::CUevent, DeviceError> {
        if let Some(e) = self.events.lock().ok().and_then(|mut v| v.pop()) {
            return Ok(e);
        }
        ffi::event_create(false).map_err(|e| self.driver("cuEventCreate", e))
    }

    pub(super) fn take_descs(&self, n: usize) -> Result<PinnedDescs, DeviceError> {
        if let Ok(mut pool) = self.descs.lock() {
            if let Some(i) = pool.iter().position(|d| d.cap >= n) {
                return Ok(pool.swap_remove(i));
            }
        }
        let cap = n.next_power_of_two().max(4096);
        let bytes = cap * std::mem::size_of::<Desc>();
        let host = ffi::mem_host_alloc(bytes).map_err(|e| self.driver("cuMemHostAlloc", e))?;
        let info = ffi::pointer_info(host as u64).unwrap_or_default();
        let device = if info.device_pointer != 0 {
            info.device_pointer
        } else {
            host as u64
        };
        Ok(PinnedDescs {
            host: host.cast(),
            cap,
            device,
        })
    }

    /// Queues a batch's work on `stream`. On error, whatever was queued before it is still in
    /// flight; the caller records the event anyway so the batch resolves only after it.
    pub(super) fn enqueue(
        &self,
        dir: CopyDirection,
        stream: ffi::CUstream,
        plan: &Plan,
        pending: &mut Pending,
    ) -> Result<(), DeviceError> {
        if let Some(staged) = &plan.staged {
            let index = lane_index(dir);
            let guard = self.lock_staging(index);
            let st = guard.as_ref().ok_or(DeviceError::Unsupported {
                what: "staged copies",
                reason: "no staging buffers".into(),
            })?;
            self.staged_batches.fetch_add(1, Ordering::Relaxed);
            return self.enqueue_staged(dir, stream, st, staged, pending);
        }
        if !plan.kernel.is_empty() {
            let kernel = self.kernel.as_ref().ok_or(DeviceError::Unsupported {
                what: "gather kernel",
                reason: "not loaded".into(),
            })?;
            let n = plan.kernel.len();
            let count = u32::try_from(n).map_err(|_| DeviceError::Copy {
                ordinal: self.ordinal,
                ops: n,
                reason: "too many ranges for one launch".into(),
            })?;
            let descs = self.take_descs(n)?;
            // SAFETY: the buffer holds `cap >= n` descriptors, is owned by this batch alone,
            // and no earlier launch still reads it (buffers return to the pool only after
            // their batch's event completed).
            unsafe { std::ptr::copy_nonoverlapping(plan.kernel.as_ptr(), descs.host, n) };
            let device = descs.device;
            pending.descs = Some(descs);
            // SAFETY: the descriptors stay untouched until the batch completes (held by
            // `pending`); device ranges were validated by the planner and host ranges are
            // mapped registrations the caller of `submit` keeps valid; context is bound.
            unsafe { kernel.launch(stream, device, count, self.sm_count) }
                .map_err(|e| self.driver("cuLaunchKernel", e))?;
        }
        if plan.engine.is_empty() {
            return Ok(());
        }
        let ops = plan.engine.iter().map(|o| (o.dst, o.src, o.len));
        // SAFETY: device sides validated, host sides kept valid by the caller of `submit`
        // until the batch completes; `engine_batched` only where the driver has the call.
        unsafe { self.copy_ranges(stream, plan.engine_batched, ops) }?;
        Ok(())
    }

    /// Queues `(dst, src, len)` copies on `stream`: one `cuMemcpyBatchAsync` where
    /// `batched`, otherwise one `cuMemcpyAsync` each.
    ///
    /// # Safety
    /// Every range stays valid until the work on `stream` completes; `stream` is live in the
    /// bound context; `batched` only where the driver has the batched call.
    pub(super) unsafe fn copy_ranges(
        &self,
        stream: ffi::CUstream,
        batched: bool,
        ops: impl ExactSizeIterator<Item = (u64, u64, u64)>,
    ) -> Result<(), DeviceError> {
        if batched {
            let n = ops.len();
            let (mut dsts, mut srcs, mut sizes) = (
                Vec::with_capacity(n),
                Vec::with_capacity(n),
                Vec::with_capacity(n),
            );
            for (dst, src, len) in ops {
                dsts.push(dst);
                srcs.push(src);
                sizes.push(len as usize);
            }
            // SAFETY: as the caller guarantees.
            return unsafe { ffi::memcpy_batch_async(&mut dsts, &mut srcs, &mut sizes, stream) }
                .map_err(|e| self.driver("cuMemcpyBatchAsync", e));
        }
        for (dst, src, len) in ops {
            // SAFETY: as the caller guarantees, one range at a time.
            unsafe { ffi::memcpy_async(dst, src, len as usize, stream) }
                .map_err(|e| self.driver("cuMemcpyAsync", e))?;
        }
        Ok(())
    }

    /// Plans one batch: the lane's staging buffers on first use, then the path and its
    /// pieces. An error refuses the batch before anything is queued.
    pub(super) fn plan_batch(
        &self,
        dir: CopyDirection,
        list: &CopyList,
    ) -> Result<Plan, DeviceError> {
        let index = lane_index(dir);
        let path = self.options.copy_path;
        // Staging buffers come with the lane's first batch that might use them; a forced
        // staged path without them is refused, nothing copied.
        let staging = match path {
            CopyPath::Staged => self.ensure_staging(index)?,
            CopyPath::Auto if list.len() > ENGINE_MAX_OPS => {
                self.ensure_staging(index).unwrap_or(false)
            }
            _ => false,
        };
        let paths = Paths {
            kernel: self.kernel.is_some(),
            batch: self.caps.batch_copy,
            stage_chunk: if staging {
                self.options.stage_chunk()
            } else {
                0
            },
        };
        plan(dir, list, path, paths, self)
    }
}
