//! The staged path's buffers: per lane, device chunks the copy engines fill from (or drain to)
//! long pinned host runs at link speed, while an aux stream scatters (or gathers) them.

use std::sync::MutexGuard;

use crate::{CopyDirection, DeviceError};

use super::context::Context;
use super::ffi;
use super::kernel::Desc;
use super::lane::Pending;
use super::plan::{StageChunk, Staged};

/// A lane's staging chunks and the stream on which the device side of the staged path runs
/// (the scatter for H2D, the gather for D2H); the lane's own stream drives the copy engines.
///
/// Ordering, per chunk `i` in buffer `b = i % n`: the filling stream waits `free[b]`, fills
/// and records `filled[b]`; the draining stream waits `filled[b]`, drains and records
/// `free[b]`. `entry` (lane → aux, host→device batches) orders a batch's scatters after
/// what the lane queued before it; `join` (aux → lane) makes the batch's completion event,
/// recorded on the lane stream, come after the last scatter or gather.
pub(super) struct Staging {
    aux: ffi::CUstream,
    bufs: Vec<u64>,
    filled: Vec<ffi::CUevent>,
    free: Vec<ffi::CUevent>,
    entry: ffi::CUevent,
    join: ffi::CUevent,
}

impl Staging {
    fn empty() -> Self {
        Self {
            aux: std::ptr::null_mut(),
            bufs: Vec::new(),
            filled: Vec::new(),
            free: Vec::new(),
            entry: std::ptr::null_mut(),
            join: std::ptr::null_mut(),
        }
    }

    /// Allocates `n` chunks of `chunk` bytes, their events and the aux stream in the bound
    /// context; on failure frees what it made.
    fn create(inner: &Context, chunk: u64, n: u32) -> Result<Self, DeviceError> {
        let mut st = Self::empty();
        let r = (|| {
            st.aux = ffi::stream_create().map_err(|e| inner.driver("cuStreamCreate", e))?;
            let ev = || ffi::event_create(false).map_err(|e| inner.driver("cuEventCreate", e));
            st.entry = ev()?;
            st.join = ev()?;
            for _ in 0..n.max(2) {
                let size = usize::try_from(chunk).unwrap_or(usize::MAX);
                let p = ffi::mem_alloc(size).map_err(|e| DeviceError::Alloc {
                    ordinal: inner.ordinal,
                    bytes: chunk,
                    reason: format!("staging buffer: {e}"),
                })?;
                st.bufs.push(p);
                st.filled.push(ev()?);
                st.free.push(ev()?);
            }
            Ok(())
        })();
        match r {
            Ok(()) => Ok(st),
            Err(e) => {
                st.destroy();
                Err(e)
            }
        }
    }

    /// Waits for the aux stream and frees everything; best-effort (teardown or a failed
    /// create). The context is bound and the lane stream holds no work on these buffers.
    pub(super) fn destroy(&mut self) {
        // SAFETY: every handle is ours and created in the bound context; null ones were never
        // created. The aux stream is drained first, so no queued work uses the buffers or
        // events when they go.
        unsafe {
            if !self.aux.is_null() {
                let _ = ffi::stream_synchronize(self.aux);
                let _ = ffi::stream_destroy(self.aux);
            }
            for e in [self.entry, self.join]
                .into_iter()
                .chain(self.filled.drain(..))
                .chain(self.free.drain(..))
            {
                if !e.is_null() {
                    let _ = ffi::event_destroy(e);
                }
            }
            for p in self.bufs.drain(..) {
                let _ = ffi::mem_free(p);
            }
        }
        self.aux = std::ptr::null_mut();
        self.entry = std::ptr::null_mut();
        self.join = std::ptr::null_mut();
    }
}

impl Context {
    pub(super) fn lock_staging(&self, index: usize) -> MutexGuard<'_, Option<Staging>> {
        match self.staging[index].lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Allocates the lane's staging on first use. False where staging is off or could not
    /// be allocated (the error is returned for a forced staged path).
    pub(super) fn ensure_staging(&self, index: usize) -> Result<bool, DeviceError> {
        let chunk = self.options.stage_chunk();
        if chunk == 0 || self.kernel.is_none() {
            return Ok(false);
        }
        let mut g = self.lock_staging(index);
        if g.is_none() {
            *g = Some(Staging::create(self, chunk, self.options.staging_chunks)?);
        }
        Ok(true)
    }

