//! A memfd mapped shared between a client process and the node: what completion boards and
//! request mailboxes are made of. Either side maps the same pages; every field is read and
//! written through atomics or through bounds-checked copies, never through references that
//! another process could write under.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::mm::{MapFlags, ProtFlags};
use rustix::thread::futex;

/// Why a memfd shared with the node could not be made or mapped: a failed call, or a file
/// that could shrink under the mapping. Boards and mailboxes report it as their own.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    #[error("{call} failed")]
    Os {
        call: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// Not sealed against shrinking, and it cannot be (a shrunk file faults its mappings, a
    /// fault the node cannot catch): refused.
    #[error("the memfd cannot be kept from shrinking")]
    Unsealable {
        #[source]
        source: kvferry_gpu::memfd::SealError,
    },
}

fn os(call: &'static str) -> impl FnOnce(rustix::io::Errno) -> ShmError {
    move |e| ShmError::Os {
        call,
        source: e.into(),
    }
}

fn unsealable(source: kvferry_gpu::memfd::SealError) -> ShmError {
    ShmError::Unsealable { source }
}

/// A shared mapping of a whole memfd. Unmapped on drop.
#[derive(Debug)]
pub(crate) struct SharedMap {
    base: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is only accessed through atomics and through copies bounded by `len`
// (`read`/`write`), so sharing it between threads is sound; it stays mapped until drop, and
// `&self` methods never hand out plain references into it.
unsafe impl Send for SharedMap {}
// SAFETY: as above.
unsafe impl Sync for SharedMap {}

impl SharedMap {
    /// A new zeroed memfd of `len` bytes, sealed against shrinking and mapped (the client
    /// side: the node maps what it is sent, and it must not be able to shrink under the node).
    pub(crate) fn create(name: &str, len: u64) -> Result<Self, ShmError> {
        let fd = rustix::fs::memfd_create(
            name,
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )
        .map_err(os("memfd_create"))?;
        rustix::fs::ftruncate(&fd, len).map_err(os("ftruncate"))?;
        Self::map(fd, len)
    }

    /// Seals `fd` against shrinking (the node side, before it checks the size: a size read
    /// before the seal could be gone by the time the mapping is touched) and returns the size
    /// of the file, which it now keeps.
    pub(crate) fn sealed_len(fd: &OwnedFd) -> Result<u64, ShmError> {
        kvferry_gpu::memfd::seal_against_shrinking(fd.as_fd()).map_err(unsealable)?;
        let st = rustix::fs::fstat(fd).map_err(os("fstat"))?;
        Ok(u64::try_from(st.st_size).unwrap_or(0))
    }

    /// Maps the first `len` bytes of `fd`, which the caller checked the file holds. The file
    /// is sealed against shrinking first, whoever maps it: every mapping this type makes stays
    /// backed for its whole life, so no access through it can fault.
    pub(crate) fn map(fd: OwnedFd, len: u64) -> Result<Self, ShmError> {
        kvferry_gpu::memfd::seal_against_shrinking(fd.as_fd()).map_err(unsealable)?;
        let n = usize::try_from(len)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| ShmError::Os {
                call: "mmap",
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            })?;
        // SAFETY: a fresh shared mapping of `n` bytes of the memfd; nothing else in this
        // process aliases it, and every access goes through atomics or bounded copies.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                n,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(os("mmap"))?;
        let base = NonNull::new(p.cast::<u8>()).ok_or_else(|| ShmError::Os {
            call: "mmap",
            source: std::io::Error::from(std::io::ErrorKind::AddrNotAvailable),
        })?;
        Ok(Self { base, len: n, fd })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The 32-bit word at `off`. Panics (a bug of the caller, never of input) when `off` is
    /// not a 4-aligned offset inside the mapping: callers pass offsets of their layout.
    pub(crate) fn word32(&self, off: usize) -> &AtomicU32 {
        assert!(off + 4 <= self.len && off.is_multiple_of(4), "word {off}");
        // SAFETY: checked above: a 4-aligned offset inside the page-aligned mapping, which
        // lives as long as `self`.
        unsafe { &*self.base.as_ptr().add(off).cast::<AtomicU32>() }
    }

    /// The 64-bit word at `off` (8-aligned, inside), as [`Self::word32`].
    pub(crate) fn word64(&self, off: usize) -> &AtomicU64 {
        assert!(off + 8 <= self.len && off.is_multiple_of(8), "word {off}");
        // SAFETY: as in `word32`.
        unsafe { &*self.base.as_ptr().add(off).cast::<AtomicU64>() }
    }

