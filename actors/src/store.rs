//! The BlockStore actor: drives the block cache, pins prefixes for leases, and runs puts and
//! saves into the host pool.

use std::sync::Arc;
use std::time::Instant;

use actix::{Actor, Addr, AsyncContext, Context, Handler, Message, ResponseFuture};
use kvferry_gpu::{CopyDirection, CopyList};
use tokio::sync::oneshot;

use crate::api::{Stage, StoreReport};
use crate::cache::{BlockCache, BlockClass, CacheStats, Reservation, SlotRef};
use crate::error::NodeError;
use crate::metrics::{Counters, InFlight};
use crate::model::{BlockHash, Namespace};
use crate::pool::{HostPool, PoolMemory};
use crate::registry::RankHandle;
use crate::transfer::{Transfer, TransferSpec};

pub struct BlockStore {
    cache: BlockCache,
    counters: Arc<Counters>,
}

impl BlockStore {
    pub fn new(pool: HostPool, counters: Arc<Counters>) -> Self {
        Self {
            cache: BlockCache::new(pool),
            counters,
        }
    }
}

impl Actor for BlockStore {
    type Context = Context<Self>;
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
        for (hash, data) in &m.blocks {
            match self.cache.reserve(
                &h.namespace,
                *hash,
                h.shape.tp_size(),
                h.rank,
                h.shape.block_bytes(),
                BlockClass::Retained,
            )? {
                Reservation::Present => report.present += 1,
                Reservation::Write(slot) => {
                    self.cache.pool().write(slot.slot, offset, data);
                    report.sealed += usize::from(self.cache.commit(&h.namespace, *hash, h.rank));
                    report.written += 1;
                    report.bytes += rank_bytes;
                }
            }
        }
        report.seconds = t0.elapsed().as_secs_f64();
        Ok(report)
    }
}

/// A writer pin on one rank part; aborts the reservation if dropped before commit.
struct WriteGuard {
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
struct Abort {
    namespace: Namespace,
    hash: BlockHash,
}

impl Handler<Abort> for BlockStore {
    type Result = ();

    fn handle(&mut self, m: Abort, _: &mut Context<Self>) {
        self.cache.abort(&m.namespace, m.hash);
    }
}

/// Marks rank parts written; replies with how many blocks this sealed.
#[derive(Message)]
#[rtype(result = "usize")]
struct Commit {
    namespace: Namespace,
    rank: u32,
    hashes: Vec<BlockHash>,
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
