//! Checked spans: the only ranges a [`crate::CopyBatch`] is built from. A host span carries the
//! guard that keeps its memory mapped and was checked against that guard's bounds; a device
//! span was checked by the device it names.

use std::fmt;
use std::sync::Arc;

use thiserror::Error;

use crate::{Device, DeviceError};

/// Host memory that stays mapped for as long as this value lives: what a [`HostSpan`] points
/// into, and what a [`crate::CopyBatch`] keeps alive until its copies have resolved.
///
/// # Safety
/// Implementors promise that the range [`HostMemory::span`] returns
/// - is the same for the value's whole life, does not wrap around the address space, and
///   stays mapped readable and writable until the value is dropped;
/// - is not reachable through Rust references (`&[u8]`, `&mut [u8]`) while a batch may use
///   it: the device reads and writes it behind the compiler's back, so it must be memory
///   that is only accessed through raw pointers (a mapped pool, a shared memfd), never a
///   `Vec` someone borrows.
///
/// Which batch may write which bytes when (two saves into one slot) stays the caller's
/// protocol, as with pins on pool slots; the guard only makes the memory outlive the copies.
/// Where the memory is registered with a device, the [`crate::HostRegistration`] belongs
/// inside the value too, so it is undone only after the copies that use it.
pub unsafe trait HostMemory: Send + Sync + 'static {
    /// `(addr, len)`: the host virtual address of byte 0 and the length kept mapped.
    fn span(&self) -> (u64, u64);
}

/// Why a span or a batch was refused; nothing was copied.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpanError {
    #[error("host span {offset}+{len} lies outside its guard's {size} bytes at {base:#x}")]
    OutsideGuard {
        base: u64,
        size: u64,
        offset: u64,
        len: u64,
    },
    #[error("sub-span {offset}+{len} lies outside its {side} span of {span_len} bytes")]
    OutsideSpan {
        side: &'static str,
        span_len: u64,
        offset: u64,
        len: u64,
    },
    #[error("device {ordinal} refused the range {ptr:#x}+{len}")]
    NotDeviceRange {
        ordinal: u32,
        ptr: u64,
        len: u64,
        #[source]
        source: DeviceError,
    },
    #[error("a host span of {host} bytes paired with a device span of {device} bytes")]
    LengthMismatch { host: u64, device: u64 },
    #[error("a host copy of {src} bytes into a span of {dst} bytes")]
    HostLengthMismatch { src: u64, dst: u64 },
    #[error("{given} device planes given for a scatter of {want} segments")]
    PlaneCount { want: usize, given: usize },
}

/// `[offset, offset + len)` inside `size` bytes, without overflow.
pub(crate) fn inside(size: u64, offset: u64, len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= size)
}

/// A range of host memory inside what its guard keeps mapped; holds the guard.
#[derive(Clone)]
pub struct HostSpan {
    guard: Arc<dyn HostMemory>,
    addr: u64,
    len: u64,
}

impl HostSpan {
    /// `len` bytes at `offset` into `guard`'s memory, refused where they reach past it.
    pub fn new(guard: Arc<dyn HostMemory>, offset: u64, len: u64) -> Result<Self, SpanError> {
        let (base, size) = guard.span();
        if !inside(size, offset, len) {
            return Err(SpanError::OutsideGuard {
                base,
                size,
                offset,
                len,
            });
        }
        Ok(Self {
            // Cannot overflow: the guard's range does not wrap (its contract).
            addr: base + offset,
            len,
            guard,
        })
    }

    /// `len` bytes at `offset` into this span, with the same guard (no recheck of the guard
    /// needed: a part of a checked span is checked).
    pub fn sub(&self, offset: u64, len: u64) -> Result<Self, SpanError> {
        if !inside(self.len, offset, len) {
            return Err(SpanError::OutsideSpan {
                side: "host",
                span_len: self.len,
                offset,
                len,
            });
        }
        Ok(Self {
            guard: Arc::clone(&self.guard),
            addr: self.addr + offset,
            len,
        })
    }

    /// Host virtual address of the span's first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn guard(&self) -> &Arc<dyn HostMemory> {
        &self.guard
    }
}

/// Copies `src`'s bytes into `dst`, host to host (an owner's shared pool into this node's
/// pool): both ranges are checked spans whose guards keep them mapped while this runs.
/// Refused, with nothing copied, where the lengths differ.
pub fn copy_host(src: &HostSpan, dst: &HostSpan) -> Result<(), SpanError> {
    if src.len != dst.len {
        return Err(SpanError::HostLengthMismatch {
            src: src.len,
            dst: dst.len,
        });
    }
    // SAFETY: both ranges lie inside what their guards keep mapped (checked when the spans
    // were built) and the guards live through the call; `HostMemory` memory is only reached
    // through raw pointers, so no Rust reference aliases either range. `copy` (a memmove)
    // stays sound even where the two overlap. A destination mapped read-only is the guard's
    // contract broken (it promises readable and writable memory).
    unsafe {
        std::ptr::copy(
            src.addr as usize as *const u8,
            dst.addr as usize as *mut u8,
            src.len as usize,
        )
    };
    Ok(())
}

impl fmt::Debug for HostSpan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostSpan")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

/// A range of device memory that [`Device::check_range`] accepted. The check is early
/// refusal with a clear error, not what the copy's safety rests on: backends validate every
/// device range again when a batch is submitted (device memory can be freed in between),
/// and a batch whose device side is refused then copies nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSpan {
    ptr: u64,
    len: u64,
}

impl DeviceSpan {
    /// `[ptr, ptr + len)`, checked by `device`.
    pub fn new<D: Device + ?Sized>(device: &D, ptr: u64, len: u64) -> Result<Self, SpanError> {
        device
            .check_range(ptr, len)
            .map_err(|source| SpanError::NotDeviceRange {
                ordinal: device.ordinal(),
                ptr,
                len,
                source,
            })?;
        Ok(Self { ptr, len })
    }

    /// `len` bytes at `offset` into this span: one check of a whole plane serves every block
    /// of it, where a driver query per block would cost microseconds each.
    pub fn sub(&self, offset: u64, len: u64) -> Result<Self, SpanError> {
        if !inside(self.len, offset, len) {
            return Err(SpanError::OutsideSpan {
                side: "device",
                span_len: self.len,
                offset,
                len,
            });
        }
        Ok(Self {
            ptr: self.ptr + offset,
            len,
        })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
