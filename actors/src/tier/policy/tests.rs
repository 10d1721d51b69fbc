//! The policy on a fake disk: an [`SsdIndex`] (the real one) with a byte map for a file and
//! a backlog counter, whose writes and reads finish when the test says so, as it says.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use kvferry_gpu::KvShape;

use super::*;
use crate::tier::ssd::format::Damage;
use crate::tier::ssd::index::{Entry as SsdEntry, Loc, NoSlot, SsdIndex};
use crate::tier::ssd::io::{ReadInto, ReadOutcome};
use crate::tier::ssd::port::ReadEnd;
use crate::tier::ssd::tier::{PendingRead, WriteSkip};
use crate::tier::ssd::SsdMetrics;

const BLOCK: u64 = 4096;
const TTL: Duration = Duration::from_secs(30);

struct FakeDisk {
    index: SsdIndex,
    write_through: bool,
    /// Bytes queued writes may hold at once (`ssd.write-backlog`).
    backlog_limit: u64,
    backlog: u64,
    /// What each write copied out of RAM, by disk slot.
    file: HashMap<Loc, Vec<u8>>,
    charged: HashMap<Loc, u64>,
    metrics: SsdMetrics,
}

impl FakeDisk {
    fn new(slots: u64) -> Self {
        Self {
            index: SsdIndex::new(&[slots]),
            write_through: false,
            backlog_limit: u64::MAX,
            backlog: 0,
            file: HashMap::new(),
            charged: HashMap::new(),
            metrics: SsdMetrics::default(),
        }
    }

    fn writing_through(mut self) -> Self {
        self.write_through = true;
        self
    }

    fn with_backlog(mut self, bytes: u64) -> Self {
        self.backlog_limit = bytes;
        self
    }

    fn bytes_of(&self, key: &BlockKey) -> Option<&Vec<u8>> {
        self.file.get(&self.index.get(key)?.loc)
    }
}

impl Disk for FakeDisk {
    type WriteWait = ();
    type ReadWait = ();

    fn contains(&self, key: &BlockKey) -> bool {
        self.index.contains(key)
    }

    fn is_writing(&self, key: &BlockKey) -> bool {
        self.index.get(key).is_some_and(SsdEntry::is_writing)
    }

    fn write_through(&self) -> bool {
        self.write_through
    }

