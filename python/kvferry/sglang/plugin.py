"""The ``sglang.srt.plugins`` entry point: registers :class:`KvferryRadixCache` as the radix
cache backend ``kvferry``, selected with ``--radix-cache-backend kvferry``.

SGLang calls :func:`register` in every process it starts (``load_plugins``). The settings of
:mod:`kvferry.sglang.config` come from the environment variable ``KVFERRY_SGLANG_CONFIG``: a
JSON object, or ``@PATH`` of a file holding one (SGLang has no flag for a radix cache
backend's settings). A setting that is wrong stops SGLang at start, naming it; a node that is
down does not (it costs hits).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict

from .config import ConfigError

__all__ = ["BACKEND", "CONFIG_ENV", "factory", "load_config", "register"]

log = logging.getLogger("kvferry.sglang")

BACKEND = "kvferry"
CONFIG_ENV = "KVFERRY_SGLANG_CONFIG"


def register() -> None:
    """Registers the backend (once per process; a second call does nothing)."""
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    if get_radix_cache_factory(BACKEND) is None:
        register_radix_cache_backend(BACKEND, factory)


def load_config() -> Dict[str, Any]:
    raw = os.environ.get(CONFIG_ENV, "").strip()
    if not raw:
        return {}
    where = CONFIG_ENV
    if raw.startswith("@"):
        where = raw[1:]
        try:
            with open(where, encoding="utf-8") as f:
                raw = f.read()
        except OSError as e:
            raise ConfigError(f"kvferry.sglang: {CONFIG_ENV}: cannot read {where}: {e}") from e
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"kvferry.sglang: {where} is not JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"kvferry.sglang: {where} must hold a JSON object")
    return cfg


def _tp_helpers(tp_group: Any, tp_size: int):
    """(broadcast, agree) over SGLang's TP group (its CPU process group)."""
    if tp_size <= 1 or tp_group is None:
        return None, None
    import torch
    import torch.distributed as dist

    group = getattr(tp_group, "cpu_group", tp_group)
    src = dist.get_global_rank(group, 0) if hasattr(dist, "get_global_rank") else 0

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def agree(n: int) -> int:
        t = torch.tensor([int(n)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())

    return broadcast, agree


def factory(ctx: Any) -> Any:
    """Builds the cache from SGLang's ``TreeCacheBuildContext``."""
    from .connector import KvferryConnector
    from .radix import KvferryRadixCache

    params = ctx.params
    kv_pool = params.token_to_kv_pool_allocator.get_kvcache()
    broadcast, agree = _tp_helpers(ctx.tp_group, ctx.tp_size)
    server_args = ctx.server_args
    model = getattr(server_args, "served_model_name", None) or server_args.model_path
    conn = KvferryConnector(
        kv_pool, model=model, config=load_config(), tp_rank=ctx.tp_rank,
        tp_size=ctx.tp_size, pp_rank=params.pp_rank, pp_size=params.pp_size,
        cp_rank=params.attn_cp_rank, cp_size=params.attn_cp_size, broadcast=broadcast,
    )
    log.info("kvferry: radix cache backend for %s, TP rank %d of %d", model, ctx.tp_rank,
             ctx.tp_size)
    return KvferryRadixCache(params, connector=conn, agree=agree)
