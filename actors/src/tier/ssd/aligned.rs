//! [`AlignedBuf`]: the heap buffer `O_DIRECT` I/O needs (block copies, headers, scans).

use crate::tier::ssd::format::ALIGN;

/// A zeroed, `ALIGN`-aligned heap buffer (what `O_DIRECT` reads and writes need).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain owned heap memory with no thread affinity; `&AlignedBuf` only
// gives shared reads.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above: shared access is read-only.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize) -> Self {
        let len = len.max(ALIGN as usize);
        let Ok(layout) = std::alloc::Layout::from_size_align(len, ALIGN as usize) else {
            std::alloc::handle_alloc_error(std::alloc::Layout::new::<u8>())
        };
        // SAFETY: `layout` has a nonzero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` initialized (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Where the kernel reads or writes the buffer (an io_uring entry's address).
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Ok(layout) = std::alloc::Layout::from_size_align(self.len, ALIGN as usize) {
            // SAFETY: allocated in `new` with this very layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}
