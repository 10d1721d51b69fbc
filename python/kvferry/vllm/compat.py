"""What the installed vLLM offers the connector, found from its classes, never its version.

The connector API moves between releases (see the README's "Use with vLLM"): 0.26 asks for
cross-layer KV with ``prefer_cross_layer_blocks`` and hands it to
``register_cross_layers_kv_cache``; 0.33 and 0.34 ask for it with a ``BLHNC`` KV cache layout
and take load failures per request through ``get_transfer_results().failed_recving``; 0.34
lets a connector say how it reaches KV memory (``kv_cache_access``) and hands resumed requests
over as new ones. :func:`probe` finds each of these from what the installed vLLM has, so a
release in between, or after, gets whatever of them it has. The version string is used for
one thing only: the warning that a release was not tested.

This module imports vLLM (only :mod:`kvferry.vllm.connector` imports it).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

__all__ = [
    "REQUIRED_HOOKS",
    "RESULT_HOOKS",
    "TESTED_VLLM",
    "MissingHook",
    "VllmApi",
    "check_hooks",
    "probe",
    "warn_if_untested",
]

log = logging.getLogger("kvferry.vllm")

#: The releases the connector is tested with (real scheduler, on CPU; see the README).
TESTED_VLLM = ("0.26.0", "0.33.0", "0.34.0")

#: ``KVConnectorBase_V1`` methods vLLM must call for the connector to be correct. A release
#: without one cannot run it; one that calls it with more arguments than the connector's
#: takes cannot either.
REQUIRED_HOOKS: Tuple[str, ...] = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "bind_connector_metadata",
    "clear_connector_metadata",
    "register_kv_caches",
    "start_load_kv",
    "wait_for_layer_load",
    "wait_for_save",
    "get_block_ids_with_load_errors",
)

#: Of these vLLM must call one: how finished saves and loads are reported (0.33+ asks the
#: first, 0.26 the second).
RESULT_HOOKS = ("get_transfer_results", "get_finished")


class MissingHook(RuntimeError):
    """The installed vLLM lacks a hook the connector needs (the message names it)."""


@dataclass(frozen=True)
class VllmApi:
    """The connector API of the installed vLLM."""

    version: str
    #: ``get_transfer_results`` / ``KVConnectorTransferResults.failed_recving`` (0.33+):
    #: a failed asynchronous load is reported per request, and vLLM recomputes it.
    transfer_results: bool
    #: How cross-layer KV is asked for: "layout" (a ``BLHNC`` KV cache layout, 0.33+),
    #: "register" (``prefer_cross_layer_blocks`` + ``register_cross_layers_kv_cache``,
    #: 0.26) or "" (not offered).
    cross_layer: str
    #: ``kv_cache_access`` (0.34): how the workers reach device KV memory decides whether
    #: vLLM may use its extensible (VMM) KV cache.
    kv_cache_access: bool
    #: ``vllm.v1.metrics.cache_hit_source.CacheHitSource`` (0.33+).
    cache_hit_source: bool
    #: ``CachedRequestData.resumed_req_ids`` (up to 0.33); 0.34 hands resumed requests
    #: over as new ones.
    resumed_req_ids: bool
    #: ``SchedulerOutput.kv_connector_block_state`` (0.33+); before it, block tables are
    #: followed from the new and cached requests of each step.
    block_state: bool


def _fields(cls: Any) -> set:
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:
        return set(getattr(cls, "__annotations__", {}))


def probe() -> VllmApi:
    """The API of the installed vLLM (imports it)."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    from vllm.v1.core.sched import output

    b = base.KVConnectorBase_V1
    transfer = hasattr(b, "get_transfer_results") and "failed_recving" in _fields(
        getattr(base, "KVConnectorTransferResults", None)
    )
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        layout = hasattr(KVCacheLayout, "BLHNC")
    except ImportError:
        layout = False
    if layout:
        cross = "layout"
    elif hasattr(b, "prefer_cross_layer_blocks") and hasattr(b, "register_cross_layers_kv_cache"):
        cross = "register"
    else:
        cross = ""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: F401

        hit_source = True
    except ImportError:
        hit_source = False
    return VllmApi(
        version=str(getattr(vllm, "__version__", "unknown")),
        transfer_results=transfer,
        cross_layer=cross,
        kv_cache_access=hasattr(b, "kv_cache_access"),
        cache_hit_source=hit_source,
        resumed_req_ids="resumed_req_ids" in _fields(output.CachedRequestData),
        block_state="kv_connector_block_state" in _fields(output.SchedulerOutput),
    )


