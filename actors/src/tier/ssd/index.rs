//! Which disk slot holds which block, and the LRU by capacity over them. Plain state, no
//! I/O: the [`super::SsdTier`] drives it on the store's actor thread, and only the reads and
//! writes it plans go to the I/O threads.
//!
//! A slot being read or held is busy: it leaves the LRU (a lease's hold, a load's read or a
//! peer's promotion cannot have its bytes overwritten) and is freed only once idle, even if
//! its block is removed meanwhile. A block being written is visible at once: reads of its
//! slot wait behind the write on the I/O thread.
//!
//! Namespaces under an SSD quota ([`crate::tier::quota`]) are admitted by its rules: one at
//! its quota takes the slot of its own oldest idle block, never a free slot or another
//! namespace's block, and is refused when it has none idle.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::model::BlockKey;
use crate::tier::quota::{Admission, QuotaRules, TenantId, TenantUsage, Tenants, Tier};

/// Where a block lives: a directory and a slot of its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Loc {
    pub dir: usize,
    pub slot: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub loc: Loc,
    pub tp: u32,
    pub len: u64,
    /// The block's LRU tick; also its write sequence number on disk.
    tick: u64,
    writing: bool,
    tenant: TenantId,
}

impl Entry {
    /// Its write has been queued and has not answered yet.
    pub fn is_writing(&self) -> bool {
        self.writing
    }
}

/// One directory's slots: `[0, fresh)` have been used (and are held or in `free`),
/// `[fresh, slots)` never were. Memory is proportional to what was used, not to the
/// configured capacity.
#[derive(Debug)]
struct Dir {
    free: Vec<u64>,
    fresh: u64,
    slots: u64,
    /// The disk said ENOSPC: no more slots of this file are taken, only reused.
    full: bool,
}

impl Dir {
    fn take(&mut self) -> Option<u64> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        if self.full || self.fresh >= self.slots {
            return None;
        }
        self.fresh += 1;
        Some(self.fresh - 1)
    }
}

/// A write the tier should issue.
#[derive(Debug, PartialEq, Eq)]
pub struct WritePlan {
    pub loc: Loc,
    pub seq: u64,
    /// The block whose slot this reuses (it left the disk tier).
    pub evicted: Option<BlockKey>,
}

/// Why a block gets no slot.
#[derive(Debug, PartialEq, Eq)]
pub enum NoSlot {
    /// It is on disk already (or being written).
    Present,
    /// Every slot is busy or being written.
    AllBusy,
    /// Its namespace holds its SSD quota and every block of it is busy, or its quota is 0.
    OverQuota,
}

#[derive(Debug)]
pub struct SsdIndex {
    dirs: Vec<Dir>,
    map: HashMap<BlockKey, Entry>,
    /// Idle, written blocks by tick: the oldest goes first.
    lru: BTreeMap<u64, BlockKey>,
    tick: u64,
    next_dir: usize,
    busy: HashMap<Loc, u32>,
    /// Slots whose block was removed while they were busy: freed when idle.
    free_when_idle: HashSet<Loc>,
    pub evictions: u64,
    tenants: Tenants,
    /// The ticks of `lru` whose block's namespace is under a quota, by namespace: what a
    /// namespace at its quota gives up first.
    own: BTreeSet<(TenantId, u64)>,
}

impl Default for SsdIndex {
    fn default() -> Self {
        Self {
            dirs: Vec::new(),
            map: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            next_dir: 0,
            busy: HashMap::new(),
            free_when_idle: HashSet::new(),
            evictions: 0,
            tenants: Tenants::of_tier(QuotaRules::default(), Tier::Ssd, 1),
            own: BTreeSet::new(),
        }
    }
}

impl SsdIndex {
    /// An empty index over directories of `slots[i]` slots each.
    pub fn new(slots: &[u64]) -> Self {
        Self {
            dirs: slots
                .iter()
                .map(|&n| Dir {
                    free: Vec::new(),
                    fresh: 0,
                    slots: n,
                    full: false,
                })
                .collect(),
            ..Default::default()
        }
    }