    /// Copies `src` to `off`; false (nothing written) when it would not fit.
    pub(crate) fn write(&self, off: usize, src: &[u8]) -> bool {
        if off.checked_add(src.len()).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: the range lies inside the mapping (checked above) and `src` is memory of
        // this process, so they do not overlap. The other side may read the range at the
        // same time; the protocol orders that with the atomics around it, and a racing
        // reader only ever sees bytes, never a reference.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.as_ptr().add(off), src.len())
        };
        true
    }

    /// Copies `len` bytes at `off` into a new buffer; `None` when the range is outside.
    pub(crate) fn read(&self, off: usize, len: usize) -> Option<Vec<u8>> {
        if off.checked_add(len).is_none_or(|end| end > self.len) {
            return None;
        }
        let mut out = vec![0u8; len];
        // SAFETY: as in `write`, with the roles swapped.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.as_ptr().add(off), out.as_mut_ptr(), len)
        };
        Some(out)
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; nothing refers into it after
        // drop (accessors borrow `self`).
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// Sleeps while `word` still holds `seen`, at most `timeout`. EAGAIN, EINTR and ETIMEDOUT
/// all mean the same to a caller: look again. Shared (not private) futexes, so waiters and
/// wakers may be in different processes.
pub(crate) fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = futex::Timespec {
        tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    let _ = futex::wait(word, futex::Flags::empty(), seen, Some(&ts));
}

/// Asks `ready` until it answers or `timeout` passes (`None`): for `spin` between looks it
/// yields the core (to whatever else may run on it, the other side included), then it sleeps
/// on `word`. Writers change `word` after what `ready` reads, then wake it; a look reads the
/// word first, so a write between the look and the sleep ends the sleep at once.
pub(crate) fn poll_then_sleep<T>(
    word: &AtomicU32,
    spin: Duration,
    timeout: Duration,
    mut ready: impl FnMut() -> Option<T>,
) -> Option<T> {
    let now = Instant::now();
    let (spin_until, deadline) = (now + spin.min(timeout), now + timeout);
    loop {
        let seen = word.load(Ordering::Acquire);
        if let Some(v) = ready() {
            return Some(v);
        }
        let now = Instant::now();
        if now < spin_until {
            std::thread::yield_now();
            continue;
        }
        let left = deadline.saturating_duration_since(now);
        if left.is_zero() {
            return None;
        }
        futex_wait(word, seen, left);
    }
}

/// Wakes every waiter on `word`. The kernel reads the count as an `int`: `u32::MAX` would be
/// -1 there, which wakes one waiter only (a rank's loader and its forward may both sleep on
/// one board), so the most an `int` holds.
pub(crate) fn futex_wake(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shrink(fd: BorrowedFd<'_>) -> Result<(), rustix::io::Errno> {
        rustix::fs::ftruncate(fd, 0)
    }

    /// What a client creates is sealed before it is sent; what the node maps is sealed before
    /// it reads its size, whoever created it: neither side's mapping can lose its pages.
    #[test]
    fn no_mapping_can_shrink_under_either_side() {
        let client = SharedMap::create("t", 8192).unwrap();
        assert_eq!(shrink(client.fd()), Err(rustix::io::Errno::PERM));
        // A client that did not seal it (an older or foreign one): the node seals it.
        let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 8192).unwrap();
        let theirs = fd.try_clone().unwrap();
        assert_eq!(SharedMap::sealed_len(&fd).unwrap(), 8192);
        let node = SharedMap::map(fd, 8192).unwrap();
        assert_eq!(shrink(theirs.as_fd()), Err(rustix::io::Errno::PERM));
        // Growing is harmless and still allowed; the mapping reads as before.
        rustix::fs::ftruncate(&theirs, 16384).unwrap();
        assert_eq!(node.read(8188, 4), Some(vec![0; 4]));
        // One that cannot be sealed is not mapped.
        let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 8192).unwrap();
        assert!(matches!(
            SharedMap::sealed_len(&fd),
            Err(ShmError::Unsealable { .. })
        ));
        assert!(matches!(
            SharedMap::map(fd, 8192),
            Err(ShmError::Unsealable { .. })
        ));
    }
}