    fn write(
        &mut self,
        key: &BlockKey,
        tp: u32,
        len: u64,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(PendingWrite, (), Option<BlockKey>), WriteSkip> {
        if self.index.contains(key) {
            return Err(WriteSkip::Present);
        }
        if self.backlog + len > self.backlog_limit {
            return Err(WriteSkip::Backlog);
        }
        let plan = match self.index.begin_write(key, tp, len) {
            Ok(p) => p,
            Err(NoSlot::Present) => return Err(WriteSkip::Present),
            Err(NoSlot::AllBusy) => return Err(WriteSkip::Busy),
            Err(NoSlot::OverQuota) => return Err(WriteSkip::OverQuota),
        };
        let mut data = vec![0; len as usize];
        fill(&mut data);
        self.file.insert(plan.loc, data);
        self.charged.insert(plan.loc, len);
        self.backlog += len;
        let w = PendingWrite {
            key: key.clone(),
            loc: plan.loc,
        };
        Ok((w, (), plan.evicted))
    }

    fn skipped_for_backlog(&self, _: &BlockKey) {
        self.metrics.writes_skipped_backlog.fetch_add(1, Relaxed);
    }

    fn write_done(&mut self, w: &PendingWrite, out: Result<(), SsdError>) -> Result<(), SsdError> {
        self.backlog -= self.charged.remove(&w.loc).unwrap_or(0);
        let full = out.as_ref().err().is_some_and(SsdError::is_disk_full);
        self.index.end_write(&w.key, w.loc, out.is_ok(), full);
        out
    }

    fn hold(&mut self, key: &BlockKey) -> Option<SsdEntry> {
        self.index.begin_read(key)
    }

    fn release(&mut self, key: &BlockKey, e: &SsdEntry) {
        self.index.end_read(key, e.loc, true);
    }

    fn read_held(
        &mut self,
        key: &BlockKey,
        e: SsdEntry,
        into: ReadInto,
    ) -> Option<(PendingRead, ())> {
        if e.len > into.cap {
            self.index.end_read(key, e.loc, true);
            return None;
        }
        let r = PendingRead {
            key: key.clone(),
            loc: e.loc,
            len: e.len,
        };
        Some((r, ()))
    }

    fn read_done(&mut self, r: &PendingRead, out: Option<&ReadOutcome>) -> (bool, bool) {
        match out {
            Some(ReadOutcome::Ok) => {
                self.index.end_read(&r.key, r.loc, true);
                (true, false)
            }
            Some(_) => (false, self.index.end_read(&r.key, r.loc, false)),
            None => {
                self.index.end_read(&r.key, r.loc, true);
                (false, false)
            }
        }
    }

    fn read_ended(&mut self, r: &PendingRead, end: ReadEnd) -> bool {
        let ok = matches!(end, ReadEnd::Ok | ReadEnd::NotRead);
        self.index.end_read(&r.key, r.loc, ok)
    }

    fn metrics(&self) -> &SsdMetrics {
        &self.metrics
    }

    fn set_quotas(&mut self, rules: QuotaRules) {
        self.index.set_quotas(rules, BLOCK);
    }
}

fn ns() -> Namespace {
    Namespace::new("m", "bf16", "t").unwrap()
}

fn h(i: u64) -> BlockHash {
    BlockHash::from_u64(i)
}

fn key(i: u64) -> BlockKey {
    BlockKey {
        namespace: ns(),
        hash: h(i),
    }
}

fn shape() -> KvShape {
    KvShape::new(1, 1, 1, BLOCK).unwrap()
}

/// RAM of `slots` blocks over `disk`.
fn tiers(slots: u64, disk: Option<FakeDisk>) -> Tiers<FakeDisk> {
    Tiers::new(
        HostPool::new(slots * BLOCK, BLOCK, false).unwrap(),
        disk,
        TTL,
    )
}

fn bytes(i: u64) -> Vec<u8> {
    vec![i as u8; BLOCK as usize]
}

/// Puts blocks `ids`, each filled with its id; returns the keys to wait for.
fn put(t: &mut Tiers<FakeDisk>, ids: &[u64]) -> Vec<BlockKey> {
    let blocks: Vec<_> = ids.iter().map(|&i| (h(i), bytes(i))).collect();
    t.put(&ns(), &shape(), 0, &blocks).unwrap().1
}

fn writes(fx: &[Effect<()>]) -> Vec<BlockKey> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Watch { write, .. } => Some(write.key.clone()),
            _ => None,
        })
        .collect()
}

fn withdrawn(fx: &[Effect<()>]) -> Vec<BlockHash> {
    fx.iter()
        .flat_map(|e| match e {
            Effect::Withdraw { hashes, .. } => hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

fn durable(fx: &[Effect<()>]) -> Vec<(BlockKey, Result<(), String>)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Durable { key, out } => Some((
                key.clone(),
                out.as_ref().map_err(|e| e.to_string()).copied(),
            )),
            _ => None,
        })
        .collect()
}

fn pending(fx: Vec<Effect<()>>) -> Vec<PendingWrite> {
    fx.into_iter()
        .filter_map(|e| match e {
            Effect::Watch { write, .. } => Some(write),
            _ => None,
        })
        .collect()
}

#[test]
fn sealed_blocks_are_admitted_to_ram_and_published_without_a_disk_write() {
    let mut t = tiers(4, Some(FakeDisk::new(8)));
    let keys = put(&mut t, &[1, 2]);
    assert!(keys.is_empty(), "write-behind: nobody waits for the disk");
    let fx = t.take_effects();
    assert!(matches!(&fx[..], [Effect::Publish { hashes, .. }] if *hashes == vec![h(1), h(2)]));
    assert!(t.cache().contains(&ns(), h(1)));
    assert!(
        !t.ssd().unwrap().contains(&key(1)),
        "nothing evicted, nothing written"
    );
}

#[test]
fn a_put_of_the_wrong_size_changes_nothing() {
    let mut t = tiers(4, None);
    let err = t.put(&ns(), &shape(), 0, &[(h(1), bytes(1)), (h(2), vec![0; 10])]);
    assert!(err.is_err());
    assert!(
        !t.cache().contains(&ns(), h(1)),
        "validated before anything is written"
    );
    assert!(t.take_effects().is_empty());
}

#[test]
fn ram_only_an_evicted_block_is_withdrawn() {
    let mut t = tiers(2, None);
    put(&mut t, &[1, 2]);
    put(&mut t, &[3]);
    let fx = t.take_effects();
    assert_eq!(withdrawn(&fx), vec![h(1)], "the oldest block left the node");
    assert!(writes(&fx).is_empty());
}