    /// Rebuilds an index from what a scan found: `(loc, key, tp, len, seq)`. Where two slots
    /// hold one block the later write wins; everything else stays free.
    pub fn recover(slots: &[u64], found: Vec<(Loc, BlockKey, u32, u64, u64)>) -> Self {
        let mut idx = Self::new(slots);
        let mut taken: HashSet<Loc> = HashSet::new();
        let mut found = found;
        found.sort_by_key(|f| f.4);
        for (loc, key, tp, len, seq) in found {
            if loc.dir >= idx.dirs.len() || loc.slot >= slots[loc.dir] {
                continue;
            }
            if let Some(old) = idx.map.remove(&key) {
                idx.lru.remove(&old.tick);
                taken.remove(&old.loc);
                idx.tenants.dropped(old.tenant);
            }
            // Ticks must be unique: a damaged sequence number must not hide another block.
            let tick = seq.max(idx.tick + 1);
            idx.tick = tick;
            let tenant = idx.tenants.id(&key.namespace);
            idx.tenants.stored(tenant);
            idx.map.insert(
                key.clone(),
                Entry {
                    loc,
                    tp,
                    len,
                    tick,
                    writing: false,
                    tenant,
                },
            );
            idx.lru.insert(tick, key);
            taken.insert(loc);
        }
        for (d, dir) in idx.dirs.iter_mut().enumerate() {
            let used = taken
                .iter()
                .filter(|l| l.dir == d)
                .map(|l| l.slot + 1)
                .max()
                .unwrap_or(0);
            dir.fresh = used;
            // Popped from the end: low slots first, so the used part of the file stays small.
            dir.free = (0..used)
                .rev()
                .filter(|&s| !taken.contains(&Loc { dir: d, slot: s }))
                .collect();
        }
        idx
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Holds the namespaces to `rules`' SSD quotas from now on, counted in disk slots of
    /// `slot_bytes`; blocks already on disk (a warm restart's) count, and those of a
    /// namespace with a quota are what it gives up first.
    pub fn set_quotas(&mut self, rules: QuotaRules, slot_bytes: u64) {
        self.tenants.set_rules_counted_in(rules, slot_bytes);
        self.own.clear();
        for (tick, key) in &self.lru {
            if let Some(e) = self.map.get(key) {
                if self.tenants.has_quota(e.tenant) {
                    self.own.insert((e.tenant, *tick));
                }
            }
        }
    }

    /// Every namespace's use of the tier, with its quota.
    pub fn usage(&self) -> Vec<TenantUsage> {
        self.tenants.usage()
    }

    fn lru_insert(&mut self, tick: u64, key: BlockKey, tenant: TenantId) {
        if self.tenants.has_quota(tenant) {
            self.own.insert((tenant, tick));
        }
        self.lru.insert(tick, key);
    }

    fn lru_remove(&mut self, tick: u64, tenant: TenantId) {
        self.own.remove(&(tenant, tick));
        self.lru.remove(&tick);
    }

    /// `tenant`'s oldest idle block leaves the tier; its slot, for the caller's write.
    fn evict_own(&mut self, tenant: TenantId) -> Option<(Loc, BlockKey)> {
        let &(_, tick) = self.own.range((tenant, 0)..=(tenant, u64::MAX)).next()?;
        self.own.remove(&(tenant, tick));
        let key = self.lru.remove(&tick)?;
        let e = self.map.remove(&key)?;
        self.tenants.dropped(e.tenant);
        self.evictions += 1;
        Some((e.loc, key))
    }

    pub fn get(&self, key: &BlockKey) -> Option<&Entry> {
        self.map.get(key)
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.map.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn keys(&self) -> impl Iterator<Item = &BlockKey> {
        self.map.keys()
    }

    /// Slots being read, written or held now (none of them can be evicted or reused).
    pub fn busy_slots(&self) -> usize {
        self.busy.len()
    }

    /// Slots that hold or may hold blocks now (a full directory counts only what it uses).
    pub fn capacity(&self) -> usize {
        let free: u64 = self
            .dirs
            .iter()
            .map(|d| d.free.len() as u64 + if d.full { 0 } else { d.slots - d.fresh })
            .sum();
        (self.map.len() as u64 + free + self.free_when_idle.len() as u64)
            .try_into()
            .unwrap_or(usize::MAX)
    }

    /// Slots of directory `dir` ever used: a restart scans no further.
    pub fn high_water(&self, dir: usize) -> u64 {
        self.dirs.get(dir).map_or(0, |d| d.fresh)
    }

    /// Takes a slot for `key`: a free one (directories in turn), else the least recently
    /// used idle block's; for a namespace at its quota, its own oldest idle block's.
    pub fn begin_write(&mut self, key: &BlockKey, tp: u32, len: u64) -> Result<WritePlan, NoSlot> {
        if self.map.contains_key(key) {
            return Err(NoSlot::Present);
        }
        let tenant = self.tenants.id(&key.namespace);
        let mut loc = None;
        let mut evicted = None;
        match self.tenants.admission(tenant) {
            Admission::Admit => {}
            Admission::Never => {
                self.tenants.refused(tenant);
                return Err(NoSlot::OverQuota);
            }
            Admission::ReplaceOwn { .. } => match self.evict_own(tenant) {
                Some((l, old)) => {
                    loc = Some(l);
                    evicted = Some(old);
                }
                None => {
                    self.tenants.refused(tenant);
                    return Err(NoSlot::OverQuota);
                }
            },
        }
        let n = self.dirs.len();
        for i in 0..n {
            if loc.is_some() {
                break;
            }
            let d = (self.next_dir + i) % n;
            if let Some(slot) = self.dirs[d].take() {
                loc = Some(Loc { dir: d, slot });
                self.next_dir = (d + 1) % n;
            }
        }
        let loc = match loc {
            Some(l) => l,
            None => {
                let (tick, old) = self.lru.pop_first().ok_or(NoSlot::AllBusy)?;
                let e = self.map.remove(&old).ok_or(NoSlot::AllBusy)?;
                self.own.remove(&(e.tenant, tick));
                self.tenants.dropped(e.tenant);
                self.evictions += 1;
                evicted = Some(old);
                e.loc
            }
        };
        self.tenants.stored(tenant);
        let seq = self.next_tick();
        self.map.insert(
            key.clone(),
            Entry {
                loc,
                tp,
                len,
                tick: 0,
                writing: true,
                tenant,
            },
        );
        *self.busy.entry(loc).or_default() += 1;
        Ok(WritePlan { loc, seq, evicted })
    }

    /// One read or write of `loc` finished; true when none is left.
    fn unbusy(&mut self, loc: Loc) -> bool {
        match self.busy.get_mut(&loc) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => {
                self.busy.remove(&loc);
                true
            }
        }
    }

    /// Puts an idle, written block at the young end of the LRU.
    fn touch(&mut self, key: &BlockKey) {
        let tick = self.next_tick();
        if let Some(e) = self.map.get_mut(key) {
            if !e.writing && e.tick == 0 {
                e.tick = tick;
                let tenant = e.tenant;
                self.lru_insert(tick, key.clone(), tenant);
            }
        }
    }

    /// Frees `loc` if it was waiting to be idle.
    fn settle(&mut self, loc: Loc, idle: bool, reusable: bool) {
        if idle && self.free_when_idle.remove(&loc) && reusable {
            if let Some(d) = self.dirs.get_mut(loc.dir) {
                if !d.full {
                    d.free.push(loc.slot);
                }
            }
        }
    }

    /// A write finished: the block joins the LRU, or on failure leaves the tier; `disk_full`
    /// marks its directory full (its never-written slots are dropped).
    pub fn end_write(&mut self, key: &BlockKey, loc: Loc, ok: bool, disk_full: bool) {
        let idle = self.unbusy(loc);
        if disk_full {
            if let Some(d) = self.dirs.get_mut(loc.dir) {
                d.full = true;
                d.free.clear();
            }
        }
        let ours = self.map.get(key).is_some_and(|e| e.loc == loc && e.writing);
        if ours {
            if let Some(e) = self.map.get_mut(key) {
                e.writing = false;
            }
            if !ok {
                if let Some(e) = self.map.remove(key) {
                    self.tenants.dropped(e.tenant);
                }
                self.free_when_idle.insert(loc);
            } else if idle {
                self.touch(key);
            }
        }
        self.settle(loc, idle, !disk_full);
    }

    /// Marks a block's slot busy for a read; its location and geometry.
    pub fn begin_read(&mut self, key: &BlockKey) -> Option<Entry> {
        let e = *self.map.get(key)?;
        if e.tick != 0 {
            self.lru_remove(e.tick, e.tenant);
            if let Some(m) = self.map.get_mut(key) {
                m.tick = 0;
            }
        }
        *self.busy.entry(e.loc).or_default() += 1;
        Some(e)
    }

    /// A read finished: on success the block is the most recently used; on damage it leaves
    /// the tier (returns true if this removed it).
    pub fn end_read(&mut self, key: &BlockKey, loc: Loc, ok: bool) -> bool {
        let idle = self.unbusy(loc);
        let ours = self.map.get(key).is_some_and(|e| e.loc == loc);
        let mut removed = false;
        if ours && !ok {
            removed = self.remove(key);
        } else if ours && idle {
            self.touch(key);
        }
        self.settle(loc, idle, true);
        removed
    }

    /// Drops a block from the tier (damaged on disk); its slot is freed once idle.
    pub fn remove(&mut self, key: &BlockKey) -> bool {
        let Some(e) = self.map.remove(key) else {
            return false;
        };
        self.tenants.dropped(e.tenant);
        if e.tick != 0 {
            self.lru_remove(e.tick, e.tenant);
        }
        self.free_when_idle.insert(e.loc);
        let idle = !self.busy.contains_key(&e.loc);
        self.settle(e.loc, idle, true);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{BlockHash, Namespace};

    fn k(i: u64) -> BlockKey {
        BlockKey {
            namespace: Namespace::new("m", "bf16", "t").unwrap(),
            hash: BlockHash::from_u64(i),
        }
    }

    fn write(idx: &mut SsdIndex, i: u64) -> WritePlan {
        let p = idx.begin_write(&k(i), 1, 10).unwrap();
        idx.end_write(&k(i), p.loc, true, false);
        p
    }

    #[test]
    fn lru_by_capacity_spreads_over_dirs_and_spares_busy_slots() {
        let mut idx = SsdIndex::new(&[2, 1]);
        let a = write(&mut idx, 0);
        let b = write(&mut idx, 1);
        let c = write(&mut idx, 2);
        assert_eq!(
            (a.loc.dir, b.loc.dir, c.loc.dir),
            (0, 1, 0),
            "directories in turn"
        );
        assert_eq!(idx.begin_write(&k(1), 1, 10), Err(NoSlot::Present));
        // Block 0 is read (busy, and then the youngest): block 1 goes next.
        let r = idx.begin_read(&k(0)).unwrap();
        let d = write(&mut idx, 3);
        assert_eq!(d.evicted, Some(k(1)));
        assert_eq!(d.loc, b.loc);
        idx.end_read(&k(0), r.loc, true);
        let e = write(&mut idx, 4);
        assert_eq!(e.evicted, Some(k(2)), "block 0 was used after block 2");
        assert_eq!(idx.len(), 3);
        assert_eq!(idx.evictions, 2);
        // Everything busy: no slot, nothing changes.
        let busy: Vec<_> = [0, 3, 4].map(|i| idx.begin_read(&k(i)).unwrap()).to_vec();
        assert_eq!(idx.begin_write(&k(5), 1, 10), Err(NoSlot::AllBusy));
        for (i, e) in [0, 3, 4].iter().zip(busy) {
            idx.end_read(&k(*i), e.loc, true);
        }
        assert!(idx.begin_write(&k(5), 1, 10).is_ok());
    }

    #[test]
    fn damaged_blocks_leave_and_their_slot_frees_when_idle() {
        let mut idx = SsdIndex::new(&[1]);
        write(&mut idx, 0);
        let r1 = idx.begin_read(&k(0)).unwrap();
        let r2 = idx.begin_read(&k(0)).unwrap();
        assert!(idx.end_read(&k(0), r1.loc, false), "removed");
        assert!(!idx.contains(&k(0)));
        // Still read by r2: the slot is not handed out.
        assert_eq!(idx.begin_write(&k(1), 1, 10), Err(NoSlot::AllBusy));
        assert!(!idx.end_read(&k(0), r2.loc, false));
        assert_eq!(idx.begin_write(&k(1), 1, 10).unwrap().loc, r1.loc);
    }

    #[test]
    fn failed_writes_free_the_slot_and_disk_full_stops_taking_new_ones() {
        let mut idx = SsdIndex::new(&[3]);
        let p = idx.begin_write(&k(0), 1, 10).unwrap();
        idx.end_write(&k(0), p.loc, false, false);
        assert!(!idx.contains(&k(0)));
        write(&mut idx, 1);
        let p = idx.begin_write(&k(2), 1, 10).unwrap();
        idx.end_write(&k(2), p.loc, false, true);
        assert_eq!(idx.capacity(), 1, "only the written slot remains usable");
        let p = write(&mut idx, 3);
        assert_eq!(p.evicted, Some(k(1)), "reuses the written slot in place");
    }

    #[test]
    fn recovery_keeps_the_latest_copy_and_the_lru_order() {
        let found = vec![
            (Loc { dir: 0, slot: 0 }, k(1), 1, 10, 5),
            (Loc { dir: 0, slot: 1 }, k(2), 1, 10, 3),
            (Loc { dir: 0, slot: 2 }, k(1), 1, 10, 7),
            (Loc { dir: 0, slot: 9 }, k(3), 1, 10, 8),
        ];
        let mut idx = SsdIndex::recover(&[4], found);
        assert_eq!(idx.len(), 2, "slot 9 is past the file");
        assert_eq!(idx.get(&k(1)).unwrap().loc.slot, 2);
        assert_eq!(idx.capacity(), 4);
        // Two free slots (0 and 3), then block 2 (seq 3) is the oldest.
        write(&mut idx, 10);
        write(&mut idx, 11);
        assert_eq!(write(&mut idx, 12).evicted, Some(k(2)));
        assert!(idx.begin_write(&k(13), 1, 10).unwrap().evicted == Some(k(1)));
    }

    fn kn(model: &str, i: u64) -> BlockKey {
        BlockKey {
            namespace: Namespace::new(model, "bf16", "t").unwrap(),
            hash: BlockHash::from_u64(i),
        }
    }

    fn quotas(rules: &[(&str, u64)]) -> QuotaRules {
        use crate::tier::quota::{NsMatch, QuotaRule};
        QuotaRules {
            rules: rules
                .iter()
                .map(|(p, slots)| QuotaRule {
                    matches: NsMatch::Prefix(format!("{p}/")),
                    ram: None,
                    ssd: Some(slots * 10),
                })
                .collect(),
            ..Default::default()
        }
    }

    fn write_key(idx: &mut SsdIndex, key: &BlockKey) -> Result<WritePlan, NoSlot> {
        let p = idx.begin_write(key, 1, 10)?;
        idx.end_write(key, p.loc, true, false);
        Ok(p)
    }

    #[test]
    fn a_namespace_at_its_ssd_quota_replaces_its_own_oldest_block_never_anothers() {
        // 8 slots of 10 bytes: a may hold 2, b is unlimited, off none.
        let mut idx = SsdIndex::new(&[8]);
        idx.set_quotas(quotas(&[("a", 2), ("off", 0)]), 10);
        for i in 0..3 {
            write_key(&mut idx, &kn("b", i)).unwrap();
        }
        write_key(&mut idx, &kn("a", 10)).unwrap();
        write_key(&mut idx, &kn("a", 11)).unwrap();
        // At its quota with free slots left: its own oldest goes, b's older blocks stay.
        let p = write_key(&mut idx, &kn("a", 12)).unwrap();
        assert_eq!(p.evicted, Some(kn("a", 10)));
        assert!((0..3).all(|i| idx.contains(&kn("b", i))));
        let u = idx.usage();
        let blocks = |m: &str| {
            u.iter()
                .find(|x| x.namespace.as_str().starts_with(m))
                .map_or(0, |x| x.blocks)
        };
        assert_eq!((blocks("a/"), blocks("b/")), (2, 3));
        // Every block of a busy (read, held): refused, nothing evicted, counted.
        let r11 = idx.begin_read(&kn("a", 11)).unwrap();
        let r12 = idx.begin_read(&kn("a", 12)).unwrap();
        assert_eq!(idx.begin_write(&kn("a", 13), 1, 10), Err(NoSlot::OverQuota));
        assert_eq!(idx.len(), 5);
        idx.end_read(&kn("a", 11), r11.loc, true);
        idx.end_read(&kn("a", 12), r12.loc, true);
        // Quota 0: never admitted, even with free slots.
        assert_eq!(
            idx.begin_write(&kn("off", 1), 1, 10),
            Err(NoSlot::OverQuota)
        );
        let u = idx.usage();
        let a = u
            .iter()
            .find(|x| x.namespace.as_str().starts_with("a/"))
            .unwrap();
        assert_eq!((a.refused, a.bytes, a.quota_bytes), (1, 20, Some(20)));
        // b fills the tier: the tier's LRU evicts the oldest whoever's it is (b's own here),
        // and a's use follows what it loses.
        for i in 3..10 {
            write_key(&mut idx, &kn("b", i)).unwrap();
        }
        assert_eq!(idx.len(), 8);
        write_key(&mut idx, &kn("a", 14)).unwrap();
        let u = idx.usage();
        assert!(u
            .iter()
            .all(|x| !x.namespace.as_str().starts_with("a/") || x.blocks <= 2));
        // A failed write and a removed block give their quota back.
        let p = idx.begin_write(&kn("a", 15), 1, 10).unwrap();
        idx.end_write(&kn("a", 15), p.loc, false, false);
        let before = idx
            .usage()
            .iter()
            .find(|x| x.namespace.as_str().starts_with("a/"))
            .unwrap()
            .blocks;
        assert!(idx.remove(&kn("a", 14)));
        let after = idx
            .usage()
            .iter()
            .find(|x| x.namespace.as_str().starts_with("a/"))
            .unwrap()
            .blocks;
        assert_eq!(after + 1, before);
    }

    #[test]
    fn quotas_set_after_a_warm_restart_count_what_was_found() {
        let found = (0..4)
            .map(|i| (Loc { dir: 0, slot: i }, kn("a", i), 1, 10, i + 1))
            .collect();
        let mut idx = SsdIndex::recover(&[8], found);
        idx.set_quotas(quotas(&[("a", 2)]), 10);
        // Over its new quota: each write replaces its oldest found block, free slots or not.
        let p = write_key(&mut idx, &kn("a", 9)).unwrap();
        assert_eq!(p.evicted, Some(kn("a", 0)));
        assert_eq!(
            write_key(&mut idx, &kn("a", 8)).unwrap().evicted,
            Some(kn("a", 1))
        );
        assert_eq!(idx.len(), 4);
    }
}
