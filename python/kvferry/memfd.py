"""Host memory that a kvferry node can map: memfds mapped into this process.

A CPU KV cache registered with a node must live in memory the node can map too; a memfd
is such memory, passed to the node on its fd socket (:meth:`EngineClient.send_memfd`).
:func:`allocate` creates one and records its address range, so that a tensor or array
built on it is found again by address (:func:`lookup`) when it is registered. The record
lasts as long as the mapping: it goes (and the fd is closed) when the last view of the
memory is gone.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from typing import List, Optional, Tuple

__all__ = ["MemfdBuffer", "allocate", "lookup"]

_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class MemfdBuffer:
    """A memfd of ``length`` bytes mapped at ``address``; ``mmap`` is the mapping (views of
    it, such as ``torch.frombuffer`` or ``numpy.frombuffer``, keep it alive)."""

    fd: int
    length: int
    address: int
    mmap: mmap.mmap
    name: str


# (start, end, fd, name, weak reference to the mapping); sorted by start.
_lock = threading.Lock()
_records: List[Tuple[int, int, int, str, "weakref.ref[mmap.mmap]"]] = []


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
            mm = ref()
            if start <= address and address + nbytes <= end and mm is not None:
                buf = MemfdBuffer(fd=fd, length=end - start, address=start, mmap=mm, name=name)
                return buf, address - start
    return None