#[test]
fn an_evicted_block_is_written_to_ssd_with_its_bytes_and_stays_advertised() {
    let mut t = tiers(2, Some(FakeDisk::new(8)));
    put(&mut t, &[1, 2, 3]);
    let fx = t.take_effects();
    assert_eq!(writes(&fx), vec![key(1)]);
    assert!(withdrawn(&fx).is_empty(), "on disk: still served");
    let disk = t.ssd().unwrap();
    assert_eq!(
        disk.bytes_of(&key(1)),
        Some(&bytes(1)),
        "copied out before reuse"
    );
    assert!(disk.is_writing(&key(1)));
    for w in pending(fx) {
        t.handle_write_done(w, Ok(()));
    }
    assert!(t
        .take_effects()
        .iter()
        .all(|e| !matches!(e, Effect::Withdraw { .. })));
    assert!(!t.ssd().unwrap().is_writing(&key(1)));
    assert!(t.ssd().unwrap().contains(&key(1)));
}

#[test]
fn a_failed_write_behind_withdraws_the_block() {
    let mut t = tiers(2, Some(FakeDisk::new(8)));
    put(&mut t, &[1, 2, 3]);
    let w = pending(t.take_effects()).pop().unwrap();
    t.handle_write_done(w, Err(disk_full()));
    let fx = t.take_effects();
    assert_eq!(withdrawn(&fx), vec![h(1)], "in no tier any more");
    assert!(!t.ssd().unwrap().contains(&key(1)));
}

fn disk_full() -> SsdError {
    SsdError::DiskFull {
        path: "/fake".into(),
        offset: 0,
        bytes: BLOCK,
    }
}

#[test]
fn the_held_prefix_counts_blocks_in_ram_and_on_disk_alike() {
    let mut t = tiers(2, Some(FakeDisk::new(8)));
    put(&mut t, &[1, 2, 3]);
    for w in pending(t.take_effects()) {
        t.handle_write_done(w, Ok(()));
    }
    t.take_effects();
    // 1 on disk only, 2 and 3 in RAM; 4 nowhere.
    assert!(!t.cache().contains(&ns(), h(1)) && t.ssd().unwrap().contains(&key(1)));
    assert_eq!(t.cache().prefix_len(&ns(), &[h(1), h(2), h(3)]), 0);
    assert_eq!(t.held_prefix_len(&ns(), &[h(1), h(2), h(3), h(4), h(2)]), 3);
    assert_eq!(t.held_prefix_len(&ns(), &[h(4), h(1)]), 0);
    let without_disk = tiers(2, None);
    assert_eq!(without_disk.held_prefix_len(&ns(), &[h(1)]), 0);
}

#[test]
fn a_read_back_hit_promotes_an_ssd_block_into_ram_pinned() {
    let mut t = tiers(2, Some(FakeDisk::new(8)));
    put(&mut t, &[1, 2, 3]);
    for w in pending(t.take_effects()) {
        t.handle_write_done(w, Ok(()));
    }
    t.take_effects();
    // Block 1 on SSD only, 2 and 3 in RAM: a peer's lookup of 1, 2.
    let (pin, waits) = t.begin_pin_local(&ns(), &[h(1), h(2)]);
    assert_eq!(waits.len(), 1, "one read: block 1");
    // Block 2 is pinned, so room for 1 came from 3, which went to disk.
    assert_eq!(writes(&t.take_effects()), vec![key(3)]);
    let (blocks, from_ssd) = t.finish_pin_local(pin, vec![Some(ReadOutcome::Ok)]);
    assert_eq!(
        blocks.iter().map(|b| b.hash).collect::<Vec<_>>(),
        vec![h(1), h(2)]
    );
    assert_eq!(from_ssd, 1);
    assert!(t.cache().contains(&ns(), h(1)));
    assert_eq!(t.cache().stats().pinned_blocks, 2);
}