def _positional(fn: Any) -> Optional[List[str]]:
    """The positional parameters of ``fn`` after ``self``; None if it takes ``*args``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names = []
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            return None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return names[1:] if names and names[0] in ("self", "cls") else names


def check_hooks(base_cls: Any, ours: Any) -> None:
    """Raises :class:`MissingHook` naming the first hook ``base_cls`` (vLLM's
    ``KVConnectorBase_V1``) lacks, or calls with arguments ``ours`` does not take."""
    if not any(hasattr(base_cls, name) for name in RESULT_HOOKS):
        raise MissingHook(
            f"kvferry: this vLLM's KVConnectorBase_V1 has neither "
            f"{' nor '.join(n + '()' for n in RESULT_HOOKS)}; the connector needs one to "
            f"report finished loads and saves (tested with vLLM {', '.join(TESTED_VLLM)})"
        )
    hooks = REQUIRED_HOOKS + tuple(n for n in RESULT_HOOKS if hasattr(base_cls, n))
    for name in hooks:
        theirs = getattr(base_cls, name, None)
        if theirs is None:
            raise MissingHook(
                f"kvferry: this vLLM's KVConnectorBase_V1 has no {name}(); the connector "
                f"needs it (tested with vLLM {', '.join(TESTED_VLLM)})"
            )
        want = _positional(theirs)
        have = _positional(getattr(ours, name))
        if want is None or have is None:
            continue
        # vLLM passes the base class's required positional arguments; ours must take as
        # many (extra ones of ours have defaults).
        required = [
            p.name
            for p in list(inspect.signature(theirs).parameters.values())[1:]
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
        if len(required) > len(have):
            raise MissingHook(
                f"kvferry: this vLLM calls KVConnectorBase_V1.{name}({', '.join(want)}); the "
                f"connector's takes ({', '.join(have)}) (tested with vLLM "
                f"{', '.join(TESTED_VLLM)})"
            )


def _series(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


_warned: set = set()


def warn_if_untested(api: VllmApi) -> bool:
    """Logs a warning naming the release, once per process, where it is not of a tested
    series (0.26.x, 0.33.x, 0.34.x); True if the release is untested."""
    tested = {_series(v) for v in TESTED_VLLM}
    if _series(api.version) in tested:
        return False
    if api.version in _warned:
        return True
    _warned.add(api.version)
    log.warning(
        "kvferry: vLLM %s is not a release kvferry is tested with (%s); the connector uses "
        "what this release offers (failed loads %s, cross-layer KV %s, kv_cache_access %s)",
        api.version,
        ", ".join(f"{s}.x" for s in sorted(tested, key=lambda s: tuple(map(int, s.split("."))))),
        "per request" if api.transfer_results else "per block",
        f"by {api.cross_layer}" if api.cross_layer else "not offered",
        "declared" if api.kv_cache_access else "not asked for",
    )
    return True


def engine_events(vllm_config: Any, endpoint: Optional[str]) -> Any:
    """The connector's event book (:class:`kvferry.vllm.events.EngineEvents`) where this
    engine publishes KV events (``--kv-events-config`` with ``enable_kv_cache_events``),
    its vLLM has ``KVConnectorBase_V1.take_events`` (0.26 and 0.34 do), and the extra config
    names the node's publisher (``events``); else None: no socket, nothing tracked."""
    kec = getattr(vllm_config, "kv_events_config", None)
    if not endpoint or not getattr(kec, "enable_kv_cache_events", False):
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if not hasattr(KVConnectorBase_V1, "take_events"):
        log.warning("kvferry: this vLLM has no take_events on its connectors: no events")
        return None
    import msgspec
    from vllm.distributed import kv_events

    from .events import EngineEvents, NodeStream, only_fields

    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as convert
    except ImportError:  # a release that publishes block hashes as they are

        def convert(h: Any) -> Any:
            return h

    book = EngineEvents(
        NodeStream(endpoint),
        msgspec.msgpack.decode,
        only_fields(kv_events.BlockStored),
        only_fields(kv_events.BlockRemoved),
    )
    book.convert = convert  # type: ignore[attr-defined]
    return book
