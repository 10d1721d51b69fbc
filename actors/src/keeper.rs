//! The LeaseKeeper actor: answers queries with leases, hands each rank its share at load
//! time and starts the Transfer that owns it, and sweeps expired leases.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::fut::{wrap_future, ActorFutureExt};
use actix::{
    Actor, ActorContext, Addr, AsyncContext, Context, Handler, Message, ResponseActFuture,
};
use kvferry_gpu::{CopyDirection, CopyList, CopyOp};
use tokio::sync::oneshot;

use crate::api::{DirectGrant, LoadRequest, QueryRequest, QueryResponse, Stage, TransferReport};
use crate::cache::SlotRef;
use crate::clock::Clock;
use crate::error::NodeError;
use crate::lease::LeaseTable;
use crate::metrics::{Counters, InFlight};
use crate::model::BlockHash;
use crate::model::{InstanceId, LeaseId, Namespace};
use crate::nic::stripe::{NicRouting, ReadRoute, StripePlan};
use crate::registry::RankHandle;
use crate::registry::{GetInstance, GetRank, InstanceRegistry};
use crate::remote::directory::segments;
use crate::remote::link::{BoxFut, Drained, Keep, ReadStats};
use crate::remote::{PeerLink, Peers, RemoteBlock, RemotePin};
use crate::store::{BlockStore, PinGuard, PinPrefix, ReserveFetch};
use crate::transfer::{Transfer, TransferSpec};

/// Why a direct-GPU request is refused on a node without peers.
pub const DIRECT_REFUSAL: &str = "remote suffix not supported: this node has no peers";

/// One owner's part of a remote suffix: its pinned blocks, in block order.
#[derive(Debug)]
pub struct RemoteSeg {
    pub link: Arc<dyn PeerLink>,
    pub blocks: Vec<RemoteBlock>,
    /// Released (the owner unpins) when the lease and every share are gone.
    pub pin: Option<RemotePin>,
}

/// What a lease holds: the pinned local prefix and the ordered remote plan. Each rank's
/// share is a clone; the pins go when the lease and every share are gone.
#[derive(Clone, Debug)]
pub struct LeasePlan {
    pub namespace: Namespace,
    pub local: Arc<Vec<SlotRef>>,
    pub pins: Option<Arc<PinGuard>>,
    pub remote: Arc<Vec<RemoteSeg>>,
    /// The query asked for direct loads and was granted them.
    pub direct: bool,
    /// Seconds the query spent pinning on owners.
    pub pin_seconds: f64,
}

impl LeasePlan {
    pub fn remote_blocks(&self) -> usize {
        self.remote.iter().map(|s| s.blocks.len()).sum()
    }

    pub fn blocks(&self) -> usize {
        self.local.len() + self.remote_blocks()
    }
}

pub struct LeaseKeeper {
    table: LeaseTable<LeasePlan>,
    clock: Clock,
    sweep_every: Duration,
    store: Addr<BlockStore>,
    registry: Addr<InstanceRegistry>,
    counters: Arc<Counters>,
    node_id: String,
    cluster: Option<Arc<dyn Peers>>,
    /// Why `direct_gpu` is refused although the config asks for verbs (the capability gate).
    direct_refusal: Option<String>,
    /// Which verbs NIC carries each read of a direct remote load.
    routing: Option<Arc<NicRouting>>,
}

impl LeaseKeeper {
    #[allow(clippy::too_many_arguments)] // one per collaborator; built once by the node
    pub fn new(
        ttl: Duration,
        sweep_every: Duration,
        clock: Clock,
        store: Addr<BlockStore>,
        registry: Addr<InstanceRegistry>,
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
        }
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
pub struct Query(pub QueryRequest);

impl Handler<Query> for LeaseKeeper {
    type Result = ResponseActFuture<Self, Result<QueryResponse, NodeError>>;