#[test]
fn a_damaged_read_ends_the_prefix_and_leaves_the_tier() {
    let mut t = tiers(3, Some(FakeDisk::new(8)));
    put(&mut t, &[1, 2, 3, 4]);
    for w in pending(t.take_effects()) {
        t.handle_write_done(w, Ok(()));
    }
    t.take_effects();
    let (pin, waits) = t.begin_pin_local(&ns(), &[h(1), h(2)]);
    assert_eq!(waits.len(), 1);
    t.take_effects();
    let damaged = Some(ReadOutcome::Damaged(Damage::Checksum));
    let (blocks, from_ssd) = t.finish_pin_local(pin, vec![damaged]);
    assert!(
        blocks.is_empty(),
        "the prefix ends at block 1: block 2 is unpinned again"
    );
    assert_eq!(from_ssd, 0);
    assert_eq!(t.cache().stats().pinned_blocks, 0);
    assert_eq!(withdrawn(&t.take_effects()), vec![h(1)]);
    assert!(!t.ssd().unwrap().contains(&key(1)));
    assert!(!t.cache().contains(&ns(), h(1)), "its RAM slot is freed");
}

#[test]
fn a_lease_pins_ram_blocks_and_holds_ssd_blocks_in_prefix_order() {
    let mut t = tiers(2, Some(FakeDisk::new(8)));
    put(&mut t, &[1, 2, 3]);
    for w in pending(t.take_effects()) {
        t.handle_write_done(w, Ok(()));
    }
    let pin = t.pin_prefix(&ns(), &[h(1), h(2), h(9), h(3)]);
    assert_eq!(pin.ssd, vec![SsdBlock { hash: h(1), at: 0 }]);
    assert_eq!(
        pin.blocks.iter().map(|b| b.hash).collect::<Vec<_>>(),
        vec![h(2)]
    );
    assert_eq!(t.ssd_held(), 1, "the prefix ends at 9, which no tier holds");
    let disk = t.ssd().unwrap();
    assert_eq!(disk.metrics().hits_ssd.load(Relaxed), 1);
    assert_eq!(disk.metrics().hits_ram.load(Relaxed), 1);
    let hashes: Vec<_> = pin.blocks.iter().map(|b| b.hash).collect();
    t.unpin(&ns(), &hashes, &pin.holds);
    assert_eq!(t.ssd_held(), 0);
    assert_eq!(t.cache().stats().pinned_blocks, 0);
}

#[test]
fn pinned_blocks_are_not_evicted() {
    let mut t = tiers(2, None);
    put(&mut t, &[1, 2]);
    let pin = t.pin_prefix(&ns(), &[h(1)]);
    t.take_effects();
    put(&mut t, &[3]);
    assert_eq!(
        withdrawn(&t.take_effects()),
        vec![h(2)],
        "1 is pinned: 2 goes"
    );
    assert!(t.cache().contains(&ns(), h(1)));
    t.unpin(&ns(), &[h(1)], &pin.holds);
    put(&mut t, &[4, 5]);
    let gone = withdrawn(&t.take_effects());
    assert!(gone.contains(&h(1)), "unpinned: evictable again ({gone:?})");
}

#[test]
fn a_peer_pin_holds_blocks_until_its_ttl() {
    let mut t = tiers(2, None);
    let now = Instant::now();
    put(&mut t, &[1, 2]);
    let (pin, waits) = t.begin_pin_local(&ns(), &[h(1)]);
    assert!(waits.is_empty(), "in RAM: nothing to read");
    let (blocks, _) = t.finish_pin_local(pin, Vec::new());
    let id = t.pin_for_peer(ns(), &blocks, now);
    assert_eq!(t.peer_pin_count(), 1);
    assert_eq!(t.sweep_peer_pins(now + TTL / 2), 0);
    assert_eq!(t.cache().stats().pinned_blocks, 1);
    assert_eq!(t.sweep_peer_pins(now + TTL + Duration::from_secs(1)), 1);
    assert_eq!(
        t.cache().stats().pinned_blocks,
        0,
        "expired pins release their blocks"
    );
    t.unpin_peer(id);
    assert_eq!(
        t.cache().stats().pinned_blocks,
        0,
        "an expired id is ignored"
    );
}

#[test]
fn write_through_is_durable_once_the_write_is_done() {
    let mut t = tiers(4, Some(FakeDisk::new(8).writing_through()));
    let keys = put(&mut t, &[1]);
    assert_eq!(keys, vec![key(1)]);
    let fx = t.take_effects();
    assert_eq!(writes(&fx), vec![key(1)]);
    assert!(durable(&fx).is_empty(), "not on disk yet");
    t.handle_write_done(pending(fx).pop().unwrap(), Ok(()));
    assert_eq!(durable(&t.take_effects()), vec![(key(1), Ok(()))]);
    assert_eq!(t.cache().stats().pinned_blocks, 0, "unpinned once queued");
}

