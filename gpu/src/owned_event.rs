//! [`OwnedCopyEvent`]: a batch's completion that owns what its copies touch, as cudarc's
//! `SyncOnDrop` does: the guards go once the batch has resolved, never before, however the
//! event ends.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::{drain, CopyEvent, CopyStats, DeviceError, HostMemory};

/// Completion of a submitted [`crate::CopyBatch`], holding its guards. Awaiting it, or a
/// [`Self::try_complete`] that finds it done, releases them with the result; dropping it while
/// the copies still run hands them to the crate's drain thread, which waits for the batch and
/// only then drops them.
pub struct OwnedCopyEvent {
    /// `None` once resolved (the guards are gone then too).
    event: Option<CopyEvent>,
    ordinal: u32,
    guards: Vec<Arc<dyn HostMemory>>,
}

impl OwnedCopyEvent {
    pub(crate) fn new(event: CopyEvent, ordinal: u32, guards: Vec<Arc<dyn HostMemory>>) -> Self {
        Self {
            event: Some(event),
            ordinal,
            guards,
        }
    }

    /// The batch has resolved: nothing touches the guarded memory any more.
    fn resolved(&mut self, r: Result<CopyStats, DeviceError>) -> Result<CopyStats, DeviceError> {
        self.event = None;
        self.guards.clear();
        r
    }

    /// Non-blocking check; `None` while the batch is still running (the guards stay held).
    pub fn try_complete(&mut self) -> Option<Result<CopyStats, DeviceError>> {
        let r = self.event.as_mut()?.try_complete()?;
        Some(self.resolved(r))
    }

    /// Blocks the calling thread until the batch resolves. Only for threads outside any
    /// async runtime.
    pub fn wait_blocking(mut self) -> Result<CopyStats, DeviceError> {
        let r = match self.event.take() {
            Some(ev) => ev.wait_blocking(),
            None => Err(DeviceError::Stopped {
                ordinal: self.ordinal,
            }),
        };
        self.resolved(r)
    }

    /// Guards still held (one per run of spans sharing one; 0 once resolved).
    pub fn guards_held(&self) -> usize {
        self.guards.len()
    }
}

impl Future for OwnedCopyEvent {
    type Output = Result<CopyStats, DeviceError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(ev) = this.event.as_mut() else {
            // Polled after it resolved, as a `CopyEvent` answers then.
            return Poll::Ready(Err(DeviceError::Stopped {
                ordinal: this.ordinal,
            }));
        };
        match Pin::new(ev).poll(cx) {
            Poll::Ready(r) => Poll::Ready(this.resolved(r)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for OwnedCopyEvent {
    fn drop(&mut self) {
        let Some(mut ev) = self.event.take() else {
            return;
        };
        if self.guards.is_empty() || ev.try_complete().is_some() {
            return;
        }
        drain::hand_over(ev, std::mem::take(&mut self.guards));
    }
}

impl fmt::Debug for OwnedCopyEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedCopyEvent")
            .field("ordinal", &self.ordinal)
            .field("resolved", &self.event.is_none())
            .field("guards", &self.guards.len())
            .finish()
    }
}
