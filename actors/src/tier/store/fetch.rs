//! Staged remote fetches: pool slots (class reclaimable) a remote read lands in before its
//! copy to the device; the written parts seal and are advertised when the fetch finishes.

use std::sync::Arc;

use actix::{Addr, AsyncContext, Context, Handler, Message};

use super::BlockStore;
use crate::model::{BlockHash, Namespace};
use crate::tier::pool::PoolMemory;
use crate::tier::TierError;

/// One block reserved for a fetched copy of one rank's part.
pub(crate) struct FetchSlot {
    pub(crate) addr: u64,
    /// False when the part is already here: nothing to read, only to copy to the device.
    pub(crate) must_write: bool,
}

/// Reserves slots (class reclaimable) for a staged remote read. Replies with the slots and
/// a guard that keeps them pinned; `FinishFetch` commits the written parts and unpins all.
#[derive(Message)]
#[rtype(result = "Result<(Vec<FetchSlot>, FetchGuard), TierError>")]
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
        let reserved =
            self.tiers
                .reserve_fetch(&m.namespace, m.tp, m.rank, m.block_bytes, &m.hashes);
        self.run_effects(ctx);
        let reserved = match reserved {
            Ok(r) => r,
            Err(e) => return actix::MessageResult(Err(e.into())),
        };
        let mut slots = Vec::with_capacity(reserved.len());
        let mut pinned = Vec::with_capacity(reserved.len());
        for (hash, slot, must_write) in reserved {
            pinned.push((hash, must_write));
            slots.push(FetchSlot {
                addr: slot.addr,
                must_write,
            });
        }
        let guard = FetchGuard {
            store: ctx.address(),
            namespace: m.namespace,
            rank: m.rank,
            pinned,
            memory: Arc::clone(self.tiers.pool().memory()),
        };
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
        self.tiers
            .finish_fetch(&m.namespace, m.rank, m.pinned, m.commit);
        self.run_effects(ctx);
    }
}
