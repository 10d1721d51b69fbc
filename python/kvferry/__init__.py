"""kvferry: the Python client of a kvferry node.

::

    import kvferry
    client = kvferry.EngineClient("127.0.0.1:7200")
    client.capabilities()

:class:`EngineClient` is kvferry's Rust engine client (one implementation for Rust and
Python), with the GIL released while it waits. Failures raise :class:`KvferryError`
subclasses (:mod:`kvferry.errors`). :mod:`kvferry.torch` registers torch tensors (CPU by
memfd, CUDA by IPC handle or, for VMM allocations, by fd: :mod:`kvferry.vmm`) in the KV
layouts engines allocate; :mod:`kvferry.layout` holds the layout logic without torch.
"""

from ._native import (
    DEFAULT_DEADLINE_S,
    CompletionBoard,
    EngineClient,
    Session,
    __version__,
)
from .errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    FdSocketError,
    InvalidArgument,
    KvferryError,
    LayoutError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from .layout import KvLayout, KvPlanes, describe_layout, register_kv, register_tensors

__all__ = [
    "DEFAULT_DEADLINE_S",
    "EngineClient",
    "Session",
    "CompletionBoard",
    "__version__",
    "KvferryError",
    "InvalidArgument",
    "LayoutError",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Unavailable",
    "DeadlineExceeded",
    "Unauthenticated",
    "FdSocketError",
    "KvLayout",
    "KvPlanes",
    "describe_layout",
    "register_kv",
    "register_tensors",
]
