//! The LeaseKeeper actor: answers queries with leases, hands each rank its share at load
//! time (planned by [`crate::load::share::prepare`], executed by the Transfer that owns it), sweeps expired
//! leases, and owns the instance registry.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::fut::{wrap_future, ActorFutureExt};
use actix::{
    Actor, ActorContext, Addr, AsyncContext, Context, Handler, Message, ResponseActFuture,
};
use tokio::sync::oneshot;

use crate::api::{
    DirectGrant, LoadObserver, LoadRequest, QueryRequest, QueryResponse, Stage, StageName,
    TransferReport,
};
use crate::clock::Clock;
use crate::error::NodeError;
use crate::fence::{monotonic_ns, Fence};
use crate::lease::registry::InstanceRegistry;
use crate::lease::table::LeaseTable;
use crate::lease::tenants::TenantBook;
use crate::load::share::prepare;
use crate::load::share::{LeasePlan, RemoteSeg};
use crate::load::transfer::{reservation, LoadJob, Transfer};
use crate::metrics::{Counters, InFlight};
use crate::model::BlockHash;
use crate::model::{InstanceId, LeaseId, Namespace};
use crate::nic::stripe::NicRouting;
use crate::peer::directory::segments;
use crate::peer::{Peers, RemotePin};
use crate::tier::store::{BlockStore, PinPrefix};

/// Why a direct-GPU request is refused on a node without peers.
pub const DIRECT_REFUSAL: &str = "remote suffix not supported: this node has no peers";

pub struct LeaseKeeper {
    table: LeaseTable<LeasePlan>,
    clock: Clock,
    sweep_every: Duration,
    store: Addr<BlockStore>,
    /// Instances and their ranks: a load finds its rank handle here, without a round trip.
    pub(crate) registry: InstanceRegistry,
    counters: Arc<Counters>,
    node_id: String,
    cluster: Option<Arc<dyn Peers>>,
    /// Why `direct_gpu` is refused although the config asks for verbs (the capability gate).
    direct_refusal: Option<String>,
    /// Which verbs NIC carries each read of a direct remote load.
    routing: Option<Arc<NicRouting>>,
    /// The tenant namespaces queries name (shared with the node's saves).
    tenants: Arc<TenantBook>,
}

impl LeaseKeeper {
    #[allow(clippy::too_many_arguments)] // one per collaborator; built once by the node
    pub fn new(
        ttl: Duration,
        sweep_every: Duration,
        clock: Clock,
        store: Addr<BlockStore>,
        registry: InstanceRegistry,
        counters: Arc<Counters>,
        node_id: String,
        cluster: Option<Arc<dyn Peers>>,
    ) -> Self {
        Self {
            table: LeaseTable::new(ttl),
            clock,
            sweep_every,
            store,
            registry,
            counters,
            node_id,
            cluster,
            direct_refusal: None,
            routing: None,
            tenants: Arc::default(),
        }
    }

    /// Shares the node's tenant book (its saves name tenants too).
    pub fn with_tenants(mut self, tenants: Arc<TenantBook>) -> Self {
        self.tenants = tenants;
        self
    }

