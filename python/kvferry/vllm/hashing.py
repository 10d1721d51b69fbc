"""Block hashes that are the same in every engine process and across restarts.

vLLM's own block hashes start from a per-process random seed (unless ``PYTHONHASHSEED`` is
set), so two engines, or one engine after a restart, would never find each other's blocks.
The connector therefore names blocks by its own chained content hash:

    base   = SHA-256("kvferry-vllm-v1" | model | KV dtype | block size | TP size)
    salt   = base                                  (no LoRA adapter, no cache salt), else
             SHA-256(base | LoRA adapter (name, id, path) or none | cache salt or none)
    h[-1]  = salt
    h[i]   = SHA-256(h[i-1] | token ids of block i as little-endian int64
                     | multimodal inputs overlapping block i (content hash, offset))

The salt is what keeps tenants apart on a node shared by many: vLLM salts its own block
hashes with the request's LoRA adapter (0.34: its name and path), its ``cache_salt`` and its
multimodal inputs, and so does this, with the adapter's id as well, so that blocks of two
adapters, two salts or two images never share a key even where the token ids are equal
(every field is length-prefixed and tagged, so no two tenants' fields run together into
the same bytes). Prompt embeddings are not hashed: such requests are not named at all.

Only full blocks are hashed (the chain itself is :mod:`kvferry.hashing`, shared with the
SGLang connector). ``h[i]`` names the whole prefix up to block ``i``, so a node
answering "the longest prefix of these hashes" answers a prefix hit. Nothing here imports
vLLM or torch.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Iterable, List, Optional, Sequence, Tuple

from ..hashing import MmSpan, chain_hashes
from ..hashing import field as _field

__all__ = ["HASH_VERSION", "ChainHasher", "LoraKey", "chain_hashes", "engine_salt", "lora_key",
           "request_salt"]

HASH_VERSION = b"kvferry-vllm-v1"

# (name, id, path) of a LoRA adapter.
LoraKey = Tuple[str, int, str]


def engine_salt(model: str, kv_dtype: str, block_size: int, tp_size: int) -> bytes:
    """What every block hash of one engine configuration starts from."""
    h = hashlib.sha256()
    h.update(_field(HASH_VERSION))
    h.update(_field(model.encode()))
    h.update(_field(kv_dtype.encode()))
    h.update(struct.pack("<II", block_size, tp_size))
    return h.digest()


def lora_key(lora_request: Any) -> Optional[LoraKey]:
    """A vLLM ``LoRARequest`` as the salt names it: name, integer id and path (any of them
    absent in a release reads as empty); None without an adapter."""
    if not lora_request:
        return None
    name = getattr(lora_request, "lora_name", None) or ""
    lid = getattr(lora_request, "lora_int_id", None)
    path = getattr(lora_request, "lora_path", None) or ""
    try:
        lid = int(lid) if lid is not None else 0
    except (TypeError, ValueError):
        lid = 0
    return (str(name), lid, str(path))


def request_salt(base: bytes, lora: Optional[LoraKey], cache_salt: Optional[str]) -> bytes:
    """The salt of one request's chain: ``base`` itself for a request without a LoRA
    adapter and without a cache salt, else a hash of both (see the module doc)."""
    if lora is None and not cache_salt:
        return base
    h = hashlib.sha256(base)
    if lora is None:
        h.update(b"\x00")
    else:
        name, lid, path = lora
        h.update(b"\x01")
        h.update(_field(name.encode("utf-8", "surrogatepass")))
        h.update(struct.pack("<q", lid))
        h.update(_field(path.encode("utf-8", "surrogatepass")))
    if cache_salt:
        h.update(b"\x01")
        h.update(_field(str(cache_salt).encode("utf-8", "surrogatepass")))
    else:
        h.update(b"\x00")
    return h.digest()


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
