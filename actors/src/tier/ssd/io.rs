//! Block file I/O: one thread per directory drives an io_uring (or, where io_uring cannot be
//! set up, plain `pread`/`pwrite`) at the configured queue depth. Nothing here blocks the
//! store's actor thread: it sends [`Op`]s and awaits their replies.
//!
//! Reads of a slot that is being written wait behind the write on this thread, so a block
//! is readable as soon as its write is queued.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
#[cfg(test)]
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};
use slab::Slab;
use tokio::sync::oneshot;

use crate::model::BlockKey;
pub use crate::tier::ssd::aligned::AlignedBuf;
pub use crate::tier::ssd::backlog::{Backlog, Charge};
use crate::tier::ssd::error::{is_no_space, SsdError};
use crate::tier::ssd::format::{round_up, BlockHeader, Damage, ALIGN, HEADER};

/// How a directory's file is read and written, as found when it was opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoMode {
    /// `O_DIRECT` in use; else buffered, with the reason.
    pub direct: Result<(), String>,
    /// io_uring in use; else `pread`/`pwrite` on the I/O thread, with the reason.
    pub uring: Result<(), String>,
}

/// Opens (creating) a block file, with `O_DIRECT` if asked and the filesystem allows it;
/// the second value says whether it is in use, or why not.
/// The file is the node user's alone (mode 0600 at creation and set again on one that was
/// there), whatever the umask.
pub fn open_file(path: &Path, direct: bool) -> Result<(File, Result<(), String>), SsdError> {
    let (file, direct) = open_with(path, direct, |flags| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(crate::private_fs::FILE_MODE)
            .custom_flags(flags)
            .open(path)
    })?;
    crate::private_fs::private_file(&file).map_err(|source| SsdError::Open {
        path: path.into(),
        op: "setting its mode to 0600",
        source,
    })?;
    Ok((file, direct))
}

fn open_with(
    path: &Path,
    direct: bool,
    open: impl Fn(i32) -> std::io::Result<File>,
) -> Result<(File, Result<(), String>), SsdError> {
    let buffered = |why: String| {
        open(0)
            .map(|f| (f, Err(why)))
            .map_err(|source| SsdError::Open {
                path: path.into(),
                op: "open",
                source,
            })
    };
    if !direct {
        return buffered("ssd.direct-io = false".into());
    }
    match open(libc::O_DIRECT) {
        Ok(f) => Ok((f, Ok(()))),
        // Filesystems without O_DIRECT (tmpfs before Linux 6.6, some FUSE and overlay
        // setups) refuse it with EINVAL.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            buffered(format!("the filesystem refuses O_DIRECT ({e})"))
        }
        Err(source) => Err(SsdError::Open {
            path: path.into(),
            op: "open with O_DIRECT",
            source,
        }),
    }
}

/// Where a read puts a block's bytes: pool memory the caller holds a writer pin on.
pub struct ReadInto {
    pub addr: u64,
    /// Bytes available at `addr` (the pool slot size).
    pub cap: u64,
    /// Keeps the mapping alive until the read is done.
    pub keep: Arc<dyn Send + Sync>,
}

/// How a read ended.
#[derive(Debug)]
pub enum ReadOutcome {
    /// The bytes are at the destination and match their header and checksum.
    Ok,
    /// The slot does not hold this block's bytes: a miss (the destination may hold garbage).
    Damaged(Damage),
    Failed(SsdError),
}

pub enum Op {
    /// Writes a slot: header and bytes in one buffer. A write at offset 0 (the file
    /// header, whose used mark says how far a restart scans) is a fence: it starts once
    /// everything before it is done, and nothing after it starts before it is done, so a
    /// block past the old mark is never written before the mark that covers it.
    Write {
        offset: u64,
        buf: AlignedBuf,
        reply: oneshot::Sender<Result<(), SsdError>>,
        /// The buffer's share of the write backlog (None: not counted, e.g. the header).
        charge: Option<Charge>,
    },
    /// Reads a slot's header and `len` bytes, checks them against `key`.
    Read {
        offset: u64,
        key: BlockKey,
        len: u64,
        into: ReadInto,
        reply: oneshot::Sender<ReadOutcome>,
    },
    /// Reads `len` raw bytes into `buf` (benchmarks: the same disk without the tier).
    Raw {
        offset: u64,
        buf: AlignedBuf,
        reply: oneshot::Sender<Result<AlignedBuf, SsdError>>,
    },
    /// Replies once every op sent before it has finished.
    Barrier { reply: oneshot::Sender<()> },
}

