//! [`CopyBatch`]: copies between checked spans, owning the guards of the host memory they
//! touch, and the one place the safe submission is built on [`Device::submit_then`].

use std::fmt;
use std::sync::Arc;

use crate::span::inside;
use crate::{
    CopyDirection, CopyList, Device, DeviceError, DeviceSpan, HostMemory, HostSpan, Landed,
    OwnedCopyEvent, SpanError,
};

/// One batch of copies in one direction, built only from [`HostSpan`]s and [`DeviceSpan`]s.
/// It owns every host span's guard; submitting moves them into the [`OwnedCopyEvent`], which
/// keeps them until the copies have resolved. So the memory a copy touches outlives it by
/// construction, where [`Device::submit`] leaves that to a comment.
pub struct CopyBatch {
    dir: CopyDirection,
    list: CopyList,
    /// One entry per run of spans sharing a guard (a batch over one pool holds one), so a
    /// 57,344-range load does not hold 57,344 references.
    guards: Vec<Arc<dyn HostMemory>>,
}

/// Which of the device's submissions a batch goes through.
enum Submission {
    Then(Option<Landed>),
    Detached,
}

impl CopyBatch {
    pub fn new(dir: CopyDirection) -> Self {
        Self::with_capacity(dir, 0)
    }

    /// A batch with room for `n` copies before merging.
    pub fn with_capacity(dir: CopyDirection, n: usize) -> Self {
        Self {
            dir,
            list: CopyList::with_capacity(n),
            guards: Vec::new(),
        }
    }

    /// Appends the copy between `host` and `device` (source and destination as the batch's
    /// direction says), merged into the previous one where both sides continue it.
    pub fn push(&mut self, host: HostSpan, device: DeviceSpan) -> Result<(), SpanError> {
        if host.len() != device.len() {
            return Err(SpanError::LengthMismatch {
                host: host.len(),
                device: device.len(),
            });
        }
        self.push_checked(host.guard(), host.addr(), device.ptr(), host.len());
        Ok(())
    }

    /// [`Self::push`] of `device.len()` bytes at `offset` into `host`, without building a
    /// sub-span: no reference on the guard is taken per copy where it is the previous copy's
    /// (a 1,024-block load pushes 57,344 copies).
    pub fn push_within(
        &mut self,
        host: &HostSpan,
        offset: u64,
        device: DeviceSpan,
    ) -> Result<(), SpanError> {
        let len = device.len();
        if !inside(host.len(), offset, len) {
            return Err(SpanError::OutsideSpan {
                side: "host",
                span_len: host.len(),
                offset,
                len,
            });
        }
        // Cannot overflow: `offset + len` lies inside the span, which lies inside its guard.
        self.push_checked(host.guard(), host.addr() + offset, device.ptr(), len);
        Ok(())
    }

    /// A batch of the copies of `list`, built elsewhere (a plan made before the memory's
    /// guard was at hand), whose host side must lie inside `host`: each copy is checked, none
    /// is merged or reordered. Device ranges are checked when the batch is submitted, by the
    /// backend, as every batch's are (a [`DeviceSpan`]'s check only refuses early).
    pub fn from_list(
        dir: CopyDirection,
        list: CopyList,
        host: &HostSpan,
    ) -> Result<Self, SpanError> {
        let (base, size) = (host.addr(), host.len());
        for op in list.ops() {
            let addr = match dir {
                CopyDirection::HostToDevice => op.src,
                CopyDirection::DeviceToHost => op.dst,
            };
            let offset = addr.wrapping_sub(base);
            if addr < base || !inside(size, offset, op.len) {
                return Err(SpanError::OutsideSpan {
                    side: "host",
                    span_len: size,
                    offset,
                    len: op.len,
                });
            }
        }
        let guards = if list.is_empty() {
            Vec::new()
        } else {
            vec![Arc::clone(host.guard())]
        };
        Ok(Self { dir, list, guards })
    }

    /// Appends a copy whose host side, `[host, host + len)`, lies inside `guard`'s memory.
    fn push_checked(&mut self, guard: &Arc<dyn HostMemory>, host: u64, device: u64, len: u64) {
        if len == 0 {
            return;
        }
        match self.dir {
            CopyDirection::HostToDevice => self.list.push(host, device, len),
            CopyDirection::DeviceToHost => self.list.push(device, host, len),
        }
        if !self.guards.last().is_some_and(|g| Arc::ptr_eq(g, guard)) {
            self.guards.push(Arc::clone(guard));
        }
    }

    pub fn dir(&self) -> CopyDirection {
        self.dir
    }

    /// The copies as the device will see them.
    pub fn list(&self) -> &CopyList {
        &self.list
    }

    /// Total bytes the batch moves.
    pub fn bytes(&self) -> u64 {
        self.list.bytes()
    }

    /// Number of copies after merging.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Submits the batch to `device` ([`Device::submit_then`]): `landed` runs when it
    /// resolves, on the thread that resolves it. The returned event holds the guards until
    /// then; an error means nothing was queued, and the guards go with the batch.
    pub fn submit<D: Device + ?Sized>(
        self,
        device: &D,
        landed: Option<Landed>,
    ) -> Result<OwnedCopyEvent, DeviceError> {
        self.launch(device, Submission::Then(landed))
    }

    /// As [`Self::submit`], through [`Device::submit_detached`]: for a thread that must
    /// return at once.
    pub fn submit_detached<D: Device + ?Sized>(
        self,
        device: &D,
    ) -> Result<OwnedCopyEvent, DeviceError> {
        self.launch(device, Submission::Detached)
    }

    fn launch<D: Device + ?Sized>(
        self,
        device: &D,
        how: Submission,
    ) -> Result<OwnedCopyEvent, DeviceError> {
        let Self { dir, list, guards } = self;
        // SAFETY: every host range in `list` lies inside the memory of one of `guards`
        // (checked when its `HostSpan` was built), which `HostMemory`'s contract keeps mapped
        // and free of Rust references while the guard lives. The guards move into the
        // returned event, which drops them only once the batch has resolved (awaited, found
        // complete, or waited for by the drain thread when dropped pending). Where this
        // returns an error the batch was refused before anything was queued, so the guards
        // may drop with it. Device ranges are validated by the backend itself.
        let event = unsafe {
            match how {
                Submission::Then(landed) => device.submit_then(dir, list, landed),
                Submission::Detached => device.submit_detached(dir, list),
            }
        }?;
        Ok(OwnedCopyEvent::new(event, device.ordinal(), guards))
    }
}

impl fmt::Debug for CopyBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyBatch")
            .field("dir", &self.dir)
            .field("ops", &self.list.len())
            .field("bytes", &self.list.bytes())
            .field("guards", &self.guards.len())
            .finish()
    }
}

#[cfg(test)]
mod tests;
