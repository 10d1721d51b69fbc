"""kvferry inside vLLM: ``kvferry.vllm.KvferryConnector``, a vLLM v1 KV connector.

::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "127.0.0.1:7200"}}'

Importing :mod:`kvferry.vllm` does not import vLLM: only ``KvferryConnector`` (and the
other names of :mod:`kvferry.vllm.connector`) do, when first used. The logic underneath,
:class:`~kvferry.vllm.scheduler.SchedulerSide` and :class:`~kvferry.vllm.worker.WorkerSide`,
runs without vLLM, so the GPU half is tested where vLLM is not installed.
"""

from __future__ import annotations

from typing import Any

from .config import KEYS, ConfigError, KvferryConfig, parse_extra_config
from .hashing import ChainHasher, engine_salt
from .kvcache import KvCacheLayoutError, RankLayout, describe_kv_caches
from .metadata import LoadSpec, SaveSpec, StepMetadata
from .scheduler import SchedulerSide
from .worker import WorkerSide

#: The vLLM releases this connector is tested with (CPU, vLLM's real scheduler; see the
#: README). Others start with a warning naming them, and work where they offer the hooks
#: the connector needs (:mod:`kvferry.vllm.compat` finds what a release offers).
SUPPORTED_VLLM = ("0.26.0", "0.33.0", "0.34.0")

_LAZY = {
    "KvferryConnector",
    "KvferryConnectorMetadata",
    "KvferryConnectorStats",
    "KvferryPromMetrics",
}

__all__ = [
    "KEYS",
    "SUPPORTED_VLLM",
    "ChainHasher",
    "ConfigError",
    "KvCacheLayoutError",
    "KvferryConfig",
    "LoadSpec",
    "RankLayout",
    "SaveSpec",
    "SchedulerSide",
    "StepMetadata",
    "WorkerSide",
    "describe_kv_caches",
    "engine_salt",
    "parse_extra_config",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvferry.vllm' has no attribute {name!r}")
