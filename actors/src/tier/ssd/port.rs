//! [`ReadPort`]: the SSD tier's I/O threads as a load reaches them, for blocks the tier
//! already holds for it. The tier's bookkeeping (which slot holds which block, LRU, damage)
//! stays with the tier; a load that holds a [`PendingRead`] per block only queues the reads
//! of its chunks as its staging slots free up, and hands every block's [`ReadEnd`] back to
//! [`super::SsdTier::read_ended`] once, when it ends. So a running load asks the store for
//! nothing per chunk.

use std::sync::mpsc;

use tokio::sync::oneshot;

use crate::tier::ssd::format;
use crate::tier::ssd::io::{Op, ReadInto, ReadOutcome};
use crate::tier::ssd::tier::{PendingRead, ReadRx};

/// How a held block's read ended, as the tier's bookkeeping needs it (the error itself
/// goes to the load that read it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadEnd {
    /// The bytes came back intact.
    Ok,
    /// The slot did not hold the block's bytes: it leaves the tier.
    Damaged(format::Damage),
    /// The read failed (an I/O error): a miss, the block leaves the tier.
    Failed,
    /// Never read, or its outcome never arrived (the load stopped first): the hold ends and
    /// the block stays.
    NotRead,
}

impl ReadEnd {
    pub fn of(out: &ReadOutcome) -> Self {
        match out {
            ReadOutcome::Ok => ReadEnd::Ok,
            ReadOutcome::Damaged(d) => ReadEnd::Damaged(*d),
            ReadOutcome::Failed(_) => ReadEnd::Failed,
        }
    }
}

/// The directories' I/O threads, cloned out of the tier for one load's reads.
#[derive(Clone)]
pub struct ReadPort {
    pub(super) dirs: Vec<Option<mpsc::Sender<Op>>>,
    pub(super) stride: u64,
}

impl std::fmt::Debug for ReadPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadPort")
            .field("dirs", &self.dirs.len())
            .finish()
    }
}

impl ReadPort {
    /// Queues the read of `r` (a block the tier holds for the caller) into `into`. None when
    /// nothing was queued: the block is larger than `into` or its directory's thread has
    /// stopped (both a failed read).
    pub fn read(&self, r: &PendingRead, into: ReadInto) -> Option<ReadRx> {
        if r.len > into.cap {
            return None;
        }
        let (reply, done) = oneshot::channel();
        let op = Op::Read {
            offset: format::slot_offset(r.loc.slot, self.stride),
            key: r.key.clone(),
            len: r.len,
            into,
            reply,
        };
        let tx = self.dirs.get(r.loc.dir)?.as_ref()?;
        tx.send(op).ok()?;
        Some(done)
    }
}
