//! Host memory that reads come from or land in: page-aligned mappings that the MR table keeps
//! alive while any registration or in-flight read refers to them.

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::MemfdFlags;
use rustix::mm::{MapFlags, ProtFlags};
use thiserror::Error;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RegionError {
    #[error("region length must be non-zero")]
    Empty,
    #[error("memfd_create({name:?}) failed")]
    MemfdCreate {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("sizing memfd to {len} bytes failed")]
    Truncate {
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error("mmap of {len} bytes failed")]
    Map {
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error("range {offset}+{len} is outside the {region_len}-byte region")]
    OutOfBounds {
        offset: usize,
        len: usize,
        region_len: usize,
    },
    #[error("region is mapped read-only")]
    ReadOnly,
    #[error("reopening memfd read-only failed")]
    Reopen {
        #[source]
        source: io::Error,
    },
}

/// A page-aligned host mapping: anonymous, memfd-backed (shareable with same-host peers), or a
/// read-only view of a peer's memfd.
///
/// The bytes are DMA-style memory: remote reads and local copies write them through raw
/// pointers while other parts of the program may hold the region, so the region never hands
/// out `&[u8]`/`&mut [u8]`; access is by copying (`read_at`, `write_at`). The RC contract (no
/// one touches a destination range while a read into it is in flight) is what keeps copies from
/// overlapping in time.
#[derive(Debug)]
pub struct HostRegion {
    ptr: NonNull<u8>,
    len: usize,
    fd: Option<OwnedFd>,
    writable: bool,
}

