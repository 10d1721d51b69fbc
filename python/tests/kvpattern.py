"""Test patterns and canaried KV for the kvferry package's tests (and tests/python).

The pattern is kvferry's Rust fixture's (``actors/src/fixture.rs``), ported: a segment of
block ``b``, rank ``r``, layer ``l``, segment ``s`` holds splitmix64 words seeded from those
four, so a byte in the wrong place is told apart from every other. A :class:`HostKv` is one
rank's KV in one of the layouts of :mod:`kvferry.layout`, in memfds with guard bytes before
and after every tensor; every byte it owns starts as the canary, and :meth:`HostKv.verify`
checks that loaded segments hold the pattern and every other byte still holds the canary.
Memory is read and written by address, so torch tensors and numpy arrays are handled alike.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import kvferry
from kvferry import memfd
from kvferry.layout import KvLayout, TensorInfo, describe_layout

CANARY = 0xA5
MASK = (1 << 64) - 1
#: Guard bytes around each tensor inside its memfd (also makes region offsets nonzero).
GUARD = 4096


def mix(z: int) -> int:
    """splitmix64's finaliser, as in actors/src/fixture.rs."""
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def segment_pattern(n: int, block: int, rank: int, layer: int, seg: int) -> bytes:
    seed = mix(block ^ (rank << 48) ^ (layer << 32) ^ (seg << 24))
    words = (n + 7) // 8
    return b"".join(mix(seed ^ i).to_bytes(8, "little") for i in range(words))[:n]


def block_hash(i: int) -> bytes:
    """The hash the Rust fixture uses for block ``i`` (BlockHash::from_u64)."""
    return i.to_bytes(8, "big")


def rank_block(block: int, rank: int, layers: int, segments: int, seg_bytes: int) -> bytes:
    """One rank's part of pattern block ``block``, as PutBlocks carries it (layer-major)."""
    return b"".join(
        segment_pattern(seg_bytes, block, rank, l, s) for l in range(layers) for s in range(segments)
    )


# Layout name -> (tensor shape for one layer or the whole cross-layer tensor)
def layout_shape(layout: str, layers: int, num_blocks: int, block_size: int, heads: int,
                 head_dim: int) -> Tuple[int, ...]:
    return {
        "flash_attn": (2, num_blocks, block_size, heads, head_dim),
        "flashinfer": (num_blocks, 2, block_size, heads, head_dim),
        "mla": (num_blocks, block_size, head_dim),
        "cross_layer": (num_blocks, layers, 2, block_size, heads, head_dim),
    }[layout]


