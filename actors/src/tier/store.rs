//! The BlockStore actor: drives the block cache, pins prefixes for leases, and runs puts and
//! saves into the host pool.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::fut::{wrap_future, ActorFutureExt};
use actix::{
    Actor, Addr, AsyncContext, Context, Handler, Message, ResponseActFuture, ResponseFuture,
};
use kvferry_gpu::{CopyDirection, CopyList};
use tokio::sync::oneshot;

use crate::api::{Stage, StageName, StoreReport, TransferPath};
use crate::clock::Clock;
use crate::error::NodeError;
use crate::fence::{monotonic_ns, Fence};
use crate::lease::registry::RankHandle;
use crate::load::transfer::{Transfer, TransferSpec};
use crate::metrics::{Counters, InFlight};
use crate::model::{BlockHash, BlockKey, Namespace};
use crate::peer::directory::Directory;
use crate::peer::link::{PinnedRemote, RemoteBlock};
use crate::peer::pins::PeerPins;
use crate::tier::cache::{BlockCache, BlockClass, CacheStats, Reservation, SlotRef};
use crate::tier::pool::{HostPool, PoolMemory};
use crate::tier::ssd::error::ReadFailure;
use crate::tier::ssd::index::Entry as SsdEntry;
use crate::tier::ssd::io::{ReadInto, ReadOutcome};
use crate::tier::ssd::tier::{PendingRead, PendingWrite, ReadRx, WriteRx, WriteSkip};
use crate::tier::ssd::{SsdError, SsdStats, SsdTier};

pub struct BlockStore {
    cache: BlockCache,
    counters: Arc<Counters>,
    node_id: String,
    directory: Option<Arc<dyn Directory>>,
    peer_pins: PeerPins,
    clock: Clock,
    /// The SSD tier behind the pool; None: RAM only.
    ssd: Option<SsdTier>,
    /// `(tp, block bytes)` of every namespace seen: what an evicted block's bytes are.
    shapes: HashMap<Namespace, (u32, u64)>,
    /// SSD blocks held on disk for leases (released with the lease's pins).
    ssd_held: usize,
    /// Pool slots lent to loads as staging for their SSD reads.
    staging: usize,
    /// Where save transfers run: not on this actor's thread, which the keeper and the load
    /// transfers share. Submitting a save of 256 blocks (14,336 copies) takes a thread about
    /// a millisecond, which a load issued beside it would otherwise wait out.
    saves: Option<actix::ArbiterHandle>,
    /// Write-through answers waiting for their blocks to be on disk, by block.
    durable: HashMap<BlockKey, Vec<oneshot::Sender<Result<(), SsdError>>>>,
    /// Write-through blocks waiting for room in the write backlog, oldest first. Each is
    /// pinned in RAM (its bytes stay in its slot) until its write is queued.
    wt_waiting: VecDeque<WaitingWrite>,
}

/// A write-through block waiting for room in the SSD write backlog.
struct WaitingWrite {
    key: BlockKey,
    tp: u32,
    len: u64,
    slot: usize,
}

/// Where a write-through block's outcome arrives: Ok once it is on disk.
type Durable = oneshot::Receiver<Result<(), SsdError>>;

/// Waits until every block of `acks` is on disk; the answer of a write-through put or save.
async fn durable(acks: Vec<Durable>) -> Result<(), NodeError> {
    let blocks = acks.len();
    let mut failed = 0;
    let mut first = None;
    for a in acks {
        let e = match a.await {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => e,
            Err(_) => SsdError::Stopped {
                path: Default::default(),
            },
        };
        failed += 1;
        first.get_or_insert(e);
    }
    match first {
        None => Ok(()),
        Some(source) => Err(NodeError::NotDurable {
            failed,
            blocks,
            source,
        }),
    }
}

/// SSD blocks being read into RAM slots for one lookup, in prefix order. Each block's slot
/// holds a writer pin for every rank until the read is done.
struct Promotion {
    namespace: Namespace,
    reads: Vec<(PendingRead, u32)>,
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
            ssd: None,
            shapes: HashMap::new(),
            ssd_held: 0,
            staging: 0,
            saves: None,
            durable: HashMap::new(),
            wt_waiting: VecDeque::new(),
        }
    }

    /// Runs save transfers on `arbiter` (see the field); without one they run here.
    pub fn with_save_arbiter(mut self, arbiter: Option<actix::ArbiterHandle>) -> Self {
        self.saves = arbiter;
        self
    }

    /// Puts an SSD tier behind the pool: evicted sealed blocks are written to it (and every
    /// sealed block if it writes through), lookups continue into it, and what it found on
    /// disk at open is advertised when the store starts.
    pub fn with_ssd(mut self, ssd: Option<SsdTier>) -> Self {
        self.ssd = ssd;
        self
    }

    /// Advertises newly sealed blocks and withdraws evicted ones. The directory only queues
    /// them (it writes in batches off this thread), so this never waits on the network.
    /// Write-through: returns where each sealed block's write outcome arrives.
    fn advertise(
        &mut self,
        ns: &Namespace,
        sealed: &[BlockHash],
        ctx: &mut Context<Self>,
    ) -> Vec<Durable> {
        if let Some(dir) = &self.directory {
            if !sealed.is_empty() {
                dir.publish(&self.node_id, ns, sealed);
            }
        }
        let acks = self.write_through(ns, sealed, ctx);
        self.advertise_evictions(ctx);
        acks
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
        // A warm restart: what the SSD tier found on disk is served again, to peers too.
        if let (Some(ssd), Some(dir)) = (&self.ssd, &self.directory) {
            for (ns, hashes) in by_namespace(ssd.keys().cloned()) {
                dir.publish(&self.node_id, &ns, &hashes);
            }
        }
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        if let Some(dir) = &self.directory {
            dir.withdraw_node(&self.node_id);
        }
    }
}

