//! The BlockStore actor: drives the block cache, pins prefixes for leases, and runs puts and
//! saves into the host pool.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{Actor, Addr, AsyncContext, Context, Handler, Message, ResponseFuture};
use kvferry_gpu::{CopyDirection, CopyList};
use tokio::sync::oneshot;

use crate::api::{Stage, StoreReport};
use crate::cache::{BlockCache, BlockClass, CacheStats, Reservation, SlotRef};
use crate::clock::Clock;
use crate::error::NodeError;
use crate::metrics::{Counters, InFlight};
use crate::model::{BlockHash, Namespace};
use crate::pool::{HostPool, PoolMemory};
use crate::registry::RankHandle;
use crate::remote::directory::Directory;
use crate::remote::link::{PinnedRemote, RemoteBlock};
use crate::remote::pins::PeerPins;
use crate::transfer::{Transfer, TransferSpec};

pub struct BlockStore {
    cache: BlockCache,
    counters: Arc<Counters>,
    node_id: String,
    directory: Option<Arc<dyn Directory>>,
    peer_pins: PeerPins,
    clock: Clock,
}

impl BlockStore {
    pub fn new(
        pool: HostPool,
        counters: Arc<Counters>,
        node_id: String,
        directory: Option<Arc<dyn Directory>>,
        clock: Clock,
        peer_pin_ttl: Duration,
    ) -> Self {
        Self {
            cache: BlockCache::new(pool),
            counters,
            node_id,
            directory,
            peer_pins: PeerPins::new(peer_pin_ttl),
            clock,
        }
    }

    /// Advertises newly sealed blocks and withdraws evicted ones. The directory only queues
    /// them (it writes in batches off this thread), so this never waits on the network.
    fn advertise(&mut self, ns: &Namespace, sealed: &[BlockHash]) {
        if let Some(dir) = &self.directory {
            if !sealed.is_empty() {
                dir.publish(&self.node_id, ns, sealed);
            }
        }
        self.advertise_evictions();
    }

    fn sweep_peer_pins(&mut self) -> usize {
        let gone = self.peer_pins.expire(self.clock.now());
        for (ns, hashes) in &gone {
            self.cache.unpin(ns, hashes);
        }
        gone.len()
    }
}

impl Actor for BlockStore {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(Duration::from_secs(1), |act, _| {
            act.sweep_peer_pins();
        });
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        if let Some(dir) = &self.directory {
            dir.withdraw_node(&self.node_id);
        }
    }
}

/// Pins on a prefix, released when the last holder (a lease, or a transfer using its share)
/// drops it. Also keeps the pool memory mapped.
pub struct PinGuard {
    store: Addr<BlockStore>,
    namespace: Namespace,
    hashes: Vec<BlockHash>,
    _memory: Arc<PoolMemory>,
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        let hashes = std::mem::take(&mut self.hashes);
        if !hashes.is_empty() {
            self.store.do_send(Unpin {
                namespace: self.namespace.clone(),
                hashes,
            });
        }
    }
}

impl std::fmt::Debug for PinGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinGuard")
            .field("blocks", &self.hashes.len())
            .finish()
    }
}

/// A pinned prefix.
#[derive(Debug, Clone)]
pub struct PinnedPrefix {
    pub blocks: Arc<Vec<SlotRef>>,
    pub guard: Option<Arc<PinGuard>>,
}

#[derive(Message)]
#[rtype(result = "PinnedPrefix")]
pub struct PinPrefix {
    pub namespace: Namespace,
    pub hashes: Vec<BlockHash>,
}

impl Handler<PinPrefix> for BlockStore {
    type Result = actix::MessageResult<PinPrefix>;

    fn handle(&mut self, m: PinPrefix, ctx: &mut Context<Self>) -> Self::Result {
        let blocks = self.cache.pin_prefix(&m.namespace, &m.hashes);
        let guard = (!blocks.is_empty()).then(|| {
            Arc::new(PinGuard {
                store: ctx.address(),
                namespace: m.namespace,
                hashes: blocks.iter().map(|b| b.hash).collect(),
                _memory: Arc::clone(self.cache.pool().memory()),
            })
        });
        actix::MessageResult(PinnedPrefix {
            blocks: Arc::new(blocks),
            guard,
        })
    }
}

