//! The Transfer actor: one per load or save. It owns everything its copies touch (lease
//! share, rank handle, pool memory, writer pins) until every batch it submitted has been
//! reported, and only then releases them and replies, once.
//!
//! A load runs its [`LoadPlan`]: the local prefix's RAM blocks as layer batches submitted
//! back to back (each reported as it lands, so an engine can start on early layers), and
//! beside them its parts: the SSD blocks ([`SsdLoad`]) and the remote suffix ([`Suffix`])
//! (their destinations are other blocks); it replies when all are done.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{self, Poll};
use std::time::Instant;

use actix::fut::ActorFutureExt;
use actix::{Actor, ActorContext, ActorFuture, AsyncContext, Context};
use kvferry_gpu::{
    CopyBatch, CopyDirection, CopyList, CopyStats, Device, DeviceError, HostSpan, Landed,
    OwnedCopyEvent,
};
use tokio::sync::oneshot;

use crate::api::{LoadObserver, Span, Stage, StageName, TransferPath, TransferReport};
use crate::error::NodeError;
use crate::load::memory::PoolGuard;
use crate::load::plan::LoadPlan;
use crate::load::rank::RankHandle;
use crate::load::remote::Suffix;
use crate::load::share::LeasePlan;
use crate::load::ssd::SsdLoad;
use crate::metrics::InFlight;
use crate::nic::stripe::StripePlan;
use crate::peer::link::BoxFut;
use crate::tier::pool::PoolMemory;
use crate::tier::store::{LoadSlots, ReserveLoad, SsdSlots};

/// Batches a transfer keeps queued on the device (see `Transfer::submit_ahead`).
const SUBMIT_AHEAD: usize = 2;

/// Size of one batch of a save (or put) transfer. Planning a batch costs ~0.1 us per copy on
/// the H200's host before the device starts on it (the device's submit thread does it for
/// large batches): a 256-block save in one batch (14,336 copies, 448 MiB) started ~1 ms
/// late. Two staging chunks' worth: each batch's device time (~1.2 ms) covers the next one's
/// planning.
const SAVE_BATCH_BYTES: u64 = 64 << 20;

/// The first batch of a save: small, so the device starts after ~30 us of planning rather
/// than ~230 (a 64 MiB batch); the next ones double up to [`SAVE_BATCH_BYTES`], each planned
/// while the one before copies.
const SAVE_FIRST_BATCH_BYTES: u64 = 8 << 20;

/// Tells a load's observer the layers that have landed, from whichever thread learns it
/// first: the device's completion thread as a batch lands (the actor thread may be busy
/// submitting the next batch, hundreds of microseconds for a large one), or the actor as a
/// part ends. Counts reach the observer growing, never repeated.
struct LayerGate {
    observer: Arc<dyn LoadObserver>,
    total: u32,
    /// Parts (SSD, remote) still running: their blocks hold every layer, so no layer is
    /// visible before they end.
    parts_running: AtomicUsize,
    /// A batch or a part failed: nothing more is reported as landed.
    failed: AtomicBool,
    /// The count the observer was told last; the lock orders concurrent reports.
    told: Mutex<u32>,
}

impl LayerGate {
    fn report(&self, layers: u32) {
        if layers == 0
            || self.failed.load(Ordering::Acquire)
            || self.parts_running.load(Ordering::Acquire) > 0
        {
            return;
        }
        let mut told = match self.told.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if layers > *told {
            *told = layers;
            self.observer.layers_landed(layers, self.total);
        }
    }

    fn fail(&self) {
        self.failed.store(true, Ordering::Release);
    }

    /// What runs on the completion thread when a batch ending at `layers` resolves.
    fn on_batch(self: &Arc<Self>, layers: u32) -> Landed {
        let gate = Arc::clone(self);
        Box::new(move |r| match r {
            Ok(_) => gate.report(layers),
            Err(_) => gate.fail(),
        })
    }
}

/// Runs once the batch completed successfully (commits written blocks).
pub type OnSuccess = Box<dyn FnOnce() + Send>;

