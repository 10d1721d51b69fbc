"""One connection to the node that costs the engine hits, never a crash or a hang.

Every call has the configured deadline. When the node cannot be reached, answers too late
or breaks, the failure is logged once (then once a minute while it lasts), counted, and
the node is left alone for ``retry_ms`` (doubling up to 30 s while it keeps failing):
calls in that window fail at once with :class:`NodeDown` instead of waiting again. The
first call that works again logs that the node is back. Shared by the vLLM and SGLang
connectors; nothing here imports an engine.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["NodeDown", "NodeLink", "is_node_failure"]


MAX_RETRY_S = 30.0
# Codes that say the node (not the request) failed.
_NODE_CODES = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "UNKNOWN", "INTERNAL", "CANCELLED", "ABORTED"}


class Timeouts:
    """The seconds :class:`NodeLink` reads, from a connector config's ``*_ms`` fields
    (``deadline_ms``, ``connect_timeout_ms``, ``retry_ms``, ``load_timeout_ms``)."""

    deadline_ms: int
    connect_timeout_ms: int
    retry_ms: int
    load_timeout_ms: int

    @property
    def deadline_s(self) -> float:
        return self.deadline_ms / 1000.0

    @property
    def connect_timeout_s(self) -> float:
        return self.connect_timeout_ms / 1000.0

    @property
    def retry_s(self) -> float:
        return self.retry_ms / 1000.0

    @property
    def load_timeout_s(self) -> float:
        return self.load_timeout_ms / 1000.0


class NodeDown(Exception):
    """The node cannot be used now: it failed, or (``skipped``) it is left alone after
    failing and nothing was sent."""

    def __init__(self, message: str, skipped: bool = False):
        super().__init__(message)
        self.skipped = skipped


def is_node_failure(e: BaseException) -> bool:
    code = getattr(e, "code", None)
    if code is None:
        # Not a KvferryError: an OS error from the fd socket, a connection refused...
        return not isinstance(e, (ValueError, TypeError, LookupError))
    return code in _NODE_CODES


def default_factory(cfg: Any) -> Callable[[], Any]:
    def make() -> Any:
        import kvferry

        kwargs = dict(
            token=cfg.token or None,
            deadline_s=cfg.deadline_s,
            connect_timeout_s=cfg.connect_timeout_s,
        )
        if cfg.fd_socket:
            kwargs["fd_socket"] = cfg.fd_socket
        return kvferry.EngineClient(cfg.address, **kwargs)

    return make


class NodeLink:
    def __init__(
        self,
        cfg: Any,
        who: str,
        factory: Optional[Callable[[], Any]] = None,
        clock: Callable[[], float] = time.monotonic,
        on_failure: Optional[Callable[[str], None]] = None,
        mailbox_for: Optional[str] = None,
        logger: str = "kvferry.vllm",
    ):
        self.cfg = cfg
        #: The engine connector's logger (``kvferry.vllm``, ``kvferry.sglang``).
        self._log = logging.getLogger(logger)
        self.who = who
        #: The instance a request mailbox is attached for on each new connection (None:
        #: calls only).
        self._mailbox_for = mailbox_for
        #: The current client had a mailbox attached.
        self._had_mailbox = False
        self._factory = factory or default_factory(cfg)
        self._clock = clock
        self._lock = threading.Lock()
        self._client: Any = None
        self._retry_at = 0.0
        self._retry_s = 0.0
        self._down_since: Optional[float] = None
        self._last_log = -1e18
        self._on_failure = on_failure
        #: Incremented by every connection made: a new one may face a restarted node.
        self.generation = 0

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def resting(self) -> bool:
        """True while a failed node is left alone (calls would fail at once)."""
        return self._clock() < self._retry_at

    def connection_lost(self) -> bool:
        """True once the current connection is known to be gone without a call failing: its
        request mailbox's session ended (the node died, stopped or restarted). A call made
        now fails at once, or reconnects."""
        with self._lock:
            c = self._client
            return c is not None and self._had_mailbox and not getattr(c, "has_mailbox", True)

    def client(self) -> Any:
        """The client, connecting if needed; NodeDown while the node is left alone."""
        with self._lock:
            if self._clock() < self._retry_at:
                raise NodeDown(f"kvferry node {self.cfg.address}: retrying later", skipped=True)
            if self._had_mailbox and not getattr(self._client, "has_mailbox", True):
                # Its mailbox's session ended (the node stopped or restarted): the client
                # still works through calls, but a new connection attaches a new mailbox.
                self._log.info("kvferry (%s): the request mailbox is gone; reconnecting", self.who)
                self._client = None
            if self._client is None:
                self._had_mailbox = False
                try:
                    self._client = self._factory()
                    self.generation += 1
                    self._attach_mailbox(self._client)
                except Exception as e:  # noqa: BLE001 - any failure to connect is the node's
                    self._failed_locked("connect", e, drop=True)
                    raise NodeDown(str(e)) from e
            return self._client

    def _attach_mailbox(self, client: Any) -> None:
        """Queries and loads through a request mailbox where the config asks for one (the
        default) and the node takes it; the calls otherwise, which work the same."""
        if self._mailbox_for is None or not getattr(self.cfg, "mailbox", False):
            return
        attach = getattr(client, "attach_mailbox", None)
        if attach is None:
            return
        try:
            self._had_mailbox = bool(attach(self._mailbox_for))
            if not self._had_mailbox:
                self._log.info(
                    "kvferry (%s): the node takes no request mailbox; calls only", self.who
                )
        except Exception as e:  # noqa: BLE001 - the calls still serve without one
            self._log.warning("kvferry (%s): no request mailbox (%s); calls only", self.who, e)

    def call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)``; a node failure becomes NodeDown (logged, counted, backed off);
        other errors (NotFound, InvalidArgument...) are raised as they are."""
        c = self.client()
        try:
            out = fn(c)
        except Exception as e:  # noqa: BLE001
            if is_node_failure(e):
                with self._lock:
                    drop = getattr(e, "code", None) in (None, "UNAVAILABLE")
                    self._failed_locked(what, e, drop=drop)
                raise NodeDown(str(e)) from e
            raise
        if self._down_since is not None:
            with self._lock:
                if self._down_since is not None:
                    self._log.warning(
                        "kvferry (%s): the node at %s answers again after %.1f s",
                        self.who,
                        self.cfg.address,
                        self._clock() - self._down_since,
                    )
                    self._down_since = None
                    self._retry_s = 0.0
        return out

    def _failed_locked(self, what: str, e: BaseException, drop: bool) -> None:
        now = self._clock()
        if drop:
            self._client = None
        self._retry_s = min(MAX_RETRY_S, max(self.cfg.retry_s, self._retry_s * 2))
        self._retry_at = now + self._retry_s
        first = self._down_since is None
        if first:
            self._down_since = now
        if first or now - self._last_log >= 60.0:
            self._last_log = now
            self._log.warning(
                "kvferry (%s): the node at %s failed (%s: %s); kvferry hits are off, next try "
                "in %.1f s",
                self.who,
                self.cfg.address,
                what,
                e,
                self._retry_s,
            )
        if self._on_failure is not None:
            self._on_failure(what)
