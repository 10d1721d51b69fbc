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
use crate::tier::ssd::config::SsdConfig;
use crate::tier::ssd::error::SsdError;
use crate::tier::ssd::format::{self, BlockHeader, FileHeader, HEADER};
use crate::tier::ssd::index::{Entry, Loc, NoSlot, SsdIndex};
use crate::tier::ssd::io::{
    open_file, AlignedBuf, Backlog, DirIo, IoMode, Op, ReadInto, ReadOutcome,
};
use crate::tier::ssd::metrics::{SsdDirStats, SsdMetrics, SsdStats};

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
}

impl WriteSkip {
    pub fn as_str(self) -> &'static str {
        match self {
            WriteSkip::Present => "present",
            WriteSkip::TooLarge => "too large",
            WriteSkip::Busy => "every disk slot busy",
            WriteSkip::Backlog => "write backlog full",
            WriteSkip::Stopped => "I/O thread stopped",
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

/// How long a start waits for a block file's lock that another process holds. A node killed
/// with SIGKILL still holds it for a while after it is reaped (1–15 ms measured: its io_uring
/// is torn down after the process, and the file and its lock with it), so a supervisor's
/// immediate restart would be refused; a live node holds it for good and is still refused,
/// after this long. Far longer than the teardown, short beside a node's start.
const LOCK_WAIT: Duration = Duration::from_secs(2);

/// Between two tries for the lock.
const LOCK_RETRY: Duration = Duration::from_millis(2);

/// One node per directory: a second one (a restart racing the old process, or two configs
/// naming one disk) would overwrite the first's slots under it. The lock goes with the
/// file, when the I/O thread ends or the process (and its io_uring) is gone.
fn lock_block_file(file: &std::fs::File, path: &std::path::Path) -> Result<(), SsdError> {
    let t0 = Instant::now();
    loop {
        match rustix::fs::flock(file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {
                if t0.elapsed() >= LOCK_RETRY {
                    tracing::info!(file = %path.display(), waited_ms = t0.elapsed().as_millis() as u64,
                        "ssd: waited for the block file's lock (a node that just died releases it late)");
                }
                return Ok(());
            }
            Err(rustix::io::Errno::WOULDBLOCK) if t0.elapsed() < LOCK_WAIT => {
                std::thread::sleep(LOCK_RETRY);
            }
            Err(e) => {
                return Err(SsdError::Open {
                    path: path.to_path_buf(),
                    op: "locking the block file (another node uses this directory)",
                    source: e.into(),
                })
            }
        }
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

    /// A queued read finished; true when its bytes are good. A damaged block leaves the
    /// tier (returns its key in `gone` when this removed it, to withdraw it).
    pub fn read_done(&mut self, r: &PendingRead, out: Option<&ReadOutcome>) -> (bool, bool) {
        use std::sync::atomic::Ordering::Relaxed;
        match out {
            Some(ReadOutcome::Ok) => {
                self.metrics.reads.fetch_add(1, Relaxed);
                self.metrics.read_bytes.fetch_add(r.len, Relaxed);
                self.index.end_read(&r.key, r.loc, true);
                (true, false)
            }
            Some(ReadOutcome::Damaged(d)) => {
                self.metrics.damaged(*d);
                tracing::warn!(dir = %self.dir_path(r.loc.dir), slot = r.loc.slot,
                    damage = d.as_str(), key = ?r.key,
                    "ssd: damaged block on disk: a miss, dropped from the tier");
                let gone = self.index.end_read(&r.key, r.loc, false);
                (false, gone)
            }
            Some(ReadOutcome::Failed(e)) => {
                self.metrics.read_errors.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, "ssd: block read failed: a miss");
                let gone = self.index.end_read(&r.key, r.loc, false);
                (false, gone)
            }
            None => {
                self.index.end_read(&r.key, r.loc, true);
                (false, false)
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

/// Checks (or writes) the file header and sizes the file to `slots` slots, then scans the
/// slots' headers up to its used mark. A file of another geometry is started afresh (with a
/// warning). Returns how many blocks the scan found and the used mark written.
fn prepare_file(
    io: &mut DirIo,
    path: &std::path::Path,
    stride: u64,
    slots: u64,
    mut seen: impl FnMut(u64, BlockHeader),
) -> Result<(usize, u64), SsdError> {
    let os = |op: &'static str| {
        move |source| SsdError::Open {
            path: path.into(),
            op,
            source,
        }
    };
    let mut head = AlignedBuf::new(HEADER as usize);
    let len = io.file().metadata().map_err(os("stat"))?.len();
    let existing = if len >= HEADER {
        use std::os::unix::fs::FileExt;
        io.file()
            .read_exact_at(head.as_mut_slice(), 0)
            .map_err(os("reading the file header"))?;
        FileHeader::decode(head.as_slice())
    } else {
        None
    };
    let keep = match existing {
        Some(h) if h.stride == stride => h.used.min(h.slots).min(slots),
        Some(h) => {
            tracing::warn!(file = %path.display(), old_stride = h.stride, stride,
                "ssd: block file written for another pool.slot-bytes; starting it afresh");
            0
        }
        None if len > 0 => {
            tracing::warn!(file = %path.display(), "ssd: no valid file header; starting it afresh");
            0
        }
        None => 0,
    };
    if keep == 0 {
        io.file().set_len(0).map_err(os("truncating"))?;
    }
    io.file()
        .set_len(format::slot_offset(slots, stride))
        .map_err(os("sizing"))?;
    FileHeader {
        stride,
        slots,
        used: keep,
    }
    .encode(head.as_mut_slice());
    {
        use std::os::unix::fs::FileExt;
        io.file()
            .write_all_at(head.as_slice(), 0)
            .map_err(os("writing the file header"))?;
    }
    let mut n = 0;
    io.scan(
        keep,
        |s| format::slot_offset(s, stride),
        |slot, b| {
            if let Ok(h) = BlockHeader::decode(b) {
                if h.len + HEADER <= stride {
                    n += 1;
                    seen(slot, h);
                }
            }
        },
    );
    Ok((n, keep))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ByteSize;
    use crate::model::{BlockHash, Namespace};
    use crate::tier::ssd::config::SsdDir;
    use crate::tier::ssd::format::Damage;
    use std::path::Path;
    use std::time::Duration;

    const SLOT: u64 = 64 << 10;

    fn key(i: u64) -> BlockKey {
        BlockKey {
            namespace: Namespace::new("m", "bf16", "t").unwrap(),
            hash: BlockHash::from_u64(i),
        }
    }

    fn data(i: u64, len: usize) -> Vec<u8> {
        (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
    }

    /// A fresh directory under `base` (removed first if a failed run left it).
    fn fresh(base: &str, name: &str) -> PathBuf {
        let p = Path::new(base).join(format!("kvferry-ssd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        p
    }

    fn cfg(dirs: &[&Path], blocks: u64) -> SsdConfig {
        SsdConfig {
            dir: dirs
                .iter()
                .map(|p| SsdDir {
                    path: p.to_path_buf(),
                    capacity: ByteSize(HEADER + blocks * format::slot_stride(SLOT)),
                })
                .collect(),
            queue_depth: 4,
            ..Default::default()
        }
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    async fn put(t: &mut SsdTier, i: u64, len: usize) -> (bool, Option<BlockKey>) {
        let d = data(i, len);
        let Ok((w, rx, evicted)) = t.write(&key(i), 2, len as u64, |dst| dst.copy_from_slice(&d))
        else {
            return (false, None);
        };
        let out = rx.await.unwrap();
        (t.write_done(&w, out).is_ok(), evicted)
    }

    /// Reads block `i` into a fresh buffer: the outcome and the bytes.
    async fn get(t: &mut SsdTier, i: u64) -> (bool, Vec<u8>) {
        let buf = Arc::new(AlignedBuf::new(SLOT as usize));
        let into = ReadInto {
            addr: buf.as_slice().as_ptr() as u64,
            cap: SLOT,
            keep: Arc::clone(&buf) as Arc<dyn Send + Sync>,
        };
        let Some((r, rx)) = t.read(&key(i), into) else {
            return (false, Vec::new());
        };
        let out = rx.await.ok();
        let (ok, _) = t.read_done(&r, out.as_ref());
        (ok, buf.as_slice()[..r.len as usize].to_vec())
    }

    /// Both I/O paths: O_DIRECT where /tmp allows it, and the buffered fallback on tmpfs.
    fn round_trip_and_restart(base: &str, expect_direct: bool) {
        let dir = fresh(base, "rt");
        rt().block_on(async {
            let mut t = SsdTier::open(&cfg(&[&dir], 8), SLOT).unwrap();
            assert_eq!(
                t.modes()[0].direct.is_ok(),
                expect_direct,
                "{:?}",
                t.modes()
            );
            for i in 0..5u64 {
                // Odd lengths: padding is not part of the block.
                assert!(put(&mut t, i, 1000 + i as usize * 4099).await.0);
            }
            for i in 0..5u64 {
                let (ok, bytes) = get(&mut t, i).await;
                assert!(ok);
                assert_eq!(bytes, data(i, 1000 + i as usize * 4099), "block {i}");
            }
            assert_eq!(t.stats().writes, 5);
            drop(t);
            // Restart on the same directory: every block is found by the scan.
            let mut t = SsdTier::open(&cfg(&[&dir], 8), SLOT).unwrap();
            assert_eq!(t.recovered(), 5);
            for i in 0..5u64 {
                let (ok, bytes) = get(&mut t, i).await;
                assert!(
                    ok && bytes == data(i, 1000 + i as usize * 4099),
                    "block {i}"
                );
            }
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn o_direct_round_trip_and_restart_on_tmp() {
        // /tmp is a disk filesystem here (ext4); where it is tmpfs this asserts the fallback.
        let direct = !is_tmpfs("/tmp");
        round_trip_and_restart("/tmp", direct);
    }

    /// tmpfs: O_DIRECT where the kernel allows it on tmpfs (6.6 and later), else the
    /// buffered fallback; either way the same bytes come back.
    #[test]
    fn tmpfs_round_trip_and_restart() {
        assert!(
            is_tmpfs("/dev/shm"),
            "/dev/shm is tmpfs on every supported host"
        );
        let probe = fresh("/dev/shm", "probe");
        let direct = super::super::io::open_file(&probe, true)
            .map(|(_, d)| d.is_ok())
            .unwrap();
        let _ = std::fs::remove_file(&probe);
        round_trip_and_restart("/dev/shm", direct);
    }

    /// The fallback path end to end: buffered I/O (what a filesystem without O_DIRECT gets).
    #[test]
    fn buffered_io_round_trip_and_restart() {
        let dir = fresh("/tmp", "buffered");
        rt().block_on(async {
            let mut c = cfg(&[&dir], 4);
            c.direct_io = false;
            let mut t = SsdTier::open(&c, SLOT).unwrap();
            assert!(t.modes()[0].direct.is_err());
            assert!(put(&mut t, 7, 12345).await.0);
            drop(t);
            let mut t = SsdTier::open(&c, SLOT).unwrap();
            let (ok, bytes) = get(&mut t, 7).await;
            assert!(ok && bytes == data(7, 12345));
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn is_tmpfs(path: &str) -> bool {
        let c = std::ffi::CString::new(path).unwrap();
        // SAFETY: a zeroed statfs is a valid out-parameter; the path is NUL-terminated.
        let mut s: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let rc = unsafe { libc::statfs(c.as_ptr(), &mut s) };
        rc == 0 && s.f_type == libc::TMPFS_MAGIC
    }

    #[test]
    fn a_flipped_byte_is_a_miss_counted_and_dropped() {
        let dir = fresh("/tmp", "corrupt");
        rt().block_on(async {
            let mut t = SsdTier::open(&cfg(&[&dir], 4), SLOT).unwrap();
            assert!(put(&mut t, 1, 5000).await.0);
            assert!(put(&mut t, 2, 5000).await.0);
            let loc = t.entry(&key(1)).unwrap().loc;
            drop(t);
            // Flip one byte of block 1's bytes on disk, behind the tier's back.
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(dir.join(format::FILE_NAME))
                .unwrap();
            use std::os::unix::fs::FileExt;
            let at = format::slot_offset(loc.slot, format::slot_stride(SLOT)) + HEADER + 1234;
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, at).unwrap();
            f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
            f.sync_all().unwrap();
            let mut t = SsdTier::open(&cfg(&[&dir], 4), SLOT).unwrap();
            assert_eq!(t.recovered(), 2, "the header is intact: found by the scan");
            let (ok, _) = get(&mut t, 1).await;
            assert!(!ok, "corrupt bytes are never served");
            assert_eq!(t.stats().damaged, [0, 0, 1]);
            assert!(!t.contains(&key(1)), "dropped from the tier");
            let (ok, bytes) = get(&mut t, 2).await;
            assert!(ok && bytes == data(2, 5000));
            // Its slot is reused.
            assert!(put(&mut t, 3, 5000).await.0);
        });
        std::fs::remove_dir_all(&dir).unwrap();
        let _ = Damage::Checksum;
    }

    #[test]
    fn capacity_evicts_the_least_recently_used() {
        let (a, b) = (fresh("/tmp", "lru-a"), fresh("/dev/shm", "lru-b"));
        rt().block_on(async {
            let mut t = SsdTier::open(&cfg(&[&a, &b], 2), SLOT).unwrap();
            for i in 0..4 {
                assert_eq!(put(&mut t, i, 3000).await, (true, None));
            }
            assert!(get(&mut t, 0).await.0, "block 0 is now the youngest");
            assert_eq!(put(&mut t, 4, 3000).await, (true, Some(key(1))));
            assert_eq!(put(&mut t, 5, 3000).await, (true, Some(key(2))));
            let s = t.stats();
            assert_eq!((s.blocks, s.capacity_blocks, s.evictions), (4, 4, 2));
            for i in [0, 3, 4, 5] {
                let (ok, bytes) = get(&mut t, i).await;
                assert!(ok && bytes == data(i, 3000), "block {i}");
            }
            assert!(!get(&mut t, 1).await.0);
        });
        std::fs::remove_dir_all(&a).unwrap();
        std::fs::remove_dir_all(&b).unwrap();
    }

    /// 1 TiB configured (15.8 M slots of this size): opening, writing past the first used
    /// mark and restarting cost what is used, not what is configured.
    #[test]
    fn a_huge_directory_costs_only_what_it_uses() {
        let dir = fresh("/tmp", "huge");
        rt().block_on(async {
            let mut c = cfg(&[&dir], 1);
            c.dir[0].capacity = ByteSize(1 << 40);
            let t0 = std::time::Instant::now();
            let mut t = SsdTier::open(&c, SLOT).unwrap();
            assert!(t.stats().capacity_blocks > 15_000_000);
            for i in 0..300 {
                assert!(put(&mut t, i, 100).await.0, "block {i}");
            }
            drop(t);
            let mut t = SsdTier::open(&c, SLOT).unwrap();
            assert_eq!(
                t.recovered(),
                300,
                "the used mark moved past the first 256 slots"
            );
            let (ok, bytes) = get(&mut t, 299).await;
            assert!(ok && bytes == data(299, 100));
            assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A slow disk (20 ms a write) and a backlog of two copies: a third write is refused
    /// before it takes a disk slot (nothing on disk is evicted for it), and the room comes
    /// back as soon as a write answers.
    #[test]
    fn the_write_backlog_is_bounded_and_given_back() {
        let dir = fresh("/tmp", "backlog");
        rt().block_on(async {
            let mut c = cfg(&[&dir], 8);
            c.test_write_delay = Some(Duration::from_millis(20));
            const LEN: usize = SLOT as usize;
            let copy = HEADER + format::round_up(LEN as u64);
            let mut t = SsdTier::open(&c, SLOT)
                .unwrap()
                .with_write_backlog(2 * copy);
            let mut queued = Vec::new();
            for i in 0..2 {
                let d = data(i, LEN);
                let w = t.write(&key(i), 1, LEN as u64, |dst| dst.copy_from_slice(&d));
                queued.push(w.unwrap());
            }
            assert_eq!(t.backlog_bytes(), 2 * copy);
            let d = data(2, LEN);
            let refused = t.write(&key(2), 1, LEN as u64, |dst| dst.copy_from_slice(&d));
            assert_eq!(refused.err(), Some(WriteSkip::Backlog));
            assert!(!t.contains(&key(2)), "no disk slot taken for it");
            assert!(!t.has_room(LEN as u64));
            let (w, rx, _) = queued.remove(0);
            let out = rx.await.unwrap();
            // Given back by the I/O thread before the answer.
            assert!(t.backlog_bytes() <= copy, "{}", t.backlog_bytes());
            t.write_done(&w, out).unwrap();
            assert!(t.has_room(LEN as u64));
            assert!(put(&mut t, 2, LEN).await.0);
            let (w, rx, _) = queued.remove(0);
            t.write_done(&w, rx.await.unwrap()).unwrap();
            let s = t.stats();
            assert_eq!(
                (
                    s.write_backlog_bytes,
                    s.write_backlog_peak_bytes,
                    s.write_backlog_limit_bytes
                ),
                (0, 2 * copy, 2 * copy)
            );
            for i in 0..3 {
                let (ok, bytes) = get(&mut t, i).await;
                assert!(ok && bytes == data(i, LEN), "block {i}");
            }
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_serves_one_node_at_a_time() {
        let dir = fresh("/tmp", "lock");
        let t = SsdTier::open(&cfg(&[&dir], 2), SLOT).unwrap();
        let e = SsdTier::open(&cfg(&[&dir], 2), SLOT).unwrap_err();
        assert!(e.to_string().contains(&dir.display().to_string()), "{e}");
        assert!(
            matches!(&e, SsdError::Open { op, .. } if op.contains("another node")),
            "{e:?}"
        );
        drop(t);
        SsdTier::open(&cfg(&[&dir], 2), SLOT).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn another_slot_size_starts_the_file_afresh() {
        let dir = fresh("/tmp", "geometry");
        rt().block_on(async {
            let mut t = SsdTier::open(&cfg(&[&dir], 4), SLOT).unwrap();
            assert!(put(&mut t, 1, 5000).await.0);
            drop(t);
            let mut c = cfg(&[&dir], 4);
            c.dir[0].capacity = ByteSize(HEADER + 4 * format::slot_stride(2 * SLOT));
            let t = SsdTier::open(&c, 2 * SLOT).unwrap();
            assert_eq!(t.recovered(), 0);
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A directory on a 1 MiB tmpfs configured for far more: writes fail with DiskFull,
    /// what was written stays readable, and the directory reuses its written slots.
    #[test]
    fn disk_full_is_typed_and_the_tier_keeps_working() {
        let dir = fresh("/tmp", "full");
        std::fs::create_dir_all(&dir).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            eprintln!("cannot mount a tmpfs here (not root?): disk full is not exercised");
            let _ = std::fs::remove_dir_all(&dir);
            return;
        }
        let out = std::panic::catch_unwind(|| {
            rt().block_on(async {
                let mut t = SsdTier::open(&cfg(&[&dir], 64), SLOT).unwrap();
                let mut written = 0;
                let mut full = 0;
                for i in 0..64 {
                    match put(&mut t, i, SLOT as usize).await.0 {
                        true => written += 1,
                        false => full += 1,
                    }
                }
                let s = t.stats();
                // One write met the full disk; every later one reused a written slot.
                assert_eq!((full, s.disk_full, s.write_errors), (1, 1, 1), "{s:?}");
                assert_eq!(written, 63);
                assert!(s.blocks >= 8 && s.blocks < 64, "{s:?}");
                assert_eq!(s.capacity_blocks, s.blocks, "a full directory only reuses");
                assert_eq!(s.evictions, 63 - s.blocks as u64);
                // The newest written blocks are readable.
                let last = (0..64).rev().find(|i| t.contains(&key(*i))).unwrap();
                let (ok, bytes) = get(&mut t, last).await;
                assert!(ok && bytes == data(last, SLOT as usize));
                // And it keeps taking blocks by evicting, in place.
                let (ok, evicted) = put(&mut t, 100, SLOT as usize).await;
                assert!(ok && evicted.is_some());
            })
        });
        let _ = std::process::Command::new("umount").arg(&dir).status();
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(p) = out {
            std::panic::resume_unwind(p);
        }
    }
}
