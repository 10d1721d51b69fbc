//! A directory's block file as a tier opens it: locked for this node alone, its header
//! checked (or written), sized, and scanned for the blocks a restart finds again.

use std::time::{Duration, Instant};

use crate::tier::ssd::error::SsdError;
use crate::tier::ssd::format::{self, BlockHeader, FileHeader, HEADER};
use crate::tier::ssd::io::{AlignedBuf, DirIo};

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
pub(super) fn lock_block_file(
    file: &std::fs::File,
    path: &std::path::Path,
) -> Result<(), SsdError> {
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

/// Checks (or writes) the file header and sizes the file to `slots` slots, then scans the
/// slots' headers up to its used mark. A file of another geometry is started afresh (with a
/// warning). Returns how many blocks the scan found and the used mark written.
pub(super) fn prepare_file(
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
