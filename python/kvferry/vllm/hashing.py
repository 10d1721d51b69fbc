"""Block hashes that are the same in every engine process and across restarts.

vLLM's own block hashes start from a per-process random seed (unless ``PYTHONHASHSEED`` is
set), so two engines, or one engine after a restart, would never find each other's blocks.
The connector therefore names blocks by its own chained content hash:

    salt   = SHA-256("kvferry-vllm-v1" | model | KV dtype | block size | TP size
                     | LoRA name | cache salt)
    h[-1]  = salt
    h[i]   = SHA-256(h[i-1] | token ids of block i as little-endian int64
                     | multimodal inputs overlapping block i (content hash, offset))

Only full blocks are hashed. ``h[i]`` names the whole prefix up to block ``i``, so a node
answering "the longest prefix of these hashes" answers a prefix hit. Nothing here imports
vLLM or torch.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from typing import Iterable, List, Optional, Sequence, Tuple

__all__ = ["HASH_VERSION", "ChainHasher", "chain_hashes", "engine_salt"]

HASH_VERSION = b"kvferry-vllm-v1"

# (content identifier, offset, length) of one multimodal input in the token sequence.
MmSpan = Tuple[str, int, int]


def _field(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def engine_salt(model: str, kv_dtype: str, block_size: int, tp_size: int) -> bytes:
    """What every block hash of one engine configuration starts from."""
    h = hashlib.sha256()
    h.update(_field(HASH_VERSION))
    h.update(_field(model.encode()))
    h.update(_field(kv_dtype.encode()))
    h.update(struct.pack("<II", block_size, tp_size))
    return h.digest()


def request_salt(base: bytes, lora_name: Optional[str], cache_salt: Optional[str]) -> bytes:
    if not lora_name and not cache_salt:
        return base
    h = hashlib.sha256(base)
    h.update(_field((lora_name or "").encode()))
    h.update(_field((cache_salt or "").encode()))
    return h.digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
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
    out: List[bytes] = []
    n = len(tokens) // block_size
    for j in range(n):
        i = first_block + j
        h = hashlib.sha256(prev)
        h.update(_token_bytes(tokens[j * block_size : (j + 1) * block_size]))
        start, end = i * block_size, (i + 1) * block_size
        for ident, off, length in mm:
            if off < end and off + length > start:
                h.update(_field(ident.encode()))
                h.update(struct.pack("<qq", off, length))
        prev = h.digest()
        out.append(prev)
    return out


class ChainHasher:
    """One request's block hashes, extended as its tokens grow."""

    __slots__ = ("salt", "block_size", "mm", "hashes")

    def __init__(self, salt: bytes, block_size: int, mm: Iterable[MmSpan] = ()):
        self.salt = salt
        self.block_size = block_size
        self.mm = tuple(mm)
        self.hashes: List[bytes] = []

    def upto(self, tokens: Sequence[int], blocks: int) -> List[bytes]:
        """The hashes of the first ``blocks`` full blocks of ``tokens`` (fewer if ``tokens``
        holds fewer full blocks)."""
        blocks = min(blocks, len(tokens) // self.block_size)
        have = len(self.hashes)
        if blocks > have:
            prev = self.hashes[-1] if self.hashes else self.salt
            bs = self.block_size
            self.hashes.extend(
                chain_hashes(prev, tokens[have * bs : blocks * bs], bs, have, self.mm)
            )
        return self.hashes[:blocks]
