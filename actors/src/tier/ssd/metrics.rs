//! The SSD tier's counters and gauges. The node's scrape records an [`SsdStats`] snapshot
//! as the `kvferry_ssd_*` families (`crate::metrics`).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use ::metrics::{counter, gauge};

use crate::metrics::names::*;
use crate::tier::ssd::format::Damage;

/// Counters the tier and the store bump; read as an [`SsdStats`] snapshot.
#[derive(Debug, Default)]
pub struct SsdMetrics {
    pub hits_ram: AtomicU64,
    pub hits_ssd: AtomicU64,
    pub writes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub write_errors: AtomicU64,
    pub disk_full: AtomicU64,
    /// Blocks not written because every disk slot was busy.
    pub writes_skipped: AtomicU64,
    /// Blocks RAM evicted that were not written: the write backlog was full.
    pub writes_skipped_backlog: AtomicU64,
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    pub read_errors: AtomicU64,
    pub damaged_header: AtomicU64,
    pub damaged_key: AtomicU64,
    pub damaged_checksum: AtomicU64,
    /// Promotions for peers that found no free RAM slot (the pinned prefix ends there).
    pub promote_no_room: AtomicU64,
}

impl SsdMetrics {
    pub fn damaged(&self, d: Damage) {
        match d {
            Damage::Header => &self.damaged_header,
            Damage::OtherKey => &self.damaged_key,
            Damage::Checksum => &self.damaged_checksum,
        }
        .fetch_add(1, Relaxed);
    }
}

/// One directory as a scrape sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SsdDirStats {
    pub path: String,
    pub direct: bool,
    pub uring: bool,
}

/// The tier's counters and gauges at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SsdStats {
    pub blocks: usize,
    pub capacity_blocks: usize,
    pub evictions: u64,
    pub hits_ram: u64,
    pub hits_ssd: u64,
    pub writes: u64,
    pub write_bytes: u64,
    pub write_errors: u64,
    pub disk_full: u64,
    /// Skipped writes: every disk slot busy.
    pub writes_skipped: u64,
    /// Skipped writes: the write backlog full (`ssd.write-backlog`).
    pub writes_skipped_backlog: u64,
    /// Bytes that copies of queued writes hold now, the most they ever held, and the bound.
    pub write_backlog_bytes: u64,
    pub write_backlog_peak_bytes: u64,
    pub write_backlog_limit_bytes: u64,
    pub reads: u64,
    pub read_bytes: u64,
    pub read_errors: u64,
    /// Blocks found damaged when read: by header, key and checksum.
    pub damaged: [u64; 3],
    pub promote_no_room: u64,
    /// Blocks held on disk for leases (a query holds its SSD blocks, a load reads them).
    pub held_blocks: usize,
    /// Disk slots being read, written or held now: none of them can be evicted.
    pub busy_slots: usize,
    /// Pool slots staging SSD reads of loads now.
    pub staging_slots: usize,
    /// Blocks a restart found on disk.
    pub recovered: usize,
    pub dirs: Vec<SsdDirStats>,
}

impl SsdStats {
    pub fn damaged_total(&self) -> u64 {
        self.damaged.iter().sum()
    }

    pub(crate) fn fill(&mut self, m: &SsdMetrics) {
        self.hits_ram = m.hits_ram.load(Relaxed);
        self.hits_ssd = m.hits_ssd.load(Relaxed);
        self.writes = m.writes.load(Relaxed);
        self.write_bytes = m.write_bytes.load(Relaxed);
        self.write_errors = m.write_errors.load(Relaxed);
        self.disk_full = m.disk_full.load(Relaxed);
        self.writes_skipped = m.writes_skipped.load(Relaxed);
        self.writes_skipped_backlog = m.writes_skipped_backlog.load(Relaxed);
        self.reads = m.reads.load(Relaxed);
        self.read_bytes = m.read_bytes.load(Relaxed);
        self.read_errors = m.read_errors.load(Relaxed);
        self.damaged = [
            m.damaged_header.load(Relaxed),
            m.damaged_key.load(Relaxed),
            m.damaged_checksum.load(Relaxed),
        ];
        self.promote_no_room = m.promote_no_room.load(Relaxed);
    }
}

impl crate::metrics::Sampled for SsdStats {
    fn record(&self) {
        gauge!(SSD_BLOCKS).set(self.blocks as f64);
        gauge!(SSD_CAPACITY_BLOCKS).set(self.capacity_blocks as f64);
        gauge!(SSD_HELD_BLOCKS).set(self.held_blocks as f64);
        gauge!(SSD_STAGING_SLOTS).set(self.staging_slots as f64);
        gauge!(SSD_WRITE_BACKLOG_BYTES).set(self.write_backlog_bytes as f64);
        gauge!(SSD_WRITE_BACKLOG_PEAK_BYTES).set(self.write_backlog_peak_bytes as f64);
        gauge!(SSD_WRITE_BACKLOG_LIMIT_BYTES).set(self.write_backlog_limit_bytes as f64);
        for (name, v) in [
            (SSD_EVICTIONS, self.evictions),
            (SSD_WRITES, self.writes),
            (SSD_WRITE_BYTES, self.write_bytes),
            (SSD_WRITE_ERRORS, self.write_errors),
            (SSD_DISK_FULL, self.disk_full),
            (SSD_READS, self.reads),
            (SSD_READ_BYTES, self.read_bytes),
            (SSD_READ_ERRORS, self.read_errors),
            (SSD_PROMOTE_NO_ROOM, self.promote_no_room),
        ] {
            counter!(name).absolute(v);
        }
        for (damage, v) in ["header", "key", "checksum"].into_iter().zip(self.damaged) {
            counter!(SSD_DAMAGED_BLOCKS, "damage" => damage).absolute(v);
        }
        counter!(SSD_WRITES_SKIPPED, "reason" => "busy").absolute(self.writes_skipped);
        counter!(SSD_WRITES_SKIPPED, "reason" => "backlog").absolute(self.writes_skipped_backlog);
        counter!(SSD_HIT_BLOCKS, "tier" => "ram").absolute(self.hits_ram);
        counter!(SSD_HIT_BLOCKS, "tier" => "ssd").absolute(self.hits_ssd);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_reads_every_counter() {
        let m = SsdMetrics::default();
        m.damaged(Damage::Checksum);
        m.damaged(Damage::Header);
        m.hits_ssd.fetch_add(3, Relaxed);
        m.disk_full.fetch_add(1, Relaxed);
        let mut s = SsdStats {
            blocks: 5,
            ..Default::default()
        };
        s.fill(&m);
        assert_eq!(s.damaged, [1, 0, 1]);
        assert_eq!(s.damaged_total(), 2);
        assert_eq!((s.hits_ssd, s.disk_full, s.blocks), (3, 1, 5));
    }
}
