//! SSD reads of loads: pool slots lent as staging, and the reads of a lease's SSD blocks
//! into them. The reads' bookkeeping happens on the store whatever the load does meanwhile.

use std::sync::Arc;

use actix::fut::{wrap_future, ActorFutureExt};
use actix::{Addr, AsyncContext, Context, Handler, Message, ResponseActFuture};

use super::BlockStore;
use crate::model::{BlockHash, Namespace};
use crate::tier::policy::ReadFail;
use crate::tier::pool::PoolMemory;
use crate::tier::TierError;

/// Pool slots a load reads SSD blocks into. They go back to the pool when the last holder
/// drops this: the load, every disk read into them (the I/O thread holds it until the read
/// is done) and every copy from them to the device (held until the copy drained).
pub(crate) struct StagingGuard {
    store: Addr<BlockStore>,
    slots: Vec<usize>,
    /// The slots' memory stays mapped while anything may still read or write them.
    memory: Arc<PoolMemory>,
}

impl StagingGuard {
    /// The pool memory the lent slots lie in, mapped while this guard lives.
    pub(crate) fn memory(&self) -> &Arc<PoolMemory> {
        &self.memory
    }
}

impl Drop for StagingGuard {
    fn drop(&mut self) {
        let slots = std::mem::take(&mut self.slots);
        if !slots.is_empty() {
            self.store.do_send(FreeStaging(slots));
        }
    }
}

impl BlockStore {
    /// Lends up to `want` pool slots (at least one, evicting unpinned blocks as needed) for
    /// a load's SSD reads: their addresses and the guard that gives them back (part of
    /// [`super::ReserveLoad`]).
    pub(super) fn reserve_staging(
        &mut self,
        want: usize,
        ctx: &mut Context<Self>,
    ) -> Result<(Vec<u64>, Arc<StagingGuard>), TierError> {
        let reserved = self.tiers.reserve_staging(want);
        self.run_effects(ctx);
        let slots = reserved?;
        let addrs = slots.iter().map(|s| s.addr).collect();
        Ok((
            addrs,
            Arc::new(StagingGuard {
                store: ctx.address(),
                slots: slots.iter().map(|s| s.slot).collect(),
                memory: Arc::clone(self.tiers.pool().memory()),
            }),
        ))
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct FreeStaging(Vec<usize>);

impl Handler<FreeStaging> for BlockStore {
    type Result = ();

    fn handle(&mut self, m: FreeStaging, _: &mut Context<Self>) {
        self.tiers.free_staging(m.0);
    }
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
        let keep = m.staging as Arc<dyn Send + Sync>;
        let (reads, waits) = self.tiers.begin_ssd_reads(&m.namespace, m.reads, keep);
        let wait = async move {
            let mut got = Vec::with_capacity(waits.len());
            for rx in waits {
                got.push(rx.await.ok());
            }
            got
        };
        Box::pin(wrap_future(wait).map(move |got, act: &mut Self, ctx| {
            let out = act.tiers.finish_ssd_reads(reads, got);
            act.run_effects(ctx);
            out
        }))
    }
}
