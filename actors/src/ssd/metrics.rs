//! The SSD tier's counters and gauges, and their families on the node's recorder
//! (`kvferry_ssd_*`, through the `metrics` facade like the rest of the node's).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::format::Damage;

/// Counters the tier and the store bump; read as an [`SsdStats`] snapshot.
#[derive(Debug, Default)]
pub struct SsdMetrics {
    pub hits_ram: AtomicU64,
    pub hits_ssd: AtomicU64,
    pub writes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub write_errors: AtomicU64,
    pub disk_full: AtomicU64,
    /// Blocks that left RAM unwritten because every disk slot was busy.
    pub writes_skipped: AtomicU64,
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    pub read_errors: AtomicU64,
    pub damaged_header: AtomicU64,
    pub damaged_key: AtomicU64,
    pub damaged_checksum: AtomicU64,
    /// Promotions that found no free RAM slot (the prefix ends there).
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
    pub writes_skipped: u64,
    pub reads: u64,
    pub read_bytes: u64,
    pub read_errors: u64,
    /// Blocks found damaged when read: by header, key and checksum.
    pub damaged: [u64; 3],
    pub promote_no_room: u64,
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

// Family names (`kvferry_ssd_*`); hits by tier are the node's query family.
pub const SSD_BLOCKS: &str = "kvferry_ssd_blocks";
pub const SSD_CAPACITY: &str = "kvferry_ssd_capacity_blocks";
pub const SSD_EVICTIONS: &str = "kvferry_ssd_evictions_total";
pub const SSD_WRITES: &str = "kvferry_ssd_writes_total";
pub const SSD_WRITE_BYTES: &str = "kvferry_ssd_write_bytes_total";
pub const SSD_WRITE_ERRORS: &str = "kvferry_ssd_write_errors_total";
pub const SSD_DISK_FULL: &str = "kvferry_ssd_disk_full_total";
pub const SSD_WRITES_SKIPPED: &str = "kvferry_ssd_writes_skipped_total";
pub const SSD_READS: &str = "kvferry_ssd_reads_total";
pub const SSD_READ_BYTES: &str = "kvferry_ssd_read_bytes_total";
pub const SSD_READ_ERRORS: &str = "kvferry_ssd_read_errors_total";
pub const SSD_DAMAGED: &str = "kvferry_ssd_damaged_blocks_total";
pub const SSD_PROMOTE_NO_ROOM: &str = "kvferry_ssd_promote_no_room_total";
/// Local-prefix blocks by tier, label `tier` = `ram` | `ssd` (the store's part of the
/// query's hits by tier; `remote` and `miss` are the keeper's).
pub const HIT_BLOCKS: &str = "kvferry_hit_blocks_total";

const COUNTERS: [(&str, &str); 11] = [
    (SSD_EVICTIONS, "Blocks evicted from SSD by capacity."),
    (SSD_WRITES, "Blocks written to SSD."),
    (
        SSD_WRITE_BYTES,
        "Bytes written to SSD (block slots, headers included).",
    ),
    (
        SSD_WRITE_ERRORS,
        "SSD block writes that failed (disk full included); the block stays in RAM only.",
    ),
    (SSD_DISK_FULL, "SSD block writes refused for lack of space."),
    (
        SSD_WRITES_SKIPPED,
        "Blocks evicted from RAM unwritten: every SSD slot was busy.",
    ),
    (SSD_READS, "Blocks read from SSD into RAM."),
    (SSD_READ_BYTES, "Block bytes read from SSD."),
    (
        SSD_READ_ERRORS,
        "SSD block reads that failed with an I/O error (a miss).",
    ),
    (
        SSD_PROMOTE_NO_ROOM,
        "SSD hits cut short: no RAM slot to promote into.",
    ),
    (
        SSD_DAMAGED,
        "Blocks read from SSD that were torn or corrupt, by damage (a miss, never served).",
    ),
];

/// Describes the tier's families on the current recorder (once per recorder).
pub fn describe() {
    use ::metrics::{describe_counter, describe_gauge};
    describe_gauge!(SSD_BLOCKS, "Blocks held on SSD.");
    describe_gauge!(SSD_CAPACITY, "Block slots the SSD directories can use.");
    for (name, help) in COUNTERS {
        describe_counter!(name, help);
    }
    describe_counter!(
        HIT_BLOCKS,
        "Blocks of local prefixes by tier (ram, ssd); remote and miss come from the query."
    );
}

/// Records a snapshot on the current recorder (at scrape time: totals go in with
/// `absolute`, so they never go back).
pub fn record(s: &SsdStats) {
    use ::metrics::{counter, gauge};
    gauge!(SSD_BLOCKS).set(s.blocks as f64);
    gauge!(SSD_CAPACITY).set(s.capacity_blocks as f64);
    for (name, v) in [
        (SSD_EVICTIONS, s.evictions),
        (SSD_WRITES, s.writes),
        (SSD_WRITE_BYTES, s.write_bytes),
        (SSD_WRITE_ERRORS, s.write_errors),
        (SSD_DISK_FULL, s.disk_full),
        (SSD_WRITES_SKIPPED, s.writes_skipped),
        (SSD_READS, s.reads),
        (SSD_READ_BYTES, s.read_bytes),
        (SSD_READ_ERRORS, s.read_errors),
        (SSD_PROMOTE_NO_ROOM, s.promote_no_room),
    ] {
        counter!(name).absolute(v);
    }
    for (damage, v) in ["header", "key", "checksum"].into_iter().zip(s.damaged) {
        counter!(SSD_DAMAGED, "damage" => damage).absolute(v);
    }
    counter!(HIT_BLOCKS, "tier" => "ram").absolute(s.hits_ram);
    counter!(HIT_BLOCKS, "tier" => "ssd").absolute(s.hits_ssd);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_every_family_on_a_prometheus_recorder() {
        let m = SsdMetrics::default();
        m.damaged(Damage::Checksum);
        m.hits_ssd.fetch_add(3, Relaxed);
        let mut s = SsdStats {
            blocks: 5,
            ..Default::default()
        };
        s.fill(&m);
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        ::metrics::with_local_recorder(&recorder, || {
            describe();
            record(&s);
        });
        let o = handle.render();
        assert!(o.contains("kvferry_ssd_blocks 5\n"), "{o}");
        assert!(
            o.contains("kvferry_ssd_damaged_blocks_total{damage=\"checksum\"} 1\n"),
            "{o}"
        );
        assert!(
            o.contains("kvferry_hit_blocks_total{tier=\"ssd\"} 3\n"),
            "{o}"
        );
        assert!(o.contains("# HELP kvferry_ssd_writes_total"), "{o}");
        assert_eq!(s.damaged_total(), 1);
    }
}
