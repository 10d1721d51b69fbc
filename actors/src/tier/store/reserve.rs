//! A load's slots, reserved once, when the keeper has planned it: the pool slots each staged
//! remote segment lands in, and the staging ring its SSD reads go through. The transfer owns
//! the guards, so its parts never ask the store for slots while they run; a load the pool
//! cannot hold fails before any of its parts starts.

use std::sync::Arc;

use actix::{Context, Handler, Message};

use super::fetch::{FetchGuard, FetchSlot};
use super::ssd_read::{SsdReads, StagingGuard};
use super::BlockStore;
use crate::model::{BlockHash, Namespace};
use crate::tier::TierError;

/// Reserves what one rank's load needs from the pool, all or nothing.
#[derive(Message)]
#[rtype(result = "Result<LoadSlots, TierError>")]
pub(crate) struct ReserveLoad {
    pub(crate) namespace: Namespace,
    pub(crate) tp: u32,
    pub(crate) rank: u32,
    pub(crate) block_bytes: u64,
    /// Each staged remote segment's blocks, in the order the suffix reads them.
    pub(crate) fetches: Vec<Vec<BlockHash>>,
    /// Staging slots for the SSD part (at least one); None: the load reads no SSD block.
    pub(crate) staging: Option<usize>,
    /// The SSD part's blocks, in prefix order: held on disk for the load's reads.
    pub(crate) ssd: Vec<BlockHash>,
}

impl ReserveLoad {
    /// Nothing to reserve: the load may start at once.
    pub(crate) fn is_empty(&self) -> bool {
        self.fetches.is_empty() && self.staging.is_none()
    }
}

/// What a load was lent: dropped unused, everything goes back.
#[derive(Default)]
pub(crate) struct LoadSlots {
    /// One per staged segment, in the order of [`ReserveLoad::fetches`].
    pub(crate) fetches: Vec<(Vec<FetchSlot>, FetchGuard)>,
    /// The SSD part's staging ring, and its blocks held on disk.
    pub(crate) ssd: Option<SsdSlots>,
}

/// What the SSD part of a load was lent.
pub(crate) struct SsdSlots {
    /// The staging slots' addresses, and the guard that gives them back.
    pub(crate) staging: (Vec<u64>, Arc<StagingGuard>),
    /// The SSD blocks, held on disk until this drops.
    pub(crate) reads: SsdReads,
}

impl Handler<ReserveLoad> for BlockStore {
    type Result = actix::MessageResult<ReserveLoad>;

    fn handle(&mut self, m: ReserveLoad, ctx: &mut Context<Self>) -> Self::Result {
        let mut slots = LoadSlots::default();
        let r = self.reserve_load_into(&m, &mut slots, ctx);
        // On a refusal `slots` drops here, giving back what was reserved before it.
        actix::MessageResult(r.map(|()| slots))
    }
}

impl BlockStore {
    fn reserve_load_into(
        &mut self,
        m: &ReserveLoad,
        slots: &mut LoadSlots,
        ctx: &mut Context<Self>,
    ) -> Result<(), TierError> {
        if let Some(want) = m.staging {
            let staging = self.reserve_staging(want, ctx)?;
            let reads = self.hold_ssd_reads(&m.namespace, &m.ssd, ctx);
            slots.ssd = Some(SsdSlots { staging, reads });
        }
        for hashes in &m.fetches {
            let f = self.reserve_fetch(&m.namespace, m.tp, m.rank, m.block_bytes, hashes, ctx)?;
            slots.fetches.push(f);
        }
        Ok(())
    }
}
