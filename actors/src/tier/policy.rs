//! `Tiers`: the block store's decisions about RAM and SSD, as a plain struct. No actor, no
//! channel awaited, no clock: the store actor (or a test, on a fake [`Disk`]) calls its
//! methods, passing `now` where time matters, and executes the [`Effect`]s it queues
//! ([`Tiers::take_effects`]): directory calls, SSD writes to watch, durability answers.
//!
//! The rules it keeps:
//! - **Spill**: a block RAM evicts is written to SSD (write-behind) from its freed slot,
//!   right after the reservation that evicted it and before that slot is written; a block
//!   that gets no disk write (backlog full, every disk slot busy) leaves the node and is
//!   withdrawn. Only blocks that no tier holds any more are withdrawn.
//! - **Write-through**: every newly sealed block is queued for SSD too, pinned in RAM (its
//!   bytes stay in its slot) until its write is queued; blocks wait for room in the write
//!   backlog in order, and each one's outcome ([`Effect::Durable`]) arrives once it is on
//!   disk, or as the error that kept it off (a full disk: not durable).
//! - **Promotion**: SSD blocks a peer reads are held on disk first (so that making room in
//!   RAM, which writes evicted blocks to disk, cannot evict them), then get RAM slots and
//!   are read into them; the prefix ends at the first block that got no slot or whose read
//!   was bad, and a damaged block leaves the tier.
//! - **A request's prefix is kept**: a save's blocks are pinned by their writers until it
//!   commits, and a put holds its blocks until it ends where RAM is the last tier (no SSD,
//!   or a namespace under a quota), so neither evicts its own earlier blocks. A block
//!   refused for its namespace's quota, or for a pool full of pinned blocks (a request
//!   larger than RAM), ends the request there — the blocks before it are kept, advertised
//!   and answered as written, the rest are reported not stored (a prefix is what a later
//!   query can use). With an SSD tier a put larger than RAM spills its first blocks to
//!   disk; each block is advertised before any move of it, so the directory and the events
//!   end where the tiers are.
//! - **Quotas**: a namespace at its RAM quota replaces its own oldest block
//!   ([`crate::tier::quota`]).
//! - **Pins**: a lease's RAM blocks are pinned and its SSD blocks held on disk; a peer's pin
//!   expires after its TTL. Pinned blocks are never evicted.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use kvferry_gpu::KvShape;

use crate::api::StoreReport;
use crate::model::{BlockHash, BlockKey, Namespace};
use crate::peer::pins::PeerPins;
use crate::tier::cache::{BlockCache, BlockClass, CacheError, Reservation, SlotRef};
use crate::tier::pool::HostPool;
use crate::tier::quota::QuotaRules;
use crate::tier::ssd::tier::PendingWrite;
use crate::tier::ssd::{SsdError, SsdTier};
use crate::tier::TierError;

mod disk;
mod pins;
mod promote;
mod spill;

pub use disk::Disk;
pub use pins::{LeasePin, SsdBlock};
pub use promote::LocalPin;
use spill::WaitingWrite;

#[cfg(test)]
mod quota_tests;
#[cfg(test)]
mod tests;

/// What the driver does for the policy.
#[derive(Debug)]
pub enum Effect<W> {
    /// Advertise newly sealed blocks.
    Publish {
        namespace: Namespace,
        hashes: Vec<BlockHash>,
    },
    /// Withdraw blocks that left this node (no tier holds them).
    Withdraw {
        namespace: Namespace,
        hashes: Vec<BlockHash>,
    },
    /// A queued SSD write: await `wait`, then hand its outcome to
    /// [`Tiers::handle_write_done`].
    Watch { write: PendingWrite, wait: W },
    /// `key`'s write outcome, for everyone waiting for it to be on disk.
    Durable {
        key: BlockKey,
        out: Result<(), SsdError>,
    },
    /// Blocks left `tier` while the other tier still holds them: nothing changes for the
    /// directory (the node still serves them); the event log hears of it.
    LeftTier {
        namespace: Namespace,
        hashes: Vec<BlockHash>,
        tier: crate::tier::quota::Tier,
    },
}

