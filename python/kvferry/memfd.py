"""Host memory that a kvferry node can map: memfds mapped into this process.

A CPU KV cache registered with a node must live in memory the node can map too; a memfd
is such memory, passed to the node on its fd socket (:meth:`EngineClient.send_memfd`).
:func:`allocate` creates one and records its address range, so that a tensor or array
built on it is found again by address (:func:`lookup`) when it is registered. The record
lasts as long as the mapping: it goes (and the fd is closed) when the last view of the
memory is gone.

Memory an engine allocated itself as a shared anonymous mapping (SGLang's HiCache host
pool, ``mmap(MAP_SHARED | MAP_ANONYMOUS)``) is made mappable by :func:`adopt`, which puts a
memfd under the same addresses: every tensor and pointer the engine holds stays valid.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

__all__ = ["AdoptError", "MemfdBuffer", "adopt", "allocate", "lookup"]

_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class MemfdBuffer:
    """A memfd of ``length`` bytes mapped at ``address``; ``mmap`` is the mapping (views of
    it, such as ``torch.frombuffer`` or ``numpy.frombuffer``, keep it alive)."""

    fd: int
    length: int
    address: int
    #: None for memory placed under an engine's own mapping (:func:`adopt`).
    mmap: Optional[mmap.mmap]
    name: str


# (start, end, fd, name, weak reference to what owns the mapping: our mmap, or the object
# an adopted mapping lives as long as); sorted by start.
_lock = threading.Lock()
_records: List[Tuple[int, int, int, str, "weakref.ref[Any]"]] = []


def _forget(start: int, fd: int) -> None:
    with _lock:
        _records[:] = [r for r in _records if r[0] != start]
    os.close(fd)


def allocate(nbytes: int, name: str = "kv") -> MemfdBuffer:
    """A new zeroed memfd of at least ``nbytes`` bytes (whole pages), mapped read-write."""
    if nbytes <= 0:
        raise ValueError(f"a memfd needs at least one byte, got {nbytes}")
    length = -(-nbytes // _PAGE) * _PAGE
    fd = os.memfd_create(f"kvferry-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, length)
        mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    probe = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(probe)
    del probe  # releases its export of the mapping
    with _lock:
        _records.append((address, address + length, fd, name, weakref.ref(mm)))
        _records.sort(key=lambda r: r[0])
    weakref.finalize(mm, _forget, address, fd)
    return MemfdBuffer(fd=fd, length=length, address=address, mmap=mm, name=name)


def lookup(address: int, nbytes: int) -> Optional[Tuple[MemfdBuffer, int]]:
    """The buffer from :func:`allocate` that holds ``[address, address + nbytes)`` and the
    offset of ``address`` in it, or None."""
    with _lock:
        for start, end, fd, name, ref in _records:
            owner = ref()
            if start <= address and address + nbytes <= end and owner is not None:
                mm = owner if isinstance(owner, mmap.mmap) else None
                buf = MemfdBuffer(fd=fd, length=end - start, address=start, mmap=mm, name=name)
                return buf, address - start
    return None


class AdoptError(ValueError):
    """Memory that :func:`adopt` cannot put a memfd under (the message says why)."""


# Shared anonymous memory is shmem: /proc/self/maps names it "/dev/zero (deleted)" (older
# kernels) or "[anon_shmem]". Hugepage mappings ("/anon_hugepage") are not taken: the memfd
# would need MFD_HUGETLB and the same page size.
_SHARED_ANON = ("/dev/zero (deleted)", "[anon_shmem]", "/SYSV00000000 (deleted)")
_COPY_CHUNK = 64 << 20


def _mapping_of(address: int) -> Optional[Tuple[int, int, str, str]]:
    """(start, end, perms, path) of the mapping of this process holding ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                path = parts[5].strip() if len(parts) > 5 else ""
                return lo, hi, parts[1], path
    return None


def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_long,
    ]
    return libc


def adopt(address: int, nbytes: int, owner: Any, name: str = "kv",
          preserve: bool = True) -> MemfdBuffer:
    """Puts a new memfd under ``[address, address + nbytes)`` of this process, which must be
    (part of) one shared anonymous mapping starting on a page boundary, and records it for
    :func:`lookup` for as long as ``owner`` (the object that unmaps the memory, such as the
    tensor over it) lives. The memory keeps its addresses; with ``preserve`` it keeps its
    contents too (copied 64 MiB at a time, so at most that much more memory is used). Nothing
    may write the range while this runs. Memory registered with a GPU (``cudaHostRegister``)
    must be unregistered first and registered again after, since its pages change.
    Raises :class:`AdoptError` naming what does not fit."""
    if nbytes <= 0:
        raise AdoptError(f"a memfd needs at least one byte, got {nbytes}")
    if address % _PAGE:
        raise AdoptError(f"address {address:#x} is not on a {_PAGE}-byte page boundary")
    length = -(-nbytes // _PAGE) * _PAGE
    found = _mapping_of(address)
    if found is None:
        raise AdoptError(f"address {address:#x} is not mapped")
    lo, hi, perms, path = found
    if address + length > hi:
        raise AdoptError(
            f"[{address:#x}, {address + length:#x}) runs past its mapping's end {hi:#x}"
        )
    if perms[:2] != "rw" or perms[3] != "s" or path not in _SHARED_ANON:
        raise AdoptError(
            f"the memory at {address:#x} is mapped {perms} {path or '(anonymous)'}, not as "
            "shared anonymous memory (mmap MAP_SHARED | MAP_ANONYMOUS, without hugepages)"
        )
    with _lock:
        for start, end, fd, rname, ref in _records:
            if ref() is None or not (start < address + length and address < end):
                continue
            if (start, end) == (address, address + length):
                return MemfdBuffer(fd=fd, length=length, address=start, mmap=None, name=rname)
            raise AdoptError(f"[{address:#x}, {address + length:#x}) overlaps memory adopted "
                             f"before, [{start:#x}, {end:#x})")
    libc = _libc()
    fd = os.memfd_create(f"kvferry-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, length)
        for off in range(0, length, _COPY_CHUNK):
            n = min(_COPY_CHUNK, length - off)
            if preserve:
                with mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                               offset=off) as tmp:
                    dst = ctypes.c_char.from_buffer(tmp)
                    ctypes.memmove(ctypes.addressof(dst), address + off, n)
                    del dst
            got = libc.mmap(
                ctypes.c_void_p(address + off), n, mmap.PROT_READ | mmap.PROT_WRITE,
                mmap.MAP_SHARED | 0x10,  # MAP_FIXED: replace the pages at these addresses
                fd, off,
            )
            if got != address + off:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap MAP_FIXED at {address + off:#x}: {os.strerror(err)}")
    except BaseException:
        os.close(fd)
        raise
    with _lock:
        _records.append((address, address + length, fd, name, weakref.ref(owner)))
        _records.sort(key=lambda r: r[0])
    weakref.finalize(owner, _forget, address, fd)
    return MemfdBuffer(fd=fd, length=length, address=address, mmap=None, name=name)