// SAFETY: the region owns its mapping (unmapped only in Drop); all access to the bytes goes
// through raw-pointer copies bounded by `len`, never through Rust references, so sharing the
// pointer between threads does not create aliasing references.
unsafe impl Send for HostRegion {}
// SAFETY: see `Send`; `&HostRegion` offers no way to form a reference into the mapping.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// Private anonymous memory (staging buffers, test destinations).
    pub fn anonymous(len: usize) -> Result<Self, RegionError> {
        if len == 0 {
            return Err(RegionError::Empty);
        }
        // SAFETY: a fresh anonymous mapping at an address the kernel picks; no existing
        // memory is affected.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        };
        Self::from_mmap(ptr, len, None, true)
    }

    /// Shared memory backed by a memfd, the form a host pool takes so that same-host peers can
    /// map it.
    pub fn memfd(name: &str, len: usize) -> Result<Self, RegionError> {
        if len == 0 {
            return Err(RegionError::Empty);
        }
        // A NUL inside the name would make it unrepresentable as a C string; the name is
        // only a label in /proc, so it is replaced rather than refused.
        let fd = rustix::fs::memfd_create(name.replace('\0', "_"), MemfdFlags::CLOEXEC).map_err(
            |e| RegionError::MemfdCreate {
                name: name.to_string(),
                source: e.into(),
            },
        )?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(|e| RegionError::Truncate {
            len,
            source: e.into(),
        })?;
        // SAFETY: maps the memfd we just sized to `len` at an address the kernel picks; no
        // existing memory is affected.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        };
        Self::from_mmap(ptr, len, Some(fd), true)
    }

    /// Maps a memfd the caller created and sized (with whatever flags it needed, hugepages
    /// for example) shared and writable: the form a node's host pool takes. `populate`
    /// prefaults every page so the first copies do not pay for page faults.
    pub fn map_shared(fd: OwnedFd, len: usize, populate: bool) -> Result<Self, RegionError> {
        if len == 0 {
            return Err(RegionError::Empty);
        }
        let mut flags = MapFlags::SHARED;
        if populate {
            flags |= MapFlags::POPULATE;
        }
        // SAFETY: maps `len` bytes of a descriptor we own at an address the kernel picks; no
        // existing memory is affected. The caller sized the file to at least `len`.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                flags,
                &fd,
                0,
            )
        };
        Self::from_mmap(ptr, len, Some(fd), true)
    }

    /// Maps a peer's memfd `PROT_READ`. `fd` should itself be read-only so that the mapping can
    /// never be upgraded with `mprotect`.
    pub fn map_read_only(fd: OwnedFd, len: usize) -> Result<Self, RegionError> {
        if len == 0 {
            return Err(RegionError::Empty);
        }
        // SAFETY: maps `len` bytes of a descriptor we own read-only at an address the kernel
        // picks; no existing memory is affected. A file shorter than `len` would fault on
        // access, so callers pass the length the owner sized the memfd to.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ,
                MapFlags::SHARED,
                &fd,
                0,
            )
        };
        Self::from_mmap(ptr, len, Some(fd), false)
    }

    fn from_mmap(
        mapped: rustix::io::Result<*mut c_void>,
        len: usize,
        fd: Option<OwnedFd>,
        writable: bool,
    ) -> Result<Self, RegionError> {
        let ptr = mapped.map_err(|e| RegionError::Map {
            len,
            source: e.into(),
        })?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(RegionError::Map {
            len,
            source: io::Error::from(io::ErrorKind::InvalidData),
        })?;
        Ok(HostRegion {
            ptr,
            len,
            fd,
            writable,
        })
    }

    /// Virtual address of the first byte (what descriptors and segments name).
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// The backing memfd, where there is one.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// A new read-only descriptor of the backing memfd (what same-host peers receive).
    pub fn reopen_read_only(&self) -> Result<Option<OwnedFd>, RegionError> {
        let Some(fd) = &self.fd else { return Ok(None) };
        // A new open file description through /proc, not a dup: its read-only mode is what
        // keeps a peer's mapping from ever being made writable.
        let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        let file = std::fs::File::open(path).map_err(|source| RegionError::Reopen { source })?;
        Ok(Some(file.into()))
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), RegionError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(RegionError::OutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }

    /// Copies `data` into the region at `offset`.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<(), RegionError> {
        if !self.writable {
            return Err(RegionError::ReadOnly);
        }
        self.check(offset, data.len())?;
        // SAFETY: bounds checked above; the mapping is writable and lives as long as self.
        unsafe { self.copy_in(offset, data.as_ptr(), data.len()) };
        Ok(())
    }

    /// Copies `buf.len()` bytes at `offset` out of the region.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<(), RegionError> {
        self.check(offset, buf.len())?;
        // SAFETY: bounds checked above; the mapping is readable and lives as long as self.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        Ok(())
    }

    /// The whole region as a vector (tests, canary checks).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        // Cannot fail: the range is the region itself.
        let _ = self.read_at(0, &mut v);
        v
    }

    /// Fills the whole region with `byte`.
    pub fn fill(&self, byte: u8) -> Result<(), RegionError> {
        if !self.writable {
            return Err(RegionError::ReadOnly);
        }
        // SAFETY: the whole mapping is writable and `len` bytes long.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), byte, self.len) };
        Ok(())
    }

    /// Raw pointer to `offset`; callers check bounds and writability.
    pub(crate) fn ptr_at(&self, offset: usize) -> *mut u8 {
        self.ptr.as_ptr().wrapping_add(offset)
    }

    /// # Safety
    /// `offset + len <= self.len`, the region is writable, and `src..src+len` is readable.
    /// Overlap is allowed (a region registered for both local write and remote read may be
    /// read into itself), hence `copy` rather than `copy_nonoverlapping`.
    pub(crate) unsafe fn copy_in(&self, offset: usize, src: *const u8, len: usize) {
        // SAFETY: guaranteed by the caller.
        unsafe { std::ptr::copy(src, self.ptr.as_ptr().add(offset), len) }
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly the mapping created in the constructor, unmapped once.
        // munmap of a valid mapping cannot fail in a way we could act on.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_roundtrip_and_bounds() {
        let r = HostRegion::memfd("t", 8192).unwrap();
        r.write_at(10, b"hello").unwrap();
        let mut b = [0u8; 5];
        r.read_at(10, &mut b).unwrap();
        assert_eq!(&b, b"hello");
        assert!(matches!(
            r.write_at(8190, b"abc"),
            Err(RegionError::OutOfBounds { .. })
        ));
        assert!(r.fd().is_some());
        let ro = HostRegion::map_read_only(r.reopen_read_only().unwrap().unwrap(), 8192).unwrap();
        ro.read_at(10, &mut b).unwrap();
        assert_eq!(&b, b"hello");
        assert!(matches!(ro.write_at(0, b"x"), Err(RegionError::ReadOnly)));
        assert!(matches!(HostRegion::anonymous(0), Err(RegionError::Empty)));
    }

    #[test]
    fn a_read_only_reopen_cannot_be_mapped_writable() {
        let r = HostRegion::memfd("ro", 4096).unwrap();
        let ro = r.reopen_read_only().unwrap().unwrap();
        // The peer's descriptor itself refuses a writable shared mapping (EACCES), so no
        // mprotect could ever turn its read-only view into a writable one.
        assert!(matches!(
            HostRegion::map_shared(ro, 4096, false),
            Err(RegionError::Map { .. })
        ));
        assert!(HostRegion::anonymous(4096)
            .unwrap()
            .reopen_read_only()
            .unwrap()
            .is_none());
    }

    #[test]
    fn a_nul_in_the_name_is_replaced_and_writes_reach_the_shared_mapping() {
        let r = HostRegion::memfd("pool\0name", 8192).unwrap();
        r.write_at(4096, b"shared").unwrap();
        let fd = r.fd().unwrap().try_clone_to_owned().unwrap();
        let twin = HostRegion::map_shared(fd, 8192, true).unwrap();
        let mut b = [0u8; 6];
        twin.read_at(4096, &mut b).unwrap();
        assert_eq!(&b, b"shared");
        let name = std::fs::read_link(format!("/proc/self/fd/{}", r.fd().unwrap().as_raw_fd()));
        assert_eq!(
            name.unwrap().to_string_lossy(),
            "/memfd:pool_name (deleted)"
        );
    }
}
