//! The requests every test makes: a node over a host-emulated device ([`node`], [`start`]),
//! instances over canaried device KV ([`register`], [`register_ranks`], [`put`]), queries and
//! loads ([`query`], [`load`], [`load_and_verify`], [`expected`]) and gauge checks
//! ([`settled`], [`settled_with_peers`]).

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use crate::{put_pattern, RegisterKv};
use kvferry_actors::config::ByteSize;
use kvferry_actors::peer::{LocalCluster, Peers};
use kvferry_actors::{
    BlockHash, Clock, InstanceId, LeaseId, LoadRequest, Node, NodeConfig, NodeError, QueryRequest,
    QueryResponse, Stats, TransferReport,
};
use kvferry_gpu::{Device, HostDevice, KvShape};
use kvferry_testkit::{DeviceKv, KvKind};

pub fn config(slot: u64, slots: u64) -> NodeConfig {
    let mut cfg = NodeConfig {
        node_id: "test".into(),
        ..Default::default()
    };
    cfg.pool.slot_bytes = ByteSize(slot);
    cfg.pool.size = ByteSize(slot * slots);
    cfg
}

/// The runtime every test drives its async calls on (two workers: the node's actors run
/// on their own thread, so this only drives clients and servers).
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A node over one host-emulated device.
pub fn node(slot: u64, slots: u64, clock: Clock) -> (Node, Arc<dyn Device>) {
    start(config(slot, slots), clock, None::<Arc<LocalCluster>>)
}

/// A node from `cfg` over one host-emulated device, a member of `peers` where given.
pub fn start<P: Peers + 'static>(
    cfg: NodeConfig,
    clock: Clock,
    peers: Option<Arc<P>>,
) -> (Node, Arc<dyn Device>) {
    let dev: Arc<dyn Device> = HostDevice::new(0);
    let node = Node::start_in(cfg, vec![Arc::clone(&dev)], clock, peers).unwrap();
    (node, dev)
}

pub fn hashes(range: std::ops::Range<u64>) -> Vec<BlockHash> {
    range.map(BlockHash::from_u64).collect()
}

/// Registers `rank` of `instance` over freshly allocated device KV.
// Every argument is one knob a test turns; a builder would only hide them.
#[allow(clippy::too_many_arguments)]
pub async fn register(
    node: &Node,
    dev: &Arc<dyn Device>,
    instance: &str,
    shape: KvShape,
    rank: u32,
    kind: KvKind,
    num_blocks: u32,
    view_offset: u64,
) -> DeviceKv {
    let kv = DeviceKv::alloc(
        Arc::clone(dev),
        shape,
        kind,
        num_blocks,
        shape.segment_bytes(),
        view_offset,
    )
    .unwrap();
    kv.register(node, instance, "m", rank).await.unwrap();
    kv
}

/// Registers every rank of `instance` (the TP size of `shape`) over freshly allocated device
/// KV ([`register`]), then puts pattern blocks `ids` for each; the KV by rank.
// As `register`: every argument is one knob a test turns.
#[allow(clippy::too_many_arguments)]
pub async fn register_ranks(
    node: &Node,
    dev: &Arc<dyn Device>,
    instance: &str,
    shape: KvShape,
    kind: KvKind,
    num_blocks: u32,
    view_offset: u64,
    ids: Range<u64>,
) -> Vec<DeviceKv> {
    let mut kvs = Vec::new();
    for rank in 0..shape.tp_size() {
        kvs.push(
            register(
                node,
                dev,
                instance,
                shape,
                rank,
                kind,
                num_blocks,
                view_offset,
            )
            .await,
        );
    }
    for rank in 0..shape.tp_size() {
        put(node, instance, &shape, rank, ids.clone()).await;
    }
    kvs
}

