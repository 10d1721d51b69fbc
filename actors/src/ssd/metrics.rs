//! The SSD tier's counters and gauges, and their Prometheus text (`kvferry_ssd_*`).

use std::fmt::Write as _;
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

/// Appends the tier's metrics in the Prometheus text format.
pub fn render(o: &mut String, s: &SsdStats) {
    let mut one = |name: &str, kind: &str, help: &str, v: u64| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
    };
    one(
        "kvferry_ssd_blocks",
        "gauge",
        "Blocks held on SSD.",
        s.blocks as u64,
    );
    one(
        "kvferry_ssd_capacity_blocks",
        "gauge",
        "Block slots of the SSD directories.",
        s.capacity_blocks as u64,
    );
    one(
        "kvferry_ssd_evictions_total",
        "counter",
        "Blocks evicted from SSD by capacity.",
        s.evictions,
    );
    one(
        "kvferry_ssd_writes_total",
        "counter",
        "Blocks written to SSD.",
        s.writes,
    );
    one(
        "kvferry_ssd_write_bytes_total",
        "counter",
        "Bytes written to SSD (headers and padding included).",
        s.write_bytes,
    );
    one(
        "kvferry_ssd_write_errors_total",
        "counter",
        "SSD block writes that failed (disk full included).",
        s.write_errors,
    );
    one(
        "kvferry_ssd_disk_full_total",
        "counter",
        "SSD block writes refused for lack of space.",
        s.disk_full,
    );
    one(
        "kvferry_ssd_writes_skipped_total",
        "counter",
        "Blocks evicted from RAM unwritten: every SSD slot was busy.",
        s.writes_skipped,
    );
    one(
        "kvferry_ssd_reads_total",
        "counter",
        "Blocks read from SSD into RAM.",
        s.reads,
    );
    one(
        "kvferry_ssd_read_bytes_total",
        "counter",
        "Block bytes read from SSD.",
        s.read_bytes,
    );
    one(
        "kvferry_ssd_read_errors_total",
        "counter",
        "SSD block reads that failed with an I/O error.",
        s.read_errors,
    );
    one(
        "kvferry_ssd_promote_no_room_total",
        "counter",
        "SSD hits cut short: no RAM slot to promote into.",
        s.promote_no_room,
    );
    let _ = writeln!(
        o,
        "# HELP kvferry_ssd_damaged_blocks_total Blocks read from SSD that were torn or corrupt (a miss, never served).\n# TYPE kvferry_ssd_damaged_blocks_total counter"
    );
    for (what, v) in ["header", "key", "checksum"].iter().zip(s.damaged) {
        let _ = writeln!(
            o,
            "kvferry_ssd_damaged_blocks_total{{damage=\"{what}\"}} {v}"
        );
    }
    let _ = writeln!(
        o,
        "# HELP kvferry_ssd_hit_blocks_total Blocks of the local prefix by tier.\n# TYPE kvferry_ssd_hit_blocks_total counter"
    );
    let _ = writeln!(
        o,
        "kvferry_ssd_hit_blocks_total{{tier=\"ram\"}} {}",
        s.hits_ram
    );
    let _ = writeln!(
        o,
        "kvferry_ssd_hit_blocks_total{{tier=\"ssd\"}} {}",
        s.hits_ssd
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_series() {
        let m = SsdMetrics::default();
        m.damaged(Damage::Checksum);
        m.hits_ssd.fetch_add(3, Relaxed);
        let mut s = SsdStats {
            blocks: 5,
            ..Default::default()
        };
        s.fill(&m);
        let mut o = String::new();
        render(&mut o, &s);
        assert!(o.contains("kvferry_ssd_blocks 5\n"), "{o}");
        assert!(
            o.contains("kvferry_ssd_damaged_blocks_total{damage=\"checksum\"} 1\n"),
            "{o}"
        );
        assert!(
            o.contains("kvferry_ssd_hit_blocks_total{tier=\"ssd\"} 3\n"),
            "{o}"
        );
        assert_eq!(s.damaged_total(), 1);
    }
}