/// Control: drop one pin on each block.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Unpin {
    pub namespace: Namespace,
    pub hashes: Vec<BlockHash>,
}

impl Handler<Unpin> for BlockStore {
    type Result = ();

    fn handle(&mut self, m: Unpin, _: &mut Context<Self>) {
        self.cache.unpin(&m.namespace, &m.hashes);
    }
}

/// Writes one rank's bytes of whole blocks from host memory.
#[derive(Message)]
#[rtype(result = "Result<StoreReport, NodeError>")]
pub struct Put {
    pub handle: Arc<RankHandle>,
    pub blocks: Vec<(BlockHash, Vec<u8>)>,
}

impl Handler<Put> for BlockStore {
    type Result = Result<StoreReport, NodeError>;

    fn handle(&mut self, m: Put, _: &mut Context<Self>) -> Self::Result {
        let t0 = Instant::now();
        let h = &m.handle;
        let rank_bytes = h.shape.rank_bytes();
        // Validate the whole request before changing anything.
        for (i, (_, data)) in m.blocks.iter().enumerate() {
            if data.len() as u64 != rank_bytes {
                return Err(NodeError::bad(format!(
                    "block #{i} has {} bytes, one rank's part is {rank_bytes}",
                    data.len()
                )));
            }
        }
        let mut report = StoreReport::default();
        let offset = h.shape.rank_offset(h.rank);
        let mut sealed = Vec::new();
        for (hash, data) in &m.blocks {
            match self.cache.reserve(
                &h.namespace,
                *hash,
                h.shape.tp_size(),
                h.rank,
                h.shape.block_bytes(),
                BlockClass::Retained,
            ) {
                Err(e) => {
                    self.advertise(&h.namespace, &sealed);
                    return Err(e.into());
                }
                Ok(Reservation::Present) => report.present += 1,
                Ok(Reservation::Write(slot)) => {
                    self.cache.pool().write(slot.slot, offset, data);
                    if self.cache.commit(&h.namespace, *hash, h.rank) {
                        sealed.push(*hash);
                    }
                    report.written += 1;
                    report.bytes += rank_bytes;
                }
            }
        }
        report.sealed = sealed.len();
        self.advertise(&h.namespace, &sealed);
        report.seconds = t0.elapsed().as_secs_f64();
        Ok(report)
    }
}

/// A writer pin on one rank part; aborts the reservation if dropped before commit.
pub(crate) struct WriteGuard {
    store: Addr<BlockStore>,
    namespace: Namespace,
    hash: BlockHash,
    armed: bool,
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        if self.armed {
            self.store.do_send(Abort {
                namespace: self.namespace.clone(),
                hash: self.hash,
            });
        }
    }
}

#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Abort {
    namespace: Namespace,
    hash: BlockHash,
}

impl Handler<Abort> for BlockStore {
    type Result = ();

    fn handle(&mut self, m: Abort, _: &mut Context<Self>) {
        self.cache.abort(&m.namespace, m.hash);
        self.advertise(&m.namespace, &[]);
    }
}

/// Marks rank parts written; replies with how many blocks this sealed.
#[derive(Message)]
#[rtype(result = "usize")]
pub(crate) struct Commit {
    pub(crate) namespace: Namespace,
    pub(crate) rank: u32,
    pub(crate) hashes: Vec<BlockHash>,
}

impl Handler<Commit> for BlockStore {
    type Result = usize;

    fn handle(&mut self, m: Commit, _: &mut Context<Self>) -> usize {
        m.hashes
            .iter()
            .filter(|h| self.cache.commit(&m.namespace, **h, m.rank))
            .count()
    }
}

/// Saves one rank's device KV blocks into host blocks (device → host through the layout).
#[derive(Message)]
#[rtype(result = "Result<StoreReport, NodeError>")]
pub struct Save {
    pub handle: Arc<RankHandle>,
    pub hashes: Vec<BlockHash>,
    pub src_blocks: Vec<u32>,
}

