//! The Transfer actor: one per load or save. It owns everything its copies touch (lease
//! share, instance handle, pool memory, writer pins) until the device reports the batch
//! complete, and only then releases them and replies.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{self, Poll};
use std::time::Instant;

use actix::fut::ActorFutureExt;
use actix::{Actor, ActorContext, ActorFuture, AsyncContext, Context};
use kvferry_gpu::{CopyDirection, CopyEvent, CopyList, CopyStats, Device, DeviceError};
use tokio::sync::oneshot;

use crate::api::{Stage, TransferReport};
use crate::error::NodeError;
use crate::metrics::InFlight;
use crate::remote::link::BoxFut;

/// Something a transfer keeps alive until its copies have drained.
pub type Hold = Box<dyn Any + Send>;

/// Runs once the batch completed successfully (commits written blocks).
pub type OnSuccess = Box<dyn FnOnce() + Send>;

pub type ReportTx = oneshot::Sender<Result<TransferReport, NodeError>>;

/// Work that runs once the batch has landed (the remote suffix of a load): bytes it moved and
/// the stages it spent.
pub type Then = BoxFut<Result<(u64, Vec<Stage>), NodeError>>;

pub struct Transfer {
    path: &'static str,
    dir: CopyDirection,
    device: Arc<dyn Device>,
    list: Option<CopyList>,
    blocks: usize,
    holds: Vec<Hold>,
    on_success: Option<OnSuccess>,
    reply: Option<ReportTx>,
    stages: Vec<Stage>,
    started: Instant,
    submitted: Option<Instant>,
    pending: Option<CopyEvent>,
    in_flight: Option<InFlight>,
    then: Option<Then>,
    /// The batch's result while `then` runs.
    local: Option<CopyStats>,
}

/// Everything a transfer needs, built by whoever accepted the request.
pub struct TransferSpec {
    pub path: &'static str,
    pub dir: CopyDirection,
    pub device: Arc<dyn Device>,
    pub list: CopyList,
    pub blocks: usize,
    pub holds: Vec<Hold>,
    pub on_success: Option<OnSuccess>,
    /// Stages already spent before the transfer started (plan, pin).
    pub stages: Vec<Stage>,
    pub started: Instant,
    pub in_flight: InFlight,
    pub then: Option<Then>,
}

impl Transfer {
    pub fn new(spec: TransferSpec, reply: ReportTx) -> Self {
        Self {
            path: spec.path,
            dir: spec.dir,
            device: spec.device,
            list: Some(spec.list),
            blocks: spec.blocks,
            holds: spec.holds,
            on_success: spec.on_success,
            reply: Some(reply),
            stages: spec.stages,
            started: spec.started,
            submitted: None,
            pending: None,
            in_flight: Some(spec.in_flight),
            then: spec.then,
            local: None,
        }
    }

