"""GPU KV in CUDA VMM allocations (``cuMemCreate`` / ``cuMemMap``), shared with a node by
POSIX file descriptor.

vLLM 0.34 allocates its KV cache this way by default on CUDA (the *extensible* KV cache):
memory that a CUDA IPC handle (``cuIpcGetMemHandle``) cannot name (nor PyTorch's expandable
segments, whose tensors may span several allocations, which :func:`export` refuses). Such an allocation can be shared where it was created exportable as a POSIX
fd (vLLM does so for a connector that declares ``EXPORTS_FD``, see
:mod:`kvferry.vllm.vmm`): :func:`export` retains the allocation that holds an address,
exports it with ``cuMemExportToShareableHandle`` and drops the retained reference, giving a
new fd the caller owns; the node maps the whole allocation (``send_vmm``, fd-socket kind
``vmm``), which keeps the memory alive until the node drops the registration.

:func:`sharing_of` says how memory at an address reaches a node: :data:`IPC` (an ordinary
allocation: CUDA IPC handle, the path for PyTorch's caching allocator), :data:`FD` (a VMM
allocation exportable as a POSIX fd), or :data:`NONE` (a VMM allocation that cannot be
shared: vLLM's extensible KV cache under a connector that declared only ``IN_PROCESS``).
The driver is reached with ctypes on first use (``libcuda.so.1``, the library the process
already has loaded); nothing here imports torch, and nothing initialises CUDA.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "FD",
    "IPC",
    "NONE",
    "Mapping",
    "VmmError",
    "VmmRegion",
    "available",
    "export",
    "mapping_of",
    "sharing_of",
]

IPC = "ipc"
FD = "fd"
NONE = "none"

#: The calls :func:`export` makes (all since CUDA 10.2).
SYMBOLS = (
    "cuPointerGetAttributes",
    "cuMemRetainAllocationHandle",
    "cuMemExportToShareableHandle",
    "cuMemRelease",
)

_HANDLE_POSIX_FD = 1
# CUpointer_attribute values (cuda.h).
_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_ATTR_ALLOWED_HANDLE_TYPES = 14
_ATTR_MAPPING_SIZE = 18
_ATTR_MAPPING_BASE_ADDR = 19


class VmmError(RuntimeError):
    """A driver call of VMM sharing failed; the message names the call and the error."""


@dataclass(frozen=True)
class Mapping:
    """What the driver says of the memory at one address."""

    #: Start and length of the VMM mapping holding the address (0, 0: not VMM memory).
    base: int
    size: int
    #: The allocation may be exported as a POSIX fd.
    posix_fd: bool
    #: The allocation may be shared by CUDA IPC handle (an ordinary ``cuMemAlloc``).
    legacy_ipc: bool


@dataclass(frozen=True)
class VmmRegion:
    """A POSIX fd of one VMM allocation (owned by whoever holds this), where its mapping
    lies in this process, and the offset of the exported address inside it."""

    fd: int
    base: int
    size: int
    offset: int

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class CudaDriver:
    """The driver calls of VMM sharing through ctypes."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        u64, vp = ctypes.c_uint64, ctypes.c_void_p
        lib.cuPointerGetAttributes.argtypes = [
            ctypes.c_uint,
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(vp),
            u64,
        ]
        lib.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(u64), vp]
        lib.cuMemExportToShareableHandle.argtypes = [vp, u64, ctypes.c_int, ctypes.c_ulonglong]
        lib.cuMemRelease.argtypes = [u64]
        for name in SYMBOLS:
            getattr(lib, name).restype = ctypes.c_int

    def _check(self, call: str, code: int) -> None:
        if code == 0:
            return
        name = ctypes.c_char_p()
        try:
            self._lib.cuGetErrorName(code, ctypes.byref(name))
        except (AttributeError, ctypes.ArgumentError):
            pass
        what = name.value.decode() if name.value else f"error {code}"
        raise VmmError(f"{call} failed: {what} ({code})")

    def mapping(self, address: int) -> Mapping:
        attrs = [
            _ATTR_IS_LEGACY_CUDA_IPC_CAPABLE,
            _ATTR_ALLOWED_HANDLE_TYPES,
            _ATTR_MAPPING_SIZE,
            _ATTR_MAPPING_BASE_ADDR,
        ]
        # Eight zeroed bytes per attribute: at least what the driver writes for each.
        vals = [ctypes.c_uint64(0) for _ in attrs]
        arr = (ctypes.c_int * len(attrs))(*attrs)
        data = (ctypes.c_void_p * len(attrs))(*[ctypes.addressof(v) for v in vals])
        self._check(
            "cuPointerGetAttributes",
            self._lib.cuPointerGetAttributes(len(attrs), arr, data, address),
        )
        legacy, types, size, base = (v.value for v in vals)
        return Mapping(
            base=base,
            size=size,
            posix_fd=bool(types & _HANDLE_POSIX_FD),
            legacy_ipc=bool(legacy & 0xFF),
        )

    def export_fd(self, address: int) -> int:
        handle = ctypes.c_uint64(0)
        self._check(
            "cuMemRetainAllocationHandle",
            self._lib.cuMemRetainAllocationHandle(ctypes.byref(handle), address),
        )
        fd = ctypes.c_int(-1)
        exported = self._lib.cuMemExportToShareableHandle(
            ctypes.byref(fd), handle.value, _HANDLE_POSIX_FD, 0
        )
        # The exported fd holds the allocation on its own: drop the retained reference
        # whatever happened.
        released = self._lib.cuMemRelease(handle.value)
        self._check("cuMemExportToShareableHandle", exported)
        try:
            self._check("cuMemRelease", released)
        except VmmError:
            os.close(fd.value)
            raise
        return fd.value


