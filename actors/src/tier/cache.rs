//! The block cache: which host slot holds which block, sealing, pins and LRU eviction.
//!
//! Plain state, no actor: [`crate::tier::store::BlockStore`] drives it. Every namespace's
//! RAM use is counted, and a namespace under a quota is admitted by the rules of
//! [`crate::tier::quota`].

use hashbrown::{Equivalent, HashMap};
use thiserror::Error;

use crate::model::{BlockHash, BlockKey, Namespace};
use crate::tier::pool::{HostPool, PoolError};
use crate::tier::quota::{Admission, QuotaRules, TenantId, TenantUsage, Tenants};
use crate::tier::slot_lru::SlotLru;

/// Eviction class: fetched copies go before blocks this node saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockClass {
    /// Saved here by a local engine.
    Retained,
    /// A copy fetched from a peer; evicted first.
    Reclaimable,
}

impl BlockClass {
    fn idx(self) -> usize {
        match self {
            BlockClass::Reclaimable => 0,
            BlockClass::Retained => 1,
        }
    }
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CacheError {
    #[error("block of {need} bytes does not fit a {slot}-byte pool slot")]
    BlockTooLarge { need: u64, slot: u64 },
    #[error("host pool full: {capacity} slots, {pinned} pinned, nothing evictable")]
    Full { capacity: usize, pinned: usize },
    #[error("rank {rank} out of range for tp {tp}")]
    RankOutOfRange { rank: u32, tp: u32 },
    #[error("block {hash:?} was stored with tp {stored}, written now with tp {tp}")]
    TpMismatch {
        hash: BlockHash,
        stored: u32,
        tp: u32,
    },
    /// The namespace holds its whole RAM quota and every block of it is pinned (by leases
    /// or writers): the block is refused, the others' blocks are never taken instead.
    #[error(
        "namespace {namespace} holds its RAM quota ({quota} bytes, {blocks} blocks) and all \
         of it is pinned"
    )]
    OverQuota {
        namespace: Namespace,
        quota: u64,
        blocks: usize,
    },
    /// The namespace's RAM quota is 0: it is never cached here.
    #[error("namespace {namespace} has a RAM quota of 0: its blocks are never admitted")]
    NotAdmitted { namespace: Namespace },
    #[error(transparent)]
    Pool(#[from] PoolError),
}

impl CacheError {
    /// Ends a put or a save at this block, keeping the blocks before it: refused for the
    /// namespace's quota, or no slot left that the request itself does not hold.
    pub fn ends_request(&self) -> bool {
        self.is_quota() || matches!(self, CacheError::Full { .. })
    }

    /// Refused for the namespace's quota (the request keeps the blocks admitted before).
    pub fn is_quota(&self) -> bool {
        matches!(
            self,
            CacheError::OverQuota { .. } | CacheError::NotAdmitted { .. }
        )
    }
}

#[derive(Debug)]
struct Entry {
    slot: usize,
    tp: u32,
    written: u64,
    pins: u32,
    class: BlockClass,
    tenant: TenantId,
}

impl Entry {
    fn sealed(&self) -> bool {
        self.written == full_mask(self.tp)
    }
}

fn full_mask(tp: u32) -> u64 {
    if tp >= 64 {
        u64::MAX
    } else {
        (1u64 << tp) - 1
    }
}

/// One pinned block as handed to a lease or a writer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotRef {
    pub hash: BlockHash,
    pub slot: usize,
    pub addr: u64,
}

/// Result of reserving a block for writing one rank's part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// Write this rank's part here; the block is pinned until commit or abort.
    Write(SlotRef),
    /// This rank's part is already present; nothing to write, nothing pinned.
    Present,
}

/// A sealed block that left the cache. Its slot is free, but its bytes stay as they were
/// until the slot's next writer writes (the store copies them to the SSD tier before that).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evicted {
    pub key: BlockKey,
    pub slot: usize,
    pub tp: u32,
}

