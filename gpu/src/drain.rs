//! The crate's one drain thread: where the guards of an [`crate::OwnedCopyEvent`] dropped
//! while its copies still ran wait for them, so no owner of an event ever blocks in `Drop`
//! (an actor stopped mid-transfer) and no memory a copy uses is unmapped under it.
//!
//! One thread for the whole crate, started on first use: events are dropped pending only on
//! teardown and cancellation, rarely and briefly, so a thread per event or device would sit
//! idle. It waits for batches in the order they were handed over; a slow one delays the
//! release of those behind it, never their copies, and releasing late is always safe.

use std::sync::{mpsc, Arc, OnceLock};

use crate::{CopyEvent, HostMemory};

struct Drained {
    event: CopyEvent,
    guards: Vec<Arc<dyn HostMemory>>,
}

/// The thread's queue; `None` where it could not be started.
static DRAIN: OnceLock<Option<mpsc::Sender<Drained>>> = OnceLock::new();

/// Name of the drain thread (tests check who dropped a guard).
pub(crate) const THREAD_NAME: &str = "kvferry-gpu-drain";

fn start() -> Option<mpsc::Sender<Drained>> {
    let (tx, rx) = mpsc::channel::<Drained>();
    let spawned = std::thread::Builder::new()
        .name(THREAD_NAME.into())
        .spawn(move || {
            while let Ok(d) = rx.recv() {
                // Resolved either way: landed, failed, or its device stopped after draining.
                let _ = d.event.wait_blocking();
                drop(d.guards);
            }
        });
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the copy drain thread; guards of dropped pending copies will leak");
            None
        }
    }
}

/// Keeps `guards` until `event` resolves, then drops them on the drain thread. Where that
/// thread is missing they leak, which is safe, instead of freeing memory a copy may use.
pub(crate) fn hand_over(event: CopyEvent, guards: Vec<Arc<dyn HostMemory>>) {
    let job = Drained { event, guards };
    let unsent = match DRAIN.get_or_init(start) {
        Some(tx) => tx.send(job).err().map(|mpsc::SendError(job)| job),
        None => Some(job),
    };
    if let Some(job) = unsent {
        std::mem::forget(job.guards);
    }
}