    fn copy_stage(&self) -> &'static str {
        match self.dir {
            CopyDirection::HostToDevice => "h2d",
            CopyDirection::DeviceToHost => "d2h",
        }
    }

    fn finish(&mut self, result: Result<CopyStats, DeviceError>, ctx: &mut Context<Self>) {
        let copy_seconds = self
            .submitted
            .map(|t| t.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        if let (Ok(stats), Some(then)) = (&result, self.then.take()) {
            // The local prefix landed; now the remote suffix, still owning everything.
            self.stages.push(Stage {
                name: self.copy_stage(),
                seconds: copy_seconds,
            });
            self.local = Some(*stats);
            ctx.spawn(actix::fut::wrap_future(then).map(|r, act: &mut Self, ctx| act.done(r, ctx)));
            return;
        }
        let out = match result {
            Ok(stats) => {
                if let Some(f) = self.on_success.take() {
                    f();
                }
                self.stages.push(Stage {
                    name: self.copy_stage(),
                    seconds: copy_seconds,
                });
                Ok(TransferReport {
                    path: self.path,
                    blocks: self.blocks,
                    bytes: stats.bytes,
                    copies: stats.ops,
                    seconds: self.started.elapsed().as_secs_f64(),
                    stages: std::mem::take(&mut self.stages),
                })
            }
            Err(source) => Err(NodeError::Transfer {
                path: self.path,
                source,
            }),
        };
        self.reply_with(out, ctx);
    }

    /// The remote suffix finished.
    fn done(&mut self, r: Result<(u64, Vec<Stage>), NodeError>, ctx: &mut Context<Self>) {
        let local = self.local.take().unwrap_or_default();
        let out = r.map(|(bytes, stages)| {
            // One entry per stage: the prefix's and the suffix's device copies add up.
            for st in stages {
                match self.stages.iter_mut().find(|s| s.name == st.name) {
                    Some(s) => s.seconds += st.seconds,
                    None => self.stages.push(st),
                }
            }
            TransferReport {
                path: self.path,
                blocks: self.blocks,
                bytes: local.bytes + bytes,
                copies: local.ops,
                seconds: self.started.elapsed().as_secs_f64(),
                stages: std::mem::take(&mut self.stages),
            }
        });
        self.reply_with(out, ctx);
    }

    fn reply_with(&mut self, out: Result<TransferReport, NodeError>, ctx: &mut Context<Self>) {
        if let Some(f) = &self.in_flight {
            if self.dir == CopyDirection::HostToDevice {
                f.0.load(out.is_ok(), out.as_ref().map(|r| r.bytes).unwrap_or(0));
            }
            f.0.transfer(self.path, out.as_ref().map_err(|_| ()));
        }
        // Release before replying, so a caller that sees the reply sees the pins gone.
        self.on_success = None;
        self.holds.clear();
        self.in_flight = None;
        if let Some(tx) = self.reply.take() {
            let _ = tx.send(out);
        }
        ctx.stop();
    }
}

/// Polls the transfer's pending event from inside the actor, so the event (and what it
/// protects) stays owned by the actor until it resolves.
struct AwaitCopy;

impl ActorFuture<Transfer> for AwaitCopy {
    type Output = Result<CopyStats, DeviceError>;

    fn poll(
        self: Pin<&mut Self>,
        act: &mut Transfer,
        _ctx: &mut Context<Transfer>,
        cx: &mut task::Context<'_>,
    ) -> Poll<Self::Output> {
        let ordinal = act.device.ordinal();
        match act.pending.as_mut() {
            Some(ev) => {
                let r = Pin::new(ev).poll(cx);
                if r.is_ready() {
                    act.pending = None;
                }
                r
            }
            None => Poll::Ready(Err(DeviceError::Stopped { ordinal })),
        }
    }
}

impl Actor for Transfer {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let Some(list) = self.list.take() else {
            return;
        };
        let now = Instant::now();
        self.submitted = Some(now);
        // SAFETY: every host range in `list` lies in pool slots kept alive by `self.holds`
        // (the pool memory `Arc` and the pins on those slots), and the holds are released
        // only after the event has resolved: in `finish`, or by the drain thread in `Drop`.
        match unsafe { self.device.submit(self.dir, list) } {
            Ok(ev) => {
                self.pending = Some(ev);
                ctx.spawn(actix::fut::ActorFutureExt::map(AwaitCopy, |r, act, ctx| {
                    act.finish(r, ctx)
                }));
            }
            Err(e) => self.finish(Err(e), ctx),
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        // Stopped with a batch still in flight (the system is shutting down): the device may
        // still read or write the held memory, so keep it until the batch drains.
        if let Some(ev) = self.pending.take() {
            // ManuallyDrop: if the thread cannot start, the closure is dropped unrun and the
            // holds leak, which is safe, instead of freeing memory a copy may still use.
            let holds = std::mem::ManuallyDrop::new(std::mem::take(&mut self.holds));
            let in_flight = self.in_flight.take();
            let _ = std::thread::Builder::new()
                .name("kvferry-drain".into())
                .spawn(move || {
                    let _ = ev.wait_blocking();
                    drop(std::mem::ManuallyDrop::into_inner(holds));
                    drop(in_flight);
                });
        }
    }
}