/// Puts pattern blocks `ids` (pattern block = hash value) for one rank.
pub async fn put(
    node: &Node,
    instance: &str,
    shape: &KvShape,
    rank: u32,
    ids: std::ops::Range<u64>,
) {
    put_pattern(node, &id(instance), shape, rank, ids)
        .await
        .unwrap();
}

pub fn id(s: &str) -> InstanceId {
    InstanceId::new(s).unwrap()
}

/// The query of blocks `ids` (hash = pattern block = id) for `instance`.
pub fn query_request(instance: &str, ids: Range<u64>, direct_gpu: bool) -> QueryRequest {
    QueryRequest {
        instance: id(instance),
        hashes: hashes(ids),
        direct_gpu,
        tenant: None,
    }
}

/// Queries blocks `ids` for `instance` ([`query_request`]); the answer (a lease where
/// anything hit, held until loaded or released).
pub async fn query(
    node: &Node,
    instance: &str,
    ids: Range<u64>,
    direct_gpu: bool,
) -> QueryResponse {
    node.query(query_request(instance, ids, direct_gpu))
        .await
        .unwrap()
}

/// The load of `lease` for `rank` of `instance` into device blocks `dest`.
pub fn load_request(lease: LeaseId, instance: &str, rank: u32, dest: &[u32]) -> LoadRequest {
    LoadRequest {
        lease,
        instance: id(instance),
        rank,
        dest_blocks: dest.to_vec(),
        per_layer: false,
    }
}

/// Loads `lease` for `rank` of `instance` into device blocks `dest` ([`load_request`]).
pub async fn load(
    node: &Node,
    lease: LeaseId,
    instance: &str,
    rank: u32,
    dest: &[u32],
) -> Result<TransferReport, NodeError> {
    node.load(load_request(lease, instance, rank, dest)).await
}

/// Runs `req` on `node` and checks every byte of `kv` (the KV of `req`'s instance and rank):
/// pattern blocks `first..` in `req`'s destinations, canaries everywhere else (so `kv` must
/// hold nothing else: fresh or reset). Panics naming `what` where the load or a byte is
/// wrong; the load's report.
pub async fn load_and_verify(
    node: &Node,
    kv: &DeviceKv,
    req: LoadRequest,
    first: u64,
    what: &str,
) -> TransferReport {
    let want = expected(&req.dest_blocks, first);
    let rank = req.rank;
    let r = node
        .load(req)
        .await
        .unwrap_or_else(|e| panic!("{what}: the load failed: {e}"));
    kv.verify(&want, rank)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    r
}

/// What a load of pattern blocks `first..` into `dest` leaves, as [`DeviceKv::verify`] takes
/// it: block `first + i` in device block `dest[i]`.
pub fn expected(dest: &[u32], first: u64) -> Vec<(u32, u64)> {
    dest.iter().zip(first..).map(|(&d, b)| (d, b)).collect()
}

/// Waits (briefly) until the leak gauges are back to zero, then returns the stats.
pub async fn settled(node: &Node) -> Stats {
    for _ in 0..200 {
        let s = node.stats().await.unwrap();
        if s.leases_live == 0 && s.pinned_blocks == 0 && s.pins == 0 && s.transfers_in_flight == 0 {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let s = node.stats().await.unwrap();
    panic!("gauges did not return to zero: {s:?}");
}

/// Waits (up to 5 s: requesters unpin with fire-and-forget calls as their loads end) until
/// the leak gauges of `node` and the pins its peers hold on it are back to zero; its stats.
pub async fn settled_with_peers(node: &Node) -> Stats {
    for _ in 0..1000 {
        let s = node.stats().await.unwrap();
        let idle =
            s.leases_live == 0 && s.pinned_blocks == 0 && s.pins == 0 && s.transfers_in_flight == 0;
        if idle && node.peer_pins().await.unwrap() == 0 {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let s = node.stats().await.unwrap();
    let peer_pins = node.peer_pins().await.unwrap();
    panic!("gauges did not return to zero: {s:?}, {peer_pins} peer pins");
}
