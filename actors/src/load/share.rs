//! A rank's share of a lease, as a load takes it: the pinned local prefix (RAM and SSD
//! blocks) and the remote suffix per owner ([`LeasePlan`]), and what a load makes of it
//! before anything is consumed ([`prepare`]: the plan of copies and reads, and for a direct
//! load the NIC of every remote read).

use std::sync::Arc;

use crate::api::LoadRequest;
use crate::error::NodeError;
use crate::load::plan::{LoadPlan, PlanInput, MIN_LAYER_GROUP_BYTES};
use crate::load::rank::RankHandle;
use crate::model::Namespace;
use crate::nic::stripe::{NicRouting, StripePlan};
use crate::peer::{PeerLink, RemoteBlock, RemotePin};
use crate::tier::cache::SlotRef;
use crate::tier::store::{PinGuard, SsdBlock};
use kvferry_transport::verbs::AffinityError;

/// One owner's part of a remote suffix: its pinned blocks, in block order.
#[derive(Debug)]
pub struct RemoteSeg {
    pub link: Arc<dyn PeerLink>,
    pub blocks: Vec<RemoteBlock>,
    /// Released (the owner unpins) when the lease and every share are gone.
    pub pin: Option<RemotePin>,
}

/// What a lease holds: the pinned local prefix (RAM blocks pinned, SSD blocks held on disk)
/// and the ordered remote plan. Each rank's share is a clone; the pins and holds go when
/// the lease and every share are gone.
#[derive(Clone, Debug)]
pub struct LeasePlan {
    pub namespace: Namespace,
    /// The local prefix's RAM blocks.
    pub local: Arc<Vec<SlotRef>>,
    /// The local prefix's SSD blocks (with their positions in it).
    pub ssd: Arc<Vec<SsdBlock>>,
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
        self.local.len() + self.ssd.len() + self.remote_blocks()
    }
}

/// Plans `req`'s load of `share` into `handle`'s KV and, for a direct load with a remote
/// suffix, routes its reads; fails (changing nothing) where the request does not fit the
/// share or no NIC can carry the plan.
pub fn prepare(
    share: &LeasePlan,
    handle: &RankHandle,
    req: &LoadRequest,
    routing: Option<&NicRouting>,
) -> Result<(LoadPlan, Option<StripePlan>), NodeError> {
    let local: Vec<u64> = share.local.iter().map(|b| b.addr).collect();
    let ssd_at: Vec<usize> = share.ssd.iter().map(|b| b.at).collect();
    let remote: Vec<Vec<u64>> = share
        .remote
        .iter()
        .map(|s| s.blocks.iter().map(|b| b.addr).collect())
        .collect();
    let plan = LoadPlan::build(PlanInput {
        shape: &handle.shape,
        layout: &handle.layout,
        rank: req.rank,
        local: &local,
        ssd_at: &ssd_at,
        remote: &remote,
        direct: share.direct,
        dest: &req.dest_blocks,
        min_group_bytes: MIN_LAYER_GROUP_BYTES,
        per_layer: req.per_layer,
    })
    .map_err(|e| NodeError::bad(e.to_string()))?;
    let route = match (routing, share.direct) {
        (Some(r), true) if !share.remote.is_empty() => Some(
            route_reads(r, share, handle.shape.rank_bytes(), handle.device.ordinal())
                .map_err(|source| NodeError::Unroutable { source })?,
        ),
        _ => None,
    };
    Ok((plan, route))
}

/// The NIC of every remote read of a direct load (one read per block's rank part, in plan
/// order), from the NICs nearest the destination GPU; a plan that cannot be routed fails the
/// load (direct is direct: no fallback to staging).
pub fn route_reads(
    routing: &NicRouting,
    share: &LeasePlan,
    rank_bytes: u64,
    ordinal: u32,
) -> Result<StripePlan, AffinityError> {
    let lens = vec![rank_bytes; share.remote_blocks()];
    routing.route(&lens, ordinal)
}