pub struct Tiers<D: Disk> {
    cache: BlockCache,
    /// The SSD tier behind the pool; None: RAM only.
    ssd: Option<D>,
    /// `(tp, block bytes)` of every namespace seen: what an evicted block's bytes are.
    shapes: HashMap<Namespace, (u32, u64)>,
    /// SSD blocks held on disk for leases (released with the lease's pins).
    ssd_held: usize,
    /// Pool slots lent to loads as staging for their SSD reads.
    staging: usize,
    /// Write-through blocks waiting for room in the write backlog, oldest first. Each is
    /// pinned in RAM (its bytes stay in its slot) until its write is queued.
    wt_waiting: VecDeque<WaitingWrite>,
    peer_pins: PeerPins,
    effects: Vec<Effect<D::WriteWait>>,
    /// The namespaces' quotas, RAM's and the SSD tier's (kept for a tier set later).
    quotas: QuotaRules,
}

impl<D: Disk> Tiers<D> {
    pub fn new(pool: HostPool, ssd: Option<D>, peer_pin_ttl: Duration) -> Self {
        Self::with_quotas(pool, ssd, peer_pin_ttl, QuotaRules::default())
    }

    /// Like [`Self::new`], with the namespaces' RAM quotas.
    pub fn with_quotas(
        pool: HostPool,
        ssd: Option<D>,
        peer_pin_ttl: Duration,
        quotas: QuotaRules,
    ) -> Self {
        let mut ssd = ssd;
        if let Some(d) = ssd.as_mut() {
            d.set_quotas(quotas.clone());
        }
        Self {
            cache: BlockCache::with_quotas(pool, quotas.clone()),
            quotas,
            ssd,
            shapes: HashMap::new(),
            ssd_held: 0,
            staging: 0,
            wt_waiting: VecDeque::new(),
            peer_pins: PeerPins::new(peer_pin_ttl),
            effects: Vec::new(),
        }
    }

    /// The namespaces' RAM and SSD quotas; before any block is stored (see
    /// [`BlockCache::set_quotas`]; on SSD what a warm restart found counts).
    pub fn set_quotas(&mut self, rules: QuotaRules) {
        self.cache.set_quotas(rules.clone());
        if let Some(d) = self.ssd.as_mut() {
            d.set_quotas(rules.clone());
        }
        self.quotas = rules;
    }

    pub fn set_ssd(&mut self, ssd: Option<D>) {
        self.ssd = ssd;
        if let Some(d) = self.ssd.as_mut() {
            d.set_quotas(self.quotas.clone());
        }
    }

    /// What the driver must do now, in order.
    pub fn take_effects(&mut self) -> Vec<Effect<D::WriteWait>> {
        std::mem::take(&mut self.effects)
    }

    pub fn cache(&self) -> &BlockCache {
        &self.cache
    }

    pub fn pool(&self) -> &HostPool {
        self.cache.pool()
    }

    pub fn ssd(&self) -> Option<&D> {
        self.ssd.as_ref()
    }