impl Handler<Save> for BlockStore {
    type Result = ResponseFuture<Result<StoreReport, NodeError>>;

    fn handle(&mut self, m: Save, ctx: &mut Context<Self>) -> Self::Result {
        let t0 = Instant::now();
        let prepared = self.prepare_save(&m, ctx.address());
        let (guards, present, list) = match prepared {
            Ok(p) => p,
            Err(e) => return Box::pin(async move { Err(e) }),
        };
        let mut report = StoreReport {
            present,
            ..Default::default()
        };
        if guards.is_empty() {
            report.seconds = t0.elapsed().as_secs_f64();
            return Box::pin(async move { Ok(report) });
        }
        let plan = t0.elapsed().as_secs_f64();
        let (tx, rx) = oneshot::channel();
        let spec = TransferSpec {
            path: "save",
            dir: CopyDirection::DeviceToHost,
            device: Arc::clone(&m.handle.device),
            list,
            blocks: guards.len(),
            holds: vec![
                Box::new(Arc::clone(&m.handle)),
                Box::new(Arc::clone(self.cache.pool().memory())),
            ],
            on_success: None,
            stages: vec![Stage {
                name: "plan",
                seconds: plan,
            }],
            started: t0,
            in_flight: InFlight::new(Arc::clone(&self.counters)),
            then: None,
        };
        Transfer::new(spec, tx).start();
        let store = ctx.address();
        let (namespace, rank) = (m.handle.namespace.clone(), m.handle.rank);
        Box::pin(async move {
            // The guards stay here until the copies are done: the blocks cannot be evicted
            // or reused while the device writes them.
            let mut guards = guards;
            let done = rx.await.map_err(|_| NodeError::Stopped {
                what: "save transfer",
            })??;
            let hashes: Vec<BlockHash> = guards.iter().map(|g| g.hash).collect();
            report.sealed = store
                .send(Commit {
                    namespace,
                    rank,
                    hashes,
                })
                .await?;
            for g in &mut guards {
                g.armed = false;
            }
            report.written = guards.len();
            report.bytes = done.bytes;
            report.seconds = t0.elapsed().as_secs_f64();
            Ok(report)
        })
    }
}

impl BlockStore {
    /// Validates a save, reserves its blocks and builds its copy list; on any error every
    /// reservation made so far is aborted (the guards drop).
    fn prepare_save(
        &mut self,
        m: &Save,
        me: Addr<BlockStore>,
    ) -> Result<(Vec<WriteGuard>, usize, CopyList), NodeError> {
        let h = &m.handle;
        if m.hashes.len() != m.src_blocks.len() {
            return Err(NodeError::bad(format!(
                "{} hashes but {} source blocks",
                m.hashes.len(),
                m.src_blocks.len()
            )));
        }
        h.layout.check_blocks(&m.src_blocks)?;
        let shape = &h.shape;
        let mut guards = Vec::with_capacity(m.hashes.len());
        let mut present = 0;
        let mut list =
            CopyList::with_capacity(m.hashes.len() * (shape.layers() * shape.segments()) as usize);
        for (hash, src) in m.hashes.iter().zip(&m.src_blocks) {
            let r = self.cache.reserve(
                &h.namespace,
                *hash,
                shape.tp_size(),
                h.rank,
                shape.block_bytes(),
                BlockClass::Retained,
            );
            let slot = match r {
                Ok(Reservation::Present) => {
                    present += 1;
                    continue;
                }
                Ok(Reservation::Write(slot)) => slot,
                Err(e) => {
                    // Abort what we reserved synchronously so the error leaves no state.
                    for mut g in guards {
                        let g: &mut WriteGuard = &mut g;
                        g.armed = false;
                        self.cache.abort(&g.namespace, g.hash);
                    }
                    return Err(e.into());
                }
            };
            guards.push(WriteGuard {
                store: me.clone(),
                namespace: h.namespace.clone(),
                hash: *hash,
                armed: true,
            });
            for layer in 0..shape.layers() {
                for seg in 0..shape.segments() {
                    list.push(
                        h.layout.segment_addr(layer, seg, *src),
                        slot.addr + shape.segment_offset(h.rank, layer, seg),
                        shape.segment_bytes(),
                    );
                }
            }
        }
        Ok((guards, present, list))
    }
}

