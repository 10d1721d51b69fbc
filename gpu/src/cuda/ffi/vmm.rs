//! Virtual memory management (`cuMem*`): physical allocations shared by POSIX fd, address
//! reservations, mappings and their access, and what mapping an address lies in.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::{check, has_symbol, init, library_loaded, CUdeviceptr};
use crate::cuda::error::CudaError;

/// The driver calls of VMM sharing ([`vmm_import_fd`] and its exporting counterparts), all
/// optional (CUDA 10.2+): where one is missing those wrappers answer
/// [`CudaError::MissingSymbol`] before touching the driver.
pub const VMM_SYMBOLS: &[&str] = &[
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemRetainAllocationHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
];

/// A VMM physical allocation handle (`CUmemGenericAllocationHandle`).
pub type MemHandle = sys::CUmemGenericAllocationHandle;

/// The first VMM call the loaded driver lacks, as the error every VMM wrapper returns then.
pub fn vmm_missing() -> Result<(), CudaError> {
    if !library_loaded() {
        return Err(CudaError::NoLibrary);
    }
    match VMM_SYMBOLS.iter().find(|s| !has_symbol(s)) {
        Some(symbol) => Err(CudaError::MissingSymbol { symbol }),
        None => Ok(()),
    }
}

/// Pinned device memory on `ordinal` that may be exported as a POSIX fd.
fn vmm_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: all-zero is a valid value of this plain C struct (enums as u32 with 0 a valid
    // "none"/"invalid" value, a null pointer, integers).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    prop
}

/// The granularity VMM sizes and addresses on `ordinal` must be multiples of (2 MiB on
/// today's GPUs).
pub fn vmm_granularity(ordinal: i32) -> Result<usize, CudaError> {
    vmm_missing()?;
    let prop = vmm_prop(ordinal);
    let mut g: usize = 0;
    let flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: reads `prop` and writes one size_t; the symbol exists (checked above).
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(&mut g, &prop, flag)
    })?;
    Ok(g)
}

/// A new physical allocation of `size` bytes (a multiple of [`vmm_granularity`]) on
/// `ordinal`, exportable as a POSIX fd. The caller releases it once ([`vmm_release`]).
pub fn vmm_create(ordinal: i32, size: usize) -> Result<MemHandle, CudaError> {
    vmm_missing()?;
    let prop = vmm_prop(ordinal);
    let mut h: MemHandle = 0;
    // SAFETY: reads `prop`, writes one handle; the symbol exists (checked above).
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(&mut h, size, &prop, 0)
    })?;
    Ok(h)
}

/// # Safety
/// `h` came from [`vmm_create`], [`vmm_import_fd`] or [`vmm_retain`] and is released once;
/// the memory stays alive while a mapping of it remains (the driver counts those).
pub unsafe fn vmm_release(h: MemHandle) -> Result<(), CudaError> {
    vmm_missing()?;
    // SAFETY: the caller releases a live handle once; the symbol exists.
    check("cuMemRelease", unsafe { sys::cuMemRelease(h) })
}

/// A new POSIX fd naming the allocation `h` (created exportable as one), owned by the caller.
pub fn vmm_export_fd(h: MemHandle) -> Result<OwnedFd, CudaError> {
    vmm_missing()?;
    let mut fd: c_int = -1;
    let ty = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: for the POSIX fd type the driver writes one int into the handle argument; a
    // handle that is not live or not exportable is an error code; the symbol exists.
    check("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle((&mut fd as *mut c_int).cast(), h, ty, 0)
    })?;
    if fd < 0 {
        return Err(CudaError::Driver {
            call: "cuMemExportToShareableHandle",
            code: 1,
            name: format!("returned fd {fd}"),
        });
    }
    // SAFETY: on success the driver handed us a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The allocation another process exported as the POSIX fd `fd`; the fd stays the caller's
/// (the driver does not take it) and may be closed once this returns.
pub fn vmm_import_fd(fd: BorrowedFd<'_>) -> Result<MemHandle, CudaError> {
    vmm_missing()?;
    let mut h: MemHandle = 0;
    let ty = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // For the POSIX fd type the "OS handle" argument is the fd's value itself, cast to a
    // pointer, not a pointer to it.
    let os_handle = fd.as_raw_fd() as usize as *mut c_void;
    // SAFETY: the driver reads the fd (open for the borrow) and writes one handle; an fd that
    // names no exported allocation is an error code; the symbol exists.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(&mut h, os_handle, ty)
    })?;
    Ok(h)
}

