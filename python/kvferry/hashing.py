"""Chained block hashes over token ids, for every engine connector.

A prompt is named block by block: ``h[i] = SHA-256(h[i-1] | token ids of block i as
little-endian int64 | extras)``, starting from a salt that names the engine configuration.
``h[i]`` names the whole prefix up to block ``i``, so a node answering "the longest prefix
of these hashes" answers a prefix hit, and two configurations with different salts never
share a block. The salt starts with a tag naming the engine and the version of the scheme
(``kvferry-vllm-v1``, ``kvferry-sglang-v1``), so blocks of two engines never mix even for the
same model. Nothing here imports an engine or torch.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from typing import List, Sequence, Tuple, Union

__all__ = ["MmSpan", "chain_hashes", "field", "salt", "token_bytes"]

# (content identifier, offset, length) of one multimodal input in the token sequence.
MmSpan = Tuple[str, int, int]


def field(b: bytes) -> bytes:
    """``b`` prefixed with its length, so concatenated fields never run into each other."""
    return struct.pack("<I", len(b)) + b


def salt(tag: bytes, *parts: Union[str, int, bytes, None]) -> bytes:
    """SHA-256 of ``tag`` and ``parts``, each a length-prefixed field (ints as little-endian
    int64, ``None`` as the empty field)."""
    h = hashlib.sha256()
    h.update(field(tag))
    for p in parts:
        if p is None:
            p = b""
        elif isinstance(p, bool) or not isinstance(p, (int, str, bytes)):
            raise TypeError(f"a salt part is a str, int or bytes, got {type(p).__name__}")
        elif isinstance(p, int):
            p = struct.pack("<q", p)
        elif isinstance(p, str):
            p = p.encode()
        h.update(field(p))
    return h.digest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    a = array("q", tokens)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def chain_hashes(
    prev: bytes,
    tokens: Sequence[int],
    block_size: int,
    first_block: int = 0,
    mm: Sequence[MmSpan] = (),
) -> List[bytes]:
    """Hashes of the full blocks of ``tokens`` (token 0 of ``tokens`` is token
    ``first_block * block_size`` of the sequence), chained from ``prev``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    out: List[bytes] = []
    n = len(tokens) // block_size
    for j in range(n):
        i = first_block + j
        h = hashlib.sha256(prev)
        h.update(token_bytes(tokens[j * block_size : (j + 1) * block_size]))
        start, end = i * block_size, (i + 1) * block_size
        for ident, off, length in mm:
            if off < end and off + length > start:
                h.update(field(ident.encode()))
                h.update(struct.pack("<qq", off, length))
        prev = h.digest()
        out.append(prev)
    return out
