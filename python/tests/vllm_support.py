"""Helpers of the vLLM connector tests: a real ``kvferry node``, KV tensors in the layouts
vLLM 0.33 allocates (on memfds, so a ``kind = "host"`` node maps them), and a
deterministic "forward pass" that writes into them what a model would: bytes that depend
only on the tokens up to each position, the layer and the head, so two engines (or two
processes) computing the same prefix write the same bytes.

Nothing here imports vLLM.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Sequence

from nodeproc import Node, free_port, kvferry_bin  # noqa: F401  (the tests import them from here)


# ------------------------------------------------------------------------------ KV tensors

def empty(shape, dtype, device: str = "cpu"):
    """A zeroed tensor a node can map: a memfd on the CPU, its own allocation on a GPU."""
    import torch

    if device == "cpu":
        from kvferry.torch import memfd_empty

        return memfd_empty(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_tensors(layers: int, num_blocks: int, heads: int, block_size: int, head_size: int,
               layout: str = "LBNHC", dtype=None, device: str = "cpu") -> Dict[str, "object"]:
    """``{layer_name: tensor}`` as vLLM 0.33 hands a connector: logical shape
    ``(num_blocks, heads, block_size, 2 * head_size)``; ``LBNHC``/``LBHNC`` one memfd (or
    CUDA allocation) per layer, ``BLHNC`` one for all layers (cross-layer)."""
    import torch

    dtype = dtype or torch.float32

    def memfd_empty(shape, dt):
        return empty(shape, dt, device)

    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    c = 2 * head_size
    out = {}
    if layout in ("LBNHC", "LBHNC"):
        for n in names:
            if layout == "LBNHC":  # physical (B, N, H, C)
                t = memfd_empty((num_blocks, block_size, heads, c), dtype).permute(0, 2, 1, 3)
            else:  # physical (B, H, N, C)
                t = memfd_empty((num_blocks, heads, block_size, c), dtype)
            out[n] = t
    elif layout == "BLHNC":  # physical (B, L, H, N, C)
        big = memfd_empty((num_blocks, layers, heads, block_size, c), dtype)
        for i, n in enumerate(names):
            out[n] = big[:, i]
    else:
        raise ValueError(layout)
    return out


def _pattern(tokens: Sequence[int], pos: int, layer: int, heads: int, c: int, rank: int = 0):
    """What the 'model' writes for position ``pos``: a function of tokens[:pos+1] (and of
    the layer and the TP rank: each rank holds other heads) only."""
    import torch

    key = (list(tokens[: pos + 1]), layer) if rank == 0 else (list(tokens[: pos + 1]), layer, rank)
    h = hashlib.sha256(repr(key).encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little"))
    return torch.rand((heads, c), generator=g)


def forward(kv: Dict[str, object], tokens: Sequence[int], block_ids: Sequence[int],
            start: int, end: int, block_size: int, rank: int = 0) -> None:
    """Writes positions [start, end) of a request into its blocks, every layer."""
    for layer, name in enumerate(sorted(kv, key=_natural)):
        t = kv[name]
        heads, c = t.shape[1], t.shape[3]
        for pos in range(start, end):
            b, off = block_ids[pos // block_size], pos % block_size
            t[b, :, off, :] = _pattern(tokens, pos, layer, heads, c, rank).to(t.dtype)


def expected_block(kv: Dict[str, object], tokens: Sequence[int], block_index: int,
                   block_size: int, rank: int = 0) -> List[object]:
    """Per layer, the contents block ``block_index`` of ``tokens`` must hold."""
    import torch

    out = []
    for layer, name in enumerate(sorted(kv, key=_natural)):
        t = kv[name]
        heads, c = t.shape[1], t.shape[3]
        out.append(torch.stack([
            _pattern(tokens, block_index * block_size + off, layer, heads, c, rank).to(t.dtype)
            for off in range(block_size)
        ], dim=1))
    return out


def block_contents(kv: Dict[str, object], block_id: int) -> List[object]:
    return [kv[name][block_id].clone() for name in sorted(kv, key=_natural)]


def _natural(name: str):
    import re

    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))
