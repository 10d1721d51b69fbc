//! Lanes: one stream per copy direction, with a submit thread that plans and queues large
//! batches in order and a completion thread that waits on each batch's event and resolves it.

use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::{CopyDirection, CopyDone, CopyEvent, CopyList, CopyStats, DeviceError, Landed};

use super::context::Context;
use super::device::CudaDevice;
use super::enqueue::PinnedDescs;
use super::error::CudaError;
use super::ffi;
use super::plan::Plan;

/// Batches of at least this many ranges are planned and queued on the lane's submit thread
/// rather than the caller's. Planning costs about 0.1 us per range on the H200's host (a
/// 2,048-range save batch took its thread 0.23 ms, a 256-block load's 4,800-range layer
/// batch about 0.5 ms), time in which an actor thread shared by the keeper, the store and
/// the load transfers serves nobody: a save issued beside a 256-block load waited 1.3 ms
/// for the store. Smaller batches (a load of up to 16 blocks) stay on the caller's thread,
/// where they start without waking another.
pub const DEFER_MIN_OPS: usize = 1024;

pub(super) struct Lane {
    /// Held while a batch is queued on the stream or handed to the submit thread: batches
    /// reach the stream in submission order.
    order: Arc<Mutex<LaneOrder>>,
    thread: Option<JoinHandle<()>>,
    submitter: Option<JoinHandle<()>>,
}

/// A lane's stream order: the completion thread's queue, the submit thread's queue, and the
/// batches handed to the submit thread but not yet queued (while there are any, later batches
/// follow them there).
struct LaneOrder {
    tx: Option<mpsc::Sender<Pending>>,
    jobs: Option<mpsc::Sender<Job>>,
    deferred: usize,
}

/// A batch for the submit thread.
struct Job {
    dir: CopyDirection,
    list: CopyList,
    done: CopyDone,
    submitted: Instant,
}

fn lock_order(order: &Mutex<LaneOrder>) -> MutexGuard<'_, LaneOrder> {
    // The guarded data is a queue handle and a count that stay consistent at every step.
    order
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(super) struct Pending {
    pub(super) event: Option<ffi::CUevent>,
    pub(super) done: CopyDone,
    pub(super) submitted: Instant,
    pub(super) bytes: u64,
    pub(super) ops: usize,
    pub(super) descs: Option<PinnedDescs>,
    pub(super) error: Option<DeviceError>,
}

// SAFETY: the event handle is handed from the submitting thread to the lane thread, which is
// then its only user; driver handles are valid from any thread of the bound context.
unsafe impl Send for Pending {}

pub(super) fn lane_index(dir: CopyDirection) -> usize {
    match dir {
        CopyDirection::HostToDevice => 0,
        CopyDirection::DeviceToHost => 1,
    }
}

impl CudaDevice {
    /// Submits a batch: planned and queued here, or by the lane's submit thread where it is
    /// large, `detach`ed, or behind batches handed there (see [`DEFER_MIN_OPS`]).
    ///
    /// # Safety
    /// As for [`Device::submit`].
    pub(super) unsafe fn submit_on(
        &self,
        dir: CopyDirection,
        list: CopyList,
        landed: Option<Landed>,
        detach: bool,
    ) -> Result<CopyEvent, DeviceError> {
        let inner = &self.inner;
        let ordinal = inner.ordinal;
        let (done, event) = CopyEvent::channel(ordinal);
        let done = done.then(landed);
        let submitted = Instant::now();
        if list.is_empty() {
            let _ = done.send(Ok(CopyStats {
                bytes: 0,
                ops: 0,
                seconds: 0.0,
            }));
            return Ok(event);
        }
        let lane = &self.lanes[lane_index(dir)];
        let mut order = lock_order(&lane.order);
        if detach || list.len() >= DEFER_MIN_OPS || order.deferred > 0 {
            let order = &mut *order;
            let jobs = order
                .jobs
                .as_ref()
                .ok_or(DeviceError::Stopped { ordinal })?;
            order.deferred += 1;
            let job = Job {
                dir,
                list,
                done,
                submitted,
            };
            if let Err(mpsc::SendError(job)) = jobs.send(job) {
                order.deferred -= 1;
                let _ = job.done.send(Err(DeviceError::Stopped { ordinal }));
            }
            return Ok(event);
        }
        inner.bind()?;
        let plan = inner.plan_batch(dir, &list);
        inner.queue(dir, plan, &list, done, submitted, &mut order);
        Ok(event)
    }
}

