"""kvferry inside SGLang.

- :class:`KvferryStorage`, a HiCache storage backend (SGLang's ``HiCacheStorage`` with the
  zero-copy ``batch_get_v1`` / ``batch_set_v1``) for ``--hicache-storage-backend dynamic``:
  SGLang's host pool registered with the node once, pages moved between them without a
  Python copy (:mod:`kvferry.sglang.storage`).
- :class:`KvferryConnector`, loads straight into SGLang's GPU KV pool, page by page, and saves
  out of it: query and lease, load, save, release (:mod:`kvferry.sglang.connector`).
- :class:`~kvferry.sglang.radix.KvferryRadixCache`, SGLang's ``RadixCache`` driving the
  connector, registered as ``--radix-cache-backend kvferry`` by the ``sglang.srt.plugins``
  entry point :func:`kvferry.sglang.plugin.register` (:mod:`kvferry.sglang.radix`).

Importing :mod:`kvferry.sglang` does not import SGLang: only ``KvferryStorage`` does, when
first used. The logic underneath (:class:`~kvferry.sglang.storage.StorageSide`, the
connector, :mod:`~kvferry.sglang.layouts`) runs without SGLang, so the GPU half is tested
where SGLang is not installed.
"""

from __future__ import annotations

from typing import Any

from .config import KEYS, ConfigError, SglangConfig, parse_config
from .connector import KvferryConnector
from .layouts import PoolLayout, describe_device_pool, describe_host_pool
from .storage import StorageSide

#: The SGLang releases these classes are tested with (CPU, SGLang's own pool classes).
SUPPORTED_SGLANG = ("0.5.16", "0.5.23")

_LAZY = {"KvferryStorage"}

__all__ = [
    "KEYS",
    "SUPPORTED_SGLANG",
    "ConfigError",
    "KvferryConnector",
    "PoolLayout",
    "SglangConfig",
    "StorageSide",
    "describe_device_pool",
    "describe_host_pool",
    "parse_config",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import hicache

        return getattr(hicache, name)
    raise AttributeError(f"module 'kvferry.sglang' has no attribute {name!r}")