    /// How many leading `hashes` this node holds, sealed in RAM or on its disk (a query
    /// would find each in one tier or the other): what a Lookup answers for this node.
    pub fn held_prefix_len(&self, ns: &Namespace, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| {
                self.cache.prefix_len(ns, std::slice::from_ref(*h)) == 1
                    || self.ssd.as_ref().is_some_and(|d| {
                        d.contains(&BlockKey {
                            namespace: ns.clone(),
                            hash: **h,
                        })
                    })
            })
            .count()
    }

    /// SSD blocks held on disk for leases.
    pub fn ssd_held(&self) -> usize {
        self.ssd_held
    }

    /// Pool slots lent to loads as staging.
    pub fn staging(&self) -> usize {
        self.staging
    }

    pub fn learn_shape(&mut self, ns: &Namespace, tp: u32, block_bytes: u64) {
        // A namespace names its shape (the fingerprint has TP and sizes): the first wins.
        self.shapes.entry(ns.clone()).or_insert((tp, block_bytes));
    }

    fn block_len(&self, ns: &Namespace) -> u64 {
        self.shapes
            .get(ns)
            .map_or(self.cache.pool().slot_bytes(), |s| s.1)
    }

    /// Newly sealed blocks: advertised, written through, and what their reservations
    /// evicted handled. Returns the keys whose [`Effect::Durable`] answers the caller
    /// (write-through only); the driver registers for them before it runs the effects.
    pub fn handle_sealed(&mut self, ns: &Namespace, sealed: &[BlockHash]) -> Vec<BlockKey> {
        self.publish(ns, sealed.to_vec());
        let keys = self.write_through(ns, sealed);
        self.handle_evictions();
        keys
    }

    /// Writes one rank's bytes of whole blocks into RAM (validated first: a bad request
    /// changes nothing). Returns its report (`seconds` unset) and the keys whose
    /// write-through outcome answers it.
    pub fn put(
        &mut self,
        ns: &Namespace,
        shape: &KvShape,
        rank: u32,
        blocks: &[(BlockHash, Vec<u8>)],
    ) -> Result<(StoreReport, Vec<BlockKey>), TierError> {
        self.learn_shape(ns, shape.tp_size(), shape.block_bytes());
        let rank_bytes = shape.rank_bytes();
        for (i, (_, data)) in blocks.iter().enumerate() {
            if data.len() as u64 != rank_bytes {
                return Err(TierError::bad(format!(
                    "block #{i} has {} bytes, one rank's part is {rank_bytes}",
                    data.len()
                )));
            }
        }
        let mut report = StoreReport::default();
        let offset = shape.rank_offset(rank);
        let mut sealed = Vec::new();
        // Sealed here and not advertised yet: advertised before any eviction is handled, so
        // a block this put seals and then spills (or drops) is published before it is
        // withdrawn or moved, never after.
        let mut unpublished = Vec::new();
        // Without an SSD tier a block RAM evicts leaves the node, so the put's blocks are
        // held until it ends, written or present: its later blocks evict older blocks, never
        // its own prefix (RAM would keep the put's tail, which no query can use). Under a
        // quota likewise: a namespace at its quota gives up older blocks, never this
        // request's. With an SSD tier and no quota, a put larger than RAM spills its first
        // blocks to disk, where they stay served.
        let hold = self.ssd.is_none() || self.cache.has_quota(ns);
        let mut held = Vec::new();
        let mut stored = 0;
        for (hash, data) in blocks {
            let r = self.cache.reserve(
                ns,
                *hash,
                shape.tp_size(),
                rank,
                shape.block_bytes(),
                BlockClass::Retained,
            );
            if self.cache.has_evicted() {
                self.publish(ns, std::mem::take(&mut unpublished));
            }
            // Before the slot is written: an evicted block's bytes are still in it.
            self.handle_evictions();
            match r {
                // RAM is full of this put's prefix and pinned blocks, or the namespace's
                // quota is reached: the put ends here, what it stored before is answered
                // below (nothing stored: the error is the answer).
                Err(e) if e.ends_request() && stored > 0 => break,
                Err(e) => {
                    // The blocks sealed so far are kept; nobody waits for their disk writes.
                    self.cache.unpin(ns, &held);
                    self.publish(ns, unpublished);
                    self.write_through(ns, &sealed);
                    self.handle_evictions();
                    return Err(e.into());
                }
                Ok(Reservation::Present) => {
                    if hold {
                        self.cache.hold(ns, *hash);
                        held.push(*hash);
                    }
                    report.present += 1;
                }
                Ok(Reservation::Write(slot)) => {
                    self.cache.pool().write(slot.slot, offset, data);
                    if hold {
                        self.cache.hold(ns, *hash);
                        held.push(*hash);
                    }
                    if self.cache.commit(ns, *hash, rank) {
                        sealed.push(*hash);
                        unpublished.push(*hash);
                    }
                    report.written += 1;
                    report.bytes += rank_bytes;
                }
            }
            stored += 1;
        }
        self.cache.unpin(ns, &held);
        report.not_stored = blocks.len() - stored;
        report.sealed = sealed.len();
        self.publish(ns, unpublished);
        let keys = self.write_through(ns, &sealed);
        self.handle_evictions();
        Ok((report, keys))
    }

    /// Advertises newly sealed blocks (nothing for none).
    fn publish(&mut self, ns: &Namespace, hashes: Vec<BlockHash>) {
        if !hashes.is_empty() {
            self.effects.push(Effect::Publish {
                namespace: ns.clone(),
                hashes,
            });
        }
    }

    /// Reserves RAM for a save's blocks (class retained); returns the slots to copy into
    /// (with each block's index in `hashes`) and how many were present. A block refused for
    /// its namespace's quota ends the list there (the caller copies what was reserved; with
    /// nothing reserved it is the error); on any error every reservation made is aborted.
    pub fn reserve_save(
        &mut self,
        ns: &Namespace,
        tp: u32,
        rank: u32,
        block_bytes: u64,
        hashes: &[BlockHash],
    ) -> Result<(Vec<(usize, SlotRef)>, usize), CacheError> {
        let mut slots = Vec::with_capacity(hashes.len());
        let mut present = 0;
        // Present blocks are held while the later ones are reserved (the reserved ones are
        // pinned by their writers): the save's own prefix is never what makes room.
        let mut held = Vec::new();
        for (i, hash) in hashes.iter().enumerate() {
            let r = self
                .cache
                .reserve(ns, *hash, tp, rank, block_bytes, BlockClass::Retained);
            // Before the copies start: an evicted block's bytes are still in its slot.
            self.handle_evictions();
            match r {
                Ok(Reservation::Present) => {
                    self.cache.hold(ns, *hash);
                    held.push(*hash);
                    present += 1;
                }
                Ok(Reservation::Write(slot)) => slots.push((i, slot)),
                // RAM or the quota is full: the save ends here, the blocks before it are
                // copied (none: the error is the answer).
                Err(e) if e.ends_request() && !slots.is_empty() => break,
                Err(e) => {
                    // Aborted synchronously so the error leaves no state.
                    for (i, _) in slots {
                        self.cache.abort(ns, hashes[i]);
                    }
                    self.cache.unpin(ns, &held);
                    return Err(e);
                }
            }
        }
        self.cache.unpin(ns, &held);
        Ok((slots, present))
    }

    /// Marks rank parts written; returns how many blocks this sealed and the keys whose
    /// write-through outcome answers the caller.
    pub fn commit(
        &mut self,
        ns: &Namespace,
        rank: u32,
        hashes: &[BlockHash],
    ) -> (usize, Vec<BlockKey>) {
        let sealed: Vec<BlockHash> = hashes
            .iter()
            .copied()
            .filter(|h| self.cache.commit(ns, *h, rank))
            .collect();
        // Advertised like any sealed block (a put's or a fetch's): peers find saved blocks
        // in the directory, and the event log hears of them.
        if !sealed.is_empty() {
            self.effects.push(Effect::Publish {
                namespace: ns.clone(),
                hashes: sealed.clone(),
            });
        }
        (sealed.len(), self.write_through(ns, &sealed))
    }

    /// Drops a writer's reservation of one block.
    pub fn abort(&mut self, ns: &Namespace, hash: BlockHash) {
        self.cache.abort(ns, hash);
        self.handle_sealed(ns, &[]);
    }

    /// Evicts every unpinned fetched copy; returns how many.
    pub fn drop_reclaimable(&mut self) -> usize {
        let n = self.cache.drop_reclaimable();
        self.handle_evictions();
        n
    }

    /// Reserves slots (class reclaimable) for a staged remote read: each slot and whether
    /// the part must be written (false: it is here already). On an error nothing is left
    /// reserved or pinned.
    pub fn reserve_fetch(
        &mut self,
        ns: &Namespace,
        tp: u32,
        rank: u32,
        block_bytes: u64,
        hashes: &[BlockHash],
    ) -> Result<Vec<(BlockHash, SlotRef, bool)>, CacheError> {
        self.learn_shape(ns, tp, block_bytes);
        let mut slots = Vec::with_capacity(hashes.len());
        for hash in hashes {
            let r = self.cache.reserve_fetch(ns, *hash, tp, rank, block_bytes);
            // Before the remote read lands: an evicted block's bytes are still in its slot.
            self.handle_evictions();
            match r {
                Ok((slot, must_write)) => slots.push((*hash, slot, must_write)),
                Err(e) => {
                    // Undone synchronously so the error leaves no state behind.
                    for (h, _, w) in slots {
                        if w {
                            self.cache.abort(ns, h);
                        } else {
                            self.cache.unpin_one(ns, h);
                        }
                    }
                    self.handle_evictions();
                    return Err(e);
                }
            }
        }
        self.handle_evictions();
        Ok(slots)
    }

    /// Ends a staged fetch: commits (or, unfinished, aborts) the written parts and unpins
    /// the others.
    pub fn finish_fetch(
        &mut self,
        ns: &Namespace,
        rank: u32,
        pinned: Vec<(BlockHash, bool)>,
        commit: bool,
    ) {
        let mut sealed = Vec::new();
        for (hash, written) in pinned {
            match (written, commit) {
                (true, true) => {
                    if self.cache.commit(ns, hash, rank) {
                        sealed.push(hash);
                    }
                }
                (true, false) => self.cache.abort(ns, hash),
                (false, _) => self.cache.unpin_one(ns, hash),
            }
        }
        self.handle_sealed(ns, &sealed);
    }

    /// Lends up to `want` pool slots (at least one, evicting unpinned blocks as needed)
    /// for a load's SSD reads.
    pub fn reserve_staging(&mut self, want: usize) -> Result<Vec<SlotRef>, CacheError> {
        let mut slots = Vec::with_capacity(want);
        for _ in 0..want {
            let r = self.cache.alloc_staging();
            // Before the read lands: an evicted block's bytes are still in its slot.
            self.handle_evictions();
            match r {
                Ok(s) => slots.push(s),
                // Fewer slots make a shorter pipeline, not a failed load.
                Err(_) if !slots.is_empty() => break,
                Err(e) => return Err(e),
            }
        }
        self.staging += slots.len();
        Ok(slots)
    }

    pub fn free_staging(&mut self, slots: Vec<usize>) {
        self.staging = self.staging.saturating_sub(slots.len());
        for s in slots {
            self.cache.free_staging(s);
        }
    }
}

