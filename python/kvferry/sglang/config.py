"""The settings of kvferry's SGLang classes, checked when SGLang starts them.

The HiCache backend takes them from ``--hicache-storage-backend-extra-config`` (beside the
keys SGLang reads itself for a ``dynamic`` backend); the connector from its constructor.
Every key is listed in :data:`KEYS`; one that is not (a typo such as ``adress``) is refused
with :class:`ConfigError` naming it and the known ones. Nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional

from ..link import Timeouts

__all__ = ["ConfigError", "KEYS", "SGLANG_KEYS", "SglangConfig", "parse_config"]


class ConfigError(ValueError):
    """Settings the SGLang classes cannot run with (names the key)."""


#: key -> what it is (shown in error messages and the README).
KEYS: Dict[str, str] = {
    "address": "the node's engine service, host:port (its [engine] listen); default "
    "127.0.0.1:7200",
    "token": "the node's engine token ([engine] token), if it has one",
    "instance": "this engine's instance name on the node; the TP ranks of one engine must "
    "share it (default: sglang-<parent pid>, the same for every rank SGLang starts)",
    "model": "the model name blocks are shared under (default: SGLang's model path)",
    "lora": "the LoRA adapter the KV was computed with, if any (it salts every hash)",
    "deadline_ms": "deadline of each call to the node, in ms (default 1000)",
    "connect_timeout_ms": "how long connecting to the node may take, in ms (default 1000)",
    "load_timeout_ms": "a load not complete by then counts as failed (default 30000)",
    "retry_ms": "after the node failed, how long it is left alone before trying again, in "
    "ms; doubles up to 30 s while it keeps failing (default 1000)",
    "fd_socket": "the node's fd socket path where it differs from what the node announces",
    "share_wait_ms": "HiCache with TP > 1: how long a rank past 0 waits for rank 0's lease of "
    "a batch before it counts the batch as missed, in ms (default 2000)",
}

#: Keys of a ``dynamic`` HiCache backend's extra config that SGLang itself reads (and leaves
#: in the dict it hands the backend).
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")


@dataclass(frozen=True)
class SglangConfig(Timeouts):
    address: str = "127.0.0.1:7200"
    token: Optional[str] = None
    instance: Optional[str] = None
    model: Optional[str] = None
    lora: Optional[str] = None
    deadline_ms: int = 1000
    connect_timeout_ms: int = 1000
    load_timeout_ms: int = 30000
    retry_ms: int = 1000
    fd_socket: Optional[str] = None
    share_wait_ms: int = 2000

    @property
    def share_wait_s(self) -> float:
        return self.share_wait_ms / 1000.0


_MS = ("deadline_ms", "connect_timeout_ms", "load_timeout_ms", "retry_ms", "share_wait_ms")
_STR = ("address", "token", "instance", "model", "lora", "fd_socket")


def parse_config(extra: Optional[Mapping[str, Any]], *, sglang_keys: bool = False) -> SglangConfig:
    """The settings in ``extra`` (None: the defaults). ``sglang_keys``: also accept the keys
    SGLang reads itself (:data:`SGLANG_KEYS`)."""
    extra = dict(extra or {})
    known = set(KEYS) | (set(SGLANG_KEYS) if sglang_keys else set())
    for key in extra:
        if key not in known:
            raise ConfigError(
                f"kvferry.sglang: unknown setting {key!r}; known: {', '.join(sorted(known))}"
            )
    out: Dict[str, Any] = {}
    for key in _STR:
        v = extra.get(key)
        if v is None:
            continue
        if not isinstance(v, str) or not v:
            raise ConfigError(f"kvferry.sglang: {key} must be a non-empty string, got {v!r}")
        out[key] = v
    for key in _MS:
        v = extra.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 3_600_000:
            raise ConfigError(
                f"kvferry.sglang: {key} must be a whole number of ms in [1, 3600000], got {v!r}"
            )
        out[key] = v
    names = {f.name for f in fields(SglangConfig)}
    return SglangConfig(**{k: v for k, v in out.items() if k in names})