impl Drop for BlockStore {
    /// A stopping node keeps what RAM holds: every sealed block not on SSD yet is queued
    /// for writing, and the tier (dropped right after) finishes its queue before it goes.
    /// Runs however the actor ends (a stopped System drops its actors).
    fn drop(&mut self) {
        let Some(ssd) = self.ssd.as_mut() else {
            return;
        };
        let pool = self.cache.pool();
        let mut queued = 0usize;
        for (key, slot, tp) in self.cache.sealed_blocks() {
            if ssd.contains(key) {
                continue;
            }
            let len = self
                .shapes
                .get(&key.namespace)
                .map_or(pool.slot_bytes(), |s| s.1);
            // No actor runs any more: the stop waits for the disks, in bounded memory.
            ssd.wait_for_room(len);
            if ssd
                .write(key, tp, len, |dst| pool.read(slot, 0, dst))
                .is_ok()
            {
                queued += 1;
            }
        }
        if queued > 0 {
            tracing::info!(
                blocks = queued,
                "ssd: writing RAM's blocks before the node stops"
            );
        }
    }
}

/// Pins on a prefix (RAM blocks pinned, SSD blocks held on disk), released when the last
/// holder (a lease, or a transfer using its share) drops it. Also keeps the pool memory
/// mapped.
pub struct PinGuard {
    store: Addr<BlockStore>,
    namespace: Namespace,
    hashes: Vec<BlockHash>,
    ssd: Vec<(BlockKey, SsdEntry)>,
    _memory: Arc<PoolMemory>,
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        let hashes = std::mem::take(&mut self.hashes);
        let ssd = std::mem::take(&mut self.ssd);
        if !hashes.is_empty() || !ssd.is_empty() {
            self.store.do_send(Unpin {
                namespace: self.namespace.clone(),
                hashes,
                ssd,
            });
        }
    }
}

impl std::fmt::Debug for PinGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinGuard")
            .field("blocks", &self.hashes.len())
            .field("ssd_blocks", &self.ssd.len())
            .finish()
    }
}

/// A block of a lease's local prefix that is held on the SSD tier (not read yet: the load
/// reads it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SsdBlock {
    pub hash: BlockHash,
    /// Its position in the local prefix (RAM and SSD blocks may alternate: RAM evicts the
    /// oldest blocks, often a prompt's first ones).
    pub at: usize,
}

/// A pinned prefix: RAM blocks pinned, SSD blocks held on disk.
#[derive(Debug, Clone)]
pub struct PinnedPrefix {
    /// The RAM blocks, in prefix order.
    pub blocks: Arc<Vec<SlotRef>>,
    /// The SSD blocks, in prefix order.
    pub ssd: Arc<Vec<SsdBlock>>,
    pub guard: Option<Arc<PinGuard>>,
    /// `ssd.len()`: how many of the prefix's blocks are on SSD.
    pub ssd_blocks: usize,
}

impl PinnedPrefix {
    /// Blocks in the local prefix, both tiers.
    pub fn len(&self) -> usize {
        self.blocks.len() + self.ssd.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Message)]
#[rtype(result = "PinnedPrefix")]
pub struct PinPrefix {
    pub namespace: Namespace,
    pub hashes: Vec<BlockHash>,
}

/// Pins the prefix of `hashes` held here: RAM blocks are pinned, SSD blocks are held on
/// disk (not read: the load reads them, pipelined with its copies to the device). Nothing
/// waits: the answer is immediate.
impl Handler<PinPrefix> for BlockStore {
    type Result = actix::MessageResult<PinPrefix>;

    fn handle(&mut self, m: PinPrefix, ctx: &mut Context<Self>) -> Self::Result {
        let (blocks, ssd, holds) = self.pin_for_lease(&m.namespace, &m.hashes);
        if let Some(t) = &self.ssd {
            let c = t.metrics();
            c.hits_ram.fetch_add(blocks.len() as u64, Relaxed);
            c.hits_ssd.fetch_add(ssd.len() as u64, Relaxed);
        }
        self.ssd_held += holds.len();
        let guard = (!blocks.is_empty() || !holds.is_empty()).then(|| {
            Arc::new(PinGuard {
                store: ctx.address(),
                namespace: m.namespace,
                hashes: blocks.iter().map(|b| b.hash).collect(),
                ssd: holds,
                _memory: Arc::clone(self.cache.pool().memory()),
            })
        });
        actix::MessageResult(PinnedPrefix {
            blocks: Arc::new(blocks),
            ssd_blocks: ssd.len(),
            ssd: Arc::new(ssd),
            guard,
        })
    }
}

/// Control: drop one pin on each block, and the disk holds.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Unpin {
    pub namespace: Namespace,
    pub hashes: Vec<BlockHash>,
    ssd: Vec<(BlockKey, SsdEntry)>,
}

impl Handler<Unpin> for BlockStore {
    type Result = ();