/// Gauges an operator asks about.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub blocks: usize,
    pub sealed: usize,
    pub pinned_blocks: usize,
    pub pins: u64,
    pub capacity: usize,
    pub evictions: u64,
}

/// A borrowed [`BlockKey`]: looks an entry up without cloning the namespace. It hashes as
/// the key does (the derived `Hash` of both writes the namespace, then the hash).
#[derive(Hash)]
struct KeyRef<'a> {
    namespace: &'a Namespace,
    hash: &'a BlockHash,
}

impl Equivalent<BlockKey> for KeyRef<'_> {
    fn equivalent(&self, key: &BlockKey) -> bool {
        *self.hash == key.hash && *self.namespace == key.namespace
    }
}

// A query of 1,024 hashes looks each up once: SipHash over namespace and hash was the
// largest part of its cost, so the map uses hashbrown's default (foldhash). The keys are
// the engine's prefix hashes, not chosen by an attacker who could flood one bucket.
pub struct BlockCache {
    pool: HostPool,
    map: HashMap<BlockKey, Entry>,
    /// Unpinned blocks by class, oldest first; an entry is listed exactly while it has
    /// no pins.
    lru: SlotLru<BlockKey>,
    /// The same entries of namespaces under a quota, by namespace and class (list
    /// [`own_list`]): what a namespace at its quota gives up first.
    own: SlotLru<BlockKey>,
    tenants: Tenants,
    /// Entries with every rank written (kept here: `stats` is asked on every Health call).
    sealed: usize,
    pinned_blocks: usize,
    pins: u64,
    evictions: u64,
    /// Sealed blocks evicted since the last `take_evicted` (to withdraw from the directory).
    evicted: Vec<Evicted>,
}

/// The list of `tenant`'s unpinned blocks of `class` in [`BlockCache::own`].
fn own_list(tenant: TenantId, class: usize) -> usize {
    tenant as usize * 2 + class
}

impl BlockCache {
    pub fn new(pool: HostPool) -> Self {
        Self::with_quotas(pool, QuotaRules::default())
    }

    /// A cache whose namespaces are held to `rules` (see [`crate::tier::quota`]).
    pub fn with_quotas(pool: HostPool, rules: QuotaRules) -> Self {
        let tenants = Tenants::new(rules, pool.slot_bytes());
        Self {
            pool,
            map: HashMap::new(),
            lru: SlotLru::with_lists(2),
            own: SlotLru::with_lists(0),
            tenants,
            sealed: 0,
            pinned_blocks: 0,
            pins: 0,
            evictions: 0,
            evicted: Vec::new(),
        }
    }

    /// Lists an unpinned entry as the youngest of its class (and of its namespace's).
    fn list_young(&mut self, class: BlockClass, tenant: TenantId, slot: usize, key: BlockKey) {
        if self.tenants.has_quota(tenant) {
            self.own
                .push_young(own_list(tenant, class.idx()), slot, key.clone());
        }
        self.lru.push_young(class.idx(), slot, key);
    }

    /// Unlists an entry (it was pinned or it goes).
    fn unlist(&mut self, slot: usize) {
        self.own.remove(slot);
        self.lru.remove(slot);
    }

    /// Removes an unlisted, unpinned entry and frees its slot, as an eviction.
    fn drop_entry(&mut self, key: BlockKey) {
        if let Some(e) = self.map.remove(&key) {
            debug_assert_eq!(e.pins, 0);
            self.pool.free(e.slot);
            self.tenants.dropped(e.tenant);
            self.evictions += 1;
            if e.sealed() {
                self.sealed -= 1;
                self.evicted.push(Evicted {
                    key,
                    slot: e.slot,
                    tp: e.tp,
                });
            }
        }
    }

    /// Evicts `tenant`'s oldest unpinned block, fetched copies first; false if it has none.
    fn evict_own(&mut self, tenant: TenantId) -> bool {
        for class in 0..2 {
            if let Some((slot, key)) = self.own.pop_oldest(own_list(tenant, class)) {
                self.lru.remove(slot);
                self.drop_entry(key);
                return true;
            }
        }
        false
    }