_driver: Optional[CudaDriver] = None
_why_not: Optional[str] = None
_loaded = False


def driver() -> Optional[CudaDriver]:
    """The driver, or None where libcuda or one of :data:`SYMBOLS` is missing (see
    :func:`available` for why)."""
    global _driver, _why_not, _loaded
    if not _loaded:
        _loaded = True
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            _why_not = f"libcuda.so.1 cannot be loaded ({e})"
            return None
        missing = [s for s in SYMBOLS if not hasattr(lib, s)]
        if missing:
            _why_not = f"the CUDA driver lacks {', '.join(missing)} (driver too old)"
            return None
        _driver = CudaDriver(lib)
    return _driver


def available() -> Optional[str]:
    """None where this process can export VMM allocations, else why not."""
    return None if driver() is not None else _why_not


def mapping_of(address: int) -> Optional[Mapping]:
    """What the driver says of ``address``; None without a usable driver."""
    d = driver()
    return d.mapping(address) if d is not None else None


def sharing_of(address: int) -> str:
    """How the memory at ``address`` reaches a node (see the module doc). Where the driver
    cannot be asked, :data:`IPC` (the ordinary path, which reports its own errors)."""
    try:
        m = mapping_of(address)
    except VmmError:
        return IPC
    if m is None or m.legacy_ipc or m.size == 0:
        return IPC
    return FD if m.posix_fd else NONE


def export(address: int, nbytes: int) -> VmmRegion:
    """A POSIX fd of the VMM allocation holding ``[address, address + nbytes)``, which must
    lie in that one allocation. The caller owns (and closes) the fd."""
    d = driver()
    if d is None:
        raise VmmError(f"VMM export: {_why_not}")
    m = d.mapping(address)
    if m.size == 0:
        raise VmmError(f"{address:#x} lies in no VMM mapping")
    if not m.posix_fd:
        raise VmmError(
            "the VMM allocation was not created exportable as a POSIX fd (vLLM: the connector "
            "must declare KVCacheAccess.EXPORTS_FD; see kvferry.vllm.vmm.supported_access)"
        )
    if address + nbytes > m.base + m.size:
        raise VmmError(
            f"[{address:#x}, +{nbytes}) spans more than one VMM allocation (the one at "
            f"{m.base:#x} holds {m.size} bytes); a node maps one allocation per region (vLLM "
            "backs each segment with one allocation only for a connector declaring "
            "EXPORTS_FD)"
        )
    fd = d.export_fd(address)
    return VmmRegion(fd=fd, base=m.base, size=m.size, offset=address - m.base)
