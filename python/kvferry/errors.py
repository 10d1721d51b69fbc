"""Typed exceptions of the kvferry client.

Every failure of a call to the node raises a :class:`KvferryError` subclass chosen by the
gRPC status code: ``.code`` holds the code's name (``"NOT_FOUND"``) and ``.method`` the
client method that failed (``"query"``). A node that cannot be reached raises
:class:`Unavailable`; a call that ran past its deadline :class:`DeadlineExceeded`.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
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
]


class KvferryError(Exception):
    """A kvferry call failed. ``code``: gRPC code name; ``method``: the client method."""

    code: Optional[str]
    method: Optional[str]

    def __init__(self, message: str, code: Optional[str] = None, method: Optional[str] = None):
        super().__init__(message)
        self.code = code
        self.method = method

    def __reduce__(self):
        return (type(self), (str(self), self.code, self.method))


class InvalidArgument(KvferryError, ValueError):
    """The node (or this client, before sending) refused malformed input."""


class LayoutError(InvalidArgument):
    """Tensors that do not describe a KV layout kvferry can register (names the layer)."""

    def __init__(self, message: str, layer: Optional[int] = None):
        super().__init__(message, "INVALID_ARGUMENT", "layout")
        self.layer = layer

    def __reduce__(self):
        return (type(self), (str(self), self.layer))


class NotFound(KvferryError, LookupError):
    """Unknown lease, instance, rank, memory handle or load id."""


class AlreadyExists(KvferryError):
    """The instance (or rank) is already registered."""


class PermissionDenied(KvferryError):
    """A memory handle or lease of another instance."""


class ResourceExhausted(KvferryError):
    """Over a node limit (message size, hashes, pool space)."""


class FailedPrecondition(KvferryError):
    """The node cannot do this now or here (a device that cannot map the memory)."""


class Unavailable(KvferryError):
    """The node cannot be reached, or the connection broke."""


class DeadlineExceeded(KvferryError):
    """No answer within the deadline (or no completion within a wait's timeout)."""


class Unauthenticated(KvferryError):
    """Missing or wrong engine token."""


class FdSocketError(KvferryError):
    """The node's fd socket (memory passed as file descriptors) failed."""


_BY_CODE = {
    "INVALID_ARGUMENT": InvalidArgument,
    "OUT_OF_RANGE": InvalidArgument,
    "NOT_FOUND": NotFound,
    "ALREADY_EXISTS": AlreadyExists,
    "PERMISSION_DENIED": PermissionDenied,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "FAILED_PRECONDITION": FailedPrecondition,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "UNAUTHENTICATED": Unauthenticated,
}


def _from_native(kind: str, code: str, method: str, message: str) -> KvferryError:
    """Called by ``kvferry._native`` to build the exception it raises."""
    cls = FdSocketError if kind == "fd_socket" else _BY_CODE.get(code, KvferryError)
    return cls(message, code, method)