impl Op {
    fn read_offset(&self) -> Option<u64> {
        match self {
            Op::Read { offset, .. } => Some(*offset),
            _ => None,
        }
    }

    fn is_fence(&self) -> bool {
        matches!(self, Op::Write { offset: 0, .. })
    }
}

/// An op in flight, with the buffers the kernel is using.
struct Flight {
    op: Op,
    header: Option<AlignedBuf>,
    bounce: Option<AlignedBuf>,
    _iov: Option<Box<[libc::iovec; 2]>>,
    want: u64,
}

/// One directory's file and its engine; moved onto the directory's I/O thread.
pub struct DirIo {
    pub path: PathBuf,
    file: File,
    ring: Option<IoUring>,
    direct: bool,
    qd: usize,
    /// A test's slow disk: every block write waits this long before it starts.
    write_delay: Option<Duration>,
    /// Tests: the most ops ever in flight together with a file header write.
    #[cfg(test)]
    fence_company: Option<Arc<AtomicU64>>,
}

impl DirIo {
    pub fn new(path: PathBuf, file: File, direct: bool, qd: u32) -> (Self, Result<(), String>) {
        let (ring, uring) = match IoUring::new(qd.next_power_of_two()) {
            Ok(r) => (Some(r), Ok(())),
            Err(e) => (None, Err(format!("io_uring setup failed ({e})"))),
        };
        (
            Self {
                path,
                file,
                ring,
                direct,
                qd: qd.max(1) as usize,
                write_delay: None,
                #[cfg(test)]
                fence_company: None,
            },
            uring,
        )
    }

    /// Fault injection for tests: every block write waits `delay` before it starts, on
    /// this thread (so the disk does one block per `delay`, and reads wait behind).
    pub fn set_write_delay(&mut self, delay: Option<Duration>) {
        self.write_delay = delay;
    }

    pub fn direct(&self) -> bool {
        self.direct
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    fn io_err(&self, op: &'static str, offset: u64, bytes: u64, errno: i32) -> SsdError {
        if op == "write" && is_no_space(errno) {
            SsdError::DiskFull {
                path: self.path.clone(),
                offset,
                bytes,
            }
        } else {
            SsdError::Io {
                path: self.path.clone(),
                op,
                offset,
                bytes,
                source: std::io::Error::from_raw_os_error(errno),
            }
        }
    }

    /// Reads the headers of `slots` slots (offsets from `offset_of`), `qd` at a time, and
    /// hands each to `seen` (a slot that cannot be read is skipped: it counts as empty).
    pub fn scan(
        &mut self,
        slots: u64,
        offset_of: impl Fn(u64) -> u64,
        mut seen: impl FnMut(u64, &[u8]),
    ) {
        let qd = self.qd as u64;
        let mut bufs: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(HEADER as usize)).collect();
        let mut first = 0;
        while first < slots {
            let n = qd.min(slots - first);
            let mut ok = vec![false; n as usize];
            match self.ring.as_mut() {
                Some(ring) => {
                    let fd = types::Fd(self.file.as_raw_fd());
                    for i in 0..n {
                        let b = &mut bufs[i as usize];
                        let sqe = opcode::Read::new(fd, b.as_mut_ptr(), HEADER as u32)
                            .offset(offset_of(first + i))
                            .build()
                            .user_data(i);
                        // SAFETY: the buffer lives in `bufs` until every completion of this
                        // batch has been reaped below; the ring has at least `qd` entries.
                        if unsafe { ring.submission().push(&sqe) }.is_err() {
                            break;
                        }
                    }
                    let mut left = n;
                    while left > 0 {
                        if ring.submit_and_wait(1).is_err() {
                            break;
                        }
                        for cqe in ring.completion() {
                            left -= 1;
                            if cqe.result() == HEADER as i32 {
                                ok[cqe.user_data() as usize] = true;
                            }
                        }
                    }
                    if left > 0 {
                        // The ring failed mid-batch: the kernel may still write these
                        // buffers, so they are leaked rather than reused.
                        std::mem::forget(std::mem::take(&mut bufs));
                        return;
                    }
                }
                None => {
                    for i in 0..n {
                        let b = &mut bufs[i as usize];
                        ok[i as usize] = self
                            .file
                            .read_exact_at(b.as_mut_slice(), offset_of(first + i))
                            .is_ok();
                    }
                }
            }
            for i in 0..n {
                if ok[i as usize] {
                    seen(first + i, bufs[i as usize].as_slice());
                }
            }
            first += n;
        }
    }

