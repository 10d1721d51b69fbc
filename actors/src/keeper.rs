//! The LeaseKeeper actor: answers queries with leases, hands each rank its share at load
//! time and starts the Transfer that owns it, and sweeps expired leases.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::fut::{wrap_future, ActorFutureExt};
use actix::{
    Actor, ActorContext, Addr, AsyncContext, Context, Handler, Message, ResponseActFuture,
};
use kvferry_gpu::{CopyDirection, CopyList};
use tokio::sync::oneshot;

use crate::api::{DirectGrant, LoadRequest, QueryRequest, QueryResponse, Stage, TransferReport};
use crate::cache::SlotRef;
use crate::clock::Clock;
use crate::error::NodeError;
use crate::lease::LeaseTable;
use crate::metrics::{Counters, InFlight};
use crate::model::{InstanceId, LeaseId, Namespace};
use crate::registry::{GetInstance, GetRank, InstanceRegistry};
use crate::store::{BlockStore, PinGuard, PinPrefix};
use crate::transfer::{Transfer, TransferSpec};

/// Why a direct-GPU request is refused until remote suffixes exist.
pub const DIRECT_REFUSAL: &str = "remote suffix not supported";

/// What a lease holds: the pinned local prefix (and, later, the remote plan). Each rank's
/// share is a clone; the pins go when the lease and every share are gone.
#[derive(Clone, Debug)]
pub struct LeasePlan {
    pub namespace: Namespace,
    pub local: Arc<Vec<SlotRef>>,
    pub pins: Option<Arc<PinGuard>>,
}

pub struct LeaseKeeper {
    table: LeaseTable<LeasePlan>,
    clock: Clock,
    sweep_every: Duration,
    store: Addr<BlockStore>,
    registry: Addr<InstanceRegistry>,
    counters: Arc<Counters>,
}

impl LeaseKeeper {
    pub fn new(
        ttl: Duration,
        sweep_every: Duration,
        clock: Clock,
        store: Addr<BlockStore>,
        registry: Addr<InstanceRegistry>,
        counters: Arc<Counters>,
    ) -> Self {
        Self {
            table: LeaseTable::new(ttl),
            clock,
            sweep_every,
            store,
            registry,
            counters,
        }
    }

    fn sweep(&mut self) -> usize {
        // Dropping the expired plans releases their pins.
        self.table.expire(self.clock.now()).len()
    }
}

impl Actor for LeaseKeeper {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(self.sweep_every, |act, _| {
            act.sweep();
        });
    }
}

#[derive(Message)]
#[rtype(result = "Result<QueryResponse, NodeError>")]
pub struct Query(pub QueryRequest);

impl Handler<Query> for LeaseKeeper {
    type Result = ResponseActFuture<Self, Result<QueryResponse, NodeError>>;

    fn handle(&mut self, Query(q): Query, _: &mut Context<Self>) -> Self::Result {
        let (registry, store) = (self.registry.clone(), self.store.clone());
        let instance = q.instance.clone();
        let lookup = async move {
            let (namespace, shape) = registry.send(GetInstance(instance)).await??;
            let pinned = store
                .send(PinPrefix {
                    namespace: namespace.clone(),
                    hashes: q.hashes,
                })
                .await?;
            Ok::<_, NodeError>((namespace, shape, pinned))
        };
        Box::pin(wrap_future(lookup).map(move |r, act: &mut Self, _| {
            let (namespace, shape, pinned) = r?;
            let local_blocks = pinned.blocks.len();
            let direct = if q.direct_gpu {
                DirectGrant::Refused {
                    reason: DIRECT_REFUSAL.into(),
                }
            } else {
                DirectGrant::NotRequested
            };
            let lease = (local_blocks > 0).then(|| {
                let plan = LeasePlan {
                    namespace: namespace.clone(),
                    local: pinned.blocks,
                    pins: pinned.guard,
                };
                act.table
                    .create(q.instance, shape.tp_size(), plan, act.clock.now())
            });
            Ok(QueryResponse {
                lease,
                namespace,
                local_blocks,
                remote_blocks: 0,
                direct,
            })
        }))
    }
}

pub type ReportRx = oneshot::Receiver<Result<TransferReport, NodeError>>;

