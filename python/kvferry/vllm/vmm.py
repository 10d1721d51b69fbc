"""How the connector reaches vLLM's device KV cache: vLLM 0.34's ``kv_cache_access``.

vLLM 0.34 allocates the KV cache as an *extensible* VMM reservation (``cuMemCreate`` /
``cuMemMap``) by default on CUDA, memory that a CUDA IPC handle cannot name, and asks each
connector class how its workers reach that memory (``KVConnectorBase_V1.kv_cache_access``,
flags of ``vllm.config.kv_transfer.KVCacheAccess``). kvferry's node maps the KV of an
engine worker in its own process, so the connector declares either

- ``EXPORTS_FD`` (the default where the driver can export VMM allocations): vLLM then
  creates every physical chunk exportable as a POSIX fd and backs each segment (a layer's
  region, or the whole cache for block-outermost layouts) with exactly one chunk once the
  cache has its final size; kvferry exports each segment's fd (:mod:`kvferry.vmm`) and sends
  it on the fd socket, where the node maps it. vLLM keeps its default cache; or
- ``LEGACY_IPC``: vLLM turns the extensible cache off and allocates through PyTorch's caching
  allocator, whose blocks go by CUDA IPC handle as before vLLM 0.34. This is the fallback
  (logged) where the driver cannot export VMM allocations, and the choice for deployments
  that turn the extensible cache off anyway: with ``EXPORTS_FD`` vLLM refuses to start when
  ``kv_cache_memory_bytes`` or ``num_gpu_blocks_override`` is set, or the extensible cache is
  disabled (``--no-enable-extensible-kv-cache``), because those sizings cannot give a
  connector the fds it declared.

The choice is ``kv_connector_extra_config["kv_cache_access"]``: ``"auto"`` (default),
``"exports_fd"`` or ``"legacy_ipc"``. Nothing here imports vLLM: :func:`supported_access`
returns flag names, which :func:`as_flags` turns into the release's own ``KVCacheAccess``.

The connector uses it as::

    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        from vllm.config.kv_transfer import KVCacheAccess
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
        return vmm.as_flags(vmm.supported_access(extra), KVCacheAccess)

(only on releases that have ``KVCacheAccess``; earlier ones never call it). On
``unregister_kv_caches`` (sleep, a weight update) the connector must unregister the instance
from the node: vLLM then releases the physical memory and maps fresh chunks on
``restore_kv_caches``, where it registers again, exporting the new fds; a node still holding
the old chunks would load into memory vLLM no longer reads.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Iterable, Mapping, Optional, Tuple

from .. import vmm as _vmm

__all__ = ["ACCESS_KEY", "CHOICES", "as_flags", "supported_access"]

log = logging.getLogger("kvferry.vllm")

#: The ``kv_connector_extra_config`` key that picks the access mode.
ACCESS_KEY = "kv_cache_access"
CHOICES = ("auto", "exports_fd", "legacy_ipc")


@functools.lru_cache(maxsize=None)
def _log_fallback(reason: str) -> None:
    log.warning(
        "kvferry: vLLM's extensible KV cache cannot be shared with the node by fd (%s); "
        "declaring LEGACY_IPC, which makes vLLM allocate the KV cache without it",
        reason,
    )


def supported_access(extra_config: Optional[Mapping[str, Any]] = None) -> Tuple[str, ...]:
    """The ``KVCacheAccess`` flag names the connector declares (see the module doc):
    ``("EXPORTS_FD",)`` or ``("LEGACY_IPC",)``. A value of ``kv_cache_access`` outside
    :data:`CHOICES` is a ``ValueError`` naming it, at engine start."""
    raw = (extra_config or {}).get(ACCESS_KEY, "auto")
    choice = str(raw).strip().lower().replace("-", "_")
    if choice not in CHOICES:
        raise ValueError(
            f"kv_connector_extra_config[{ACCESS_KEY!r}] = {raw!r}: expected one of "
            f"{', '.join(CHOICES)}"
        )
    if choice == "legacy_ipc":
        log.info(
            "kvferry: %s = legacy_ipc: vLLM allocates the KV cache without its extensible "
            "(VMM) cache, shared by CUDA IPC handle",
            ACCESS_KEY,
        )
        return ("LEGACY_IPC",)
    if choice == "exports_fd":
        return ("EXPORTS_FD",)
    why_not = _vmm.available()
    if why_not is not None:
        _log_fallback(why_not)
        return ("LEGACY_IPC",)
    return ("EXPORTS_FD",)


def as_flags(names: Iterable[str], flags: Any) -> Any:
    """``names`` as one value of the flag class ``flags`` (vLLM's ``KVCacheAccess``); a
    name the release lacks is a ``ValueError`` naming it."""
    out = flags(0)
    for name in names:
        try:
            out |= flags[name]
        except KeyError:
            raise ValueError(
                f"this vLLM's {getattr(flags, '__name__', 'KVCacheAccess')} has no {name} "
                f"(it has {', '.join(m.name for m in flags)})"
            ) from None
    return out