pub type ReportTx = oneshot::Sender<Result<TransferReport, NodeError>>;

/// Work that runs beside the device batches (a load's SSD part and remote suffix).
pub type Then = BoxFut<Result<PartDone, NodeError>>;

/// What a part that ran beside the device batches did: bytes it moved, the stages it
/// spent, and its own timeline (seconds since the transfer started).
#[derive(Debug, Default)]
pub struct PartDone {
    pub bytes: u64,
    pub stages: Vec<Stage>,
    pub spans: Vec<Span>,
}

pub struct Transfer {
    path: TransferPath,
    blocks: usize,
    /// The device copies, a load's and a save's alike.
    queue: BatchQueue,
    /// The parts that run beside the copies (a load's SSD prefix and remote suffix).
    parts: Parts,
    /// Layers landed, for a load's observer.
    progress: Progress,
    on_success: Option<OnSuccess>,
    reply: Option<ReportTx>,
    stages: Vec<Stage>,
    started: Instant,
    in_flight: Option<InFlight>,
    /// The load's (or save's) tracing span: what it logs carries its instance, rank, path
    /// and blocks.
    trace: tracing::Span,
}

/// One batch queue of device copies: what is still to submit, what is submitted, the span
/// every batch's host side lies in, and what the batches did.
struct BatchQueue {
    dir: CopyDirection,
    device: Arc<dyn Device>,
    /// Batches not yet submitted, each with the layer count that has landed once it has.
    batches: VecDeque<(u32, CopyList)>,
    /// Submitted and not yet reported, in submission order (the device completes a lane's
    /// batches in that order).
    /// Each owns the transfer's guard until it resolved, however it ends: dropped pending
    /// (the actor stopped), it hands the guard to the gpu crate's drain thread.
    pending: VecDeque<(u32, OwnedCopyEvent)>,
    /// Every batch's host side lies in this span; its guard owns the pool memory, the pins
    /// and the rank handle the copies touch.
    host: Option<HostSpan>,
    submitted: Option<Instant>,
    /// What the device batches did so far, and their first error.
    stats: CopyStats,
    error: Option<NodeError>,
    seconds: f64,
}

impl BatchQueue {
    fn new(
        dir: CopyDirection,
        device: Arc<dyn Device>,
        batches: VecDeque<(u32, CopyList)>,
        host: Result<HostSpan, NodeError>,
    ) -> Self {
        let (host, error) = match host {
            Ok(h) => (Some(h), None),
            Err(e) => (None, Some(e)),
        };
        Self {
            dir,
            device,
            batches,
            pending: VecDeque::new(),
            host,
            submitted: None,
            stats: CopyStats::default(),
            error,
            seconds: 0.0,
        }
    }
}