#[test]
fn a_write_that_fails_with_enospc_is_not_durable() {
    let mut t = tiers(4, Some(FakeDisk::new(8).writing_through()));
    put(&mut t, &[1]);
    let w = pending(t.take_effects()).pop().unwrap();
    t.handle_write_done(w, Err(disk_full()));
    let fx = t.take_effects();
    let d = durable(&fx);
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].0, key(1));
    assert!(d[0].1.is_err(), "the caller hears it is not on disk");
    assert!(withdrawn(&fx).is_empty(), "still in RAM: still served");
    assert!(!t.ssd().unwrap().contains(&key(1)));
}

#[test]
fn write_through_blocks_wait_in_order_for_room_in_the_backlog() {
    let disk = FakeDisk::new(8).writing_through().with_backlog(BLOCK);
    let mut t = tiers(4, Some(disk));
    let keys = put(&mut t, &[1, 2, 3]);
    assert_eq!(keys, vec![key(1), key(2), key(3)]);
    let fx = t.take_effects();
    assert_eq!(writes(&fx), vec![key(1)], "one block's copy fits");
    assert_eq!(
        t.cache().stats().pinned_blocks,
        2,
        "the waiting ones stay in RAM"
    );
    let mut w = pending(fx).pop().unwrap();
    for next in [2, 3] {
        t.handle_write_done(w, Ok(()));
        let fx = t.take_effects();
        assert_eq!(writes(&fx), vec![key(next)], "room for the next, in order");
        w = pending(fx).pop().unwrap();
    }
    t.handle_write_done(w, Ok(()));
    assert_eq!(durable(&t.take_effects()), vec![(key(3), Ok(()))]);
    assert_eq!(t.cache().stats().pinned_blocks, 0);
}

#[test]
fn a_full_backlog_drops_an_evicted_block_and_counts_it() {
    let mut t = tiers(2, Some(FakeDisk::new(8).with_backlog(BLOCK)));
    put(&mut t, &[1, 2, 3, 4]);
    let fx = t.take_effects();
    assert_eq!(writes(&fx), vec![key(1)]);
    assert_eq!(
        withdrawn(&fx),
        vec![h(2)],
        "no room to write it: it left the node"
    );
    let disk = t.ssd().unwrap();
    assert_eq!(disk.metrics().writes_skipped_backlog.load(Relaxed), 1);
    assert!(!disk.contains(&key(2)));
}

#[test]
fn a_disk_eviction_withdraws_the_block_it_replaced() {
    let mut t = tiers(1, Some(FakeDisk::new(1)));
    put(&mut t, &[1, 2]);
    for w in pending(t.take_effects()) {
        t.handle_write_done(w, Ok(()));
    }
    t.take_effects();
    put(&mut t, &[3]);
    let fx = t.take_effects();
    assert_eq!(writes(&fx), vec![key(2)]);
    assert_eq!(withdrawn(&fx), vec![h(1)], "its disk slot went to block 2");
}

/// Block 1 on the only disk slot, held for a load's read that ended as `end`.
fn held_for_a_load(end: ReadEnd) -> Tiers<FakeDisk> {
    let mut t = tiers(1, Some(FakeDisk::new(1)));
    put(&mut t, &[1, 2]);
    for w in pending(t.take_effects()) {
        t.handle_write_done(w, Ok(()));
    }
    t.take_effects();
    let mut held = t.hold_ssd_reads(&ns(), &[h(1), h(9)]);
    assert!(held[1].is_none(), "block 9 is on no tier: nothing held");
    let r = held.remove(0).expect("block 1 is on disk");
    assert_eq!(r.key, key(1));
    // Block 2 leaves RAM while the load holds block 1: the disk slot is not reused.
    put(&mut t, &[3]);
    let fx = t.take_effects();
    assert!(writes(&fx).is_empty(), "the one disk slot is held");
    assert_eq!(withdrawn(&fx), vec![h(2)], "block 2 had nowhere to go");
    assert!(t.ssd().unwrap().contains(&key(1)));
    t.end_ssd_reads(vec![(r, end)]);
    t
}

