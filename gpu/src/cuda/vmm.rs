//! VMM memory (`cuMemCreate` / `cuMemMap`) shared by POSIX file descriptor: how vLLM 0.34's
//! extensible KV cache, whose allocations a CUDA IPC handle cannot name, reaches a node.
//!
//! The exporting process creates a physical allocation with the POSIX fd handle type, maps
//! it into an address range it reserved, and exports the allocation as a file descriptor;
//! the importing process turns the fd back into an allocation handle, reserves a range of
//! its own, maps the allocation there and grants its device access. Both ends own a
//! [`VmmMap`]: the reservation, the mapping and the handle, torn down in the one order the
//! driver accepts — unmap, release the handle, free the range. The physical memory lives
//! until the last mapping and handle of every process are gone, so a node's mapping keeps
//! the engine's KV alive until the node drops it.

use std::os::fd::{BorrowedFd, OwnedFd};

use super::error::CudaError;
use super::ffi;

/// One VMM allocation mapped at `[ptr, ptr + size)` of a range this process reserved.
/// Built and torn down with the owning device's context current.
#[derive(Debug)]
pub(super) struct VmmMap {
    ptr: u64,
    size: u64,
    handle: Option<ffi::MemHandle>,
    mapped: bool,
    reserved: bool,
}

/// The failing call of a [`VmmMap`] step and the driver's error.
pub(super) type StepError = (&'static str, CudaError);

fn step(call: &'static str) -> impl Fn(CudaError) -> StepError {
    move |e| (call, e)
}

impl VmmMap {
    /// Maps the allocation exported as `fd`, `size` bytes of it, for device `ordinal`.
    /// `size` must be a multiple of the allocation granularity and at most the
    /// allocation's size (the driver refuses otherwise). The fd stays the caller's.
    pub(super) fn import(fd: BorrowedFd<'_>, size: u64, ordinal: u32) -> Result<Self, StepError> {
        let handle = ffi::vmm_import_fd(fd).map_err(step("cuMemImportFromShareableHandle"))?;
        Self::map_handle(handle, size, ordinal)
    }

    /// A new allocation of `size` bytes (a multiple of the granularity) on device `ordinal`,
    /// exportable as a POSIX fd ([`export_fd`]).
    pub(super) fn create(size: u64, ordinal: u32) -> Result<Self, StepError> {
        let bytes = usize::try_from(size).map_err(|_| {
            step("cuMemCreate")(CudaError::Driver {
                call: "cuMemCreate",
                code: 1,
                name: "size exceeds the address space".into(),
            })
        })?;
        let handle = ffi::vmm_create(ordinal as i32, bytes).map_err(step("cuMemCreate"))?;
        Self::map_handle(handle, size, ordinal)
    }

    /// Reserves, maps and grants access; on failure undoes what it did (the handle
    /// included, which this takes).
    fn map_handle(handle: ffi::MemHandle, size: u64, ordinal: u32) -> Result<Self, StepError> {
        let mut m = Self {
            ptr: 0,
            size,
            handle: Some(handle),
            mapped: false,
            reserved: false,
        };
        // From here on, dropping `m` releases whatever was set up.
        let bytes = usize::try_from(size).map_err(|_| {
            step("cuMemAddressReserve")(CudaError::Driver {
                call: "cuMemAddressReserve",
                code: 1,
                name: "size exceeds the address space".into(),
            })
        })?;
        let align =
            ffi::vmm_granularity(ordinal as i32).map_err(step("cuMemGetAllocationGranularity"))?;
        m.ptr = ffi::vmm_address_reserve(bytes, align).map_err(step("cuMemAddressReserve"))?;
        m.reserved = true;
        // SAFETY: the range was just reserved and nothing is mapped in it; the handle is live
        // (ours until teardown); a handle shorter than `size` is an error code.
        unsafe { ffi::vmm_map(m.ptr, bytes, handle) }.map_err(step("cuMemMap"))?;
        m.mapped = true;
        // SAFETY: the range was just mapped.
        unsafe { ffi::vmm_set_access(m.ptr, bytes, ordinal as i32) }
            .map_err(step("cuMemSetAccess"))?;
        Ok(m)
    }

    pub(super) fn ptr(&self) -> u64 {
        self.ptr
    }

    pub(super) fn size(&self) -> u64 {
        self.size
    }

    /// Unmaps, releases the handle and frees the range, each once; continues past a failed
    /// step where the next one is still safe (a range that failed to unmap is not freed) and
    /// returns the first error. Idempotent.
    pub(super) fn teardown(&mut self) -> Result<(), StepError> {
        let mut first: Option<StepError> = None;
        let bytes = self.size as usize;
        if self.mapped {
            self.mapped = false;
            // SAFETY: mapped by `map_handle`, unmapped once (the flag is cleared); the owner
            // guarantees no queued work uses it (buffers outlive their copies).
            if let Err(e) = unsafe { ffi::vmm_unmap(self.ptr, bytes) } {
                // Still mapped: freeing the range under it would fail or worse.
                self.reserved = false;
                first = Some(("cuMemUnmap", e));
            }
        }
        if let Some(h) = self.handle.take() {
            // SAFETY: the handle is ours and released once (taken).
            if let Err(e) = unsafe { ffi::vmm_release(h) } {
                first.get_or_insert(("cuMemRelease", e));
            }
        }
        if self.reserved {
            self.reserved = false;
            // SAFETY: reserved by `map_handle` with `size` bytes, nothing mapped any more,
            // freed once.
            if let Err(e) = unsafe { ffi::vmm_address_free(self.ptr, bytes) } {
                first.get_or_insert(("cuMemAddressFree", e));
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for VmmMap {
    fn drop(&mut self) {
        // Owners tear down explicitly and record errors; this covers the error paths of
        // construction, where the caller reports the failure that caused it.
        let _ = self.teardown();
    }
}

/// A POSIX fd of the allocation mapped at `ptr`, for another process to import: where the
/// mapping starts in this process, its length (what the importer maps), and `ptr`'s offset
/// in it.
pub(super) fn export_fd(ptr: u64) -> Result<(OwnedFd, ffi::MappingInfo), StepError> {
    let info = ffi::pointer_mapping(ptr).map_err(step("cuPointerGetAttributes"))?;
    if info.size == 0 {
        return Err((
            "cuPointerGetAttributes",
            CudaError::Driver {
                call: "cuPointerGetAttributes",
                code: 1,
                name: format!("{ptr:#x} lies in no VMM mapping"),
            },
        ));
    }
    if !info.posix_fd {
        return Err((
            "cuMemExportToShareableHandle",
            CudaError::Driver {
                call: "cuMemExportToShareableHandle",
                code: super::error::CODE_NOT_SUPPORTED,
                name: "the allocation was not created exportable as a POSIX fd".into(),
            },
        ));
    }
    let h = ffi::vmm_retain(ptr).map_err(step("cuMemRetainAllocationHandle"))?;
    let fd = ffi::vmm_export_fd(h).map_err(step("cuMemExportToShareableHandle"));
    // SAFETY: `h` is the reference retained just above, released once; the exported fd holds
    // the allocation on its own.
    let released = unsafe { ffi::vmm_release(h) }.map_err(step("cuMemRelease"));
    let fd = fd?;
    released?;
    Ok((fd, info))
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    /// Without a driver (or one lacking the calls) every step is a typed error, never a
    /// panic of the dynamically loaded bindings.
    #[test]
    fn without_the_driver_calls_every_step_is_a_typed_error() {
        if ffi::vmm_missing().is_ok() {
            return; // a GPU machine: the CUDA tests cover the real calls
        }
        let file = std::fs::File::open("/dev/null").unwrap();
        let missing = |r: Result<VmmMap, StepError>| match r {
            Err((_, CudaError::NoLibrary | CudaError::MissingSymbol { .. })) => {}
            other => panic!("expected a missing driver, got {other:?}"),
        };
        missing(VmmMap::import(file.as_fd(), 2 << 20, 0));
        missing(VmmMap::create(2 << 20, 0));
        assert!(matches!(
            export_fd(0x1000),
            Err((_, CudaError::NoLibrary | CudaError::MissingSymbol { .. }))
        ));
        assert!(
            ffi::vmm_granularity(0).unwrap_err().is_not_supported() || !ffi::has_symbol("cuInit")
        );
    }
}