impl Tiers<SsdTier> {
    /// A stopping node keeps what RAM holds: every sealed block not on SSD yet is queued
    /// for writing (waiting for room in the backlog: no actor runs any more, the stop waits
    /// for the disks, in bounded memory). Returns how many were queued.
    pub fn write_back_all(&mut self) -> usize {
        let Some(ssd) = self.ssd.as_mut() else {
            return 0;
        };
        let pool = self.cache.pool();
        let mut queued = 0;
        for (key, slot, tp) in self.cache.sealed_blocks() {
            if ssd.contains(key) {
                continue;
            }
            let len = self
                .shapes
                .get(&key.namespace)
                .map_or(pool.slot_bytes(), |s| s.1);
            ssd.wait_for_room(len);
            if ssd
                .write(key, tp, len, |dst| pool.read(slot, 0, dst))
                .is_ok()
            {
                queued += 1;
            }
        }
        queued
    }
}

/// Groups block keys by namespace, for one directory call each.
pub(crate) fn by_namespace(
    keys: impl IntoIterator<Item = BlockKey>,
) -> Vec<(Namespace, Vec<BlockHash>)> {
    let mut by_ns: Vec<(Namespace, Vec<BlockHash>)> = Vec::new();
    for key in keys {
        match by_ns.iter_mut().find(|(ns, _)| *ns == key.namespace) {
            Some((_, hashes)) => hashes.push(key.hash),
            None => by_ns.push((key.namespace, vec![key.hash])),
        }
    }
    by_ns
}