    /// Holds the namespaces to `rules` from now on. Meant for the start: a namespace that
    /// gets a quota here while it has blocks can give up only those it stores from now on.
    pub fn set_quotas(&mut self, rules: QuotaRules) {
        self.tenants.set_rules(rules);
    }

    /// Every namespace's use of RAM, with its quota.
    pub fn usage(&self) -> Vec<TenantUsage> {
        self.tenants.usage()
    }

    /// Whether a sealed block was evicted since the last [`Self::take_evicted`].
    pub fn has_evicted(&self) -> bool {
        !self.evicted.is_empty()
    }

    /// Sealed blocks evicted since the last call.
    pub fn take_evicted(&mut self) -> Vec<Evicted> {
        std::mem::take(&mut self.evicted)
    }

    pub fn pool(&self) -> &HostPool {
        &self.pool
    }

    fn key(ns: &Namespace, hash: BlockHash) -> BlockKey {
        BlockKey {
            namespace: ns.clone(),
            hash,
        }
    }

    fn get(&self, ns: &Namespace, hash: &BlockHash) -> Option<&Entry> {
        self.map.get(&KeyRef {
            namespace: ns,
            hash,
        })
    }

    fn slot_ref(&self, hash: BlockHash, slot: usize) -> SlotRef {
        SlotRef {
            hash,
            slot,
            addr: self.pool.slot_addr(slot),
        }
    }

    /// Takes one pin on an entry, moving it out of the LRU on its first pin.
    fn pin_entry(&mut self, key: &BlockKey) {
        let Some(e) = self.map.get_mut(key) else {
            return;
        };
        let first = e.pins == 0;
        let slot = e.slot;
        e.pins += 1;
        self.pins += 1;
        if first {
            self.pinned_blocks += 1;
            self.unlist(slot);
        }
    }

    /// [`Self::unpin_ref`] by an owned key.
    fn unpin_entry(&mut self, key: &BlockKey) {
        self.unpin_ref(&key.namespace, &key.hash);
    }

