//! Memfds a client hands the node: sealed against shrinking before anyone maps them.
//!
//! A shared mapping of a file that shrinks under it faults (SIGBUS) on the next access to a
//! page past the new end, and the node cannot catch that: every memfd a client sends (host
//! KV, completion boards, request mailboxes) goes through [`seal_against_shrinking`] before
//! it is mapped, and the client libraries seal what they create before they send it.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use thiserror::Error;

/// Why a descriptor cannot be kept from shrinking.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SealError {
    /// `F_GET_SEALS` failed: not a memfd (or a file without seals).
    #[error("not a memfd ({source})")]
    NotMemfd {
        #[source]
        source: std::io::Error,
    },
    /// Not sealed `F_SEAL_SHRINK`, and the seal cannot be added (created without
    /// `MFD_ALLOW_SEALING`, or sealed `F_SEAL_SEAL` first).
    #[error(
        "cannot seal it against shrinking ({source}): create it with MFD_ALLOW_SEALING or \
         seal it F_SEAL_SHRINK"
    )]
    Unsealable {
        #[source]
        source: std::io::Error,
    },
}

/// Makes sure `fd` can never shrink: checks its seals and adds `F_SEAL_SHRINK` where it is
/// missing. Call it before reading the file's size, so that the size checked is one the
/// file keeps.
pub fn seal_against_shrinking(fd: BorrowedFd<'_>) -> Result<(), SealError> {
    let raw = fd.as_raw_fd();
    // SAFETY: fcntl on a descriptor the caller holds open (borrowed for the call);
    // F_GET_SEALS takes no argument.
    let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(SealError::NotMemfd {
            source: std::io::Error::last_os_error(),
        });
    }
    if seals & libc::F_SEAL_SHRINK != 0 {
        return Ok(());
    }
    // SAFETY: fcntl on the same descriptor with an integer argument.
    if unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } < 0 {
        return Err(SealError::Unsealable {
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// A client's memfd mapped shared and read-write, `len` bytes from offset 0; unmapped on drop.
/// Whoever hands its address to copies must drop it only once none can still touch it.
#[derive(Debug)]
pub(crate) struct ClientMap {
    ptr: u64,
    len: u64,
}

impl ClientMap {
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for ClientMap {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what `mmap` returned and was given in `map_client`,
        // unmapped once (here). munmap cannot fail for such a range; if it did, the mapping
        // would leak, which is safe.
        unsafe { libc::munmap(self.ptr as usize as *mut libc::c_void, self.len as usize) };
    }
}

/// Seals `fd` against shrinking ([`seal_against_shrinking`]), checks that it holds at least
/// `len` bytes and maps them shared and read-write. The descriptor is closed: the mapping
/// keeps the memory. The error says why, for the caller's typed error.
pub(crate) fn map_client(fd: OwnedFd, len: u64) -> Result<ClientMap, String> {
    let raw = fd.as_raw_fd();
    if len == 0 {
        return Err("zero-sized memory".into());
    }
    let size = usize::try_from(len).map_err(|_| format!("{len} bytes exceed the address space"))?;
    seal_against_shrinking(fd.as_fd()).map_err(|e| e.to_string())?;
    // SAFETY: a zeroed stat is valid output space for fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes into `st`, which lives across the call.
    if unsafe { libc::fstat(raw, &mut st) } < 0 {
        return Err(format!("fstat: {}", std::io::Error::last_os_error()));
    }
    if (st.st_size as u64) < len {
        return Err(format!(
            "it holds {} bytes, {len} were announced",
            st.st_size
        ));
    }
    // SAFETY: a fresh shared mapping of `size` bytes of a file at least that long (and sealed
    // against shrinking, so every mapped page stays backed); the kernel picks the address, so
    // nothing of ours is replaced.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            raw,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    Ok(ClientMap {
        ptr: p as usize as u64,
        len,
    })
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};

    use super::*;

    fn memfd(flags: libc::c_uint) -> OwnedFd {
        // SAFETY: a NUL-terminated name; the returned descriptor is checked and owned below.
        let fd = unsafe { libc::memfd_create(c"seal-test".as_ptr(), flags) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on a descriptor we own.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
        fd
    }

    fn shrink(fd: &OwnedFd) -> std::io::Result<()> {
        // SAFETY: ftruncate on a descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), 0) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    #[test]
    fn a_sealable_memfd_is_sealed_and_cannot_shrink() {
        let fd = memfd(libc::MFD_ALLOW_SEALING);
        seal_against_shrinking(fd.as_fd()).unwrap();
        // Twice is fine (a client that sealed it itself).
        seal_against_shrinking(fd.as_fd()).unwrap();
        let e = shrink(&fd).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    }

    #[test]
    fn unsealable_descriptors_are_refused_clearly() {
        // Without MFD_ALLOW_SEALING the memfd is born sealed F_SEAL_SEAL.
        let fd = memfd(0);
        let e = seal_against_shrinking(fd.as_fd()).unwrap_err();
        assert!(matches!(e, SealError::Unsealable { .. }), "{e}");
        assert!(e.to_string().contains("MFD_ALLOW_SEALING"), "{e}");
        // Sealed F_SEAL_SEAL without F_SEAL_SHRINK.
        let fd = memfd(libc::MFD_ALLOW_SEALING);
        // SAFETY: fcntl on a descriptor we own with an integer argument.
        let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SEAL) };
        assert_eq!(rc, 0);
        let e = seal_against_shrinking(fd.as_fd()).unwrap_err();
        assert!(matches!(e, SealError::Unsealable { .. }), "{e}");
        // A regular file has no seals at all.
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        let e = seal_against_shrinking(f.as_fd()).unwrap_err();
        assert!(matches!(e, SealError::NotMemfd { .. }), "{e}");
    }
}