    /// The I/O thread: takes ops until every sender is gone and everything is done.
    pub fn run(mut self, rx: mpsc::Receiver<Op>) {
        let mut pending: VecDeque<Op> = VecDeque::new();
        let mut flights: Slab<Flight> = Slab::with_capacity(self.qd);
        let mut writing: HashSet<u64> = HashSet::new();
        let mut parked: HashMap<u64, Vec<Op>> = HashMap::new();
        let mut open = true;
        loop {
            if open && flights.is_empty() && pending.is_empty() {
                match rx.recv() {
                    Ok(op) => pending.push_back(op),
                    Err(_) => open = false,
                }
            }
            while open {
                match rx.try_recv() {
                    Ok(op) => pending.push_back(op),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => open = false,
                }
            }
            while flights.len() < self.qd {
                if flights.iter().any(|(_, f)| f.op.is_fence()) {
                    break;
                }
                let Some(op) = pending.pop_front() else { break };
                if let Some(off) = op.read_offset().filter(|o| writing.contains(o)) {
                    parked.entry(off).or_default().push(op);
                    continue;
                }
                if let Op::Barrier { reply } = op {
                    if flights.is_empty() {
                        let _ = reply.send(());
                        continue;
                    }
                    pending.push_front(Op::Barrier { reply });
                    break;
                }
                if op.is_fence() && !flights.is_empty() {
                    pending.push_front(op);
                    break;
                }
                if let Op::Write { offset, .. } = &op {
                    writing.insert(*offset);
                }
                self.start(op, &mut flights, &mut writing, &mut parked, &mut pending);
            }
            #[cfg(test)]
            if let Some(c) = &self.fence_company {
                if flights.iter().any(|(_, f)| f.op.is_fence()) {
                    c.fetch_max(flights.len() as u64, Relaxed);
                }
            }
            if flights.is_empty() {
                if !open && pending.is_empty() {
                    return;
                }
                continue;
            }
            let Some(ring) = self.ring.as_mut() else {
                continue;
            };
            let mut done: Vec<(u64, i32)> = Vec::new();
            match ring.submit_and_wait(1) {
                Ok(_) => {
                    for cqe in ring.completion() {
                        done.push((cqe.user_data(), cqe.result()));
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => {
                    // The ring is unusable. The kernel may still complete what it holds, so
                    // the in-flight buffers are leaked, never freed under it; every op fails.
                    tracing::error!(dir = %self.path.display(), error = %e,
                        "ssd: io_uring failed; switching this directory to pread/pwrite");
                    for (_, f) in std::mem::take(&mut flights) {
                        let errno = e.raw_os_error().unwrap_or(libc::EIO);
                        let f = std::mem::ManuallyDrop::new(f);
                        // SAFETY: `f` is never used or dropped again; only the reply
                        // channel is moved out of it (its buffers are leaked on purpose).
                        let op = unsafe { std::ptr::read(&f.op) };
                        self.fail(op, errno);
                    }
                    writing.clear();
                    for (_, ops) in parked.drain() {
                        pending.extend(ops);
                    }
                    self.ring = None;
                    continue;
                }
            }
            for (key, res) in done {
                if let Some(f) = flights.try_remove(key as usize) {
                    self.finish(f, res, &mut writing, &mut parked, &mut pending);
                }
            }
        }
    }

    /// Fails an op the dead ring may still hold: its buffers are leaked, never freed.
    fn fail(&self, op: Op, errno: i32) {
        match op {
            Op::Write {
                offset,
                buf,
                reply,
                charge,
            } => end_write(buf, charge, Buffer::Leak, reply, |len| {
                Err(self.io_err("write", offset, len, errno))
            }),
            Op::Read {
                offset, len, reply, ..
            } => {
                let _ = reply.send(ReadOutcome::Failed(self.io_err("read", offset, len, errno)));
            }
            Op::Raw { offset, buf, reply } => {
                let len = buf.len() as u64;
                std::mem::forget(buf);
                let _ = reply.send(Err(self.io_err("read", offset, len, errno)));
            }
            Op::Barrier { reply } => {
                let _ = reply.send(());
            }
        }
    }

    /// Starts one op: on the ring, or done at once without one.
    fn start(
        &mut self,
        op: Op,
        flights: &mut Slab<Flight>,
        writing: &mut HashSet<u64>,
        parked: &mut HashMap<u64, Vec<Op>>,
        pending: &mut VecDeque<Op>,
    ) {
        let mut f = Flight {
            op,
            header: None,
            bounce: None,
            _iov: None,
            want: 0,
        };
        if let (Op::Write { offset, .. }, Some(d)) = (&f.op, self.write_delay) {
            if *offset != 0 {
                std::thread::sleep(d);
            }
        }
        let fd = types::Fd(self.file.as_raw_fd());
        let sqe = match &mut f.op {
            Op::Write { offset, buf, .. } => {
                f.want = buf.len() as u64;
                opcode::Write::new(fd, buf.as_mut_ptr(), buf.len() as u32)
                    .offset(*offset)
                    .build()
            }
            Op::Raw { offset, buf, .. } => {
                f.want = buf.len() as u64;
                opcode::Read::new(fd, buf.as_mut_ptr(), buf.len() as u32)
                    .offset(*offset)
                    .build()
            }
            Op::Read {
                offset, len, into, ..
            } => {
                let data = if self.direct { round_up(*len) } else { *len };
                let straight = !self.direct || (into.addr % ALIGN == 0 && data <= into.cap);
                if straight {
                    let mut header = AlignedBuf::new(HEADER as usize);
                    let iov = Box::new([
                        libc::iovec {
                            iov_base: header.as_mut_ptr().cast(),
                            iov_len: HEADER as usize,
                        },
                        libc::iovec {
                            iov_base: into.addr as usize as *mut libc::c_void,
                            iov_len: data as usize,
                        },
                    ]);
                    f.want = HEADER + data;
                    let sqe = opcode::Readv::new(fd, iov.as_ptr(), 2)
                        .offset(*offset)
                        .build();
                    f.header = Some(header);
                    f._iov = Some(iov);
                    sqe
                } else {
                    let mut b = AlignedBuf::new((HEADER + round_up(*len)) as usize);
                    f.want = b.len() as u64;
                    let sqe = opcode::Read::new(fd, b.as_mut_ptr(), b.len() as u32)
                        .offset(*offset)
                        .build();
                    f.bounce = Some(b);
                    sqe
                }
            }
            Op::Barrier { .. } => return,
        };
        let Some(ring) = self.ring.as_mut() else {
            let res = self.run_sync(&mut f);
            self.finish(f, res, writing, parked, pending);
            return;
        };
        let key = flights.insert(f);
        let sqe = sqe.user_data(key as u64);
        // SAFETY: every buffer and iovec the entry points at is owned by the flight in
        // `flights`, which is only removed when its completion has been reaped (or leaked
        // if the ring dies); the ring has at least `qd` entries and at most `qd` flights.
        if unsafe { ring.submission().push(&sqe) }.is_err() {
            if let Some(f) = flights.try_remove(key) {
                self.finish(f, -libc::EAGAIN, writing, parked, pending);
            }
        }
    }

    /// Runs a flight's I/O with `pread`/`pwrite`; returns bytes done or `-errno`.
    fn run_sync(&self, f: &mut Flight) -> i32 {
        let res = match &mut f.op {
            Op::Write { offset, buf, .. } => self.file.write_all_at(buf.as_slice(), *offset),
            Op::Raw { offset, buf, .. } => self.file.read_exact_at(buf.as_mut_slice(), *offset),
            Op::Read { offset, .. } => match (&mut f.header, &mut f.bounce, &f._iov) {
                (Some(h), _, Some(iov)) => {
                    let data = iov[1];
                    self.file
                        .read_exact_at(h.as_mut_slice(), *offset)
                        .and_then(|_| {
                            // SAFETY: the destination range is the caller's writer-pinned pool
                            // slot (checked against its capacity in `start`), kept mapped by
                            // the op's `keep`.
                            let dst = unsafe {
                                std::slice::from_raw_parts_mut(
                                    data.iov_base.cast::<u8>(),
                                    data.iov_len,
                                )
                            };
                            self.file.read_exact_at(dst, *offset + HEADER)
                        })
                }
                (_, Some(b), _) => self.file.read_exact_at(b.as_mut_slice(), *offset),
                _ => Ok(()),
            },
            Op::Barrier { .. } => Ok(()),
        };
        match res {
            Ok(()) => f.want.min(i32::MAX as u64) as i32,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => 0,
            Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
        }
    }

    fn finish(
        &self,
        f: Flight,
        res: i32,
        writing: &mut HashSet<u64>,
        parked: &mut HashMap<u64, Vec<Op>>,
        pending: &mut VecDeque<Op>,
    ) {
        let short = res >= 0 && (res as u64) < f.want.min(i32::MAX as u64);
        let errno = if res < 0 {
            -res
        } else if short {
            libc::EIO
        } else {
            0
        };
        match f.op {
            Op::Write {
                offset,
                buf,
                reply,
                charge,
            } => {
                writing.remove(&offset);
                if let Some(ops) = parked.remove(&offset) {
                    for op in ops.into_iter().rev() {
                        pending.push_front(op);
                    }
                }
                end_write(buf, charge, Buffer::Free, reply, |bytes| {
                    if errno == 0 {
                        Ok(())
                    } else if short {
                        // A short write is how a disk that just filled up answers.
                        Err(SsdError::DiskFull {
                            path: self.path.clone(),
                            offset,
                            bytes,
                        })
                    } else {
                        Err(self.io_err("write", offset, bytes, errno))
                    }
                });
            }
            Op::Raw { offset, buf, reply } => {
                let out = if errno == 0 {
                    Ok(buf)
                } else {
                    Err(self.io_err("read", offset, buf.len() as u64, errno))
                };
                let _ = reply.send(out);
            }
            Op::Read {
                offset,
                key,
                len,
                into,
                reply,
            } => {
                if errno != 0 {
                    // A short read is a slot past the end of a file that shrank: no block.
                    let out = if short {
                        ReadOutcome::Damaged(Damage::Header)
                    } else {
                        ReadOutcome::Failed(self.io_err("read", offset, len, errno))
                    };
                    let _ = reply.send(out);
                    return;
                }
                let out = verify(&f.header, &f.bounce, &key, len, &into);
                let _ = reply.send(out);
            }
            Op::Barrier { reply } => {
                let _ = reply.send(());
            }
        }
    }
}

/// What becomes of a finished write's buffer.
#[derive(Clone, Copy)]
enum Buffer {
    Free,
    /// A dead ring may still hold it: leaked, never freed under the kernel.
    Leak,
}

/// Ends a block write, done or failed: its copy and its backlog charge go first, so whoever
/// reads the answer sees the room (a leaked copy is not queued any more either: the backlog
/// bounds what waits for the disk), then the answer `out` makes from the copy's size.
fn end_write(
    buf: AlignedBuf,
    charge: Option<Charge>,
    buffer: Buffer,
    reply: oneshot::Sender<Result<(), SsdError>>,
    out: impl FnOnce(u64) -> Result<(), SsdError>,
) {
    let bytes = buf.len() as u64;
    match buffer {
        Buffer::Free => drop(buf),
        Buffer::Leak => std::mem::forget(buf),
    }
    drop(charge);
    let _ = reply.send(out(bytes));
}

/// Checks a finished read against its header; copies bounced bytes into place if good.
fn verify(
    header: &Option<AlignedBuf>,
    bounce: &Option<AlignedBuf>,
    key: &BlockKey,
    len: u64,
    into: &ReadInto,
) -> ReadOutcome {
    let (head, data): (&[u8], &[u8]) = match (header, bounce) {
        (Some(h), _) => {
            // SAFETY: the read just placed `len` bytes at the caller's writer-pinned slot,
            // kept mapped by `into.keep`; nothing else writes it while the pin is held.
            let d = unsafe {
                std::slice::from_raw_parts(into.addr as usize as *const u8, len as usize)
            };
            (h.as_slice(), d)
        }
        (None, Some(b)) => {
            let s = b.as_slice();
            (
                &s[..HEADER as usize],
                &s[HEADER as usize..(HEADER + len) as usize],
            )
        }
        (None, None) => return ReadOutcome::Damaged(Damage::Header),
    };
    let h = match BlockHeader::decode(head) {
        Ok(h) => h,
        Err(d) => return ReadOutcome::Damaged(d),
    };
    if let Err(d) = h.verify(key, data) {
        return ReadOutcome::Damaged(d);
    }
    if header.is_none() {
        if len > into.cap {
            return ReadOutcome::Damaged(Damage::Header);
        }
        // SAFETY: `len <= into.cap` bytes of the caller's writer-pinned slot, kept mapped.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), into.addr as usize as *mut u8, data.len())
        };
    }
    ReadOutcome::Ok
}

/// A raw sequential read of `[offset, offset + len)` of `file` in `chunk`-byte reads, `qd`
/// in flight, through a [`DirIo`] thread: what the disk gives without the tier. Returns the
/// bytes read and the time taken.
pub fn raw_read(
    path: &Path,
    direct: bool,
    offset: u64,
    len: u64,
    chunk: u64,
    qd: u32,
) -> Result<(u64, Duration, IoMode), SsdError> {
    let (file, direct_mode) = open_file(path, direct)?;
    let (io, uring) = DirIo::new(path.into(), file, direct_mode.is_ok(), qd);
    let mode = IoMode {
        direct: direct_mode,
        uring,
    };
    let (tx, rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("kvferry-ssd-raw".into())
        .spawn(move || io.run(rx))
        .map_err(|source| SsdError::Open {
            path: path.into(),
            op: "spawning the raw read thread",
            source,
        })?;
    let chunk = round_up(chunk.max(1));
    let qd = qd.max(1) as usize;
    // Allocated and touched before the clock starts: the tier reads into pool memory that
    // is mapped (and pinned where a GPU is) at start, so the raw read gets the same.
    let mut free: Vec<AlignedBuf> = (0..qd)
        .map(|_| {
            let mut b = AlignedBuf::new(chunk as usize);
            b.as_mut_slice().fill(0);
            b
        })
        .collect();
    let t0 = Instant::now();
    let mut inflight: VecDeque<oneshot::Receiver<Result<AlignedBuf, SsdError>>> = VecDeque::new();
    let mut at = offset;
    let end = offset + len;
    let mut done = 0u64;
    let stopped = || SsdError::Stopped { path: path.into() };
    while at < end || !inflight.is_empty() {
        while at < end {
            let Some(buf) = free.pop() else { break };
            let (reply, r) = oneshot::channel();
            tx.send(Op::Raw {
                offset: at,
                buf,
                reply,
            })
            .map_err(|_| stopped())?;
            inflight.push_back(r);
            at += chunk;
        }
        if let Some(r) = inflight.pop_front() {
            let buf = r.blocking_recv().map_err(|_| stopped())??;
            done += buf.len() as u64;
            free.push(buf);
        }
    }
    let took = t0.elapsed();
    drop(tx);
    let _ = thread.join();
    Ok((done, took, mode))
}

#[cfg(test)]
mod tests;