#[test]
fn a_load_holds_its_ssd_blocks_until_it_ends_and_a_damaged_one_then_leaves() {
    let mut t = held_for_a_load(ReadEnd::Damaged(Damage::Checksum));
    assert_eq!(withdrawn(&t.take_effects()), vec![h(1)]);
    assert!(!t.ssd().unwrap().contains(&key(1)));
    // The slot is free again: the next block out of RAM goes to disk.
    put(&mut t, &[4]);
    assert_eq!(writes(&t.take_effects()), vec![key(3)]);
}

#[test]
fn a_held_block_a_load_did_not_read_stays_on_disk_and_its_slot_is_free_to_reuse() {
    for end in [ReadEnd::NotRead, ReadEnd::Ok] {
        let mut t = held_for_a_load(end);
        assert!(withdrawn(&t.take_effects()).is_empty(), "{end:?}");
        assert!(t.ssd().unwrap().contains(&key(1)), "{end:?}");
        put(&mut t, &[4]);
        let fx = t.take_effects();
        assert_eq!(writes(&fx), vec![key(3)], "{end:?}: the hold ended");
        assert_eq!(
            withdrawn(&fx),
            vec![h(1)],
            "{end:?}: its slot went to block 3"
        );
    }
}

#[test]
fn a_failed_read_of_a_held_block_drops_it_from_the_tier() {
    let mut t = held_for_a_load(ReadEnd::Failed);
    assert_eq!(withdrawn(&t.take_effects()), vec![h(1)]);
    assert!(!t.ssd().unwrap().contains(&key(1)));
}

#[test]
fn staging_slots_are_counted_until_freed() {
    let mut t = tiers(2, None);
    put(&mut t, &[1]);
    let slots = t.reserve_staging(4).unwrap();
    assert_eq!(
        slots.len(),
        2,
        "fewer slots: a shorter pipeline, block 1 evicted"
    );
    assert_eq!(t.staging(), 2);
    assert_eq!(withdrawn(&t.take_effects()), vec![h(1)]);
    t.free_staging(slots.iter().map(|s| s.slot).collect());
    assert_eq!(t.staging(), 0);
}

/// Block 1 written through and evicted from RAM, then saved again: it is on disk already.
/// Returns the save's keys, what it did, and block 1's first write if still in flight.
fn save_again(
    done_first: bool,
) -> (
    Tiers<FakeDisk>,
    Vec<BlockKey>,
    Vec<Effect<()>>,
    Option<PendingWrite>,
) {
    let mut t = tiers(1, Some(FakeDisk::new(8).writing_through()));
    put(&mut t, &[1]);
    let mut first = pending(t.take_effects()).pop();
    if done_first {
        t.handle_write_done(first.take().unwrap(), Ok(()));
    }
    put(&mut t, &[2]);
    t.take_effects();
    assert!(!t.cache().contains(&ns(), h(1)), "evicted, on disk");
    let (slots, present) = t.reserve_save(&ns(), 1, 0, BLOCK, &[h(1)]).unwrap();
    assert_eq!((slots.len(), present), (1, 0));
    let (sealed, keys) = t.commit(&ns(), 0, &[h(1)]);
    assert_eq!(sealed, 1);
    let fx = t.take_effects();
    (t, keys, fx, first)
}

#[test]
fn write_through_of_a_block_on_disk_is_answered_at_once() {
    let (_, keys, fx, _) = save_again(true);
    assert_eq!(keys, vec![key(1)]);
    assert!(writes(&fx).is_empty(), "not written twice");
    assert_eq!(durable(&fx), vec![(key(1), Ok(()))]);
}

#[test]
fn write_through_of_a_block_being_written_waits_for_that_write() {
    let (mut t, keys, fx, first) = save_again(false);
    assert_eq!(keys, vec![key(1)]);
    assert!(writes(&fx).is_empty(), "not written twice");
    assert!(durable(&fx).is_empty(), "not on disk yet");
    t.handle_write_done(first.unwrap(), Ok(()));
    assert_eq!(durable(&t.take_effects()), vec![(key(1), Ok(()))]);
}

#[test]
fn a_saves_sealed_blocks_are_published() {
    let mut t = tiers(4, None);
    let (slots, present) = t.reserve_save(&ns(), 1, 0, BLOCK, &[h(1), h(2)]).unwrap();
    assert_eq!((slots.len(), present), (2, 0));
    t.take_effects();
    let (sealed, _) = t.commit(&ns(), 0, &[h(1), h(2)]);
    assert_eq!(sealed, 2);
    let fx = t.take_effects();
    assert!(matches!(&fx[..], [Effect::Publish { hashes, .. }] if *hashes == vec![h(1), h(2)]));
}

