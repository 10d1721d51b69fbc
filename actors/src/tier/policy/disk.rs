//! [`Disk`]: what the tier policy needs of the SSD tier, so that its tests can run it on a
//! fake disk. [`SsdTier`] is the real one; its waits are the I/O threads' reply channels.

use crate::model::BlockKey;
use crate::tier::ssd::index::Entry;
use crate::tier::ssd::io::{ReadInto, ReadOutcome};
use crate::tier::ssd::port::ReadEnd;
use crate::tier::ssd::tier::{PendingRead, PendingWrite, ReadRx, WriteRx, WriteSkip};
use crate::tier::ssd::{SsdError, SsdMetrics, SsdTier};

/// The SSD tier as the policy drives it; the methods are [`SsdTier`]'s, which documents them.
pub trait Disk {
    /// Where a queued write's outcome arrives (the driver awaits it, then calls
    /// [`super::Tiers::handle_write_done`]).
    type WriteWait;
    /// Where a queued read's outcome arrives.
    type ReadWait;

    fn contains(&self, key: &BlockKey) -> bool;
    fn is_writing(&self, key: &BlockKey) -> bool;
    fn write_through(&self) -> bool;
    fn write(
        &mut self,
        key: &BlockKey,
        tp: u32,
        len: u64,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(PendingWrite, Self::WriteWait, Option<BlockKey>), WriteSkip>;
    fn skipped_for_backlog(&self, key: &BlockKey);
    fn write_done(&mut self, w: &PendingWrite, out: Result<(), SsdError>) -> Result<(), SsdError>;
    fn hold(&mut self, key: &BlockKey) -> Option<Entry>;
    fn release(&mut self, key: &BlockKey, e: &Entry);
    fn read_held(
        &mut self,
        key: &BlockKey,
        e: Entry,
        into: ReadInto,
    ) -> Option<(PendingRead, Self::ReadWait)>;
    fn read_done(&mut self, r: &PendingRead, out: Option<&ReadOutcome>) -> (bool, bool);
    fn read_ended(&mut self, r: &PendingRead, end: ReadEnd) -> bool;
    fn metrics(&self) -> &SsdMetrics;
    fn set_quotas(&mut self, rules: crate::tier::quota::QuotaRules);
}

impl Disk for SsdTier {
    type WriteWait = WriteRx;
    type ReadWait = ReadRx;

    fn contains(&self, key: &BlockKey) -> bool {
        SsdTier::contains(self, key)
    }

    fn is_writing(&self, key: &BlockKey) -> bool {
        SsdTier::is_writing(self, key)
    }

    fn write_through(&self) -> bool {
        SsdTier::write_through(self)
    }

    fn write(
        &mut self,
        key: &BlockKey,
        tp: u32,
        len: u64,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(PendingWrite, WriteRx, Option<BlockKey>), WriteSkip> {
        SsdTier::write(self, key, tp, len, fill)
    }

    fn skipped_for_backlog(&self, key: &BlockKey) {
        SsdTier::skipped_for_backlog(self, key)
    }

    fn write_done(&mut self, w: &PendingWrite, out: Result<(), SsdError>) -> Result<(), SsdError> {
        SsdTier::write_done(self, w, out)
    }

    fn hold(&mut self, key: &BlockKey) -> Option<Entry> {
        SsdTier::hold(self, key)
    }

    fn release(&mut self, key: &BlockKey, e: &Entry) {
        SsdTier::release(self, key, e)
    }

    fn read_held(
        &mut self,
        key: &BlockKey,
        e: Entry,
        into: ReadInto,
    ) -> Option<(PendingRead, ReadRx)> {
        SsdTier::read_held(self, key, e, into)
    }

    fn read_done(&mut self, r: &PendingRead, out: Option<&ReadOutcome>) -> (bool, bool) {
        SsdTier::read_done(self, r, out)
    }

    fn read_ended(&mut self, r: &PendingRead, end: ReadEnd) -> bool {
        SsdTier::read_ended(self, r, end)
    }

    fn metrics(&self) -> &SsdMetrics {
        SsdTier::metrics(self)
    }

    fn set_quotas(&mut self, rules: crate::tier::quota::QuotaRules) {
        SsdTier::set_quotas(self, rules)
    }
}
