"""One SGLang rank's KV as a kvferry instance rank: registered once, then queried, loaded
into, saved from, with every call bounded by a deadline.

A node that is down, slow or restarted costs hits, never an exception out of SGLang's
hooks: each failure is logged (once, then once a minute while it lasts, by
:class:`kvferry.link.NodeLink`), counted in :attr:`RankKv.counters`, and answered as a miss
(zero hits, a failed page). A node that restarted and forgot the instance is registered with
again on the next call. Nothing here imports SGLang.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import KvferryError
from ..layout import register_tensors
from ..link import NodeDown, NodeLink
from ..namespace import keeps_tenants, model_namespace, tenant_part
from .config import SglangConfig
from .layouts import PoolLayout

__all__ = ["COUNTERS", "RankKv"]

log = logging.getLogger("kvferry.sglang")

#: What :attr:`RankKv.counters` counts.
COUNTERS = (
    "node_failures",  # calls that failed because of the node (down, slow, broken)
    "queries",
    "query_blocks",  # blocks asked about
    "hit_blocks",  # blocks the node held
    "loads",
    "loaded_blocks",
    "load_failures",  # loads that failed or did not complete by load_timeout_ms
    "parked_loads",  # loads given up on whose slots waited for their end (radix cache)
    "cancelled_loads",  # loads given up on that the node was asked to stop (CancelLoad)
    "saves",
    "saved_blocks",
    "save_failures",
    "registrations",
    "share_failures",  # queries whose answer from TP rank 0 did not reach this rank
)


class RankKv:
    """``rank`` of ``instance`` (of ``tp_size`` ranks) on the node of ``cfg``, its KV the
    planes of ``layout``. ``device``: the node's device ordinal of the memory (0 for host
    memory). ``link``: a :class:`NodeLink` (tests pass their own)."""

    def __init__(
        self,
        cfg: SglangConfig,
        *,
        instance: str,
        rank: int,
        tp_size: int,
        model: str,
        layout: PoolLayout,
        device: int = 0,
        who: str = "sglang",
        link: Optional[NodeLink] = None,
        client_factory: Optional[Callable[[], Any]] = None,
        board_slots: int = 0,
    ):
        self.cfg = cfg
        self.instance = instance
        self.rank = rank
        self.tp_size = tp_size
        self.model = model
        self.layout = layout
        self.device = device
        self.counters: Dict[str, int] = {k: 0 for k in COUNTERS}
        self.link = link or NodeLink(
            cfg, who, client_factory, on_failure=self._node_failed, logger="kvferry.sglang"
        )
        self.namespace: Optional[str] = None
        # Whether the node keeps tenants apart (protocol 9), asked with the first LoRA request.
        self._tenants: Optional[bool] = None
        self._generation = -1
        #: The completion board of the current registration (None: the node has none, or
        #: ``board_slots`` is 0); loads naming its slots report each layer landing to it.
        self.board: Any = None
        self.board_slots = board_slots
        #: Incremented by every registration: board slots of an earlier one are void.
        self.registration = 0

    def _node_failed(self, what: str) -> None:
        self.counters["node_failures"] += 1

    def _open_board(self, client: Any) -> Any:
        if not self.board_slots or not hasattr(client, "open_board"):
            return None
        try:
            return client.open_board(self.instance, self.rank, self.board_slots)
        except Exception as e:  # noqa: BLE001 - loads are polled without one
            log.info("kvferry: %s rank %d: no completion board (%s); loads are polled",
                     self.instance, self.rank, e)
            return None

    def _register(self, client: Any) -> None:
        board = self._open_board(client)
        self.namespace = register_tensors(
            client,
            self.instance,
            model_namespace(self.model),
            self.layout.dtype,
            rank=self.rank,
            tp_size=self.tp_size,
            device=self.device,
            board=board,
            **self.layout.register_kwargs(),
        )
        self.board = board
        self.registration += 1
        self.counters["registrations"] += 1
        self._generation = self.link.generation
        log.info(
            "kvferry: %s rank %d of %d registered (namespace %s, %d pages of %d tokens, "
            "layout tag %s)", self.instance, self.rank, self.tp_size, self.namespace,
            self.layout.num_blocks, self.layout.page_size, self.layout.tag,
        )

    def register(self) -> bool:
        """Registers with the node now; False (logged, counted) where the node cannot be
        reached. A layout or request the node refuses raises (the engine must not start
        believing it is cached)."""
        try:
            self.link.call("register", self._register)
            return True
        except NodeDown:
            return False

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)``, registering first on a new connection and again once if the node
        no longer knows the instance. NodeDown where the node failed."""

        def go(client: Any) -> Any:
            if self._generation != self.link.generation or self.namespace is None:
                self._register(client)
            try:
                return fn(client)
            except KvferryError as e:
                if getattr(e, "code", None) != "NOT_FOUND" or "instance" not in str(e):
                    raise
                log.warning("kvferry: the node forgot %s (restarted?); registering again",
                            self.instance)
                self._register(client)
                return fn(client)

        return self.link.call(what, go)

    def tenant(self, lora_id: Optional[str]) -> Optional[str]:
        """The node tenant of a request of SGLang's LoRA adapter ``lora_id`` (escaped), where
        the node keeps tenants apart (protocol 9); None without an adapter, or where an older
        node keeps the adapter's pages among the model's (their hashes, salted with the
        adapter, still never meet another's)."""
        if not lora_id:
            return None
        if self._tenants is None:
            try:
                caps = self.link.call("capabilities", lambda c: c.capabilities())
            except (NodeDown, KvferryError) as e:
                log.debug("kvferry: capabilities of the node failed: %s", e)
                return None  # asked again with the next adapter request
            self._tenants = keeps_tenants(caps, log, "pages")
        return tenant_part(str(lora_id)) if self._tenants else None

    def query(self, hashes: Sequence[bytes],
              tenant: Optional[str] = None) -> Tuple[Optional[str], int]:
        """(lease, blocks held): the longest prefix of ``hashes`` the node holds (of
        ``tenant``'s namespace, see :meth:`tenant`), leased for ``tp_size`` consumes; (None,
        0) on a miss or a node failure."""
        if not hashes:
            return None, 0
        self.counters["queries"] += 1
        self.counters["query_blocks"] += len(hashes)
        kw = {"tenant": tenant} if tenant else {}
        try:
            q = self._call("query", lambda c: c.query(self.instance, list(hashes), **kw))
        except (NodeDown, KvferryError) as e:
            if not isinstance(e, NodeDown):
                log.warning("kvferry: query of %d blocks refused: %s", len(hashes), e)
            return None, 0
        n = int(q["local_blocks"]) + int(q["ssd_blocks"]) + int(q["remote_blocks"])
        self.counters["hit_blocks"] += n
        return q["lease"], n

    def release(self, lease: Optional[str]) -> None:
        if lease is None:
            return
        try:
            self.link.call("release", lambda c: c.release(lease))
        except (NodeDown, KvferryError):
            pass  # the lease expires on the node

    def load(self, lease: str, dest_blocks: Sequence[int]) -> int:
        """Loads this rank's share of ``lease`` into ``dest_blocks`` (one per leased block,
        in prefix order) and waits for it; returns how many leading blocks landed (all of
        them, or those before the first failed one; 0 on a node failure)."""
        self.counters["loads"] += 1
        dest = list(dest_blocks)
        try:
            load_id = self._call(
                "load", lambda c: c.load(lease, self.instance, self.rank, dest)
            )
            done = self.link.call(
                "wait_load", lambda c: c.wait_load(load_id, self.cfg.load_timeout_s)
            )
        except (NodeDown, KvferryError) as e:
            self.counters["load_failures"] += 1
            if not isinstance(e, NodeDown):
                log.warning("kvferry: load of %d blocks failed: %s", len(dest), e)
            return 0
        if done["ok"]:
            self.counters["loaded_blocks"] += len(dest)
            return len(dest)
        self.counters["load_failures"] += 1
        good = landed_of(done, dest)
        log.warning("kvferry: load of %d blocks failed (%s: %s); %d landed before the first "
                    "failed one", len(dest), done.get("error_kind"), done.get("error"), good)
        self.counters["loaded_blocks"] += good
        return good

    def start_load(self, lease: str, dest_blocks: Sequence[int],
                   board: Optional[Tuple[int, int]] = None) -> Optional[int]:
        """Starts this rank's load of ``lease`` into ``dest_blocks``, reporting to board
        slot and tag ``board`` where given; its load id, or None (logged, counted) where it
        could not start."""
        self.counters["loads"] += 1
        dest = list(dest_blocks)

        def go(c: Any) -> Any:
            if board is None:
                return c.load(lease, self.instance, self.rank, dest)
            return c.load(lease, self.instance, self.rank, dest, board_slot=board[0],
                          board_tag=board[1])

        try:
            return self._call("load", go)
        except (NodeDown, KvferryError) as e:
            self.counters["load_failures"] += 1
            if not isinstance(e, NodeDown):
                log.warning("kvferry: load of %d blocks refused: %s", len(dest), e)
            return None

    def cancel_load(self, load_id: int) -> bool:
        """Asks the node to stop load ``load_id`` (given up on): it copies nothing more and
        ends failed soon, so its slots come back sooner. True where it was still running;
        False too where the node cannot be asked (down, or older than protocol 9)."""
        try:
            running = bool(self.link.call(
                "cancel_load", lambda c: c.cancel_load(self.instance, self.rank, load_id)))
        except (NodeDown, KvferryError) as e:
            log.debug("kvferry: cancel of load %d: %s", load_id, e)
            return False
        if running:
            self.counters["cancelled_loads"] += 1
        return running

    def poll_load(self, load_id: int) -> Optional[dict]:
        """The completion of ``load_id``, None while it runs; a failed one where the node
        cannot answer."""
        try:
            return self.link.call("poll_load", lambda c: c.poll_load(load_id))
        except (NodeDown, KvferryError) as e:
            return {"ok": False, "error_kind": "node", "error": str(e), "failed_blocks": []}

    def save(self, hashes: Sequence[bytes], src_blocks: Sequence[int],
             tenant: Optional[str] = None) -> bool:
        """Copies ``src_blocks`` into the node's blocks ``hashes`` (of ``tenant``'s
        namespace); False (logged, counted) where it did not happen."""
        if not hashes:
            return True
        self.counters["saves"] += 1
        kw = {"tenant": tenant} if tenant else {}
        try:
            self._call(
                "save", lambda c: c.save(self.instance, self.rank, list(hashes),
                                         list(src_blocks), **kw)
            )
        except (NodeDown, KvferryError) as e:
            self.counters["save_failures"] += 1
            if not isinstance(e, NodeDown):
                log.warning("kvferry: save of %d blocks failed: %s", len(hashes), e)
            return False
        self.counters["saved_blocks"] += len(hashes)
        return True

    def unregister(self) -> None:
        try:
            self.link.call("unregister", lambda c: c.unregister(self.instance))
        except (NodeDown, KvferryError):
            pass


def page_blocks(host_indices: Any, page_size: int, pages: int) -> List[int]:
    """The page (block) index of each of the first ``pages`` pages of ``host_indices`` (token
    slot indices, ``page_size`` per page, each page's first slot a multiple of
    ``page_size``); a page that is not so aligned, or missing, ends the list early."""
    firsts = host_indices[::page_size][:pages]
    firsts = firsts.tolist() if hasattr(firsts, "tolist") else list(firsts)
    out: List[int] = []
    for t in firsts:
        t = int(t)
        if t < 0 or t % page_size:
            break
        out.append(t // page_size)
    return out


def landed_of(done: Any, dest: Sequence[int]) -> int:
    """How many leading blocks of ``dest`` a load's completion ``done`` says landed."""
    if done.get("ok"):
        return len(dest)
    failed = set(done.get("failed_blocks") or ())
    return next((i for i, b in enumerate(dest) if b in failed), 0)
