//! The SSD tier as the block store drives it: the index of what is on disk (on the store's
//! thread) and one I/O thread per directory (the disk). Opening it scans every directory's
//! file, so a node restarted on the same directories finds its blocks again.

use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::log_limit::LogLimit;
use crate::model::BlockKey;
use crate::tier::ssd::block_file::{lock_block_file, prepare_file};
use crate::tier::ssd::config::SsdConfig;
use crate::tier::ssd::error::SsdError;
use crate::tier::ssd::format::{self, BlockHeader, FileHeader, HEADER};
use crate::tier::ssd::index::{Entry, Loc, NoSlot, SsdIndex};
use crate::tier::ssd::io::{
    open_file, AlignedBuf, Backlog, DirIo, IoMode, Op, ReadInto, ReadOutcome,
};
use crate::tier::ssd::metrics::{SsdDirStats, SsdMetrics, SsdStats};
use crate::tier::ssd::port::{ReadEnd, ReadPort};

struct DirHandle {
    path: PathBuf,
    tx: Option<mpsc::Sender<Op>>,
    thread: Option<JoinHandle<()>>,
    mode: IoMode,
}

/// A write the store queued: its completion goes back to [`SsdTier::write_done`].
#[derive(Debug)]
pub struct PendingWrite {
    pub key: BlockKey,
    pub loc: Loc,
}

/// Why [`SsdTier::write`] queued no write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WriteSkip {
    /// The block is on disk already, or being written.
    Present,
    /// Larger than a disk slot (not a block of this pool).
    TooLarge,
    /// Every disk slot is being read, written or held.
    Busy,
    /// The write backlog has no room for another copy (`ssd.write-backlog`).
    Backlog,
    /// The directory's I/O thread is gone.
    Stopped,
    /// The block's namespace holds its SSD quota and every block of it is busy, or its SSD
    /// quota is 0 ([`crate::tier::quota`]).
    OverQuota,
}

impl WriteSkip {
    pub fn as_str(self) -> &'static str {
        match self {
            WriteSkip::Present => "present",
            WriteSkip::TooLarge => "too large",
            WriteSkip::Busy => "every disk slot busy",
            WriteSkip::Backlog => "write backlog full",
            WriteSkip::Stopped => "I/O thread stopped",
            WriteSkip::OverQuota => "namespace at its SSD quota",
        }
    }
}

impl std::fmt::Display for WriteSkip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a write's result arrives.
pub type WriteRx = oneshot::Receiver<Result<(), SsdError>>;
/// Where a read's outcome arrives.
pub type ReadRx = oneshot::Receiver<ReadOutcome>;

/// A read the store queued: its outcome goes back to [`SsdTier::read_done`].
#[derive(Debug)]
pub struct PendingRead {
    pub key: BlockKey,
    pub loc: Loc,
    pub len: u64,
}

pub struct SsdTier {
    dirs: Vec<DirHandle>,
    index: SsdIndex,
    stride: u64,
    write_through: bool,
    metrics: Arc<SsdMetrics>,
    recovered: usize,
    /// Per directory: its slots, and the used mark its file header says (a restart scans
    /// that far); raised in steps of [`USED_STEP`] as slots are first used.
    dir_slots: Vec<u64>,
    announced: Vec<u64>,
    /// Copies of blocks queued for the disks, and the most they may take.
    backlog: Arc<Backlog>,
    backlog_limit: u64,
    skip_log: LogLimit,
}

/// The default bound of a tier opened without [`SsdTier::with_write_backlog`].
const DEFAULT_BACKLOG: u64 = 64 << 20;

/// How far the file header's used mark moves at a time: one header write per this many
/// new slots, and a restart scans at most this many empty slots past the last block.
const USED_STEP: u64 = 256;

impl std::fmt::Debug for SsdTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdTier")
            .field("dirs", &self.dirs.len())
            .field("blocks", &self.index.len())
            .finish()
    }
}