impl Lane {
    pub(super) fn start(inner: &Arc<Context>, index: usize) -> Result<Self, DeviceError> {
        let (tx, rx) = mpsc::channel::<Pending>();
        let worker = Arc::clone(inner);
        let dir = if index == 0 { "h2d" } else { "d2h" };
        let spawn_failed = |what: &'static str| {
            move |e: std::io::Error| DeviceError::Driver {
                ordinal: inner.ordinal,
                call: what,
                reason: e.to_string(),
            }
        };
        let thread = std::thread::Builder::new()
            .name(format!("kvferry-cuda{}-{dir}", inner.ordinal))
            .spawn(move || worker.complete_loop(rx))
            .map_err(spawn_failed("spawning the completion thread"))?;
        let (jobs, rx) = mpsc::channel::<Job>();
        let order = Arc::new(Mutex::new(LaneOrder {
            tx: Some(tx),
            jobs: Some(jobs),
            deferred: 0,
        }));
        let (worker, o) = (Arc::clone(inner), Arc::clone(&order));
        let submitter = std::thread::Builder::new()
            .name(format!("kvferry-cuda{}-{dir}-submit", inner.ordinal))
            .spawn(move || worker.submit_loop(&rx, &o));
        let mut lane = Self {
            order,
            thread: Some(thread),
            submitter: None,
        };
        // On failure `lane` drops: its completion thread is stopped and joined.
        lane.submitter = Some(submitter.map_err(spawn_failed("spawning the submit thread"))?);
        Ok(lane)
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // The submit thread queues what it was handed and exits; then closing the completion
        // queue lets that thread finish the batches already queued (their events still
        // resolve) and exit; joining keeps streams alive until then.
        // (The submit thread holds the order too: its queue must be taken out of it.)
        lock_order(&self.order).jobs.take();
        if let Some(t) = self.submitter.take() {
            let _ = t.join();
        }
        lock_order(&self.order).tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Context {
    /// Queues a planned batch on its lane's stream and hands it to the completion thread,
    /// or resolves it with the planning error (nothing was copied). Called with the lane's
    /// order held and the context bound.
    fn queue(
        &self,
        dir: CopyDirection,
        plan: Result<Plan, DeviceError>,
        list: &CopyList,
        done: CopyDone,
        submitted: Instant,
        order: &mut LaneOrder,
    ) {
        let ordinal = self.ordinal;
        let plan = match plan {
            Ok(p) => p,
            Err(e) => {
                let _ = done.send(Err(e));
                return;
            }
        };
        let Some(tx) = order.tx.as_ref() else {
            let _ = done.send(Err(DeviceError::Stopped { ordinal }));
            return;
        };
        let stream = self.streams[lane_index(dir)];
        let mut pending = Pending {
            event: None,
            done,
            submitted,
            bytes: list.bytes(),
            ops: list.len(),
            descs: None,
            error: None,
        };
        pending.error = self.enqueue(dir, stream, &plan, &mut pending).err();
        let recorded = self.take_event().and_then(|ev| {
            // SAFETY: the event and stream are live handles of the bound context.
            unsafe { ffi::event_record(ev, stream) }
                .map(|()| ev)
                .map_err(|e| self.driver("cuEventRecord", e))
        });
        match recorded {
            Ok(ev) => pending.event = Some(ev),
            Err(e) => {
                // Without an event, wait here so no queued copy outlives the batch.
                // SAFETY: the stream is live.
                let _ = unsafe { ffi::stream_synchronize(stream) };
                pending.error.get_or_insert(e);
            }
        }
        if let Err(mpsc::SendError(p)) = tx.send(pending) {
            if let Some(ev) = p.event {
                // SAFETY: the event was recorded on a live stream.
                let _ = unsafe { ffi::event_synchronize(ev) };
            }
            let _ = p.done.send(Err(DeviceError::Stopped { ordinal }));
        }
    }

    /// A lane's submit thread: plans each batch it is handed without holding the lane (the
    /// long part), then queues it in turn. Ends when the device drops the queue, after
    /// queueing what was handed before.
    fn submit_loop(&self, jobs: &mpsc::Receiver<Job>, order: &Mutex<LaneOrder>) {
        let bound = self.bind();
        while let Ok(job) = jobs.recv() {
            let plan = match &bound {
                Ok(()) => self.plan_batch(job.dir, &job.list),
                Err(e) => Err(e.clone()),
            };
            let mut o = lock_order(order);
            self.queue(job.dir, plan, &job.list, job.done, job.submitted, &mut o);
            o.deferred -= 1;
        }
    }

    /// Waits for `ev`: polled for up to [`CudaOptions::completion_spin`], then slept on.
    /// A blocking-sync event wakes its waiter through an interrupt, tens of microseconds
    /// after the copies ended (about 40 us on the H200, as long as a 1.75 MiB copy takes
    /// itself); polling sees the end within a microsecond. The poll yields the core between
    /// queries, and a batch still running after the spin is slept on, so a long copy does
    /// not hold a core for its whole length.
    ///
    /// # Safety
    /// `ev` is a live event of the bound context, used by no other thread meanwhile.
    unsafe fn wait_event(&self, ev: ffi::CUevent) -> Result<(), CudaError> {
        let spin = self.options.completion_spin;
        if !spin.is_zero() {
            let start = Instant::now();
            loop {
                // SAFETY: as the caller guarantees.
                if unsafe { ffi::event_query(ev) }? {
                    return Ok(());
                }
                if start.elapsed() >= spin {
                    break;
                }
                std::thread::yield_now();
            }
        }
        // SAFETY: as the caller guarantees.
        unsafe { ffi::event_synchronize(ev) }
    }

    fn complete_loop(&self, rx: mpsc::Receiver<Pending>) {
        let bound = self.bind();
        while let Ok(mut p) = rx.recv() {
            let mut error = p.error.take();
            if let Some(ev) = p.event {
                let waited = match &bound {
                    Ok(()) => {
                        // SAFETY: the event is live (taken from the pool, recorded by
                        // `submit`) and only this thread uses it until it returns to the pool.
                        let r = unsafe { self.wait_event(ev) };
                        r.map_err(|e| DeviceError::Copy {
                            ordinal: self.ordinal,
                            ops: p.ops,
                            reason: e.to_string(),
                        })
                    }
                    Err(e) => Err(e.clone()),
                };
                match waited {
                    Ok(()) => {
                        if let Ok(mut pool) = self.events.lock() {
                            pool.push(ev);
                        }
                    }
                    // The context is likely unusable (a sticky fault); do not reuse its event.
                    Err(e) => {
                        error.get_or_insert(e);
                    }
                }
            }
            if let Some(d) = p.descs.take() {
                if let Ok(mut pool) = self.descs.lock() {
                    pool.push(d);
                }
            }
            let r = match error {
                Some(e) => Err(e),
                None => Ok(CopyStats {
                    bytes: p.bytes,
                    ops: p.ops,
                    seconds: p.submitted.elapsed().as_secs_f64(),
                }),
            };
            // The waiter may have gone away (a cancelled load); nothing to report then.
            let _ = p.done.send(r);
        }
    }
}
