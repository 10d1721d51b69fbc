//! SSD reads of loads: pool slots lent as staging, and a load's SSD blocks held on disk
//! for it while it reads them into those slots ([`SsdReads`]). Both are reserved with the
//! load and given back when it drops them; the bookkeeping of the reads (LRU, damage,
//! withdrawals) happens on the store then, whatever the load did meanwhile.

use std::future::Future;
use std::sync::Arc;

use actix::fut::{wrap_future, ActorFutureExt};
use actix::{Addr, AsyncContext, Context, Handler, Message, ResponseActFuture};

use super::BlockStore;
use crate::model::{BlockHash, Namespace};
use crate::tier::pool::PoolMemory;
use crate::tier::ssd::error::{ReadFailure, SsdError};
use crate::tier::ssd::io::{ReadInto, ReadOutcome};
use crate::tier::ssd::port::{ReadEnd, ReadPort};
use crate::tier::ssd::tier::{PendingRead, ReadRx};
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

impl BlockStore {
    /// Holds `hashes` (a load's SSD blocks, in order) on disk for the load's reads.
    pub(super) fn hold_ssd_reads(
        &mut self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        ctx: &mut Context<Self>,
    ) -> SsdReads {
        let blocks = self.tiers.hold_ssd_reads(namespace, hashes);
        SsdReads {
            store: ctx.address(),
            port: self.tiers.ssd().map(|t| t.read_port()),
            cap: self.tiers.pool().slot_bytes(),
            ends: blocks.iter().map(|_| End::Unread).collect(),
            blocks,
        }
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

/// A load's SSD blocks, held on disk for it since it was planned (part of
/// [`super::ReserveLoad`]), and the I/O threads it reads them through. The load queues the
/// reads itself as its staging slots free up and records how each ended; when this drops,
/// the store learns every block's end in one message (and waits there for reads still on
/// disk, so a hold never ends under a read), so a running load never messages the store.
pub(crate) struct SsdReads {
    store: Addr<BlockStore>,
    port: Option<ReadPort>,
    cap: u64,
    blocks: Vec<Option<PendingRead>>,
    ends: Vec<End>,
}

/// Where one held block's read is.
enum End {
    Unread,
    Reading(ReadRx),
    /// With the I/O error of a failed read, until the load takes it.
    Ended(ReadEnd, Option<SsdError>),
}

/// Why one SSD block of a load was not read.
#[derive(Debug)]
pub(crate) struct ReadFail {
    pub(crate) failure: ReadFailure,
    pub(crate) source: Option<SsdError>,
}

impl ReadFail {
    fn of(failure: ReadFailure) -> Self {
        Self {
            failure,
            source: None,
        }
    }
}

impl SsdReads {
    /// Queues the read of block `i` into `addr` (a staging slot `keep` holds until the
    /// read is done). Err: nothing was queued, and the block failed as the error says.
    pub(crate) fn start(
        &mut self,
        i: usize,
        addr: u64,
        keep: Arc<dyn Send + Sync>,
    ) -> Result<(), ReadFail> {
        let (Some(Some(r)), Some(end)) = (self.blocks.get(i), self.ends.get_mut(i)) else {
            return Err(ReadFail::of(ReadFailure::Vanished));
        };
        let into = ReadInto {
            addr,
            cap: self.cap,
            keep,
        };
        match self.port.as_ref().and_then(|p| p.read(r, into)) {
            Some(rx) => {
                *end = End::Reading(rx);
                Ok(())
            }
            None => {
                *end = End::Ended(ReadEnd::Failed, None);
                Err(ReadFail::of(ReadFailure::Io))
            }
        }
    }

    /// Waits for the reads of `blocks` (started with [`Self::start`]) and gives each
    /// one's outcome, in order. Cancel-safe: an outcome not taken yet stays pending here.
    pub(crate) fn poll_ended(
        &mut self,
        blocks: std::ops::Range<usize>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Vec<Result<(), ReadFail>>> {
        use std::task::Poll;
        let mut ready = true;
        for end in self.ends.get_mut(blocks.clone()).into_iter().flatten() {
            if let End::Reading(rx) = end {
                match std::pin::Pin::new(rx).poll(cx) {
                    Poll::Pending => ready = false,
                    // Kept as it ended, for the store; its error goes to the load.
                    Poll::Ready(out) => {
                        let out = out.ok();
                        let e = end_of(out.as_ref());
                        let source = match out {
                            Some(ReadOutcome::Failed(source)) => Some(source),
                            _ => None,
                        };
                        *end = End::Ended(e, source);
                    }
                }
            }
        }
        if !ready {
            return Poll::Pending;
        }
        Poll::Ready(
            self.ends[blocks]
                .iter_mut()
                .map(|end| match end {
                    End::Ended(ReadEnd::Ok, _) => Ok(()),
                    End::Ended(ReadEnd::Damaged(d), _) => {
                        Err(ReadFail::of(ReadFailure::Damaged(*d)))
                    }
                    End::Ended(_, source) => Err(ReadFail {
                        failure: ReadFailure::Io,
                        source: source.take(),
                    }),
                    End::Unread | End::Reading(_) => Err(ReadFail::of(ReadFailure::Io)),
                })
                .collect(),
        )
    }
}

/// How a read ended, for the tier (`None`: the I/O thread dropped it unanswered).
fn end_of(out: Option<&ReadOutcome>) -> ReadEnd {
    out.map_or(ReadEnd::Failed, ReadEnd::of)
}

impl Drop for SsdReads {
    fn drop(&mut self) {
        let reads: Vec<_> = self
            .blocks
            .drain(..)
            .zip(self.ends.drain(..))
            .filter_map(|(r, end)| Some((r?, end)))
            .collect();
        if !reads.is_empty() {
            self.store.do_send(EndSsdReads(reads));
        }
    }
}

/// A load's held SSD blocks and how their reads ended (or the reads still on disk).
#[derive(Message)]
#[rtype(result = "()")]
struct EndSsdReads(Vec<(PendingRead, End)>);

impl Handler<EndSsdReads> for BlockStore {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, m: EndSsdReads, ctx: &mut Context<Self>) -> Self::Result {
        let mut ended = Vec::with_capacity(m.0.len());
        let mut reading = Vec::new();
        for (r, end) in m.0 {
            match end {
                End::Unread => ended.push((r, ReadEnd::NotRead)),
                End::Ended(e, _) => ended.push((r, e)),
                End::Reading(rx) => reading.push((r, rx)),
            }
        }
        self.tiers.end_ssd_reads(ended);
        self.run_effects(ctx);
        if reading.is_empty() {
            return Box::pin(actix::fut::ready(()));
        }
        // The load stopped with reads on disk: their holds end once they are done.
        let wait = async move {
            let mut got = Vec::with_capacity(reading.len());
            for (r, rx) in reading {
                let out = rx.await.ok();
                got.push((r, end_of(out.as_ref())));
            }
            got
        };
        Box::pin(wrap_future(wait).map(|got, act: &mut Self, ctx| {
            act.tiers.end_ssd_reads(got);
            act.run_effects(ctx);
        }))
    }
}