impl SsdTier {
    /// Opens every directory (creating what is missing), scans what is on disk and starts
    /// the I/O threads. `slot_bytes` is the host pool's slot size: the largest block.
    pub fn open(cfg: &SsdConfig, slot_bytes: u64) -> Result<Self, SsdError> {
        let t0 = Instant::now();
        let stride = format::slot_stride(slot_bytes);
        let mut dirs = Vec::with_capacity(cfg.dir.len());
        let mut slots = Vec::with_capacity(cfg.dir.len());
        let mut found = Vec::new();
        let mut announced = Vec::with_capacity(cfg.dir.len());
        for (d, dir) in cfg.dir.iter().enumerate() {
            // Blocks are trusted for their checksums alone: nobody else may write them.
            crate::private_fs::private_dir(&dir.path)
                .map_err(|source| SsdError::Directory { source })?;
            let path = dir.path.join(format::FILE_NAME);
            let (file, direct) = open_file(&path, cfg.direct_io)?;
            lock_block_file(&file, &path)?;
            let n = format::slots_for(dir.capacity.0, stride);
            let (mut io, uring) = DirIo::new(path.clone(), file, direct.is_ok(), cfg.queue_depth);
            io.set_write_delay(cfg.test_write_delay);
            let mode = IoMode { direct, uring };
            match (&mode.direct, &mode.uring) {
                (Ok(()), Ok(())) => tracing::info!(dir = %dir.path.display(), slots = n,
                    "ssd: O_DIRECT with io_uring"),
                (direct, uring) => tracing::warn!(dir = %dir.path.display(), slots = n,
                    o_direct = %direct.as_ref().err().map_or("on", |s| s.as_str()),
                    io_uring = %uring.as_ref().err().map_or("on", |s| s.as_str()),
                    "ssd: falling back (buffered I/O and/or pread/pwrite): slower, same format"),
            }
            let (scanned, used) = prepare_file(&mut io, &path, stride, n, |slot, h| {
                found.push((Loc { dir: d, slot }, h.key, h.tp, h.len, h.seq));
            })?;
            tracing::info!(dir = %dir.path.display(), blocks = scanned, "ssd: scanned");
            let (tx, rx) = mpsc::channel();
            let thread = std::thread::Builder::new()
                .name(format!("kvferry-ssd-{d}"))
                .spawn(move || io.run(rx))
                .map_err(|source| SsdError::Open {
                    path: dir.path.clone(),
                    op: "spawning its I/O thread",
                    source,
                })?;
            dirs.push(DirHandle {
                path: dir.path.clone(),
                tx: Some(tx),
                thread: Some(thread),
                mode,
            });
            slots.push(n);
            announced.push(used);
        }
        let index = SsdIndex::recover(&slots, found);
        let recovered = index.len();
        tracing::info!(
            blocks = recovered,
            seconds = t0.elapsed().as_secs_f64(),
            "ssd: tier open"
        );
        Ok(Self {
            dirs,
            index,
            stride,
            write_through: cfg.write_through,
            metrics: Arc::new(SsdMetrics::default()),
            recovered,
            dir_slots: slots,
            announced,
            backlog: Arc::default(),
            backlog_limit: DEFAULT_BACKLOG.max(stride),
            skip_log: LogLimit::new(Duration::from_secs(10)),
        })
    }

    /// Bounds the memory of queued writes to `bytes` (at least one block's slot; the node
    /// passes [`SsdConfig::backlog_bytes`]).
    pub fn with_write_backlog(mut self, bytes: u64) -> Self {
        self.backlog_limit = bytes.max(self.stride);
        self
    }

    /// Bytes that copies of queued writes hold now.
    pub fn backlog_bytes(&self) -> u64 {
        self.backlog.bytes()
    }

    /// Whether a write of a `len`-byte block fits in the backlog now.
    pub fn has_room(&self, len: u64) -> bool {
        self.backlog
            .bytes()
            .saturating_add(HEADER + format::round_up(len))
            <= self.backlog_limit
    }

