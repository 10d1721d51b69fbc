"""The connector's settings: vLLM's ``kv_connector_extra_config``, checked at engine start.

Every key is listed in :data:`KEYS`; a key that is not (a typo such as ``adress``) is
refused with :class:`ConfigError` (a ``ValueError``) when the engine starts, naming the key
and the known ones, rather than silently ignored. Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional

from ..link import Timeouts

__all__ = ["ConfigError", "KvferryConfig", "KEYS", "parse_extra_config"]


class ConfigError(ValueError):
    """A ``kv_connector_extra_config`` the connector cannot run with."""


#: key -> what it is (shown in error messages and the README).
KEYS: Dict[str, str] = {
    "address": "the node's engine service, host:port (its [engine] listen); required",
    "token": "the node's engine token ([engine] token), if it has one",
    "instance": "this engine's instance name on the node (default: vllm-<engine_id>)",
    "model": "the model name blocks are shared under (default: the served model name, "
    "else the model as given; any name: escaped into the node's namespace)",
    "direct_gpu": "ask the node for direct GPU loads of remote blocks (used only if granted)",
    "deadline_ms": "deadline of each call to the node, in ms (default 1000)",
    "connect_timeout_ms": "how long connecting to the node may take, in ms (default 1000)",
    "load_timeout_ms": "a load not complete by then fails and its blocks are recomputed "
    "(default 30000)",
    "retry_ms": "after the node failed, how long the connector leaves it alone before trying "
    "again, in ms; doubles up to 30 s while it keeps failing (default 1000)",
    "load_mode": '"auto" (default: a hit loads "sync" while no other request runs and vLLM\'s '
    'async scheduling is off, else "async"), "async" (loads run between steps, beside other requests\' forwards) or "sync" '
    "(the request's forward runs in the step of its load, each layer as it lands; other "
    "requests of that step wait for it)",
    "sync_batches": '"layer" (default: a synchronous load lands one copy batch per layer, so '
    'each layer\'s forward starts as soon as it is in) or "grouped" (the node\'s layer groups: '
    "layer 0 alone, then a few long batches that move at the copy engines' speed; faster where "
    "the step computes little beside the hit, a full-prefix hit's one-token tail)",
    "load_start": '"worker" (default: a load starts when vLLM\'s worker runs the step) or '
    '"scheduler" (a synchronous load starts from the scheduler the moment its blocks are '
    "allocated, before the step reaches the worker; only where vLLM schedules synchronously "
    "with one TP rank and one pipeline stage, else the worker starts it; not yet measured "
    "on a GPU)",
    "fd_socket": "the node's fd socket path where it differs from what the node announces",
    "mailbox": "send queries, loads and saves through a request mailbox in shared memory (default "
    "true; needs the node's fd socket, so the same host; the calls are used where the node "
    "or the host cannot)",
    "kv_cache_access": '(vLLM 0.34) how the node reaches vLLM\'s KV memory: "auto" (default: '
    '"exports_fd" where the driver can export vLLM\'s extensible VMM KV cache, else '
    '"legacy_ipc"), "exports_fd" or "legacy_ipc" (CUDA IPC; vLLM turns its extensible '
    "cache off)",
    "events": "the node's KV event publisher, tcp://host:port (its [events] publish): with "
    "vLLM's --kv-events-config on, blocks this engine saved are reported in vLLM's event "
    'stream as stored (medium "CPU", "DISK") and removed as the node evicts them',
    "idle_wait_ms": "in a step where vLLM runs no forward (nothing scheduled) while "
    "asynchronous loads run, how long the worker waits for one of them to end before the "
    "step returns, in ms, so vLLM schedules the request the moment its KV is in (default 2; "
    "0: no wait)",
    "kv_layout": '"auto" (default: vLLM picks its KV cache layout) or "cross_layer" (ask vLLM '
    "for block-outermost KV, BLHNC, so a load is one copy per block; vLLM falls back with a "
    "warning where the attention backend cannot use it)",
}


@dataclass(frozen=True)
class KvferryConfig(Timeouts):
    address: str
    token: Optional[str] = None
    instance: Optional[str] = None
    model: Optional[str] = None
    direct_gpu: bool = False
    deadline_ms: int = 1000
    connect_timeout_ms: int = 1000
    load_timeout_ms: int = 30000
    retry_ms: int = 1000
    load_mode: str = "auto"
    sync_batches: str = "layer"
    load_start: str = "worker"
    fd_socket: Optional[str] = None
    kv_layout: str = "auto"
    mailbox: bool = True
    kv_cache_access: str = "auto"
    events: Optional[str] = None
    idle_wait_ms: int = 2

    @property
    def async_load(self) -> bool:
        """Every load asynchronous (load_mode "async")."""
        return self.load_mode == "async"

    @property
    def may_load_async(self) -> bool:
        """Some loads may be asynchronous (load_mode "async" or "auto")."""
        return self.load_mode != "sync"

    @property
    def per_layer_sync(self) -> bool:
        """A synchronous load lands one copy batch per layer (sync_batches "layer")."""
        return self.sync_batches == "layer"

    @property
    def idle_wait_s(self) -> float:
        return self.idle_wait_ms / 1000.0


#: load_mode's values.
LOAD_MODES = ("auto", "async", "sync")
#: sync_batches' values.
SYNC_BATCHES = ("layer", "grouped")
#: load_start's values.
LOAD_STARTS = ("worker", "scheduler")

_STR = ("address", "token", "instance", "model", "fd_socket", "events")
_BOOL = ("direct_gpu", "mailbox")
_POSITIVE_INT = ("deadline_ms", "connect_timeout_ms", "load_timeout_ms", "retry_ms")
#: Waits that may be off (0), bounded so a step never sleeps long.
_WAIT_MS = {"idle_wait_ms": 100}


def parse_extra_config(extra: Optional[Mapping[str, Any]]) -> KvferryConfig:
    """The settings in ``extra`` (``kv_connector_extra_config``), or :class:`ConfigError`."""
    extra = dict(extra or {})
    prefix = "kvferry: kv_connector_extra_config"
    unknown = sorted(k for k in extra if k not in KEYS)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise ConfigError(
            f"{prefix}: unknown key{'s' if len(unknown) > 1 else ''} {names}; "
            f"known keys: {', '.join(KEYS)}"
        )
    values: Dict[str, Any] = {}
    for key, value in extra.items():
        if key in _STR:
            if value is None:
                continue
            if not isinstance(value, str) or (key != "token" and not value.strip()):
                raise ConfigError(f"{prefix}: {key!r} must be a non-empty string, got {value!r}")
            values[key] = value.strip() if key != "token" else value
        elif key in _BOOL:
            if not isinstance(value, bool):
                raise ConfigError(f"{prefix}: {key!r} must be true or false, got {value!r}")
            values[key] = value
        elif key in _POSITIVE_INT:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(
                    f"{prefix}: {key!r} must be a positive integer (milliseconds), got {value!r}"
                )
            values[key] = value
        elif key in _WAIT_MS:
            most = _WAIT_MS[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
                raise ConfigError(
                    f"{prefix}: {key!r} must be an integer from 0 to {most} (milliseconds), "
                    f"got {value!r}"
                )
            values[key] = value
        elif key == "load_mode":
            if value not in LOAD_MODES:
                raise ConfigError(
                    f'{prefix}: "load_mode" must be "auto", "async" or "sync", got {value!r}'
                )
            values[key] = value
        elif key == "sync_batches":
            if value not in SYNC_BATCHES:
                raise ConfigError(
                    f'{prefix}: "sync_batches" must be "layer" or "grouped", got {value!r}'
                )
            values[key] = value
        elif key == "load_start":
            if value not in LOAD_STARTS:
                raise ConfigError(
                    f'{prefix}: "load_start" must be "worker" or "scheduler", got {value!r}'
                )
            values[key] = value
        elif key == "kv_cache_access":
            from .vmm import CHOICES

            choice = str(value).strip().lower().replace("-", "_")
            if choice not in CHOICES:
                raise ConfigError(
                    f"{prefix}: 'kv_cache_access' must be one of {', '.join(CHOICES)}, got "
                    f"{value!r}"
                )
            values[key] = choice
        elif key == "kv_layout":
            if value not in ("auto", "cross_layer"):
                raise ConfigError(
                    f'{prefix}: "kv_layout" must be "auto" or "cross_layer", got {value!r}'
                )
            values[key] = value
    inst = values.get("instance")
    if inst is not None and (
        len(inst) > 128 or not all(0x21 <= ord(ch) <= 0x7E for ch in inst)
    ):
        # The node's rule for instance names (model names, by contrast, are escaped).
        raise ConfigError(
            f"{prefix}: 'instance' must be 1 to 128 printable ASCII characters without "
            f"spaces, got {inst!r}"
        )
    ev = values.get("events")
    if ev is not None and not ev.startswith("tcp://"):
        raise ConfigError(f"{prefix}: 'events' must be tcp://host:port, got {ev!r}")
    if "address" not in values:
        raise ConfigError(
            f"{prefix}: 'address' is required: the node's engine service as host:port "
            '(its [engine] listen, e.g. {"address": "127.0.0.1:7200"})'
        )
    addr = values["address"]
    if addr.startswith(("http://", "https://")):
        addr = addr.split("://", 1)[1]
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{prefix}: 'address' must be host:port, got {values['address']!r}")
    values["address"] = addr
    known = {f.name for f in fields(KvferryConfig)}
    assert set(values) <= known
    return KvferryConfig(**values)
