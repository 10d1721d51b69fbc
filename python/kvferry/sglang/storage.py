"""The HiCache storage backend's logic: SGLang's host pool as a kvferry instance, pages
named by SGLang's own page keys. :class:`kvferry.sglang.KvferryStorage` wraps it in
SGLang's ``HiCacheStorage``; nothing here imports SGLang.

- :meth:`StorageSide.register` (SGLang's ``register_mem_pool_host``, once): describes the
  host pool (:func:`~kvferry.sglang.layouts.describe_host_pool`, which refuses a layout it
  cannot describe, naming it), puts a memfd under its memory so the node can map it
  (:func:`kvferry.memfd.adopt`: the pool keeps its addresses and contents; pinned memory is
  unregistered from CUDA and registered again around it) and registers it with the node.
- :meth:`exists`: the count of leading keys the node holds (a query whose lease is
  released at once).
- :meth:`get`: query, then this rank's load straight into the host pool pages, then the
  lease's release. One bool per key: True for the leading pages that landed.
- :meth:`set`: a save of the pages straight out of the host pool.

A key names a page by SGLang's chained hash of the prefix. Every node hash is
``SHA-256(salt | key)``, the salt naming the engine (``kvferry-sglang-hicache-v1``), model,
LoRA, KV dtype, page size, layout tag and the ranks whose KV differs (TP size unless the KV
is replicated over TP, MLA; PP rank; attention CP rank), so an SGLang engine and a vLLM
engine of one model, or two SGLang configurations, never share blocks. TP ranks of an MHA
model are the ranks of one node instance: a block is complete once every rank saved its
heads; their loads share rank 0's lease (:class:`~kvferry.sglang.share.StoreExchange`:
HiCache calls ``batch_get_v1`` on each rank's own I/O thread, in its own time, so the lease
goes through the c10d store SGLang's ranks share rather than a collective). With MLA every
rank holds the same KV, so each rank is an instance of one rank of its own (SGLang saves
from rank 0 only, and every rank loads).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Callable, List, Optional, Sequence

from .. import memfd
from ..hashing import salt as make_salt
from ..layout import LayoutError
from .config import SglangConfig
from .layouts import PoolLayout, describe_host_pool
from .rank import RankKv, page_blocks
from .share import LeaseShare, StoreExchange

__all__ = ["HASH_TAG", "StorageSide"]

log = logging.getLogger("kvferry.sglang")

HASH_TAG = b"kvferry-sglang-hicache-v1"


class StorageSide:
    """One rank's HiCache backend. ``tp_rank`` ... ``cp_size`` and ``rank_replicated``
    (SGLang's ``is_mla_model``) come from SGLang's ``HiCacheStorageConfig``. ``store``: a
    ``torch.distributed.Store`` the TP ranks share, through which ranks past 0 take rank 0's
    lease (without one, with TP > 1, each rank takes its own)."""

    def __init__(
        self,
        cfg: SglangConfig,
        *,
        model: Optional[str],
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        cp_rank: int = 0,
        cp_size: int = 1,
        rank_replicated: bool = False,
        dp_rank: int = 0,
        client_factory: Optional[Callable[[], Any]] = None,
        store: Any = None,
    ):
        model = cfg.model or model
        if not model:
            raise LayoutError("kvferry.sglang: no model name (set \"model\" in the extra config)")
        self.cfg = cfg
        self.model = model
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.rank_replicated = rank_replicated
        self.dp_rank = dp_rank
        self._client_factory = client_factory
        self._store = store
        self.rank: Optional[RankKv] = None
        self.share: Optional[LeaseShare] = None
        self.layout: Optional[PoolLayout] = None
        self._salt = b""

    # -- registration ----------------------------------------------------------------------

    def instance_name(self) -> str:
        base = self.cfg.instance or f"sglang-{os.getppid()}"
        name = f"{base}-hicache"
        if self.dp_rank > 0:
            # DP attention: each DP group's TP ranks are an instance of their own.
            name += f"-dp{self.dp_rank}"
        if self.pp_size > 1:
            name += f"-pp{self.pp_rank}"
        if self.cp_size > 1:
            name += f"-cp{self.cp_rank}"
        if self.rank_replicated:
            name += f"-tp{self.tp_rank}"
        return name

    def register(self, host_pool: Any) -> None:
        """Describes, adopts and registers ``host_pool`` (SGLang's ``HostKVCache``); once.
        Raises :class:`LayoutError` for a pool kvferry cannot describe or map."""
        if self.rank is not None:
            return
        layout = describe_host_pool(host_pool)
        if layout.device != "cpu":
            raise LayoutError(f"SGLang host pool on {layout.device}: kvferry maps host pools "
                              "in CPU memory only")
        _adopt(host_pool, layout)
        tp_size, rank = (1, 0) if self.rank_replicated else (self.tp_size, self.tp_rank)
        self._salt = make_salt(
            HASH_TAG, self.model, self.cfg.lora, layout.dtype, layout.page_size, layout.tag,
            layout.kind, 1 if self.rank_replicated else self.tp_size, self.pp_rank,
            self.pp_size, self.cp_rank, self.cp_size,
        )
        self.layout = layout
        self.rank = RankKv(
            self.cfg, instance=self.instance_name(), rank=rank, tp_size=tp_size,
            model=self.model, layout=layout, device=0, who=f"hicache rank {self.tp_rank}",
            client_factory=self._client_factory,
        )
        exchange = None
        if not self.rank_replicated and self.tp_size > 1:
            if self._store is not None:
                exchange = StoreExchange(self._store, f"kvferry/{self.instance_name()}",
                                         wait_s=self.cfg.share_wait_s)
            else:
                log.warning("kvferry: HiCache rank %d of %d has no store shared with its "
                            "other ranks; each rank takes its own lease", self.tp_rank,
                            self.tp_size)
        self.share = LeaseShare(self.rank, rank, exchange)
        if not self.rank.register():
            log.warning("kvferry: the node at %s cannot be reached; HiCache storage misses "
                        "until it can", self.cfg.address)

    # -- pages -----------------------------------------------------------------------------

    def hashes(self, keys: Sequence[str]) -> List[bytes]:
        return [hashlib.sha256(self._salt + k.encode()).digest() for k in keys]

    def exists(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` the node holds (0 before :meth:`register`, or with the
        node down)."""
        if self.rank is None or not keys:
            return 0
        if self.share is not None:
            self.share.sweep()
        lease, n = self.rank.query(self.hashes(keys))
        self.rank.release(lease)
        return min(n, len(keys))

    def get(self, keys: Sequence[str], host_indices: Any) -> List[bool]:
        """Loads the pages ``keys`` into the host pool pages of ``host_indices`` (token
        slots, a page each); a bool per key, True for the leading pages that landed."""
        out = [False] * len(keys)
        if self.rank is None or not keys:
            return out
        assert self.layout is not None
        dest = page_blocks(host_indices, self.layout.page_size, len(keys))
        if len(dest) < len(keys):
            log.warning("kvferry: batch_get_v1: %d keys but %d whole aligned pages of host "
                        "indices; loading those", len(keys), len(dest))
        if not dest:
            return out
        assert self.share is not None
        lease, n = self.share.query(self.hashes(keys[: len(dest)]))
        if lease is None:
            return out
        try:
            landed = self.rank.load(lease, dest[:n])
        finally:
            self.share.loaded(lease, self.cfg.load_timeout_s)
        for i in range(landed):
            out[i] = True
        return out

    def set(self, keys: Sequence[str], host_indices: Any) -> List[bool]:
        """Saves the host pool pages of ``host_indices`` as ``keys``; a bool per key."""
        if self.rank is None or not keys:
            return [False] * len(keys)
        assert self.layout is not None
        src = page_blocks(host_indices, self.layout.page_size, len(keys))
        ok = bool(src) and self.rank.save(self.hashes(keys[: len(src)]), src)
        return [ok and i < len(src) for i in range(len(keys))]

    def stats(self) -> dict:
        return dict(self.rank.counters) if self.rank is not None else {}

    def close(self) -> None:
        if self.share is not None:
            self.share.close()
        if self.rank is not None:
            self.rank.unregister()


def _adopt(host_pool: Any, layout: PoolLayout) -> None:
    """Puts a memfd under the host pool's buffer (see :func:`kvferry.memfd.adopt`)."""
    (buf,) = layout.tensors
    nbytes = buf.numel() * buf.element_size()
    if memfd.lookup(buf.data_ptr(), nbytes) is not None:
        return
    # A pool nothing was allocated from yet holds nothing worth copying.
    fresh = _fresh(host_pool)
    pinned = bool(getattr(host_pool, "pin_memory", False)) and _cuda_registered(buf)
    if pinned:
        _cuda_host(buf, register=False)
    try:
        memfd.adopt(buf.data_ptr(), nbytes, buf, name="sglang-host-pool", preserve=not fresh)
    except memfd.AdoptError as e:
        raise LayoutError(
            f"SGLang host pool {type(host_pool).__name__}: {e}; kvferry maps the pool SGLang "
            "allocates with mmap (unset SGLANG_HUGEPAGE_SIZE)"
        ) from None
    finally:
        if pinned:
            _cuda_host(buf, register=True)


def _fresh(pool: Any) -> bool:
    try:
        return int(pool.available_size()) == int(pool.size)
    except Exception:  # noqa: BLE001 - an unknown pool: keep its contents
        return False


def _cuda_registered(buf: Any) -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def _cuda_host(buf: Any, register: bool) -> None:
    import torch

    cudart = torch.cuda.cudart()
    if register:
        rc = cudart.cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
    else:
        rc = cudart.cudaHostUnregister(buf.data_ptr())
    if int(rc) != 0:
        what = "cudaHostRegister" if register else "cudaHostUnregister"
        raise LayoutError(f"SGLang host pool: {what} failed ({int(rc)}) while kvferry moved it "
                          "into a memfd")