fn published(fx: &[Effect<()>]) -> Vec<BlockHash> {
    fx.iter()
        .flat_map(|e| match e {
            Effect::Publish { hashes, .. } => hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

/// A put of more blocks than RAM holds used to evict its own first blocks (withdrawn) and
/// then publish all of them: the directory and the events advertised blocks RAM no longer
/// held, and RAM kept the put's tail, which no query can use.
#[test]
fn a_put_larger_than_ram_keeps_its_prefix_and_advertises_only_what_is_held() {
    let mut t = tiers(4, None);
    put(&mut t, &[100]);
    t.take_effects();
    let ids: Vec<u64> = (1..=6).collect();
    let blocks: Vec<_> = ids.iter().map(|&i| (h(i), bytes(i))).collect();
    let (r, _) = t.put(&ns(), &shape(), 0, &blocks).unwrap();
    assert_eq!((r.written, r.present, r.not_stored), (4, 0, 2));
    assert_eq!(r.bytes, 4 * BLOCK);
    let fx = t.take_effects();
    // The older block made room, none of the put's own.
    assert_eq!(withdrawn(&fx), vec![h(100)]);
    assert_eq!(published(&fx), vec![h(1), h(2), h(3), h(4)]);
    let hashes: Vec<BlockHash> = ids.iter().map(|&i| h(i)).collect();
    assert_eq!(t.cache().prefix_len(&ns(), &hashes), 4);
    let pin = t.pin_prefix(&ns(), &hashes);
    for (i, s) in pin.blocks.iter().enumerate() {
        let mut got = vec![0u8; BLOCK as usize];
        t.pool().read(s.slot, 0, &mut got);
        assert_eq!(got, bytes(i as u64 + 1), "block {i}");
    }
    t.unpin(&ns(), &hashes[..4], &pin.holds);
    let s = t.cache().stats();
    assert_eq!((s.blocks, s.pinned_blocks, s.pins), (4, 0, 0));
    // The next put works, and makes room from the oldest blocks as before.
    let (r, _) = t.put(&ns(), &shape(), 0, &[(h(7), bytes(7))]).unwrap();
    assert_eq!((r.written, r.not_stored), (1, 0));
    assert_eq!(withdrawn(&t.take_effects()), vec![h(1)]);
}

/// A put whose first blocks are present holds them too: its later blocks evict others'.
#[test]
fn a_puts_present_blocks_are_not_what_makes_room_for_its_later_ones() {
    let mut t = tiers(4, None);
    put(&mut t, &[1, 2, 50, 51]);
    t.take_effects();
    let blocks: Vec<_> = [1, 2, 3, 4].iter().map(|&i| (h(i), bytes(i))).collect();
    let (r, _) = t.put(&ns(), &shape(), 0, &blocks).unwrap();
    assert_eq!((r.written, r.present, r.not_stored), (2, 2, 0));
    let fx = t.take_effects();
    assert_eq!(withdrawn(&fx), vec![h(50), h(51)]);
    assert_eq!(published(&fx), vec![h(3), h(4)]);
    assert_eq!(t.cache().prefix_len(&ns(), &[h(1), h(2), h(3), h(4)]), 4);
}

/// A pool whose every slot is pinned by others refuses a put with the pool's error.
#[test]
fn a_put_into_a_pool_pinned_full_is_refused_and_changes_nothing() {
    let mut t = tiers(2, None);
    put(&mut t, &[1, 2]);
    let pin = t.pin_prefix(&ns(), &[h(1), h(2)]);
    t.take_effects();
    let e = t.put(&ns(), &shape(), 0, &[(h(3), bytes(3))]).unwrap_err();
    assert!(
        matches!(e, TierError::Cache(CacheError::Full { capacity: 2, .. })),
        "{e:?}"
    );
    assert!(t.take_effects().is_empty());
    t.unpin(&ns(), &[h(1), h(2)], &pin.holds);
    assert_eq!(t.cache().stats().pins, 0);
}

/// A save larger than RAM: its reservations end where RAM is full of its own, and its
/// present blocks are held while the later ones are reserved.
#[test]
fn a_save_larger_than_ram_reserves_its_prefix() {
    let mut t = tiers(4, None);
    put(&mut t, &[1, 2]);
    t.take_effects();
    let hashes: Vec<BlockHash> = (1..=6).map(h).collect();
    let (slots, present) = t.reserve_save(&ns(), 1, 0, BLOCK, &hashes).unwrap();
    assert_eq!(present, 2);
    let idx: Vec<usize> = slots.iter().map(|(i, _)| *i).collect();
    assert_eq!(
        idx,
        vec![2, 3],
        "blocks 3 and 4 fit beside the present 1 and 2"
    );
    assert!(withdrawn(&t.take_effects()).is_empty());
    let (sealed, _) = t.commit(&ns(), 0, &[h(3), h(4)]);
    assert_eq!(sealed, 2);
    assert_eq!(published(&t.take_effects()), vec![h(3), h(4)]);
    assert_eq!(t.cache().prefix_len(&ns(), &hashes), 4);
    let s = t.cache().stats();
    assert_eq!((s.pinned_blocks, s.pins), (0, 0));
}

/// With an SSD tier a put larger than RAM spills its first blocks to disk (they stay
/// served), and advertises each block before its move: the directory and the event log,
/// which follow the effects in order, end where the tiers are.
#[test]
fn with_an_ssd_a_put_larger_than_ram_spills_its_first_blocks_advertised_first() {
    let mut t = tiers(4, Some(FakeDisk::new(16)));
    let blocks: Vec<_> = (1..=6).map(|i| (h(i), bytes(i))).collect();
    let (r, _) = t.put(&ns(), &shape(), 0, &blocks).unwrap();
    assert_eq!((r.written, r.not_stored), (6, 0));
    let fx = t.take_effects();
    assert!(withdrawn(&fx).is_empty(), "on disk: still served");
    assert_eq!(writes(&fx), vec![key(1), key(2)]);
    assert_eq!(published(&fx), (1..=6).map(h).collect::<Vec<_>>());
    for i in [1, 2] {
        let published_at = fx
            .iter()
            .position(|e| matches!(e, Effect::Publish { hashes, .. } if hashes.contains(&h(i))));
        let written_at = fx
            .iter()
            .position(|e| matches!(e, Effect::Watch { write, .. } if write.key == key(i)));
        assert!(
            published_at < written_at,
            "block {i}: published at {published_at:?}, spilled at {written_at:?}"
        );
    }
    assert_eq!(t.cache().stats().pins, 0);
}

fn left(fx: &[Effect<()>], want: crate::tier::quota::Tier) -> Vec<BlockHash> {
    fx.iter()
        .flat_map(|e| match e {
            Effect::LeftTier { hashes, tier, .. } if *tier == want => hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

/// A block that leaves one tier while the other holds it is said to have left that tier
/// (the event log makes BlockRemoved of that medium of it), and is not withdrawn.
#[test]
fn a_block_leaving_one_tier_while_the_other_holds_it_is_reported_for_that_tier() {
    use crate::tier::quota::Tier;
    let settle = |t: &mut Tiers<FakeDisk>| {
        for w in pending(t.take_effects()) {
            t.handle_write_done(w, Ok(()));
        }
        t.take_effects();
    };
    // RAM of 4, a disk of 2 slots, every sealed block written through: 3's write takes the
    // disk slot of 1, which RAM still holds.
    let mut t = tiers(4, Some(FakeDisk::new(2).writing_through()));
    put(&mut t, &[1, 2]);
    settle(&mut t);
    put(&mut t, &[3]);
    let fx = t.take_effects();
    assert_eq!(left(&fx, Tier::Ssd), vec![h(1)]);
    assert!(left(&fx, Tier::Ram).is_empty());
    assert!(withdrawn(&fx).is_empty(), "RAM still serves 1");
    assert!(t.cache().contains(&ns(), h(1)) && !t.ssd().unwrap().contains(&key(1)));

    // RAM of 2 over a disk of 8: 3 evicts 1 from RAM, whose copy the disk holds.
    let mut t = tiers(2, Some(FakeDisk::new(8).writing_through()));
    put(&mut t, &[1, 2]);
    settle(&mut t);
    put(&mut t, &[3]);
    let fx = t.take_effects();
    assert_eq!(left(&fx, Tier::Ram), vec![h(1)]);
    assert!(left(&fx, Tier::Ssd).is_empty());
    assert!(withdrawn(&fx).is_empty(), "the disk still serves 1");
    assert!(!t.cache().contains(&ns(), h(1)) && t.ssd().unwrap().contains(&key(1)));
}