    fn handle(&mut self, m: Unpin, _: &mut Context<Self>) {
        self.cache.unpin(&m.namespace, &m.hashes);
        self.ssd_held = self.ssd_held.saturating_sub(m.ssd.len());
        if let Some(t) = self.ssd.as_mut() {
            for (key, e) in &m.ssd {
                t.release(key, e);
            }
        }
    }
}

/// Writes one rank's bytes of whole blocks from host memory.
#[derive(Message)]
#[rtype(result = "Result<StoreReport, NodeError>")]
pub struct Put {
    pub handle: Arc<RankHandle>,
    pub blocks: Vec<(BlockHash, Vec<u8>)>,
    /// Past it the client has given up: nothing is written (see [`crate::fence`]).
    pub fence: Option<Fence>,
}

/// Write-through: answered once the blocks it sealed are on disk, or with
/// [`NodeError::NotDurable`] if any of them could not be written.
impl Handler<Put> for BlockStore {
    type Result = ResponseFuture<Result<StoreReport, NodeError>>;

    fn handle(&mut self, m: Put, ctx: &mut Context<Self>) -> Self::Result {
        let t0 = Instant::now();
        let put = self.put(m, ctx);
        Box::pin(async move {
            let (mut report, acks) = put?;
            if !acks.is_empty() {
                durable(acks).await?;
                report.seconds = t0.elapsed().as_secs_f64();
            }
            Ok(report)
        })
    }
}