    /// Queues the staged path: per chunk, the copy engines between host runs and a staging
    /// buffer on the lane stream, the scatter (H2D) or gather (D2H) kernel on the aux stream,
    /// handed over by events (see [`Staging`]). However it ends, the lane stream waits for
    /// the aux stream, so the batch's event covers everything queued.
    pub(super) fn enqueue_staged(
        &self,
        dir: CopyDirection,
        lane: ffi::CUstream,
        st: &Staging,
        staged: &Staged,
        pending: &mut Pending,
    ) -> Result<(), DeviceError> {
        let kernel = self.kernel.as_ref().ok_or(DeviceError::Unsupported {
            what: "gather kernel",
            reason: "not loaded".into(),
        })?;
        let descs = staged.relocate(dir, &st.bufs);
        let pinned = self.take_descs(descs.len().max(1))?;
        // SAFETY: the buffer holds `cap >= descs.len()` descriptors and is owned by this batch
        // alone (pooled buffers return only after their batch completed).
        unsafe { std::ptr::copy_nonoverlapping(descs.as_ptr(), pinned.host, descs.len()) };
        let table = pinned.device;
        pending.descs = Some(pinned);
        let wait = |s: ffi::CUstream, e: ffi::CUevent| {
            // SAFETY: both are live handles of the bound context, owned by this lane.
            unsafe { ffi::stream_wait_event(s, e) }.map_err(|e| self.driver("cuStreamWaitEvent", e))
        };
        let record = |e: ffi::CUevent, s: ffi::CUstream| {
            // SAFETY: as above.
            unsafe { ffi::event_record(e, s) }.map_err(|e| self.driver("cuEventRecord", e))
        };
        // One batched call per chunk where the driver has it: the copy engines then cost
        // ~1 us per host run instead of ~3.5 (H200: a 256-block load in 15 layer batches,
        // 128 KiB runs, went from 22.5 to 48 GB/s).
        let batched = self.caps.batch_copy;
        let copies = |chunk: &StageChunk, base: u64| {
            let ops = chunk.spans.iter().map(|sp| match dir {
                CopyDirection::HostToDevice => (base + sp.offset, sp.host, sp.len),
                CopyDirection::DeviceToHost => (sp.host, base + sp.offset, sp.len),
            });
            // SAFETY: the staging side lies inside one of this lane's buffers (offsets below
            // the chunk size), which no other batch touches until this one's `free` event;
            // the host side is the caller's, kept valid until the batch completes as
            // `submit` requires; `batched` only where the driver has the call.
            unsafe { self.copy_ranges(lane, batched && chunk.spans.len() > 1, ops) }
        };
        let scatter = |chunk: &StageChunk, s: ffi::CUstream| {
            let n = chunk.descs.len();
            let count = u32::try_from(n).map_err(|_| DeviceError::Copy {
                ordinal: self.ordinal,
                ops: n,
                reason: "too many ranges for one launch".into(),
            })?;
            let at = table + (chunk.descs.start * std::mem::size_of::<Desc>()) as u64;
            // SAFETY: the descriptors stay untouched until the batch completes (held by
            // `pending`); their device sides were validated by the planner and their staging
            // sides lie inside this lane's buffers; the stream is live and the context bound.
            unsafe { kernel.launch(s, at, count, self.sm_count) }
                .map_err(|e| self.driver("cuLaunchKernel", e))
        };
        let queued = (|| {
            // Host→device: the scatters wait for what the lane queued before (they follow
            // their own chunk's copy anyway). Device→host: the gathers start at once, each
            // only on its buffer's `free` event, so a batch's first gather overlaps the
            // previous batch's last copy (a save runs as several batches back to back).
            if dir == CopyDirection::HostToDevice {
                record(st.entry, lane)?;
                wait(st.aux, st.entry)?;
            }
            for (i, chunk) in staged.chunks.iter().enumerate() {
                let b = i % st.bufs.len();
                match dir {
                    CopyDirection::HostToDevice => {
                        wait(lane, st.free[b])?;
                        copies(chunk, st.bufs[b])?;
                        record(st.filled[b], lane)?;
                        wait(st.aux, st.filled[b])?;
                        scatter(chunk, st.aux)?;
                        record(st.free[b], st.aux)?;
                    }
                    CopyDirection::DeviceToHost => {
                        wait(st.aux, st.free[b])?;
                        scatter(chunk, st.aux)?;
                        record(st.filled[b], st.aux)?;
                        wait(lane, st.filled[b])?;
                        copies(chunk, st.bufs[b])?;
                        record(st.free[b], lane)?;
                    }
                }
            }
            Ok(())
        })();
        let joined = record(st.join, st.aux).and_then(|()| wait(lane, st.join));
        if joined.is_err() {
            // Without the hand-over, wait here so no queued work outlives the batch.
            // SAFETY: the aux stream is live.
            let _ = unsafe { ffi::stream_synchronize(st.aux) };
        }
        queued.and(joined)
    }
}