#[derive(Message)]
#[rtype(result = "CacheStats")]
pub struct GetCacheStats;

impl Handler<GetCacheStats> for BlockStore {
    type Result = actix::MessageResult<GetCacheStats>;

    fn handle(&mut self, _: GetCacheStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.cache.stats())
    }
}

/// Owner side: pins the present sealed prefix of `hashes` for a peer. Blocks that vanished
/// since the peer's lookup shorten the answer.
#[derive(Message)]
#[rtype(result = "PinnedRemote")]
pub struct PinForPeer {
    pub namespace: Namespace,
    pub hashes: Vec<BlockHash>,
}

impl Handler<PinForPeer> for BlockStore {
    type Result = actix::MessageResult<PinForPeer>;

    fn handle(&mut self, m: PinForPeer, _: &mut Context<Self>) -> Self::Result {
        let blocks = self.cache.pin_prefix(&m.namespace, &m.hashes);
        if blocks.is_empty() {
            return actix::MessageResult(PinnedRemote {
                pin_id: 0,
                blocks: Vec::new(),
            });
        }
        let hashes = blocks.iter().map(|b| b.hash).collect();
        let pin_id = self.peer_pins.create(m.namespace, hashes, self.clock.now());
        let blocks = blocks
            .iter()
            .map(|b| RemoteBlock {
                hash: b.hash,
                addr: b.addr,
            })
            .collect();
        actix::MessageResult(PinnedRemote { pin_id, blocks })
    }
}

/// Owner side, control: releases a peer pin (unknown ids are ignored: it expired).
#[derive(Message)]
#[rtype(result = "()")]
pub struct UnpinForPeer(pub u64);

impl Handler<UnpinForPeer> for BlockStore {
    type Result = ();

    fn handle(&mut self, m: UnpinForPeer, _: &mut Context<Self>) {
        if let Some((ns, hashes)) = self.peer_pins.remove(m.0) {
            self.cache.unpin(&ns, &hashes);
        }
    }
}

/// Expires due peer pins now; replies with how many (the store also sweeps every second).
#[derive(Message)]
#[rtype(result = "usize")]
pub struct SweepPeerPins;

impl Handler<SweepPeerPins> for BlockStore {
    type Result = usize;

    fn handle(&mut self, _: SweepPeerPins, _: &mut Context<Self>) -> usize {
        self.sweep_peer_pins()
    }
}

/// Live peer pins held by this owner.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct PeerPinCount;

impl Handler<PeerPinCount> for BlockStore {
    type Result = usize;

    fn handle(&mut self, _: PeerPinCount, _: &mut Context<Self>) -> usize {
        self.peer_pins.len()
    }
}

/// Evicts every unpinned fetched copy (benchmarks and operators: start cold).
#[derive(Message)]
#[rtype(result = "usize")]
pub struct DropReclaimable;

impl Handler<DropReclaimable> for BlockStore {
    type Result = usize;

    fn handle(&mut self, _: DropReclaimable, _: &mut Context<Self>) -> usize {
        let n = self.cache.drop_reclaimable();
        self.advertise_evictions();
        n
    }
}

impl BlockStore {
    /// Withdraws what was evicted, one call per namespace.
    fn advertise_evictions(&mut self) {
        let evicted = self.cache.take_evicted();
        let Some(dir) = &self.directory else { return };
        let mut by_ns: Vec<(Namespace, Vec<BlockHash>)> = Vec::new();
        for key in evicted {
            match by_ns.iter_mut().find(|(ns, _)| *ns == key.namespace) {
                Some((_, hashes)) => hashes.push(key.hash),
                None => by_ns.push((key.namespace, vec![key.hash])),
            }
        }
        for (ns, hashes) in by_ns {
            dir.withdraw(&self.node_id, &ns, &hashes);
        }
    }
}

