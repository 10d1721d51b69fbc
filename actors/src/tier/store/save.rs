//! Puts (bytes from the client's request) and the store's side of saves: the slots a
//! save's device → host copies write, and their commit once the copies are done (the
//! copies themselves are `load/save.rs`'s). With write-through, both answer once the blocks
//! they sealed are on disk.

use std::sync::Arc;
use std::time::Instant;

use actix::{Addr, AsyncContext, Context, Handler, Message, ResponseFuture};
use kvferry_gpu::KvShape;

use super::{durable, BlockStore, Durable};
use crate::api::StoreReport;
use crate::fence::{monotonic_ns, Fence};
use crate::model::{BlockHash, Namespace};
use crate::tier::pool::PoolMemory;
use crate::tier::TierError;

/// Writes one rank's bytes of whole blocks from host memory.
#[derive(Message)]
#[rtype(result = "Result<StoreReport, TierError>")]
pub struct Put {
    pub namespace: Namespace,
    pub shape: KvShape,
    pub rank: u32,
    pub blocks: Vec<(BlockHash, Vec<u8>)>,
    /// Past it the client has given up: nothing is written (see [`crate::fence`]).
    pub fence: Option<Fence>,
}

/// Write-through: answered once the blocks it sealed are on disk, or with
/// [`TierError::NotDurable`] if any of them could not be written.
impl Handler<Put> for BlockStore {
    type Result = ResponseFuture<Result<StoreReport, TierError>>;

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
    ) -> Result<(StoreReport, Vec<Durable>), TierError> {
        let t0 = Instant::now();
        if let Some(f) = m.fence {
            let now = monotonic_ns();
            if f.passed_at(now) {
                let late = f.late_by(now);
                self.counters.abandoned("put_blocks", m.blocks.len(), late);
                return Err(TierError::DeadlinePassed {
                    what: "PutBlocks",
                    late,
                });
            }
        }
        let put = self.tiers.put(&m.namespace, &m.shape, m.rank, &m.blocks);
        let out = put.map(|(mut report, keys)| {
            let acks = self.await_durable(keys);
            report.seconds = t0.elapsed().as_secs_f64();
            (report, acks)
        });
        self.run_effects(ctx);
        out
    }
}

/// A writer pin on one rank part; aborts the reservation if dropped before commit.
pub(crate) struct WriteGuard {
    store: Addr<BlockStore>,
    namespace: Namespace,
    hash: BlockHash,
    armed: bool,
}

impl WriteGuard {
    pub(crate) fn hash(&self) -> BlockHash {
        self.hash
    }

    /// The reservation was committed: dropping the guard no longer aborts it.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
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
        self.tiers.abort(&m.namespace, m.hash);
        self.run_effects(ctx);
    }
}

/// Marks rank parts written; replies with how many blocks this sealed. With a fence that
/// has passed, marks nothing and answers [`TierError::DeadlinePassed`]: the caller's writer
/// guards then abort the reservations (the copied bytes are never sealed nor published).
#[derive(Message)]
#[rtype(result = "Result<(usize, Vec<Durable>), TierError>")]
pub(crate) struct Commit {
    pub(crate) namespace: Namespace,
    pub(crate) rank: u32,
    pub(crate) hashes: Vec<BlockHash>,
    pub(crate) fence: Option<Fence>,
}

/// Also replies, with write-through, where each sealed block's disk write answers.
impl Handler<Commit> for BlockStore {
    type Result = Result<(usize, Vec<Durable>), TierError>;

    fn handle(&mut self, m: Commit, ctx: &mut Context<Self>) -> Self::Result {
        // Checked here, on the thread that seals, after the copies out of the client's
        // memory completed: if the fence is still ahead, every read of the source blocks
        // ended before the client could have let its engine reuse them.
        if let Some(f) = m.fence {
            let now = monotonic_ns();
            if f.passed_at(now) {
                let late = f.late_by(now);
                self.counters.abandoned("save", m.hashes.len(), late);
                return Err(TierError::DeadlinePassed { what: "Save", late });
            }
        }
        let (sealed, keys) = self.tiers.commit(&m.namespace, m.rank, &m.hashes);
        let acks = self.await_durable(keys);
        self.run_effects(ctx);
        Ok((sealed, acks))
    }
}

/// Reserves the slots a save's copies write: `hashes[i]` already present is counted, the
/// others get a slot each and a [`WriteGuard`] that aborts it unless committed.
#[derive(Message)]
#[rtype(result = "Result<SaveSlots, TierError>")]
pub(crate) struct ReserveSave {
    pub(crate) namespace: Namespace,
    pub(crate) shape: KvShape,
    pub(crate) rank: u32,
    pub(crate) hashes: Vec<BlockHash>,
}

/// What a save writes into: `(index into the request's hashes, slot address)` with one guard
/// each, in the same order.
pub(crate) struct SaveSlots {
    pub(crate) slots: Vec<(usize, u64)>,
    pub(crate) guards: Vec<WriteGuard>,
    /// Blocks of the request already held.
    pub(crate) present: usize,
    /// The pool the slots are in, kept by the copies.
    pub(crate) memory: Arc<PoolMemory>,
    /// Where the save's transfer runs: the store's save arbiter, else the store's own.
    pub(crate) arbiter: actix::ArbiterHandle,
}

impl Handler<ReserveSave> for BlockStore {
    type Result = Result<SaveSlots, TierError>;

    fn handle(&mut self, m: ReserveSave, ctx: &mut Context<Self>) -> Self::Result {
        let shape = &m.shape;
        self.tiers
            .learn_shape(&m.namespace, shape.tp_size(), shape.block_bytes());
        let reserved = self.tiers.reserve_save(
            &m.namespace,
            shape.tp_size(),
            m.rank,
            shape.block_bytes(),
            &m.hashes,
        );
        self.run_effects(ctx);
        let (slots, present) = reserved?;
        let me = ctx.address();
        let guards = slots
            .iter()
            .map(|(i, _)| WriteGuard {
                store: me.clone(),
                namespace: m.namespace.clone(),
                hash: m.hashes[*i],
                armed: true,
            })
            .collect();
        Ok(SaveSlots {
            slots: slots.into_iter().map(|(i, s)| (i, s.addr)).collect(),
            guards,
            present,
            memory: Arc::clone(self.tiers.pool().memory()),
            arbiter: self.saves.clone().unwrap_or_else(actix::Arbiter::current),
        })
    }
}