class HostKv:
    """One rank's KV: memfd-backed tensors in one of the layouts, and the memfds they are in.
    :meth:`allocate` makes one with :data:`GUARD` canaried bytes around each tensor;
    :meth:`of` wraps tensors made elsewhere (``kvferry.torch.memfd_empty``)."""

    def __init__(self, tensors: Any, layout: str, buffers: List[memfd.MemfdBuffer]):
        self.tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        self.buffers = buffers
        self.layout: KvLayout = describe_layout(tensors, layout)
        self.layers = len(self.layout.layers)
        self.num_blocks = self.layout.num_blocks
        self.reset()

    @classmethod
    def allocate(cls, layout: str, *, layers: int = 3, num_blocks: int = 16,
                 block_size: int = 4, heads: int = 2, head_dim: int = 32, itemsize: int = 2,
                 one_memfd: bool = False, make=None) -> "HostKv":
        """``one_memfd``: every tensor carved from a single memfd (one region), else one memfd
        per tensor. ``make(buf, offset, shape)`` builds a tensor on a
        :class:`kvferry.memfd.MemfdBuffer` (numpy arrays by default; see :func:`torch_maker`)."""
        make = make or numpy_maker(itemsize)
        shape = layout_shape(layout, layers, num_blocks, block_size, heads, head_dim)
        count = 1 if layout == "cross_layer" else layers
        span = GUARD + math.prod(shape) * itemsize + GUARD
        buffers: List[memfd.MemfdBuffer] = []
        tensors: List[Any] = []
        if one_memfd:
            buf = memfd.allocate(span * count, f"test-{layout}")
            buffers.append(buf)
            tensors = [make(buf, i * span + GUARD, shape) for i in range(count)]
        else:
            for i in range(count):
                buf = memfd.allocate(span, f"test-{layout}-{i}")
                buffers.append(buf)
                tensors.append(make(buf, GUARD, shape))
        return cls(tensors[0] if layout == "cross_layer" else tensors, layout, buffers)

    @classmethod
    def of(cls, tensors: Any, layout: str) -> "HostKv":
        """Tensors already in memfds of :mod:`kvferry.memfd`."""
        buffers: Dict[int, memfd.MemfdBuffer] = {}
        for t in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
            info = TensorInfo.of(t)
            found = memfd.lookup(info.address, info.nbytes)
            assert found is not None, "not a memfd tensor"
            buffers[found[0].address] = found[0]
        return cls(tensors, layout, list(buffers.values()))

    @property
    def segments(self) -> int:
        return self.layout.segments

    @property
    def seg_bytes(self) -> int:
        return self.layout.segment_bytes

    def register(self, client, instance: str, model: str = "m", *, rank: int = 0,
                 tp_size: int = 1, dtype: str = "", board=None) -> str:
        """``dtype``: the name in the namespace (default: the tensors' dtype); ``board``: a
        completion board its loads may report to."""
        return kvferry.register_tensors(
            client, instance, model, dtype or self.layout.dtype, rank=rank, tp_size=tp_size,
            device=0, board=board, **self.layout.register_kwargs(),
        )

    def reset(self) -> None:
        for b in self.buffers:
            ctypes.memset(b.address, CANARY, b.length)

    def seg_addr(self, layer: int, seg: int, block: int) -> int:
        p = self.layout.layers[layer]
        t, off = (p.k, p.k_offset) if seg == 0 else (p.v, p.v_offset)
        return TensorInfo.of(t).address + off + block * self.layout.block_stride

    def write_block(self, dest: int, block: int, rank: int = 0) -> None:
        """Writes pattern block ``block`` into KV block ``dest`` (as an engine computing it)."""
        for l in range(self.layers):
            for s in range(self.segments):
                data = segment_pattern(self.seg_bytes, block, rank, l, s)
                ctypes.memmove(self.seg_addr(l, s, dest), data, len(data))

    def verify(self, expected: Iterable[Tuple[int, int]], rank: int = 0) -> int:
        """``expected``: ``[(dest block, pattern block)]``. Asserts those segments hold the
        pattern and every other byte of every memfd the canary; returns pattern bytes seen."""
        images = [bytearray(ctypes.string_at(b.address, b.length)) for b in self.buffers]

        def locate(addr: int) -> Tuple[bytearray, int]:
            for b, img in zip(self.buffers, images):
                if b.address <= addr < b.address + b.length:
                    return img, addr - b.address
            raise AssertionError(f"address {addr:#x} is in no buffer")

        checked = 0
        canary = bytes([CANARY]) * self.seg_bytes
        for dest, block in expected:
            for l in range(self.layers):
                for s in range(self.segments):
                    img, off = locate(self.seg_addr(l, s, dest))
                    want = segment_pattern(self.seg_bytes, block, rank, l, s)
                    got = bytes(img[off: off + self.seg_bytes])
                    if got != want:
                        i = next(k for k in range(len(want)) if got[k] != want[k])
                        raise AssertionError(
                            f"dest block {dest} (pattern {block}) layer {l} seg {s} byte {i}: "
                            f"{got[i]:#04x}, expected {want[i]:#04x}"
                        )
                    img[off: off + self.seg_bytes] = canary
                    checked += self.seg_bytes
        for n, img in enumerate(images):
            stray = next((i for i, b in enumerate(img) if b != CANARY), None)
            if stray is not None:
                raise AssertionError(
                    f"byte {stray} of memfd {n} was written outside the destinations"
                )
        return checked


def numpy_maker(itemsize: int):
    import numpy as np

    dtype = {1: np.uint8, 2: np.float16, 4: np.float32}[itemsize]

    def make(buf: memfd.MemfdBuffer, offset: int, shape: Sequence[int]):
        n = math.prod(shape)
        return np.frombuffer(buf.mmap, dtype=dtype, count=n, offset=offset).reshape(shape)

    return make


def torch_maker(dtype):
    import torch

    def make(buf: memfd.MemfdBuffer, offset: int, shape: Sequence[int]):
        size = torch.empty((), dtype=dtype).element_size()
        n = math.prod(shape) * size
        raw = torch.frombuffer(buf.mmap, dtype=torch.uint8, count=n, offset=offset)
        return raw.view(dtype).view(tuple(shape))

    return make


def scattered(n: int, num_blocks: int) -> List[int]:
    """``n`` destination blocks spread over the KV, last block first."""
    dests = [(num_blocks - 1 - 2 * i) % num_blocks for i in range(n)]
    if len(set(dests)) != n:
        dests = list(range(num_blocks - 1, num_blocks - 1 - n, -1))
    return dests
