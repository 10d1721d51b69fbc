//! Staged remote fetches: pool slots (class reclaimable) a remote read lands in before its
//! copy to the device; the written parts seal and are advertised when the load ends.

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

/// Pins of a staged fetch, released in one message when this drops: committing the written
/// parts if [`Self::finish`] was called (they seal and are advertised once every rank has
/// them), nothing otherwise. The load holds it until its suffix ends, so a running load does
/// not message the store as its segments finish.
pub(crate) struct FetchGuard {
    store: Addr<BlockStore>,
    namespace: Namespace,
    rank: u32,
    pinned: Vec<(BlockHash, bool)>,
    memory: Arc<PoolMemory>,
    commit: bool,
}

impl FetchGuard {
    /// Every part was written and copied: commit them when this drops.
    pub(crate) fn finish(&mut self) {
        self.commit = true;
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
                commit: self.commit,
            });
        }
    }
}

impl BlockStore {
    /// Reserves slots (class reclaimable) for a staged remote read of `hashes`: the slots
    /// and a guard that keeps them pinned; its `finish` commits the written parts and
    /// unpins all (part of [`super::ReserveLoad`]).
    pub(super) fn reserve_fetch(
        &mut self,
        namespace: &Namespace,
        tp: u32,
        rank: u32,
        block_bytes: u64,
        hashes: &[BlockHash],
        ctx: &mut Context<Self>,
    ) -> Result<(Vec<FetchSlot>, FetchGuard), TierError> {
        let reserved = self
            .tiers
            .reserve_fetch(namespace, tp, rank, block_bytes, hashes);
        self.run_effects(ctx);
        let reserved = reserved?;
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
            namespace: namespace.clone(),
            rank,
            pinned,
            memory: Arc::clone(self.tiers.pool().memory()),
            commit: false,
        };
        Ok((slots, guard))
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