    fn handle(&mut self, Query(q): Query, _: &mut Context<Self>) -> Self::Result {
        let (registry, store) = (self.registry.clone(), self.store.clone());
        let (cluster, node_id) = (self.cluster.clone(), self.node_id.clone());
        let instance = q.instance.clone();
        let hashes = q.hashes;
        let lookup = async move {
            let (namespace, shape) = registry.send(GetInstance(instance)).await??;
            let pinned = store
                .send(PinPrefix {
                    namespace: namespace.clone(),
                    hashes: hashes.clone(),
                })
                .await?;
            let t = Instant::now();
            let remote = match &cluster {
                Some(c) => {
                    plan_remote(
                        c.as_ref(),
                        &node_id,
                        &namespace,
                        &hashes[pinned.blocks.len()..],
                    )
                    .await
                }
                None => Vec::new(),
            };
            Ok::<_, NodeError>((namespace, shape, pinned, remote, t.elapsed().as_secs_f64()))
        };
        Box::pin(wrap_future(lookup).map(move |r, act: &mut Self, _| {
            let (namespace, shape, pinned, remote, pin_seconds) = r?;
            let local_blocks = pinned.blocks.len();
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
            let lease = (local_blocks + remote_blocks > 0).then(|| {
                let plan = LeasePlan {
                    namespace: namespace.clone(),
                    local: pinned.blocks,
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
            if req.dest_blocks.len() != plan.blocks() {
                return Err(NodeError::bad(format!(
                    "lease {} holds {} blocks, {} destination blocks given",
                    req.lease,
                    plan.blocks(),
                    req.dest_blocks.len()
                )));
            }
            handle.layout.check_blocks(&req.dest_blocks)?;
            // Routed before consuming too: a plan no NIC can carry changes nothing.
            let route = match (&act.routing, plan.direct) {
                (Some(r), true) if !plan.remote.is_empty() => Some(
                    route_reads(r, plan, handle.shape.rank_bytes(), handle.device.ordinal())
                        .map_err(|reason| NodeError::Remote {
                            peer: "verbs".into(),
                            reason,
                        })?,
                ),
                _ => None,
            };
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
            let remote_dest = req.dest_blocks[share.local.len()..].to_vec();
            let then = (!share.remote.is_empty()).then(|| {
                remote_load(
                    share.clone(),
                    Arc::clone(&handle),
                    remote_dest,
                    act.store.clone(),
                    route,
                )
            });
            let path = match (share.remote.is_empty(), share.direct) {
                (true, _) => "local",
                (false, true) => "direct",
                (false, false) => "staged",
            };
            let mut stages = vec![Stage {
                name: "plan",
                seconds: plan_s,
            }];
            if !share.remote.is_empty() {
                stages.push(Stage {
                    name: "pin",
                    seconds: share.pin_seconds,
                });
            }
            let blocks = share.blocks();
            let spec = TransferSpec {
                path,
                dir: CopyDirection::HostToDevice,
                device: Arc::clone(&handle.device),
                list,
                blocks,
                holds: vec![Box::new(share), Box::new(handle)],
                on_success: None,
                stages,
                started: t0,
                in_flight: InFlight::new(Arc::clone(&act.counters)),
                then,
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

/// The NIC of every remote read of a direct load (one read per block's rank part, in plan
/// order), from the NICs nearest the destination GPU; a plan that cannot be routed fails the
/// load (direct is direct: no fallback to staging).
pub fn route_reads(
    routing: &NicRouting,
    share: &LeasePlan,
    rank_bytes: u64,
    ordinal: u32,
) -> Result<StripePlan, String> {
    let lens = vec![rank_bytes; share.remote_blocks()];
    routing
        .route(&lens, ordinal)
        .map_err(|e| format!("no verbs nic for this direct load: {e}"))
}

/// Blocks per pipeline step of a staged load: reads of later chunks overlap the device copy
/// of earlier ones.
const STAGED_CHUNK: usize = 8;

/// The remote suffix of one rank's load, run after the local prefix has landed: segment by
/// segment in block order, each block's rank part read as one remote range scattered into
/// its layer segments, either straight into device KV (direct) or through pool slots
/// (staged). Direct errors are load failures: nothing falls back to staging.
fn remote_load(
    share: LeasePlan,
    handle: Arc<RankHandle>,
    dest: Vec<u32>,
    store: Addr<BlockStore>,
    route: Option<StripePlan>,
) -> BoxFut<Result<(u64, Vec<Stage>), NodeError>> {
    Box::pin(async move {
        let shape = handle.shape;
        let rank = handle.rank;
        let layout = &handle.layout;
        let mut stages = Vec::new();
        let bytes = share.remote_blocks() as u64 * shape.rank_bytes();
        let mut dests = dest.into_iter();
        if share.direct {
            let planes: Vec<(u64, u64)> = layout
                .planes()?
                .iter()
                .map(|p| (p.start, p.extent))
                .collect();
            let mut total = ReadStats::default();
            let mut next_read = 0;
            for seg in share.remote.iter() {
                // This segment's reads, each with the NIC the plan assigned it.
                let seg_route = route.as_ref().map(|r| ReadRoute {
                    nics: r.nics.clone(),
                    reads: seg
                        .blocks
                        .iter()
                        .zip(r.per_read.iter().skip(next_read))
                        .map(|(b, nic)| {
                            (b.addr + shape.rank_offset(rank), shape.rank_bytes(), *nic)
                        })
                        .collect(),
                });
                next_read += seg.blocks.len();
                let mut list = CopyList::with_capacity(seg.blocks.len() * per_block(&shape));
                for (b, dst) in seg.blocks.iter().zip(dests.by_ref()) {
                    push_block(
                        &mut list,
                        &shape,
                        layout,
                        b.addr + shape.rank_offset(rank),
                        dst,
                    );
                }
                let keep: Keep = Box::new(Arc::clone(&handle));
                let r = seg
                    .link
                    .read_device_routed(
                        Arc::clone(&handle.device),
                        list,
                        planes.clone(),
                        keep,
                        seg_route,
                    )
                    .await?;
                total.register += r.register;
                total.post += r.post;
                total.wire += r.wire;
            }
            for (name, seconds) in [
                ("register", total.register),
                ("post", total.post),
                ("wire", total.wire),
            ] {
                stages.push(Stage { name, seconds });
            }
            let t = Instant::now();
            handle.device.flush_direct_writes()?;
            stages.push(Stage {
                name: "fence",
                seconds: t.elapsed().as_secs_f64(),
            });
            return Ok((bytes, stages));
        }
        // Staged: reserve slots, read each chunk into them, copy each chunk to the device as
        // soon as it has landed; later reads run while earlier chunks copy.
        let (mut wire, mut h2d, mut post) = (0.0f64, 0.0f64, 0.0f64);
        let mut copies = Vec::new();
        for seg in share.remote.iter() {
            let hashes: Vec<BlockHash> = seg.blocks.iter().map(|b| b.hash).collect();
            let (slots, guard) = store
                .send(ReserveFetch {
                    namespace: share.namespace.clone(),
                    tp: shape.tp_size(),
                    rank,
                    block_bytes: shape.block_bytes(),
                    hashes,
                })
                .await??;
            let seg_dests: Vec<u32> = dests.by_ref().take(seg.blocks.len()).collect();
            let memory = Arc::clone(guard.memory());
            let mut reads = Vec::new();
            for (i, chunk) in seg.blocks.chunks(STAGED_CHUNK).enumerate() {
                let ops: Vec<CopyOp> = chunk
                    .iter()
                    .zip(&slots[i * STAGED_CHUNK..])
                    .filter(|(_, s)| s.must_write)
                    .map(|(b, s)| CopyOp {
                        src: b.addr + shape.rank_offset(rank),
                        dst: s.addr + shape.rank_offset(rank),
                        len: shape.rank_bytes(),
                    })
                    .collect();
                let keep: Keep = Box::new(Arc::clone(&memory));
                reads.push(tokio::spawn(seg.link.read_host(ops, keep)));
            }
            for (i, read) in reads.into_iter().enumerate() {
                // Time spent waiting here is the part of the wire the pipeline did not hide.
                let tr = Instant::now();
                let r = read.await.map_err(|_| NodeError::Stopped {
                    what: "remote read",
                })??;
                wire += tr.elapsed().as_secs_f64();
                post += r.post;
                let lo = i * STAGED_CHUNK;
                let hi = (lo + STAGED_CHUNK).min(slots.len());
                let mut list = CopyList::with_capacity((hi - lo) * per_block(&shape));
                for (s, &dst) in slots[lo..hi].iter().zip(&seg_dests[lo..hi]) {
                    push_block(
                        &mut list,
                        &shape,
                        layout,
                        s.addr + shape.rank_offset(rank),
                        dst,
                    );
                }
                // SAFETY: sources are pool slots pinned by `guard` (kept until every copy of
                // this segment resolved, below) in memory kept mapped by `memory`;
                // destinations are device KV held by `handle`.
                let ev = unsafe { handle.device.submit(CopyDirection::HostToDevice, list) }?;
                copies.push(Drained::new(ev, vec![Box::new(Arc::clone(&memory))]));
            }
            let th = Instant::now();
            for c in copies.drain(..) {
                c.await?;
            }
            h2d += th.elapsed().as_secs_f64();
            guard.finish();
        }
        for (name, seconds) in [("post", post), ("wire", wire), ("h2d", h2d)] {
            stages.push(Stage { name, seconds });
        }
        Ok((bytes, stages))
    })
}

fn per_block(shape: &kvferry_gpu::KvShape) -> usize {
    (shape.layers() * shape.segments()) as usize
}

/// Scatters one rank part (host layout, starting at `src`) into device block `dst`.
fn push_block(
    list: &mut CopyList,
    shape: &kvferry_gpu::KvShape,
    layout: &kvferry_gpu::KvLayout,
    src: u64,
    dst: u32,
) {
    for layer in 0..shape.layers() {
        for seg in 0..shape.segments() {
            let off = u64::from(layer * shape.segments() + seg) * shape.segment_bytes();
            list.push(
                src + off,
                layout.segment_addr(layer, seg, dst),
                shape.segment_bytes(),
            );
        }
    }
}