    /// The verbs side of a node: the gate's refusal (see [`crate::nic::verbs_refusal`]) and
    /// the NIC routing of direct remote loads.
    pub fn with_verbs(
        mut self,
        direct_refusal: Option<String>,
        routing: Option<Arc<NicRouting>>,
    ) -> Self {
        self.direct_refusal = direct_refusal;
        self.routing = routing;
        self
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
pub struct Query(pub QueryRequest, pub Option<Fence>);

impl Handler<Query> for LeaseKeeper {
    type Result = ResponseActFuture<Self, Result<QueryResponse, NodeError>>;

    fn handle(&mut self, Query(q, fence): Query, _: &mut Context<Self>) -> Self::Result {
        let store = self.store.clone();
        let (cluster, node_id) = (self.cluster.clone(), self.node_id.clone());
        let tenants = Arc::clone(&self.tenants);
        let tenant = q.tenant;
        let known = self
            .registry
            .instance(&q.instance)
            .and_then(|(ns, shape)| Ok((tenants.namespace(&ns, tenant.as_deref())?, shape)));
        let hashes = q.hashes;
        let queried = hashes.len();
        let lookup = async move {
            let (namespace, shape) = known?;
            let pinned = store
                .send(PinPrefix {
                    namespace: namespace.clone(),
                    hashes: hashes.clone(),
                })
                .await?;
            let t = Instant::now();
            let remote = match &cluster {
                Some(c) => {
                    plan_remote(c.as_ref(), &node_id, &namespace, &hashes[pinned.len()..]).await
                }
                None => Vec::new(),
            };
            Ok::<_, NodeError>((namespace, shape, pinned, remote, t.elapsed().as_secs_f64()))
        };
        Box::pin(wrap_future(lookup).map(move |r, act: &mut Self, _| {
            let (namespace, shape, pinned, remote, pin_seconds) = r?;
            if let Some(f) = fence {
                let now = monotonic_ns();
                if f.passed_at(now) {
                    // The client gave up: no lease. Dropping `pinned` and `remote` here
                    // releases the local pins and the owners' pins at once.
                    let late = f.late_by(now);
                    let blocks =
                        pinned.len() + remote.iter().map(|s| s.blocks.len()).sum::<usize>();
                    act.counters.abandoned("query", blocks, late);
                    return Err(NodeError::DeadlinePassed {
                        what: "Query",
                        late,
                    });
                }
            }
            let local_blocks = pinned.len();
            let ssd_blocks = pinned.ssd_blocks.min(local_blocks);
            let remote_blocks: usize = remote.iter().map(|s| s.blocks.len()).sum();
            let direct = match (q.direct_gpu, &act.cluster, &act.direct_refusal) {
                (false, _, _) => DirectGrant::NotRequested,
                // The config asks for verbs and verbs cannot serve: refused, never downgraded.
                (true, _, Some(reason)) => DirectGrant::Refused {
                    reason: reason.clone(),
                },
                (true, None, None) => DirectGrant::Refused {
                    reason: DIRECT_REFUSAL.into(),
                },
                (true, Some(_), None) => DirectGrant::Granted,
            };
            act.counters.query(match (local_blocks, remote_blocks) {
                (0, 0) => "miss",
                (_, 0) => "local",
                _ => "remote",
            });
            act.counters.query_blocks(
                local_blocks - ssd_blocks,
                ssd_blocks,
                remote_blocks,
                queried.saturating_sub(local_blocks + remote_blocks),
            );
            act.counters.namespace_query(
                &namespace,
                local_blocks + remote_blocks,
                queried.saturating_sub(local_blocks + remote_blocks),
            );
            let lease = (local_blocks + remote_blocks > 0).then(|| {
                let plan = LeasePlan {
                    namespace: namespace.clone(),
                    local: pinned.blocks,
                    ssd: pinned.ssd,
                    pins: pinned.guard,
                    remote: Arc::new(remote),
                    direct: direct.is_granted(),
                    pin_seconds,
                };
                act.table
                    .create(q.instance, shape.tp_size(), plan, act.clock.now())
            });
            Ok(QueryResponse {
                lease,
                namespace,
                local_blocks,
                ssd_blocks,
                remote_blocks,
                direct,
            })
        }))
    }
}

/// Looks the suffix up in the directory and pins it on its owners, in block order: at each
/// position the first candidate owner that pins at least one block wins and the plan moves
/// past what it pinned (a shortened pin is no error: blocks vanished since the lookup).
/// Stops where no candidate pins anything or an owner cannot be reached.
///
/// The directory is asked once per query (its answer is bounded; a directory that is down
/// answers "nobody", and the plan is the local prefix alone).
async fn plan_remote(
    cluster: &dyn Peers,
    node_id: &str,
    namespace: &Namespace,
    hashes: &[BlockHash],
) -> Vec<RemoteSeg> {
    let mut out = Vec::new();
    if hashes.is_empty() {
        return out;
    }
    let owners = cluster.directory().owners(namespace, hashes, node_id).await;
    if owners.len() != hashes.len() {
        return out;
    }
    let mut pos = 0;
    while pos < hashes.len() {
        let Some(seg) = segments(&owners[pos..]).into_iter().next() else {
            break;
        };
        let want = &hashes[pos..pos + seg.len];
        let mut pinned = None;
        for owner in &seg.owners {
            let Ok(link) = cluster.link(node_id, owner).await else {
                continue;
            };
            if let Ok(p) = link.pin(namespace.clone(), want.to_vec()).await {
                if !p.blocks.is_empty() {
                    pinned = Some((link, p));
                    break;
                }
            }
        }
        let Some((link, p)) = pinned else { break };
        pos += p.blocks.len();
        let pin = Some(RemotePin {
            link: Arc::clone(&link),
            pin_id: p.pin_id,
        });
        out.push(RemoteSeg {
            link,
            blocks: p.blocks,
            pin,
        });
    }
    out
}

pub type ReportRx = oneshot::Receiver<Result<TransferReport, NodeError>>;

/// Accepts a load: validates it, plans it, consumes the rank's share and starts the
/// Transfer that executes the plan. Replies once the transfer is accepted; its report
/// arrives on the returned receiver. `observer` (if any) sees the layers land.
#[derive(Message)]
#[rtype(result = "Result<ReportRx, NodeError>")]
pub struct Load(
    pub LoadRequest,
    pub Option<Arc<dyn LoadObserver>>,
    /// Past it the client has given up on the load (it may reuse the destination blocks):
    /// it is refused, and nothing is consumed.
    pub Option<Fence>,
);

impl Handler<Load> for LeaseKeeper {
    type Result = Result<ReportRx, NodeError>;

    fn handle(
        &mut self,
        Load(req, observer, fence): Load,
        ctx: &mut Context<Self>,
    ) -> Self::Result {
        let t0 = Instant::now();
        if let Some(f) = fence {
            let now = monotonic_ns();
            if f.passed_at(now) {
                // Nothing may write into blocks the engine may have handed to another
                // request since.
                let late = f.late_by(now);
                self.counters.abandoned("load", req.dest_blocks.len(), late);
                return Err(NodeError::DeadlinePassed { what: "Load", late });
            }
        }
        let handle = self.registry.rank(&req.instance, req.rank)?;
        let now = self.clock.now();
        // Validate and plan everything before consuming, so a bad request changes nothing.
        let share = self.table.check(req.lease, &req.instance, req.rank, now)?;
        handle.layout.check_blocks(&req.dest_blocks)?;
        // Routed before consuming too: a plan no NIC can carry changes nothing.
        let (plan, route) = prepare(share, &handle, &req, self.routing.as_deref())?;
        let share = self
            .table
            .consume(req.lease, &req.instance, req.rank, now)?
            .share;
        let mut stages = vec![Stage {
            name: StageName::Plan,
            seconds: t0.elapsed().as_secs_f64(),
        }];
        if !share.remote.is_empty() {
            stages.push(Stage {
                name: StageName::Pin,
                seconds: share.pin_seconds,
            });
        }
        let (tx, rx) = oneshot::channel();
        let reserve = reservation(&plan, &share, &handle);
        let mut job = LoadJob {
            plan,
            share,
            handle,
            slots: Ok(Default::default()),
            route,
            observer,
            stages,
            started: t0,
            in_flight: InFlight::new(Arc::clone(&self.counters)),
        };
        if reserve.is_empty() {
            Transfer::load(job, tx).start();
            return Ok(rx);
        }
        // One round trip to the store for every slot the load's parts use; the transfer
        // owns them from its start (a refusal fails it, after its local copies drained).
        let asked = self.store.send(reserve);
        ctx.spawn(wrap_future(asked).map(move |r, _: &mut Self, _| {
            job.slots = match r {
                Ok(r) => r.map_err(NodeError::from),
                Err(e) => Err(NodeError::from(e)),
            };
            Transfer::load(job, tx).start();
        }));
        Ok(rx)
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