impl BlockStore {
    /// Writes a put's blocks into RAM; returns its report and, with write-through, where
    /// the sealed blocks' disk writes answer.
    fn put(
        &mut self,
        m: Put,
        ctx: &mut Context<Self>,
    ) -> Result<(StoreReport, Vec<Durable>), NodeError> {
        let t0 = Instant::now();
        let h = &m.handle;
        if let Some(f) = m.fence {
            let now = monotonic_ns();
            if f.passed_at(now) {
                let late = f.late_by(now);
                self.counters.abandoned("put_blocks", m.blocks.len(), late);
                return Err(NodeError::DeadlinePassed {
                    what: "PutBlocks",
                    late,
                });
            }
        }
        self.learn_shape(&h.namespace, h.shape.tp_size(), h.shape.block_bytes());
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
            let r = self.cache.reserve(
                &h.namespace,
                *hash,
                h.shape.tp_size(),
                h.rank,
                h.shape.block_bytes(),
                BlockClass::Retained,
            );
            // Before the slot is written: an evicted block's bytes are still in it.
            self.advertise_evictions(ctx);
            match r {
                Err(e) => {
                    self.advertise(&h.namespace, &sealed, ctx);
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
        let acks = self.advertise(&h.namespace, &sealed, ctx);
        report.seconds = t0.elapsed().as_secs_f64();
        Ok((report, acks))
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

    fn handle(&mut self, m: Abort, ctx: &mut Context<Self>) {
        self.cache.abort(&m.namespace, m.hash);
        self.advertise(&m.namespace, &[], ctx);
    }
}

/// Marks rank parts written; replies with how many blocks this sealed. With a fence that
/// has passed, marks nothing and answers [`NodeError::DeadlinePassed`]: the caller's writer
/// guards then abort the reservations (the copied bytes are never sealed nor published).
#[derive(Message)]
#[rtype(result = "Result<(usize, Vec<Durable>), NodeError>")]
pub(crate) struct Commit {
    pub(crate) namespace: Namespace,
    pub(crate) rank: u32,
    pub(crate) hashes: Vec<BlockHash>,
    pub(crate) fence: Option<Fence>,
}

/// Also replies, with write-through, where each sealed block's disk write answers.
impl Handler<Commit> for BlockStore {
    type Result = Result<(usize, Vec<Durable>), NodeError>;

    fn handle(&mut self, m: Commit, ctx: &mut Context<Self>) -> Self::Result {
        // Checked here, on the thread that seals, after the copies out of the client's
        // memory completed: if the fence is still ahead, every read of the source blocks
        // ended before the client could have let its engine reuse them.
        if let Some(f) = m.fence {
            let now = monotonic_ns();
            if f.passed_at(now) {
                let late = f.late_by(now);
                self.counters.abandoned("save", m.hashes.len(), late);
                return Err(NodeError::DeadlinePassed { what: "Save", late });
            }
        }
        let sealed: Vec<BlockHash> = m
            .hashes
            .iter()
            .copied()
            .filter(|h| self.cache.commit(&m.namespace, *h, m.rank))
            .collect();
        let acks = self.write_through(&m.namespace, &sealed, ctx);
        Ok((sealed.len(), acks))
    }
}

/// Saves one rank's device KV blocks into host blocks (device → host through the layout).
#[derive(Message)]
#[rtype(result = "Result<StoreReport, NodeError>")]
pub struct Save {
    pub handle: Arc<RankHandle>,
    pub hashes: Vec<BlockHash>,
    pub src_blocks: Vec<u32>,
    /// The copies are sealed only if they completed before it (see [`crate::fence`]).
    pub fence: Option<Fence>,
}

impl Handler<Save> for BlockStore {
    type Result = ResponseFuture<Result<StoreReport, NodeError>>;

    fn handle(&mut self, m: Save, ctx: &mut Context<Self>) -> Self::Result {
        let t0 = Instant::now();
        if let Some(f) = m.fence {
            let now = monotonic_ns();
            if f.passed_at(now) {
                // Given up on before it started: nothing is read.
                let late = f.late_by(now);
                self.counters.abandoned("save", m.hashes.len(), late);
                return Box::pin(
                    async move { Err(NodeError::DeadlinePassed { what: "Save", late }) },
                );
            }
        }
        let fence = m.fence;
        let prepared = self.prepare_save(&m, ctx);
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
            path: TransferPath::Save,
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
                name: StageName::Plan,
                seconds: plan,
            }],
            started: t0,
            in_flight: InFlight::new(Arc::clone(&self.counters)),
            then: None,
        };
        match &self.saves {
            Some(a) => {
                Transfer::start_in_arbiter(a, move |_| Transfer::new(spec, tx));
            }
            None => {
                Transfer::new(spec, tx).start();
            }
        }
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
            // A passed fence: the guards drop armed and abort the reservations.
            let (sealed, acks) = store
                .send(Commit {
                    namespace,
                    rank,
                    hashes,
                    fence,
                })
                .await??;
            report.sealed = sealed;
            for g in &mut guards {
                g.armed = false;
            }
            // Write-through: answered once the sealed blocks are on disk.
            durable(acks).await?;
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
        ctx: &mut Context<Self>,
    ) -> Result<(Vec<WriteGuard>, usize, CopyList), NodeError> {
        let me = ctx.address();
        let h = &m.handle;
        self.learn_shape(&h.namespace, h.shape.tp_size(), h.shape.block_bytes());
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
        let scatter = kvferry_gpu::Scatter::new(shape, &h.layout, h.rank);
        for (hash, src) in m.hashes.iter().zip(&m.src_blocks) {
            let r = self.cache.reserve(
                &h.namespace,
                *hash,
                shape.tp_size(),
                h.rank,
                shape.block_bytes(),
                BlockClass::Retained,
            );
            // Before the copies start: an evicted block's bytes are still in its slot.
            self.advertise_evictions(ctx);
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
            scatter.push_block(
                &mut list,
                kvferry_gpu::CopyDirection::DeviceToHost,
                slot.addr,
                *src,
            );
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

/// SSD-held blocks are read into RAM first (the reply waits), so a peer reads pool memory.
impl Handler<PinForPeer> for BlockStore {
    type Result = ResponseActFuture<Self, PinnedRemote>;

    fn handle(&mut self, m: PinForPeer, ctx: &mut Context<Self>) -> Self::Result {
        Box::pin(self.pin_local(m.namespace.clone(), &m.hashes, ctx).map(
            move |(blocks, _), act: &mut Self, _| {
                if blocks.is_empty() {
                    return PinnedRemote {
                        pin_id: 0,
                        blocks: Vec::new(),
                    };
                }
                let hashes = blocks.iter().map(|b| b.hash).collect();
                let pin_id = act.peer_pins.create(m.namespace, hashes, act.clock.now());
                let blocks = blocks
                    .iter()
                    .map(|b| RemoteBlock {
                        hash: b.hash,
                        addr: b.addr,
                    })
                    .collect();
                PinnedRemote { pin_id, blocks }
            },
        ))
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

    fn handle(&mut self, _: DropReclaimable, ctx: &mut Context<Self>) -> usize {
        let n = self.cache.drop_reclaimable();
        self.advertise_evictions(ctx);
        n
    }
}

impl BlockStore {
    /// Handles what RAM evicted: blocks the SSD tier takes (write-behind) stay advertised,
    /// the others are withdrawn, one call per namespace.
    ///
    /// Called right after every reservation, before its slot is written: an evicted
    /// block's bytes are still in its freed slot, and are copied out here.
    fn advertise_evictions(&mut self, ctx: &mut Context<Self>) {
        let evicted = self.cache.take_evicted();
        if evicted.is_empty() {
            return;
        }
        let mut gone = Vec::new();
        let mut writes = Vec::new();
        for ev in evicted {
            let Some(ssd) = self.ssd.as_mut() else {
                gone.push(ev.key);
                continue;
            };
            if ssd.contains(&ev.key) {
                continue;
            }
            let pool = self.cache.pool();
            let len = self
                .shapes
                .get(&ev.key.namespace)
                .map_or(pool.slot_bytes(), |s| s.1);
            match ssd.write(&ev.key, ev.tp, len, |dst| pool.read(ev.slot, 0, dst)) {
                Ok((w, rx, disk_evicted)) => {
                    writes.push((w, rx));
                    gone.extend(disk_evicted);
                }
                // Out of RAM and not on disk: it leaves the node (never wrong bytes: a miss).
                Err(why) => {
                    if why == WriteSkip::Backlog {
                        ssd.skipped_for_backlog(&ev.key);
                    }
                    gone.push(ev.key)
                }
            }
        }
        for (w, rx) in writes {
            self.watch_write(w, rx, ctx);
        }
        self.withdraw(gone);
    }

    /// Withdraws blocks that left this node: those no tier holds any more.
    fn withdraw(&self, keys: Vec<BlockKey>) {
        let Some(dir) = &self.directory else { return };
        let gone = keys.into_iter().filter(|k| {
            !self.cache.contains(&k.namespace, k.hash)
                && !self.ssd.as_ref().is_some_and(|s| s.contains(k))
        });
        for (ns, hashes) in by_namespace(gone) {
            dir.withdraw(&self.node_id, &ns, &hashes);
        }
    }

    fn learn_shape(&mut self, ns: &Namespace, tp: u32, block_bytes: u64) {
        // A namespace names its shape (the fingerprint has TP and sizes): the first wins.
        self.shapes.entry(ns.clone()).or_insert((tp, block_bytes));
    }

    /// Finishes a queued SSD write when the disk is done with it.
    fn watch_write(&mut self, w: PendingWrite, rx: WriteRx, ctx: &mut Context<Self>) {
        ctx.spawn(wrap_future(rx).map(move |r, act: &mut Self, ctx| {
            let out = r.unwrap_or_else(|_| {
                Err(SsdError::Stopped {
                    path: Default::default(),
                })
            });
            let key = w.key.clone();
            if let Some(ssd) = act.ssd.as_mut() {
                let done = ssd.write_done(&w, out);
                if done.is_err() {
                    act.withdraw(vec![key.clone()]);
                }
                act.answer_durable(&key, done);
            }
            // Its copy left the backlog: room for the write-through blocks waiting.
            act.pump_write_through(ctx);
        }));
    }

    /// Where `key`'s next write outcome arrives.
    fn await_durable(&mut self, key: &BlockKey) -> Durable {
        let (tx, rx) = oneshot::channel();
        self.durable.entry(key.clone()).or_default().push(tx);
        rx
    }

    /// Answers everyone waiting for `key` to be on disk.
    fn answer_durable(&mut self, key: &BlockKey, out: Result<(), SsdError>) {
        let Some(waiting) = self.durable.remove(key) else {
            return;
        };
        for tx in waiting {
            let _ = tx.send(match &out {
                Ok(()) => Ok(()),
                Err(e) => Err(e.again()),
            });
        }
    }

    /// Queues the writes of waiting write-through blocks, oldest first, while the backlog
    /// has room. A block whose write cannot be queued for another reason is answered here.
    fn pump_write_through(&mut self, ctx: &mut Context<Self>) {
        let mut writes = Vec::new();
        let mut gone = Vec::new();
        while let (Some(w), Some(ssd)) = (self.wt_waiting.front(), self.ssd.as_mut()) {
            let pool = self.cache.pool();
            let out = ssd.write(&w.key, w.tp, w.len, |dst| pool.read(w.slot, 0, dst));
            if out.as_ref().err() == Some(&WriteSkip::Backlog) {
                // Every queued write frees room when it is done, and pumps again.
                break;
            }
            let present_on_disk = !ssd.is_writing(&w.key);
            let Some(w) = self.wt_waiting.pop_front() else {
                break;
            };
            self.cache
                .unpin(&w.key.namespace, std::slice::from_ref(&w.key.hash));
            match out {
                Ok((pw, rx, disk_evicted)) => {
                    writes.push((pw, rx));
                    gone.extend(disk_evicted);
                }
                // Its write in flight answers it.
                Err(WriteSkip::Present) if !present_on_disk => {}
                Err(WriteSkip::Present) => self.answer_durable(&w.key, Ok(())),
                Err(reason) => {
                    self.answer_durable(&w.key, Err(SsdError::NotWritten { reason }));
                }
            }
        }
        for (w, rx) in writes {
            self.watch_write(w, rx, ctx);
        }
        self.withdraw(gone);
    }

    /// Write-through: every newly sealed block goes to the SSD tier too. Returns where each
    /// one's outcome arrives: Ok once its write is done (the block file holds it, and the
    /// file header's used mark covers it: a process killed now loses nothing acknowledged).
    /// Blocks wait for room in the write backlog in RAM, pinned, in order.
    fn write_through(
        &mut self,
        ns: &Namespace,
        sealed: &[BlockHash],
        ctx: &mut Context<Self>,
    ) -> Vec<Durable> {
        if !self.ssd.as_ref().is_some_and(SsdTier::write_through) {
            return Vec::new();
        }
        let Some(&(tp, len)) = self.shapes.get(ns) else {
            return Vec::new();
        };
        let mut acks = Vec::with_capacity(sealed.len());
        for h in sealed {
            // Pinned until its copy is queued: the bytes stay in the slot meanwhile.
            let Some(s) = self.cache.pin_prefix(ns, std::slice::from_ref(h)).pop() else {
                continue;
            };
            let key = BlockKey {
                namespace: ns.clone(),
                hash: *h,
            };
            acks.push(self.await_durable(&key));
            self.wt_waiting.push_back(WaitingWrite {
                key,
                tp,
                len,
                slot: s.slot,
            });
        }
        self.pump_write_through(ctx);
        acks
    }

    /// The prefix of `hashes` held here for a lease: RAM blocks pinned, SSD blocks held on
    /// disk (their slots cannot be evicted or reused until the holds are released). The
    /// prefix ends at the first block that neither tier holds, or that RAM holds unsealed
    /// (a writer has it). One cache lookup per RAM block (the common case).
    fn pin_for_lease(
        &mut self,
        ns: &Namespace,
        hashes: &[BlockHash],
    ) -> (Vec<SlotRef>, Vec<SsdBlock>, Vec<(BlockKey, SsdEntry)>) {
        let mut ram = Vec::with_capacity(hashes.len());
        let mut ssd = Vec::new();
        let mut holds = Vec::new();
        for (at, h) in hashes.iter().enumerate() {
            if let Some(s) = self.cache.pin_sealed(ns, h) {
                ram.push(s);
                continue;
            }
            let Some(tier) = self.ssd.as_mut() else { break };
            if self.cache.contains(ns, *h) {
                break;
            }
            let key = BlockKey {
                namespace: ns.clone(),
                hash: *h,
            };
            let Some(e) = tier.hold(&key) else { break };
            ssd.push(SsdBlock { hash: *h, at });
            holds.push((key, e));
        }
        (ram, ssd, holds)
    }

    /// Pins the prefix of `hashes` held here, RAM and SSD blocks in any order: RAM blocks
    /// are pinned first (so promotions cannot evict them), then the SSD blocks get RAM
    /// slots (evicting as needed) and are read into them off this thread. Resolves to the
    /// pinned prefix and how many of it came from SSD; the prefix ends at the first block
    /// that neither tier holds, that got no RAM slot, or whose read failed.
    fn pin_local(
        &mut self,
        namespace: Namespace,
        hashes: &[BlockHash],
        ctx: &mut Context<Self>,
    ) -> ResponseActFuture<Self, (Vec<SlotRef>, usize)> {
        let mut parts: Vec<Option<SlotRef>> = Vec::new();
        let mut on_ssd = Vec::new();
        for h in hashes {
            if let Some(s) = self.cache.pin_sealed(&namespace, h) {
                parts.push(Some(s));
                continue;
            }
            let key = BlockKey {
                namespace: namespace.clone(),
                hash: *h,
            };
            // A block in RAM but unsealed has a writer: not read from disk under it.
            if self.cache.contains(&namespace, *h)
                || !self.ssd.as_ref().is_some_and(|s| s.contains(&key))
            {
                break;
            }
            parts.push(None);
            on_ssd.push(*h);
        }
        let promotion = self.start_promotion(&namespace, &on_ssd, ctx);
        let Some((p, rxs)) = promotion else {
            let blocks = self.assemble(&namespace, parts, Vec::new());
            return Box::pin(actix::fut::ready(blocks));
        };
        let wait = async move {
            let mut out = Vec::with_capacity(rxs.len());
            for rx in rxs {
                out.push(rx.await.ok());
            }
            out
        };
        Box::pin(wrap_future(wait).map(move |outcomes, act: &mut Self, _| {
            let promoted = act.finish_promotion(p, outcomes);
            act.assemble(&namespace, parts, promoted)
        }))
    }

    /// The prefix in order: RAM blocks (`Some`) and promoted ones (`None`, filled from
    /// `promoted` in order). Where a promotion is missing the prefix ends, and the RAM
    /// blocks pinned past that point are unpinned. Also says how many came from SSD.
    fn assemble(
        &mut self,
        ns: &Namespace,
        parts: Vec<Option<SlotRef>>,
        promoted: Vec<SlotRef>,
    ) -> (Vec<SlotRef>, usize) {
        let mut promoted = promoted.into_iter();
        let mut out = Vec::with_capacity(parts.len());
        let mut cut = false;
        let mut from_ssd = 0;
        let mut unpin = Vec::new();
        for part in parts {
            match (part, cut) {
                (Some(s), false) => out.push(s),
                (Some(s), true) => unpin.push(s.hash),
                (None, false) => match promoted.next() {
                    Some(s) => {
                        out.push(s);
                        from_ssd += 1;
                    }
                    None => cut = true,
                },
                (None, true) => {}
            }
        }
        // Promoted past the cut (cannot happen: promotions are a prefix of the SSD parts).
        for s in promoted {
            unpin.push(s.hash);
        }
        self.cache.unpin(ns, &unpin);
        (out, from_ssd)
    }

    /// Reserves RAM slots for the run of `hashes` held on SSD and queues their reads. The
    /// run stops at the first block not on SSD, present in RAM in any state (a writer has
    /// it), or without a RAM slot.
    fn start_promotion(
        &mut self,
        ns: &Namespace,
        hashes: &[BlockHash],
        ctx: &mut Context<Self>,
    ) -> Option<(Promotion, Vec<ReadRx>)> {
        let ssd = self.ssd.as_mut()?;
        // Held first: making room in RAM writes evicted blocks to disk, which must not
        // evict the blocks about to be read.
        let mut held = Vec::new();
        for h in hashes {
            let key = BlockKey {
                namespace: ns.clone(),
                hash: *h,
            };
            let Some(e) = ssd.hold(&key) else { break };
            held.push((key, e));
        }
        let mut p = Promotion {
            namespace: ns.clone(),
            reads: Vec::new(),
        };
        let mut rxs = Vec::new();
        let mut held = held.into_iter();
        for (key, e) in held.by_ref() {
            let h = key.hash;
            let mut slot = None;
            let mut reserved = 0;
            if !self.cache.contains(ns, h) {
                for rank in 0..e.tp {
                    let r = self
                        .cache
                        .reserve(ns, h, e.tp, rank, e.len, BlockClass::Retained);
                    // Before the read lands: an evicted block's bytes are still in its slot.
                    self.advertise_evictions(ctx);
                    match r {
                        Ok(Reservation::Write(s)) => {
                            slot = Some(s);
                            reserved += 1;
                        }
                        Ok(Reservation::Present) | Err(_) => break,
                    }
                }
            }
            let pool = self.cache.pool();
            let read = match (slot, reserved == e.tp, self.ssd.as_mut()) {
                (Some(s), true, Some(ssd)) => ssd.read_held(
                    &key,
                    e,
                    ReadInto {
                        addr: s.addr,
                        cap: pool.slot_bytes(),
                        keep: Arc::clone(pool.memory()) as Arc<dyn Send + Sync>,
                    },
                ),
                (_, _, Some(ssd)) => {
                    ssd.release(&key, &e);
                    None
                }
                _ => None,
            };
            let Some((r, rx)) = read else {
                if let Some(ssd) = &self.ssd {
                    ssd.metrics().promote_no_room.fetch_add(1, Relaxed);
                }
                for _ in 0..reserved {
                    self.cache.abort(ns, h);
                }
                break;
            };
            p.reads.push((r, e.tp));
            rxs.push(rx);
        }
        if let Some(ssd) = self.ssd.as_mut() {
            for (key, e) in held {
                ssd.release(&key, &e);
            }
        }
        (!p.reads.is_empty()).then_some((p, rxs))
    }

    /// Seals the blocks whose reads were good and pins the good prefix of them; a damaged
    /// block frees its RAM slot, leaves the SSD tier, and ends the prefix.
    fn finish_promotion(
        &mut self,
        p: Promotion,
        outcomes: Vec<Option<ReadOutcome>>,
    ) -> Vec<SlotRef> {
        let ns = &p.namespace;
        let mut out = Vec::new();
        let mut prefix = true;
        let mut gone = Vec::new();
        for ((r, tp), outcome) in p.reads.into_iter().zip(outcomes) {
            let h = r.key.hash;
            let (ok, removed) = match self.ssd.as_mut() {
                Some(ssd) => ssd.read_done(&r, outcome.as_ref()),
                None => (false, false),
            };
            if ok {
                for rank in 0..tp {
                    self.cache.commit(ns, h, rank);
                }
                if prefix {
                    out.extend(self.cache.pin_prefix(ns, std::slice::from_ref(&h)));
                }
            } else {
                for _ in 0..tp {
                    self.cache.abort(ns, h);
                }
                prefix = false;
                if removed {
                    gone.push(r.key);
                }
            }
        }
        self.withdraw(gone);
        out
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
        self.learn_shape(&m.namespace, m.tp, m.block_bytes);
        let mut slots = Vec::with_capacity(m.hashes.len());
        let mut guard = FetchGuard {
            store: ctx.address(),
            namespace: m.namespace.clone(),
            rank: m.rank,
            pinned: Vec::with_capacity(m.hashes.len()),
            memory: Arc::clone(self.cache.pool().memory()),
        };
        for hash in &m.hashes {
            let r = self
                .cache
                .reserve_fetch(&m.namespace, *hash, m.tp, m.rank, m.block_bytes);
            // Before the remote read lands: an evicted block's bytes are still in its slot.
            self.advertise_evictions(ctx);
            match r {
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
                    self.advertise_evictions(ctx);
                    return actix::MessageResult(Err(e.into()));
                }
            }
        }
        self.advertise_evictions(ctx);
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

    fn handle(&mut self, m: FinishFetch, ctx: &mut Context<Self>) {
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
        self.advertise(&m.namespace, &sealed, ctx);
    }
}

/// Groups block keys by namespace, for one directory call each.
fn by_namespace(keys: impl IntoIterator<Item = BlockKey>) -> Vec<(Namespace, Vec<BlockHash>)> {
    let mut by_ns: Vec<(Namespace, Vec<BlockHash>)> = Vec::new();
    for key in keys {
        match by_ns.iter_mut().find(|(ns, _)| *ns == key.namespace) {
            Some((_, hashes)) => hashes.push(key.hash),
            None => by_ns.push((key.namespace, vec![key.hash])),
        }
    }
    by_ns
}

/// Pool slots a load reads SSD blocks into. They go back to the pool when the last holder
/// drops this: the load, every disk read into them (the I/O thread holds it until the read
/// is done) and every copy from them to the device (held until the copy drained).
pub(crate) struct StagingGuard {
    store: Addr<BlockStore>,
    slots: Vec<usize>,
    /// The slots' memory stays mapped while anything may still read or write them.
    _memory: Arc<PoolMemory>,
}

impl Drop for StagingGuard {
    fn drop(&mut self) {
        let slots = std::mem::take(&mut self.slots);
        if !slots.is_empty() {
            self.store.do_send(FreeStaging(slots));
        }
    }
}

/// Lends up to `want` pool slots (at least one, evicting unpinned blocks as needed) for a
/// load's SSD reads: their addresses and the guard that gives them back.
#[derive(Message)]
#[rtype(result = "Result<(Vec<u64>, Arc<StagingGuard>), NodeError>")]
pub(crate) struct ReserveStaging {
    pub(crate) want: usize,
}

impl Handler<ReserveStaging> for BlockStore {
    type Result = actix::MessageResult<ReserveStaging>;

    fn handle(&mut self, m: ReserveStaging, ctx: &mut Context<Self>) -> Self::Result {
        let mut slots = Vec::with_capacity(m.want);
        let mut addrs = Vec::with_capacity(m.want);
        for _ in 0..m.want {
            let r = self.cache.alloc_staging();
            // Before the read lands: an evicted block's bytes are still in its slot.
            self.advertise_evictions(ctx);
            match r {
                Ok(s) => {
                    slots.push(s.slot);
                    addrs.push(s.addr);
                }
                // Fewer slots make a shorter pipeline, not a failed load.
                Err(_) if !slots.is_empty() => break,
                Err(e) => return actix::MessageResult(Err(e.into())),
            }
        }
        self.staging += slots.len();
        actix::MessageResult(Ok((
            addrs,
            Arc::new(StagingGuard {
                store: ctx.address(),
                slots,
                _memory: Arc::clone(self.cache.pool().memory()),
            }),
        )))
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct FreeStaging(Vec<usize>);

impl Handler<FreeStaging> for BlockStore {
    type Result = ();

    fn handle(&mut self, m: FreeStaging, _: &mut Context<Self>) {
        self.staging = self.staging.saturating_sub(m.0.len());
        for s in m.0 {
            self.cache.free_staging(s);
        }
    }
}

/// Why one SSD block of a load was not read (see [`ReadSsd`]).
#[derive(Debug)]
pub(crate) struct ReadFail {
    pub(crate) failure: ReadFailure,
    pub(crate) source: Option<SsdError>,
}

/// Reads SSD blocks of a lease into staging slots (`(block, slot address)`, in order) and
/// replies once every one of them is done, with each block's outcome. The reads run on the
/// tier's I/O threads; their bookkeeping (LRU, damage, metrics) happens here whatever the
/// caller does meanwhile, so a load that stops waiting leaks nothing.
#[derive(Message)]
#[rtype(result = "Vec<Result<(), ReadFail>>")]
pub(crate) struct ReadSsd {
    pub(crate) namespace: Namespace,
    pub(crate) reads: Vec<(BlockHash, u64)>,
    pub(crate) staging: Arc<StagingGuard>,
}

impl Handler<ReadSsd> for BlockStore {
    type Result = ResponseActFuture<Self, Vec<Result<(), ReadFail>>>;

    fn handle(&mut self, m: ReadSsd, _: &mut Context<Self>) -> Self::Result {
        let cap = self.cache.pool().slot_bytes();
        let mut out: Vec<Option<Result<(), ReadFail>>> = Vec::with_capacity(m.reads.len());
        let mut pending = Vec::new();
        let mut rxs = Vec::new();
        for (i, (hash, addr)) in m.reads.into_iter().enumerate() {
            let key = BlockKey {
                namespace: m.namespace.clone(),
                hash,
            };
            let fail = |failure| {
                Some(Err(ReadFail {
                    failure,
                    source: None,
                }))
            };
            let Some(tier) = self.ssd.as_mut() else {
                out.push(fail(ReadFailure::Vanished));
                continue;
            };
            // The read's own hold: the lease's may be released while the read runs.
            let Some(e) = tier.hold(&key) else {
                out.push(fail(ReadFailure::Vanished));
                continue;
            };
            let into = ReadInto {
                addr,
                cap,
                keep: Arc::clone(&m.staging) as Arc<dyn Send + Sync>,
            };
            match tier.read_held(&key, e, into) {
                Some((r, rx)) => {
                    out.push(None);
                    pending.push((i, r));
                    rxs.push(rx);
                }
                None => out.push(fail(ReadFailure::Io)),
            }
        }
        let wait = async move {
            let mut got = Vec::with_capacity(rxs.len());
            for rx in rxs {
                got.push(rx.await.ok());
            }
            got
        };
        Box::pin(wrap_future(wait).map(move |got, act: &mut Self, _| {
            let mut gone = Vec::new();
            for ((i, r), outcome) in pending.into_iter().zip(got) {
                let (ok, removed) = match act.ssd.as_mut() {
                    Some(t) => t.read_done(&r, outcome.as_ref()),
                    None => (false, false),
                };
                if removed {
                    gone.push(r.key.clone());
                }
                out[i] = Some(if ok {
                    Ok(())
                } else {
                    Err(match outcome {
                        Some(ReadOutcome::Damaged(d)) => ReadFail {
                            failure: ReadFailure::Damaged(d),
                            source: None,
                        },
                        Some(ReadOutcome::Failed(e)) => ReadFail {
                            failure: ReadFailure::Io,
                            source: Some(e),
                        },
                        _ => ReadFail {
                            failure: ReadFailure::Io,
                            source: None,
                        },
                    })
                });
            }
            act.withdraw(gone);
            out.into_iter()
                .map(|o| {
                    o.unwrap_or(Err(ReadFail {
                        failure: ReadFailure::Io,
                        source: None,
                    }))
                })
                .collect()
        }))
    }
}

/// The SSD tier's counters and gauges; None without one.
#[derive(Message)]
#[rtype(result = "Option<SsdStats>")]
pub struct GetSsdStats;

impl Handler<GetSsdStats> for BlockStore {
    type Result = actix::MessageResult<GetSsdStats>;

    fn handle(&mut self, _: GetSsdStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.ssd.as_ref().map(|t| SsdStats {
            held_blocks: self.ssd_held,
            staging_slots: self.staging,
            ..t.stats()
        }))
    }
}

/// Replies once every SSD write and read queued so far is done (tests and benchmarks).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SsdSync;

impl Handler<SsdSync> for BlockStore {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, _: SsdSync, _: &mut Context<Self>) -> Self::Result {
        let wait = self.ssd.as_ref().map(SsdTier::barrier);
        Box::pin(
            wrap_future(async move {
                if let Some(w) = wait {
                    w.await;
                }
            })
            // One turn more: the write completions the barrier waited for run first.
            .map(|_, _: &mut Self, _| ()),
        )
    }
}