/// The parts of a transfer that are not device copies of its own.
#[derive(Default)]
struct Parts {
    /// Not started yet, each with the span name it runs under.
    waiting: Vec<(&'static str, Then)>,
    /// Started and not finished.
    running: usize,
    /// What the finished parts did together, and their first error.
    done: PartDone,
    error: Option<NodeError>,
    /// The parts' timeline, in seconds since the transfer started.
    spans: Vec<Span>,
}

/// How many layers have landed everywhere, and who is told.
#[derive(Default)]
struct Progress {
    layers: u32,
    landed: u32,
    observer: Option<Arc<dyn LoadObserver>>,
    /// Reports landed layers to `observer` (loads with an observer).
    gate: Option<Arc<LayerGate>>,
}

/// Everything a save (or put) transfer needs, built by whoever accepted the request.
pub struct TransferSpec {
    pub path: TransferPath,
    pub dir: CopyDirection,
    pub device: Arc<dyn Device>,
    pub list: CopyList,
    pub blocks: usize,
    /// The pool memory the copies land in, kept mapped until every copy has resolved.
    pub memory: Arc<PoolMemory>,
    /// The rank whose KV the copies read, kept registered as long.
    pub rank: Arc<RankHandle>,
    pub on_success: Option<OnSuccess>,
    /// Stages already spent before the transfer started (plan, pin).
    pub stages: Vec<Stage>,
    pub started: Instant,
    pub in_flight: InFlight,
    pub then: Option<Then>,
}

/// The pool slots `plan` needs, to be reserved before its transfer starts: a slot per
/// block of each staged remote part, and the SSD part's staging ring.
pub(crate) fn reservation(plan: &LoadPlan, share: &LeasePlan, handle: &RankHandle) -> ReserveLoad {
    let fetches = if share.direct {
        Vec::new()
    } else {
        plan.remote
            .iter()
            .filter_map(|p| share.remote.get(p.segment))
            .map(|seg| seg.blocks.iter().map(|b| b.hash).collect())
            .collect()
    };
    ReserveLoad {
        namespace: share.namespace.clone(),
        tp: handle.shape.tp_size(),
        rank: handle.rank,
        block_bytes: handle.shape.block_bytes(),
        fetches,
        staging: plan.ssd.as_ref().map(|p| p.staging_slots.max(1)),
        ssd: if plan.ssd.is_some() {
            share.ssd.iter().map(|b| b.hash).collect()
        } else {
            Vec::new()
        },
    }
}

/// One rank's load: its plan and what executing it needs.
pub struct LoadJob {
    pub plan: LoadPlan,
    pub share: LeasePlan,
    pub handle: Arc<RankHandle>,
    /// The pool slots the staged suffix and the SSD part use, reserved when the load was
    /// planned; a refusal fails the load before any part starts.
    pub(crate) slots: Result<LoadSlots, NodeError>,
    pub route: Option<StripePlan>,
    pub observer: Option<Arc<dyn LoadObserver>>,
    pub stages: Vec<Stage>,
    pub started: Instant,
    pub in_flight: InFlight,
}

impl Transfer {
    pub fn new(spec: TransferSpec, reply: ReportTx) -> Self {
        let path = spec.path;
        let host = PoolGuard::whole(spec.memory, spec.rank)
            .into_span()
            .map_err(|e| NodeError::span(path.as_str(), e));
        // In parts, so the device starts on the first while the rest are planned.
        let batches = spec
            .list
            .split_ramped(SAVE_FIRST_BATCH_BYTES, SAVE_BATCH_BYTES)
            .into_iter()
            .map(|l| (0, l))
            .collect();
        Self {
            path,
            blocks: spec.blocks,
            queue: BatchQueue::new(spec.dir, spec.device, batches, host),
            parts: Parts {
                waiting: spec.then.map(|t| ("remote", t)).into_iter().collect(),
                ..Parts::default()
            },
            progress: Progress::default(),
            on_success: spec.on_success,
            reply: Some(reply),
            stages: spec.stages,
            started: spec.started,
            in_flight: Some(spec.in_flight),
            trace: tracing::info_span!("transfer", path = path.as_str(), blocks = spec.blocks),
        }
    }