    /// Blocks the calling thread until a `len`-byte block's write fits in the backlog
    /// (the I/O threads drain it). For a stopping node only: no actor runs any more.
    pub fn wait_for_room(&self, len: u64) {
        while !self.has_room(len) && self.backlog.bytes() > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Counts (and logs, at most once per 10 s) a write-behind block that RAM evicted and
    /// the backlog had no room for: it is not on disk, so it left this node.
    pub fn skipped_for_backlog(&self, key: &BlockKey) {
        use std::sync::atomic::Ordering::Relaxed;
        self.metrics.writes_skipped_backlog.fetch_add(1, Relaxed);
        if let Some(held_back) = self.skip_log.allow("backlog") {
            tracing::warn!(backlog_bytes = self.backlog.bytes(), limit = self.backlog_limit,
                skipped_since_last_line = held_back, key = ?key,
                "ssd: write backlog full (the disks are slower than RAM evicts): an evicted \
                 block was dropped unwritten (kvferry_ssd_writes_skipped_total{{reason=\"backlog\"}})");
        }
    }

    /// Holds the namespaces to `rules`' SSD quotas, counted in disk slots (the stride: a
    /// block slot and its header).
    pub fn set_quotas(&mut self, rules: crate::tier::quota::QuotaRules) {
        self.index.set_quotas(rules, self.stride);
    }

    /// Every namespace's use of the tier, with its SSD quota.
    pub fn usage(&self) -> Vec<crate::tier::quota::TenantUsage> {
        self.index.usage()
    }

    pub fn metrics(&self) -> &Arc<SsdMetrics> {
        &self.metrics
    }

    pub fn write_through(&self) -> bool {
        self.write_through
    }

    /// Blocks a restart found on disk.
    pub fn recovered(&self) -> usize {
        self.recovered
    }

    pub fn modes(&self) -> Vec<IoMode> {
        self.dirs.iter().map(|d| d.mode.clone()).collect()
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.index.contains(key)
    }

    pub fn entry(&self, key: &BlockKey) -> Option<&Entry> {
        self.index.get(key)
    }

    pub fn keys(&self) -> impl Iterator<Item = &BlockKey> {
        self.index.keys()
    }

    /// Whether a block is being written now (its write has not answered yet).
    pub fn is_writing(&self, key: &BlockKey) -> bool {
        self.index.get(key).is_some_and(Entry::is_writing)
    }

    /// Queues a write of a `len`-byte block that `fill` copies into place (the copy is
    /// charged to the write backlog until the disk is done with it). Returns the write and
    /// the block whose disk slot it takes (it left the tier), or why nothing was queued;
    /// a block skipped for [`WriteSkip::Busy`] is counted here, for
    /// [`WriteSkip::Backlog`] by the caller that gives it up ([`Self::skipped_for_backlog`]).
    pub fn write(
        &mut self,
        key: &BlockKey,
        tp: u32,
        len: u64,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(PendingWrite, WriteRx, Option<BlockKey>), WriteSkip> {
        if len.saturating_add(HEADER) > self.stride {
            return Err(WriteSkip::TooLarge);
        }
        if self.index.contains(key) {
            return Err(WriteSkip::Present);
        }
        let bytes = HEADER + format::round_up(len);
        let charge = self
            .backlog
            .try_charge(bytes, self.backlog_limit)
            .ok_or(WriteSkip::Backlog)?;
        let plan = match self.index.begin_write(key, tp, len) {
            Ok(p) => p,
            Err(NoSlot::Present) => return Err(WriteSkip::Present),
            Err(NoSlot::OverQuota) => return Err(WriteSkip::OverQuota),
            Err(NoSlot::AllBusy) => {
                self.metrics
                    .writes_skipped
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return Err(WriteSkip::Busy);
            }
        };
        self.announce(plan.loc.dir);
        let mut buf = AlignedBuf::new(bytes as usize);
        {
            let b = buf.as_mut_slice();
            let (head, data) = b.split_at_mut(HEADER as usize);
            let data = &mut data[..len as usize];
            fill(data);
            BlockHeader::new(key.clone(), tp, data, plan.seq).encode(head);
        }
        let (reply, done) = oneshot::channel();
        let op = Op::Write {
            offset: format::slot_offset(plan.loc.slot, self.stride),
            buf,
            reply,
            charge: Some(charge),
        };
        if !self.send(plan.loc.dir, op) {
            self.index.end_write(key, plan.loc, false, false);
            return Err(WriteSkip::Stopped);
        }
        Ok((
            PendingWrite {
                key: key.clone(),
                loc: plan.loc,
            },
            done,
            plan.evicted,
        ))
    }

    /// Raises a directory's used mark in its file header before a slot past it is written
    /// (queued ahead of that write on the same thread). A crash between the two loses at
    /// most blocks past the mark: misses, never wrong bytes.
    fn announce(&mut self, dir: usize) {
        let (Some(&slots), Some(&marked)) = (self.dir_slots.get(dir), self.announced.get(dir))
        else {
            return;
        };
        let hw = self.index.high_water(dir);
        if hw <= marked {
            return;
        }
        let used = hw.div_ceil(USED_STEP).saturating_mul(USED_STEP).min(slots);
        let mut buf = AlignedBuf::new(HEADER as usize);
        FileHeader {
            stride: self.stride,
            slots,
            used,
        }
        .encode(buf.as_mut_slice());
        // Nobody waits for it: a failed header write shows as the block writes failing.
        let (reply, _) = oneshot::channel();
        if self.send(
            dir,
            Op::Write {
                offset: 0,
                buf,
                reply,
                charge: None,
            },
        ) {
            self.announced[dir] = used;
        }
    }

    fn send(&self, dir: usize, op: Op) -> bool {
        self.dirs
            .get(dir)
            .and_then(|d| d.tx.as_ref())
            .is_some_and(|tx| tx.send(op).is_ok())
    }

    /// A queued write finished: Ok when the block is on disk (a restart finds it), else
    /// the error (logged and counted here; the block left the tier).
    pub fn write_done(
        &mut self,
        w: &PendingWrite,
        out: Result<(), SsdError>,
    ) -> Result<(), SsdError> {
        use std::sync::atomic::Ordering::Relaxed;
        match out {
            Ok(()) => {
                self.metrics.writes.fetch_add(1, Relaxed);
                self.metrics.write_bytes.fetch_add(self.stride, Relaxed);
                self.index.end_write(&w.key, w.loc, true, false);
                Ok(())
            }
            Err(e) => {
                let full = e.is_disk_full();
                self.metrics.write_errors.fetch_add(1, Relaxed);
                if full {
                    // Logged once per directory: from now on it only reuses its slots.
                    if self.metrics.disk_full.fetch_add(1, Relaxed) == 0 {
                        tracing::warn!(error = %e, "ssd: disk full; this block is not on \
                            disk (evicted from RAM: lost; write-through: its answer is an \
                            error), and this directory now reuses the slots it has");
                    }
                } else {
                    tracing::warn!(error = %e, "ssd: block write failed; the block is not on \
                        disk (evicted from RAM: lost; write-through: its answer is an error)");
                }
                self.index.end_write(&w.key, w.loc, false, full);
                Err(e)
            }
        }
    }

    /// Queues a read of a block into pool memory the caller holds a writer pin on (the I/O
    /// thread writes there until the read is done). None if the block is not on disk.
    pub fn read(&mut self, key: &BlockKey, into: ReadInto) -> Option<(PendingRead, ReadRx)> {
        let e = self.hold(key)?;
        self.read_held(key, e, into)
    }

    /// Keeps a block's disk slot from being reused (by eviction) until [`Self::read_held`]
    /// or [`Self::release`]: a lookup holds its whole SSD run before it makes room in RAM,
    /// since making room writes evicted blocks to disk, which may evict on disk.
    pub fn hold(&mut self, key: &BlockKey) -> Option<Entry> {
        self.index.begin_read(key)
    }

    /// Drops a hold without reading.
    pub fn release(&mut self, key: &BlockKey, e: &Entry) {
        self.index.end_read(key, e.loc, true);
    }

    /// Queues the read of a held block (the hold passes to the read).
    pub fn read_held(
        &mut self,
        key: &BlockKey,
        e: Entry,
        into: ReadInto,
    ) -> Option<(PendingRead, ReadRx)> {
        if e.len > into.cap {
            self.index.end_read(key, e.loc, true);
            return None;
        }
        let (reply, done) = oneshot::channel();
        let op = Op::Read {
            offset: format::slot_offset(e.loc.slot, self.stride),
            key: key.clone(),
            len: e.len,
            into,
            reply,
        };
        if !self.send(e.loc.dir, op) {
            self.index.end_read(key, e.loc, true);
            return None;
        }
        Some((
            PendingRead {
                key: key.clone(),
                loc: e.loc,
                len: e.len,
            },
            done,
        ))
    }

    /// The I/O threads, for a load's reads of blocks it holds ([`Self::hold`]).
    pub fn read_port(&self) -> ReadPort {
        ReadPort {
            dirs: self.dirs.iter().map(|d| d.tx.clone()).collect(),
            stride: self.stride,
        }
    }

    /// A held block's read ended (through a [`ReadPort`]) as `end` says: the hold ends, and
    /// a damaged or unreadable block leaves the tier (true when this removed it, to withdraw
    /// it).
    pub fn read_ended(&mut self, r: &PendingRead, end: ReadEnd) -> bool {
        if end == ReadEnd::Failed {
            tracing::warn!(dir = %self.dir_path(r.loc.dir), slot = r.loc.slot, key = ?r.key,
                "ssd: block read failed: a miss, dropped from the tier");
        }
        self.end_hold(r, end)
    }

    /// A queued read finished; true when its bytes are good. A damaged block leaves the
    /// tier (returns its key in `gone` when this removed it, to withdraw it).
    pub fn read_done(&mut self, r: &PendingRead, out: Option<&ReadOutcome>) -> (bool, bool) {
        if let Some(ReadOutcome::Failed(e)) = out {
            tracing::warn!(error = %e, "ssd: block read failed: a miss");
        }
        let end = out.map_or(ReadEnd::NotRead, ReadEnd::of);
        (end == ReadEnd::Ok, self.end_hold(r, end))
    }

    fn end_hold(&mut self, r: &PendingRead, end: ReadEnd) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        match end {
            ReadEnd::Ok => {
                self.metrics.reads.fetch_add(1, Relaxed);
                self.metrics.read_bytes.fetch_add(r.len, Relaxed);
                self.index.end_read(&r.key, r.loc, true);
                false
            }
            ReadEnd::Damaged(d) => {
                self.metrics.damaged(d);
                tracing::warn!(dir = %self.dir_path(r.loc.dir), slot = r.loc.slot,
                    damage = d.as_str(), key = ?r.key,
                    "ssd: damaged block on disk: a miss, dropped from the tier");
                self.index.end_read(&r.key, r.loc, false)
            }
            ReadEnd::Failed => {
                self.metrics.read_errors.fetch_add(1, Relaxed);
                self.index.end_read(&r.key, r.loc, false)
            }
            ReadEnd::NotRead => {
                self.index.end_read(&r.key, r.loc, true);
                false
            }
        }
    }

    fn dir_path(&self, d: usize) -> String {
        self.dirs
            .get(d)
            .map_or_else(String::new, |d| d.path.display().to_string())
    }

    /// Replies once every read and write queued so far has finished.
    pub fn barrier(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let waits: Vec<_> = (0..self.dirs.len())
            .filter_map(|d| {
                let (reply, rx) = oneshot::channel();
                self.send(d, Op::Barrier { reply }).then_some(rx)
            })
            .collect();
        async move {
            for w in waits {
                let _ = w.await;
            }
        }
    }

    pub fn stats(&self) -> SsdStats {
        let mut s = SsdStats {
            write_backlog_bytes: self.backlog.bytes(),
            write_backlog_peak_bytes: self.backlog.peak(),
            write_backlog_limit_bytes: self.backlog_limit,
            blocks: self.index.len(),
            capacity_blocks: self.index.capacity(),
            evictions: self.index.evictions,
            busy_slots: self.index.busy_slots(),
            recovered: self.recovered,
            dirs: self
                .dirs
                .iter()
                .map(|d| SsdDirStats {
                    path: d.path.display().to_string(),
                    direct: d.mode.direct.is_ok(),
                    uring: d.mode.uring.is_ok(),
                })
                .collect(),
            ..Default::default()
        };
        s.fill(&self.metrics);
        s
    }
}

impl Drop for SsdTier {
    /// Finishes every queued write before the node is gone: a clean stop loses nothing.
    fn drop(&mut self) {
        for d in &mut self.dirs {
            d.tx = None;
        }
        for d in &mut self.dirs {
            if let Some(t) = d.thread.take() {
                let _ = t.join();
            }
            if let Ok(f) = std::fs::File::open(d.path.join(format::FILE_NAME)) {
                let _ = f.sync_data();
            }
        }
    }
}

#[cfg(test)]
mod tests;