/// A new reference to the allocation mapped at `ptr` (any address inside the mapping),
/// released once by the caller.
pub fn vmm_retain(ptr: CUdeviceptr) -> Result<MemHandle, CudaError> {
    vmm_missing()?;
    let mut h: MemHandle = 0;
    // SAFETY: the address is only looked up (one not mapped by cuMemMap is an error code);
    // writes one handle; the symbol exists.
    check("cuMemRetainAllocationHandle", unsafe {
        sys::cuMemRetainAllocationHandle(&mut h, ptr as usize as *mut c_void)
    })?;
    Ok(h)
}

/// Reserves `size` bytes of device address space aligned to `align`; the caller frees it
/// once ([`vmm_address_free`]).
pub fn vmm_address_reserve(size: usize, align: usize) -> Result<CUdeviceptr, CudaError> {
    vmm_missing()?;
    let mut p: CUdeviceptr = 0;
    // SAFETY: writes one pointer; no fixed address is asked for; the symbol exists.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut p, size, align, 0, 0)
    })?;
    Ok(p)
}

/// # Safety
/// `[p, p + size)` is exactly one reservation of [`vmm_address_reserve`] with nothing mapped
/// in it any more, freed once.
pub unsafe fn vmm_address_free(p: CUdeviceptr, size: usize) -> Result<(), CudaError> {
    vmm_missing()?;
    // SAFETY: the caller guarantees an unmapped reservation freed once; the symbol exists.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(p, size)
    })
}

/// # Safety
/// `[p, p + size)` lies in a reservation of this process with nothing mapped there; `h` is
/// live and at least `size` bytes long.
pub unsafe fn vmm_map(p: CUdeviceptr, size: usize, h: MemHandle) -> Result<(), CudaError> {
    vmm_missing()?;
    // SAFETY: the caller guarantees the range and the handle; offset 0 (the only one the
    // driver accepts); the symbol exists.
    check("cuMemMap", unsafe { sys::cuMemMap(p, size, 0, h, 0) })
}

/// # Safety
/// `[p, p + size)` is exactly one mapping of [`vmm_map`], unmapped once, with no queued
/// work still using it.
pub unsafe fn vmm_unmap(p: CUdeviceptr, size: usize) -> Result<(), CudaError> {
    vmm_missing()?;
    // SAFETY: the caller guarantees an idle mapping unmapped once; the symbol exists.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(p, size) })
}

/// Lets device `ordinal` read and write `[p, p + size)` (mapped memory has no access until
/// then).
///
/// # Safety
/// `[p, p + size)` is mapped by [`vmm_map`].
pub unsafe fn vmm_set_access(p: CUdeviceptr, size: usize, ordinal: i32) -> Result<(), CudaError> {
    vmm_missing()?;
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = ordinal;
    desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // SAFETY: one descriptor, read during the call; the caller guarantees the mapping; the
    // symbol exists.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(p, size, &desc, 1)
    })
}

/// The VMM mapping holding an address: where it starts, how long it is, and whether its
/// allocation may be exported as a POSIX fd.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MappingInfo {
    pub base: u64,
    pub size: u64,
    pub posix_fd: bool,
}

/// The mapping `ptr` lies in; `size` 0 where the address is in no VMM mapping (an address
/// CUDA does not know is not an error).
pub fn pointer_mapping(ptr: u64) -> Result<MappingInfo, CudaError> {
    use sys::CUpointer_attribute as A;
    // Callable before any device is opened (an exporter's first call): prove the library.
    init()?;
    let (mut base, mut size, mut types) = (0u64, 0u64, 0u64);
    let mut attrs = [
        A::CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
        A::CU_POINTER_ATTRIBUTE_MAPPING_SIZE,
        A::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
    ];
    let mut data: [*mut c_void; 3] = [
        (&mut base as *mut u64).cast(),
        (&mut size as *mut u64).cast(),
        (&mut types as *mut u64).cast(),
    ];
    // SAFETY: three attributes, each with 8 zeroed bytes of storage, at least what the driver
    // writes for each (a pointer, a size_t, a bitmask of at most 64 bits); the address is
    // only looked up.
    let r = unsafe { sys::cuPointerGetAttributes(3, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
    check("cuPointerGetAttributes", r)?;
    let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0 as u64;
    Ok(MappingInfo {
        base,
        size,
        posix_fd: types & posix != 0,
    })
}