    /// A load: the local layer batches, the SSD part and the remote suffix, started together.
    pub fn load(job: LoadJob, reply: ReportTx) -> Self {
        let LoadJob {
            mut plan,
            share,
            handle,
            slots,
            route,
            observer,
            stages,
            started,
            in_flight,
        } = job;
        let (LoadSlots { fetches, ssd }, mut refused) = match slots {
            Ok(s) => (s, None),
            Err(e) => (LoadSlots::default(), Some(e)),
        };
        if refused.is_none() && plan.ssd.is_some() && ssd.is_none() {
            // Never skipped silently: its destinations would keep stale bytes.
            refused = Some(NodeError::bad("an SSD part without staging slots"));
        }
        let trace = tracing::info_span!(
            "load",
            instance = %handle.instance,
            rank = handle.rank,
            path = plan.path.as_str(),
            blocks = plan.blocks,
            remote_blocks = plan.remote_blocks(),
            ssd_blocks = plan.ssd_blocks(),
        );
        use tracing::Instrument;
        let mut then: Vec<(&'static str, Then)> = Vec::new();
        // Refused slots: no part starts (the local copies still run and drain).
        if refused.is_some() {
            plan.ssd = None;
            plan.remote.clear();
        }
        // The SSD part first: its disk reads start while the rest is set up.
        if let (Some(part), Some(SsdSlots { staging, reads })) = (plan.ssd.take(), ssd) {
            let f = SsdLoad {
                hashes: share.ssd.iter().map(|b| b.hash).collect(),
                part,
                handle: Arc::clone(&handle),
                staging,
                reads,
                started,
            }
            .run()
            .instrument(trace.clone());
            then.push(("ssd", Box::pin(f)));
        }
        // The suffix takes the remote parts (their scatter lists can be long): nothing else
        // reads them.
        let remote = std::mem::take(&mut plan.remote);
        if !remote.is_empty() {
            let f = Suffix {
                parts: remote,
                share: share.clone(),
                handle: Arc::clone(&handle),
                fetches,
                route,
            }
            .run()
            .instrument(trace.clone());
            then.push(("remote", Box::pin(f)));
        }
        let batches = plan
            .local
            .into_iter()
            .map(|b| (b.layers.end, b.list))
            .collect();
        let gate = observer.as_ref().map(|o| {
            Arc::new(LayerGate {
                observer: Arc::clone(o),
                total: plan.layers,
                parts_running: AtomicUsize::new(then.len()),
                failed: AtomicBool::new(false),
                told: Mutex::new(0),
            })
        });
        let device = Arc::clone(&handle.device);
        // The local prefix's slots are pinned by the share's pin guard; the copies' guard
        // takes the share (and so the pins) with it.
        let guard = match share.pins.as_ref().map(|p| Arc::clone(p.memory())) {
            Some(memory) => PoolGuard::whole(memory, (share, handle)),
            None => PoolGuard::none((share, handle)),
        };
        let host = guard
            .into_span()
            .map_err(|e| NodeError::span(plan.path.as_str(), e));
        Self {
            path: plan.path,
            blocks: plan.blocks,
            queue: BatchQueue::new(CopyDirection::HostToDevice, device, batches, host),
            parts: Parts {
                waiting: then,
                error: refused,
                ..Parts::default()
            },
            progress: Progress {
                layers: plan.layers,
                landed: 0,
                observer,
                gate,
            },
            on_success: None,
            reply: Some(reply),
            stages,
            started,
            in_flight: Some(in_flight),
            trace,
        }
    }

    /// Seconds since the transfer started.
    fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn end_span(&mut self, name: &'static str) {
        let end = self.now();
        if let Some(s) = self.parts.spans.iter_mut().find(|s| s.name == name) {
            s.end = end;
        }
    }

    fn copy_stage(&self) -> StageName {
        match self.queue.dir {
            CopyDirection::HostToDevice => StageName::H2d,
            CopyDirection::DeviceToHost => StageName::D2h,
        }
    }

    /// Layers that have landed in every destination: none while a part (SSD, remote) runs
    /// (its blocks hold every layer), the local batches' count once they are done. The
    /// completion thread reports each batch as it lands; this covers what only the actor
    /// learns (a part ended, empty batches skipped).
    fn report_layers(&mut self) {
        let Some(gate) = &self.progress.gate else {
            return;
        };
        if self.queue.error.is_some() || self.parts.error.is_some() {
            gate.fail();
            return;
        }
        let local = if self.queue.pending.is_empty() && self.queue.batches.is_empty() {
            self.progress.layers
        } else {
            self.progress.landed
        };
        gate.report(local);
    }

    /// One batch resolved.
    fn batch_done(
        &mut self,
        layers: u32,
        r: Result<CopyStats, DeviceError>,
        ctx: &mut Context<Self>,
    ) {
        match r {
            Ok(s) => {
                self.queue.stats.bytes += s.bytes;
                self.queue.stats.ops += s.ops;
                self.progress.landed = self.progress.landed.max(layers);
            }
            Err(source) => {
                self.queue.error.get_or_insert(NodeError::Transfer {
                    path: self.path.as_str(),
                    source,
                });
                // Nothing more is submitted; what was is still awaited.
                self.queue.batches.clear();
            }
        }
        // Usually told already by the completion thread; not while a part was running then.
        self.report_layers();
        self.submit_ahead();
        if self.queue.pending.is_empty() {
            self.queue.seconds = self
                .queue
                .submitted
                .map(|t| t.elapsed().as_secs_f64())
                .unwrap_or(0.0);
            self.end_span("local");
            self.report_layers();
        } else {
            ctx.spawn(
                AwaitFront.map(|(layers, r), act: &mut Self, ctx| act.batch_done(layers, r, ctx)),
            );
        }
        self.maybe_finish(ctx);
    }

    /// Submits batches in order until [`SUBMIT_AHEAD`] are queued on the device. A window
    /// rather than all at once: submitting a large batch takes the actor thread hundreds of
    /// microseconds, during which no completion is handled (on the H200 a 256-block load
    /// showed layer 0 at 1.0 ms with every batch submitted up front, its copy having ended at
    /// 0.48 ms; the layers are now reported from the completion thread, but the window still
    /// bounds what a failed batch leaves queued). Two queued batches keep the device busy: the
    /// next is submitted while the second still copies.
    fn submit_ahead(&mut self) {
        if self.queue.error.is_some() {
            // Refused before anything was submitted (its memory could not be spanned).
            self.queue.batches.clear();
        }
        while self.queue.pending.len() < SUBMIT_AHEAD {
            if !self.queue.batches.is_empty()
                && self
                    .progress
                    .observer
                    .as_ref()
                    .is_some_and(|o| o.cancelled())
            {
                // Nothing more is submitted; what was is still awaited.
                if let Some(g) = &self.progress.gate {
                    g.fail();
                }
                self.queue.error.get_or_insert(NodeError::Cancelled {
                    landed: self.progress.landed,
                    layers: self.progress.layers,
                });
                self.queue.batches.clear();
                return;
            }
            let Some((layers, list)) = self.queue.batches.pop_front() else {
                return;
            };
            if list.is_empty() {
                self.progress.landed = self.progress.landed.max(layers);
                continue;
            }
            let landed = self.progress.gate.as_ref().map(|g| g.on_batch(layers));
            let path = self.path.as_str();
            let submitted = match &self.queue.host {
                Some(host) => CopyBatch::from_list(self.queue.dir, list, host)
                    .map_err(|e| NodeError::span(path, e))
                    .and_then(|b| {
                        b.submit(self.queue.device.as_ref(), landed)
                            .map_err(|source| NodeError::Transfer { path, source })
                    }),
                None => Err(NodeError::Stopped {
                    what: "transfer memory",
                }),
            };
            match submitted {
                Ok(ev) => self.queue.pending.push_back((layers, ev)),
                Err(e) => {
                    // Nothing more is submitted; what was is still awaited.
                    if let Some(g) = &self.progress.gate {
                        g.fail();
                    }
                    self.queue.error = Some(e);
                    self.queue.batches.clear();
                }
            }
        }
    }

    fn part_done(
        &mut self,
        name: &'static str,
        r: Result<PartDone, NodeError>,
        ctx: &mut Context<Self>,
    ) {
        self.parts.running = self.parts.running.saturating_sub(1);
        self.end_span(name);
        match r {
            Ok(p) => {
                self.parts.done.bytes += p.bytes;
                self.parts.done.stages.extend(p.stages);
                self.parts.spans.extend(p.spans);
            }
            Err(e) => {
                self.parts.error.get_or_insert(e);
            }
        }
        if let Some(g) = &self.progress.gate {
            if self.parts.error.is_some() {
                g.fail();
            }
            g.parts_running.fetch_sub(1, Ordering::AcqRel);
        }
        self.report_layers();
        self.maybe_finish(ctx);
    }

    /// Replies once the device batches and every part have finished.
    fn maybe_finish(&mut self, ctx: &mut Context<Self>) {
        if !self.queue.pending.is_empty() || self.parts.running > 0 {
            return;
        }
        let out = if let Some(e) = self.queue.error.take() {
            Err(e)
        } else {
            if let Some(e) = self.parts.error.take() {
                self.reply_with(Err(e), ctx);
                return;
            }
            let bytes = self.queue.stats.bytes + self.parts.done.bytes;
            let remote_stages = std::mem::take(&mut self.parts.done.stages);
            if let Some(f) = self.on_success.take() {
                f();
            }
            if self.queue.stats.ops > 0 || remote_stages.is_empty() {
                self.stages.push(Stage {
                    name: self.copy_stage(),
                    seconds: self.queue.seconds,
                });
            }
            // One entry per stage: the prefix's and the parts' device copies add up.
            for st in remote_stages {
                match self.stages.iter_mut().find(|s| s.name == st.name) {
                    Some(s) => s.seconds += st.seconds,
                    None => self.stages.push(st),
                }
            }
            Ok(TransferReport {
                path: self.path,
                blocks: self.blocks,
                bytes,
                copies: self.queue.stats.ops,
                seconds: self.started.elapsed().as_secs_f64(),
                stages: std::mem::take(&mut self.stages),
                spans: std::mem::take(&mut self.parts.spans),
            })
        };
        self.reply_with(out, ctx);
    }

    fn reply_with(&mut self, out: Result<TransferReport, NodeError>, ctx: &mut Context<Self>) {
        let _in_span = self.trace.clone().entered();
        match &out {
            Ok(r) => tracing::debug!(bytes = r.bytes, seconds = r.seconds, "transfer done"),
            Err(e) => tracing::debug!(error = %e, "transfer failed"),
        }
        if let Some(f) = &self.in_flight {
            if self.queue.dir == CopyDirection::HostToDevice {
                f.0.load(out.is_ok(), out.as_ref().map(|r| r.bytes).unwrap_or(0));
            }
            f.0.transfer(self.path.as_str(), out.as_ref().map_err(|_| ()));
            if let Err(e) = &out {
                f.0.log_failure(self.path.as_str(), e);
            }
        }
        // Release before replying, so a caller that sees the reply sees the pins gone.
        self.on_success = None;
        self.queue.host = None;
        self.in_flight = None;
        if let Some(obs) = &self.progress.observer {
            obs.finished(&out);
        }
        if let Some(tx) = self.reply.take() {
            let _ = tx.send(out);
        }
        ctx.stop();
    }
}

/// Polls the oldest pending batch from inside the actor, so the event (and what it
/// protects) stays owned by the actor until it resolves.
struct AwaitFront;

impl ActorFuture<Transfer> for AwaitFront {
    type Output = (u32, Result<CopyStats, DeviceError>);

