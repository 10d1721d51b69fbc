"""``KvferryStorage``: SGLang's ``HiCacheStorage`` over a kvferry node (imports SGLang).

::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvferry", "module_path": "kvferry.sglang",
          "class_name": "KvferryStorage", "interface_v1": 1, "address": "127.0.0.1:7200"}'

``interface_v1: 1`` makes SGLang call the zero-copy ``batch_get_v1`` / ``batch_set_v1``,
which move pages between the node and SGLang's host pool without a Python copy. The logic
is :class:`kvferry.sglang.storage.StorageSide`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, List, Optional

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from .config import ConfigError, parse_config
from .storage import StorageSide

__all__ = ["KvferryStorage"]

log = logging.getLogger("kvferry.sglang")


def _tp_store(storage_config: HiCacheStorageConfig) -> Any:
    """The c10d store of SGLang's process group, where the TP ranks' loads share rank 0's
    lease (None with one rank, MLA, or no process group)."""
    if storage_config.tp_size <= 1 or storage_config.is_mla_model:
        return None
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not dist.is_initialized():
            return None
        return distributed_c10d._get_default_store()
    except Exception as e:  # noqa: BLE001 - without it each rank takes its own lease
        log.warning("kvferry: no torch.distributed store (%s)", e)
        return None


class KvferryStorage(HiCacheStorage):
    """A HiCache L3 backend whose pages live in a kvferry node (see the module doc)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None, **extra: Any):
        cfg = parse_config(storage_config.extra_config, sglang_keys=True)
        # SGLang's StorageBackendFactory hands its keyword arguments as one dict.
        opts = dict(kwargs) if isinstance(kwargs, dict) else {}
        opts.update(extra)
        if not (storage_config.extra_config or {}).get("interface_v1"):
            # Without it SGLang hands page copies (batch_get / batch_set), which have no
            # place on the node: refuse at start rather than store nothing.
            raise ConfigError(
                'kvferry.sglang.KvferryStorage needs "interface_v1": 1 in '
                "--hicache-storage-backend-extra-config (the zero-copy batch_get_v1 / "
                "batch_set_v1 calls)"
            )
        self.side = StorageSide(
            cfg,
            model=storage_config.model_name,
            tp_rank=storage_config.tp_rank,
            tp_size=storage_config.tp_size,
            pp_rank=storage_config.pp_rank,
            pp_size=storage_config.pp_size,
            cp_rank=getattr(storage_config, "attn_cp_rank", 0) or 0,
            cp_size=getattr(storage_config, "attn_cp_size", 1) or 1,
            rank_replicated=bool(storage_config.is_mla_model),
            dp_rank=getattr(storage_config, "dp_rank", 0) or 0,
            client_factory=opts.get("client_factory"),
            store=opts.get("store") or _tp_store(storage_config),
        )
        self.enable_storage_metrics = bool(storage_config.enable_storage_metrics)
        # What get_stats hands SGLang's metrics collector, since the last call.
        self._prefetch_pgs: List[int] = []
        self._backup_pgs: List[int] = []
        self._prefetch_bw: List[float] = []
        self._backup_bw: List[float] = []

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.side.register(mem_pool_host)

    # -- the zero-copy interface -----------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        try:
            return self.side.exists(keys)
        except Exception:  # noqa: BLE001 - a miss, never an exception into SGLang's thread
            log.exception("kvferry: batch_exists failed; answering 0")
            return 0

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None
                     ) -> List[bool]:
        # Always a list: SGLang's prefetch thread indexes the answer.
        t0 = time.perf_counter()
        try:
            got = self.side.get(keys, host_indices)
        except Exception:  # noqa: BLE001
            log.exception("kvferry: batch_get_v1 failed; answering misses")
            return [False] * len(keys)
        self._record(self._prefetch_pgs, self._prefetch_bw, sum(got), t0)
        return got

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None
                     ) -> List[bool]:
        t0 = time.perf_counter()
        try:
            done = self.side.set(keys, host_indices)
        except Exception:  # noqa: BLE001
            log.exception("kvferry: batch_set_v1 failed; answering failures")
            return [False] * len(keys)
        self._record(self._backup_pgs, self._backup_bw, sum(done), t0)
        return done

    def _record(self, pages: List[int], bandwidth: List[float], n: int, t0: float) -> None:
        if not self.enable_storage_metrics or n == 0 or self.side.layout is None:
            return
        dt = max(time.perf_counter() - t0, 1e-9)
        lay = self.side.layout
        page_bytes = lay.segment_bytes * lay.segments * len(lay.layers)
        pages.append(n)
        bandwidth.append(n * page_bytes / dt / (1 << 30))  # GiB/s, as SGLang's backends

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (what its metrics collector
        takes), or None without ``--enable-cache-report`` storage metrics. kvferry's own
        counters are :meth:`counters`."""
        if not self.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        m.prefetch_pgs.extend(self._prefetch_pgs)
        m.backup_pgs.extend(self._backup_pgs)
        m.prefetch_bandwidth.extend(self._prefetch_bw)
        m.backup_bandwidth.extend(self._backup_bw)
        for xs in (self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw):
            xs.clear()
        return m

    def counters(self) -> dict:
        """kvferry's counters of this rank (:data:`kvferry.sglang.rank.COUNTERS`): node
        failures, hits, loads, saves, registrations."""
        return self.side.stats()

    def close(self) -> None:
        self.side.close()

    # -- the copying interface (SGLang without interface_v1) -------------------------------
    # kvferry moves pages between the node and the registered host pool only; a page tensor
    # SGLang hands over outside the pool has no place on the node. Misses, never errors.

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return None

    def batch_get(self, keys: List[str], target_locations: Any = None,
                  target_sizes: Any = None) -> Any:
        log.warning("kvferry: batch_get without interface_v1 is not supported; misses")
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return False

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        log.warning("kvferry: batch_set without interface_v1 is not supported; not stored")
        return False