/// Accepts a load: validates it, consumes the rank's share and starts its Transfer. Replies
/// once the transfer is accepted; its report arrives on the returned receiver.
#[derive(Message)]
#[rtype(result = "Result<ReportRx, NodeError>")]
pub struct Load(pub LoadRequest);

impl Handler<Load> for LeaseKeeper {
    type Result = ResponseActFuture<Self, Result<ReportRx, NodeError>>;

    fn handle(&mut self, Load(req): Load, _: &mut Context<Self>) -> Self::Result {
        let t0 = Instant::now();
        let get = self.registry.send(GetRank {
            instance: req.instance.clone(),
            rank: req.rank,
        });
        Box::pin(wrap_future(get).map(move |r, act: &mut Self, _| {
            let handle = r??;
            let now = act.clock.now();
            // Validate everything before consuming, so a bad request changes nothing.
            let plan = act.table.check(req.lease, &req.instance, req.rank, now)?;
            if req.dest_blocks.len() != plan.local.len() {
                return Err(NodeError::bad(format!(
                    "lease {} holds {} blocks, {} destination blocks given",
                    req.lease,
                    plan.local.len(),
                    req.dest_blocks.len()
                )));
            }
            handle.layout.check_blocks(&req.dest_blocks)?;
            let share = act
                .table
                .consume(req.lease, &req.instance, req.rank, now)?
                .share;
            let shape = handle.shape;
            let per_block = (shape.layers() * shape.segments()) as usize;
            let mut list = CopyList::with_capacity(share.local.len() * per_block);
            for (b, &dst) in share.local.iter().zip(&req.dest_blocks) {
                for layer in 0..shape.layers() {
                    for seg in 0..shape.segments() {
                        list.push(
                            b.addr + shape.segment_offset(req.rank, layer, seg),
                            handle.layout.segment_addr(layer, seg, dst),
                            shape.segment_bytes(),
                        );
                    }
                }
            }
            let plan_s = t0.elapsed().as_secs_f64();
            let (tx, rx) = oneshot::channel();
            let spec = TransferSpec {
                path: "local",
                dir: CopyDirection::HostToDevice,
                device: Arc::clone(&handle.device),
                list,
                blocks: share.local.len(),
                holds: vec![Box::new(share), Box::new(handle)],
                on_success: None,
                stages: vec![Stage {
                    name: "plan",
                    seconds: plan_s,
                }],
                started: t0,
                in_flight: InFlight::new(Arc::clone(&act.counters)),
            };
            Transfer::new(spec, tx).start();
            Ok(rx)
        }))
    }
}

#[derive(Message)]
#[rtype(result = "Result<(), NodeError>")]
pub struct Release(pub LeaseId);

impl Handler<Release> for LeaseKeeper {
    type Result = Result<(), NodeError>;

    fn handle(&mut self, m: Release, _: &mut Context<Self>) -> Self::Result {
        self.table.release(m.0)?;
        Ok(())
    }
}

/// Releases every lease of an instance (it is unregistering); replies with how many.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct ReleaseInstance(pub InstanceId);

impl Handler<ReleaseInstance> for LeaseKeeper {
    type Result = usize;

    fn handle(&mut self, m: ReleaseInstance, _: &mut Context<Self>) -> usize {
        self.table.release_instance(&m.0).len()
    }
}

/// Sweeps now (the periodic sweeper does the same); replies with how many expired.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct Sweep;

impl Handler<Sweep> for LeaseKeeper {
    type Result = usize;

    fn handle(&mut self, _: Sweep, _: &mut Context<Self>) -> usize {
        self.sweep()
    }
}

/// Live leases and leases expired so far.
#[derive(Message)]
#[rtype(result = "(usize, u64)")]
pub struct LeaseStats;

impl Handler<LeaseStats> for LeaseKeeper {
    type Result = actix::MessageResult<LeaseStats>;

    fn handle(&mut self, _: LeaseStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult((self.table.len(), self.table.expired_total()))
    }
}

/// Control: stop the keeper; dropping the table releases every lease's pins.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Shutdown;

impl Handler<Shutdown> for LeaseKeeper {
    type Result = ();

    fn handle(&mut self, _: Shutdown, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}