    fn poll(
        self: Pin<&mut Self>,
        act: &mut Transfer,
        _ctx: &mut Context<Transfer>,
        cx: &mut task::Context<'_>,
    ) -> Poll<Self::Output> {
        let ordinal = act.queue.device.ordinal();
        match act.queue.pending.front_mut() {
            Some((layers, ev)) => {
                let layers = *layers;
                match Pin::new(ev).poll(cx) {
                    Poll::Ready(r) => {
                        act.queue.pending.pop_front();
                        Poll::Ready((layers, r))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
            None => Poll::Ready((0, Err(DeviceError::Stopped { ordinal }))),
        }
    }
}

impl Actor for Transfer {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // The parts first: their reads start while the local batches are submitted.
        for (name, then) in std::mem::take(&mut self.parts.waiting) {
            self.parts.running += 1;
            let start = self.now();
            self.parts.spans.push(Span {
                name,
                start,
                end: start,
            });
            ctx.spawn(
                actix::fut::wrap_future(then)
                    .map(move |r, act: &mut Self, ctx| act.part_done(name, r, ctx)),
            );
        }
        self.queue.submitted = Some(Instant::now());
        let start = self.now();
        self.parts.spans.push(Span {
            name: "local",
            start,
            end: start,
        });
        self.submit_ahead();
        if self.queue.pending.is_empty() {
            self.queue.seconds = 0.0;
            self.end_span("local");
            self.report_layers();
            self.maybe_finish(ctx);
        } else {
            ctx.spawn(
                AwaitFront.map(|(layers, r), act: &mut Self, ctx| act.batch_done(layers, r, ctx)),
            );
        }
    }
}