/// One block reserved for a fetched copy of one rank's part.
pub(crate) struct FetchSlot {
    pub(crate) addr: u64,
    /// False when the part is already here: nothing to read, only to copy to the device.
    pub(crate) must_write: bool,
}

/// Reserves slots (class reclaimable) for a staged remote read. Replies with the slots and
/// a guard that keeps them pinned; `FinishFetch` commits the written parts and unpins all.
#[derive(Message)]
#[rtype(result = "Result<(Vec<FetchSlot>, FetchGuard), NodeError>")]
pub(crate) struct ReserveFetch {
    pub(crate) namespace: Namespace,
    pub(crate) tp: u32,
    pub(crate) rank: u32,
    pub(crate) block_bytes: u64,
    pub(crate) hashes: Vec<BlockHash>,
}

/// Pins of a staged fetch; unpins everything (committing nothing) if dropped unfinished.
pub(crate) struct FetchGuard {
    store: Addr<BlockStore>,
    namespace: Namespace,
    rank: u32,
    pinned: Vec<(BlockHash, bool)>,
    memory: Arc<PoolMemory>,
}

impl FetchGuard {
    /// Commits the written parts (they seal and are advertised once every rank has them)
    /// and unpins every block.
    pub(crate) fn finish(mut self) {
        let pinned = std::mem::take(&mut self.pinned);
        self.store.do_send(FinishFetch {
            namespace: self.namespace.clone(),
            rank: self.rank,
            pinned,
            commit: true,
        });
    }

    pub(crate) fn memory(&self) -> &Arc<PoolMemory> {
        &self.memory
    }
}

impl Drop for FetchGuard {
    fn drop(&mut self) {
        let pinned = std::mem::take(&mut self.pinned);
        if !pinned.is_empty() {
            self.store.do_send(FinishFetch {
                namespace: self.namespace.clone(),
                rank: self.rank,
                pinned,
                commit: false,
            });
        }
    }
}

impl Handler<ReserveFetch> for BlockStore {
    type Result = actix::MessageResult<ReserveFetch>;

    fn handle(&mut self, m: ReserveFetch, ctx: &mut Context<Self>) -> Self::Result {
        let mut slots = Vec::with_capacity(m.hashes.len());
        let mut guard = FetchGuard {
            store: ctx.address(),
            namespace: m.namespace.clone(),
            rank: m.rank,
            pinned: Vec::with_capacity(m.hashes.len()),
            memory: Arc::clone(self.cache.pool().memory()),
        };
        for hash in &m.hashes {
            match self
                .cache
                .reserve_fetch(&m.namespace, *hash, m.tp, m.rank, m.block_bytes)
            {
                Ok((slot, must_write)) => {
                    guard.pinned.push((*hash, must_write));
                    slots.push(FetchSlot {
                        addr: slot.addr,
                        must_write,
                    });
                }
                Err(e) => {
                    // Undo synchronously so the error leaves no state behind.
                    for (h, w) in std::mem::take(&mut guard.pinned) {
                        if w {
                            self.cache.abort(&m.namespace, h);
                        } else {
                            self.cache.unpin_one(&m.namespace, h);
                        }
                    }
                    self.advertise_evictions();
                    return actix::MessageResult(Err(e.into()));
                }
            }
        }
        self.advertise_evictions();
        actix::MessageResult(Ok((slots, guard)))
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct FinishFetch {
    namespace: Namespace,
    rank: u32,
    pinned: Vec<(BlockHash, bool)>,
    commit: bool,
}

impl Handler<FinishFetch> for BlockStore {
    type Result = ();

    fn handle(&mut self, m: FinishFetch, _: &mut Context<Self>) {
        let mut sealed = Vec::new();
        for (hash, written) in m.pinned {
            match (written, m.commit) {
                (true, true) => {
                    if self.cache.commit(&m.namespace, hash, m.rank) {
                        sealed.push(hash);
                    }
                }
                (true, false) => self.cache.abort(&m.namespace, hash),
                (false, _) => self.cache.unpin_one(&m.namespace, hash),
            }
        }
        self.advertise(&m.namespace, &sealed);
    }
}