    /// Length of the sealed prefix of `hashes` held here.
    pub fn prefix_len(&self, ns: &Namespace, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.get(ns, h).is_some_and(Entry::sealed))
            .count()
    }

    /// Pins the sealed prefix of `hashes` and returns its slots, in order.
    pub fn pin_prefix(&mut self, ns: &Namespace, hashes: &[BlockHash]) -> Vec<SlotRef> {
        let mut out = Vec::new();
        for h in hashes {
            match self.pin_sealed(ns, h) {
                Some(s) => out.push(s),
                None => break,
            }
        }
        out
    }

    /// Pins one block if it is held here and sealed: one lookup, no allocation.
    pub fn pin_sealed(&mut self, ns: &Namespace, hash: &BlockHash) -> Option<SlotRef> {
        let e = self.map.get_mut(&KeyRef {
            namespace: ns,
            hash,
        })?;
        if !e.sealed() {
            return None;
        }
        let first = e.pins == 0;
        e.pins += 1;
        self.pins += 1;
        let slot = e.slot;
        if first {
            self.pinned_blocks += 1;
            self.unlist(slot);
        }
        Some(self.slot_ref(*hash, slot))
    }

    /// Whether `ns` is held to a quota.
    pub fn has_quota(&self, ns: &Namespace) -> bool {
        self.tenants
            .known(ns)
            .is_some_and(|t| self.tenants.has_quota(t))
    }

    /// Takes one more pin on a block held here, sealed or not (released with
    /// [`Self::unpin`]).
    pub fn hold(&mut self, ns: &Namespace, hash: BlockHash) {
        self.pin_entry(&Self::key(ns, hash));
    }

    /// Releases one pin on each block (blocks evicted meanwhile are skipped).
    pub fn unpin(&mut self, ns: &Namespace, hashes: &[BlockHash]) {
        for h in hashes {
            self.unpin_ref(ns, h);
        }
    }

    /// Drops one pin; the last one puts the entry back at the young end of its LRU.
    fn unpin_ref(&mut self, ns: &Namespace, hash: &BlockHash) {
        let Some((key, e)) = self.map.get_key_value_mut(&KeyRef {
            namespace: ns,
            hash,
        }) else {
            return;
        };
        if e.pins == 0 {
            return;
        }
        e.pins -= 1;
        self.pins -= 1;
        if e.pins == 0 {
            self.pinned_blocks -= 1;
            let (class, tenant, slot, key) = (e.class, e.tenant, e.slot, key.clone());
            self.list_young(class, tenant, slot, key);
        }
    }

    fn evict_one(&mut self) -> bool {
        for class in 0..2 {
            if let Some((slot, key)) = self.lru.pop_oldest(class) {
                self.own.remove(slot);
                self.drop_entry(key);
                return true;
            }
        }
        false
    }

    fn alloc_slot(&mut self) -> Result<usize, CacheError> {
        loop {
            match self.pool.alloc() {
                Ok(s) => return Ok(s),
                Err(PoolError::Exhausted { capacity }) => {
                    if !self.evict_one() {
                        return Err(CacheError::Full {
                            capacity,
                            pinned: self.pinned_blocks,
                        });
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Reserves `rank`'s part of a block of `block_bytes` for writing: pins the block
    /// (allocating and evicting as needed) unless that part is already present.
    pub fn reserve(
        &mut self,
        ns: &Namespace,
        hash: BlockHash,
        tp: u32,
        rank: u32,
        block_bytes: u64,
        class: BlockClass,
    ) -> Result<Reservation, CacheError> {
        if rank >= tp {
            return Err(CacheError::RankOutOfRange { rank, tp });
        }
        if block_bytes > self.pool.slot_bytes() {
            return Err(CacheError::BlockTooLarge {
                need: block_bytes,
                slot: self.pool.slot_bytes(),
            });
        }
        let key = Self::key(ns, hash);
        if let Some(e) = self.map.get_mut(&key) {
            if e.tp != tp {
                return Err(CacheError::TpMismatch {
                    hash,
                    stored: e.tp,
                    tp,
                });
            }
            let relist = class == BlockClass::Retained && e.class == BlockClass::Reclaimable;
            if relist {
                e.class = BlockClass::Retained;
            }
            let (present, slot, unpinned, tenant) =
                (e.written & (1 << rank) != 0, e.slot, e.pins == 0, e.tenant);
            if relist && unpinned {
                // Saved here now: it joins the retained class as its youngest member.
                self.list_young(BlockClass::Retained, tenant, slot, key.clone());
            }
            if present {
                return Ok(Reservation::Present);
            }
            self.pin_entry(&key);
            return Ok(Reservation::Write(self.slot_ref(hash, slot)));
        }
        let tenant = self.tenants.id(ns);
        match self.tenants.admission(tenant) {
            Admission::Admit => {}
            Admission::Never => {
                self.tenants.refused(tenant);
                return Err(CacheError::NotAdmitted {
                    namespace: ns.clone(),
                });
            }
            // At its quota: one of its own blocks makes room, never another namespace's.
            Admission::ReplaceOwn { quota_slots } => {
                if !self.evict_own(tenant) {
                    self.tenants.refused(tenant);
                    return Err(CacheError::OverQuota {
                        namespace: ns.clone(),
                        quota: (quota_slots as u64).saturating_mul(self.pool.slot_bytes()),
                        blocks: self.tenants.used(tenant),
                    });
                }
            }
        }
        let slot = self.alloc_slot()?;
        self.tenants.stored(tenant);
        self.map.insert(
            key.clone(),
            Entry {
                slot,
                tp,
                written: 0,
                pins: 0,
                class,
                tenant,
            },
        );
        self.pin_entry(&key);
        Ok(Reservation::Write(self.slot_ref(hash, slot)))
    }

    /// Like [`Self::reserve`] for a fetched copy, but a part that is already present is
    /// pinned too and returned, so the caller can copy it to the device: `(slot, must_write)`.
    pub fn reserve_fetch(
        &mut self,
        ns: &Namespace,
        hash: BlockHash,
        tp: u32,
        rank: u32,
        block_bytes: u64,
    ) -> Result<(SlotRef, bool), CacheError> {
        match self.reserve(ns, hash, tp, rank, block_bytes, BlockClass::Reclaimable)? {
            Reservation::Write(slot) => Ok((slot, true)),
            Reservation::Present => {
                let key = Self::key(ns, hash);
                self.pin_entry(&key);
                let slot = self.map[&key].slot;
                Ok((self.slot_ref(hash, slot), false))
            }
        }
    }

    /// A slot outside the map, evicting as needed: a load's staging slot for an SSD read
    /// (its bytes are copied to the device and the slot goes back with [`Self::free_staging`]).
    pub fn alloc_staging(&mut self) -> Result<SlotRef, CacheError> {
        let slot = self.alloc_slot()?;
        Ok(self.slot_ref(BlockHash::from_u64(0), slot))
    }

    /// Returns a slot from [`Self::alloc_staging`] to the pool.
    pub fn free_staging(&mut self, slot: usize) {
        self.pool.free(slot);
    }

    /// Drops one pin on a block without marking anything written.
    pub fn unpin_one(&mut self, ns: &Namespace, hash: BlockHash) {
        self.unpin_ref(ns, &hash);
    }

    /// Evicts every unpinned reclaimable block (fetched copies); returns how many.
    pub fn drop_reclaimable(&mut self) -> usize {
        let class = BlockClass::Reclaimable.idx();
        let mut keys = Vec::with_capacity(self.lru.len(class));
        while let Some((slot, key)) = self.lru.pop_oldest(class) {
            self.own.remove(slot);
            keys.push(key);
        }
        let n = keys.len();
        for key in keys {
            self.drop_entry(key);
        }
        n
    }

    /// Marks `rank`'s part written and drops the writer pin. Returns true when this sealed
    /// the block.
    pub fn commit(&mut self, ns: &Namespace, hash: BlockHash, rank: u32) -> bool {
        let key = Self::key(ns, hash);
        let sealed_now = match self.map.get_mut(&key) {
            Some(e) => {
                let was = e.sealed();
                e.written |= 1 << rank;
                !was && e.sealed()
            }
            None => false,
        };
        if sealed_now {
            self.sealed += 1;
        }
        self.unpin_entry(&key);
        sealed_now
    }

    /// Drops a writer pin without marking anything written; a block left with nothing
    /// written and no pins is freed at once.
    pub fn abort(&mut self, ns: &Namespace, hash: BlockHash) {
        let key = Self::key(ns, hash);
        self.unpin_entry(&key);
        if let Some(e) = self.map.get(&key) {
            if e.written == 0 && e.pins == 0 {
                let (slot, tenant) = (e.slot, e.tenant);
                self.unlist(slot);
                self.map.remove(&key);
                self.pool.free(slot);
                self.tenants.dropped(tenant);
            }
        }
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            blocks: self.map.len(),
            sealed: self.sealed,
            pinned_blocks: self.pinned_blocks,
            pins: self.pins,
            capacity: self.pool.capacity(),
            evictions: self.evictions,
        }
    }

    /// Every sealed block with its slot and TP size (a stopping store writes them to SSD).
    pub fn sealed_blocks(&self) -> impl Iterator<Item = (&BlockKey, usize, u32)> + '_ {
        self.map
            .iter()
            .filter(|(_, e)| e.sealed())
            .map(|(k, e)| (k, e.slot, e.tp))
    }

    /// Whether a block is currently held (sealed or not).
    pub fn contains(&self, ns: &Namespace, hash: BlockHash) -> bool {
        self.get(ns, &hash).is_some()
    }
}

#[cfg(test)]
mod tests;
