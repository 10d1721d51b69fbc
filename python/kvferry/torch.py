"""Torch helpers: KV tensors a node can map, and their registration.

Importing :mod:`kvferry` never imports torch; this module does, when first used.

- :func:`memfd_empty` makes a CPU tensor backed by a memfd (zero-filled), which
  :func:`register_tensors` sends to the node once per memfd;
- CUDA tensors are registered by the CUDA IPC handle of the caching allocator's block that
  holds them (:func:`cuda_region`), one region per block, or, where they lie in a VMM
  allocation (vLLM 0.34's extensible KV cache), by the POSIX
  fd of that allocation (:mod:`kvferry.vmm`), one region per allocation;
- :func:`describe_layout` and :func:`register_kv` turn the tensors of the layouts engines
  allocate into planes (see :mod:`kvferry.layout`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence, Tuple, Union

from . import memfd
from .layout import (
    LAYOUTS,
    KvLayout,
    KvPlanes,
    LayoutError,
    describe_layout,
    register_kv,
    register_tensors,
)

__all__ = [
    "LAYOUTS",
    "KvLayout",
    "KvPlanes",
    "LayoutError",
    "cuda_region",
    "describe_layout",
    "memfd_empty",
    "register_kv",
    "register_tensors",
]


def _torch():
    import torch

    return torch


def memfd_empty(shape: Union[int, Sequence[int]], dtype: Any, name: str = "kv") -> Any:
    """A zero-filled CPU tensor of ``shape`` and ``dtype`` in a memfd of its own, so a node
    can map it (see :mod:`kvferry.memfd`). The memfd is closed once the tensor and every
    view of it are gone."""
    torch = _torch()
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    buf = memfd.allocate(nbytes, name)
    raw = torch.frombuffer(buf.mmap, dtype=torch.uint8, count=nbytes)
    return raw.view(dtype).view(shape)


def cuda_region(t: Any) -> Tuple[bytes, int]:
    """``(IPC handle, offset)``: the CUDA IPC handle of the caching allocator's block holding
    ``t`` and the byte offset of ``t``'s data inside that block. Tensors of one block share
    the handle, so they are one region."""
    storage = t.untyped_storage()
    shared = storage._share_cuda_()
    # (device, handle, storage bytes, storage offset in the block, ref counter handle,
    #  ref counter offset, event handle, event sync required)
    handle, storage_offset = shared[1], shared[3]
    return bytes(handle), int(storage_offset) + (t.data_ptr() - storage.data_ptr())
