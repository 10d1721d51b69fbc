"""The worker half of the connector: registration, loads and saves of one TP rank.

Importable and usable without vLLM (and without a GPU): it takes the ``{layer: tensor}``
dict vLLM gives ``register_kv_caches`` and the :class:`~kvferry.vllm.metadata.StepMetadata`
the scheduler half builds, so its GPU half is tested where vLLM is not installed.

Nothing here blocks vLLM's forward pass on the node: loads are started and watched by a
loader thread, saves run on a saver thread, each call with the configured deadline and
each load with ``load_timeout_ms``. With CUDA KV, a CUDA event recorded on the current
stream orders the node's copies after the kernels that wrote or freed the blocks. A load
that fails (node down, killed mid-load, timed out, lease lost) reports exactly its failed
destination blocks through ``get_block_ids_with_load_errors``, in the step whose
``get_finished`` reports the request, so vLLM recomputes them. A node that restarts is
registered with again (the rank's KV re-sent) by the next load or save.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from .config import KvferryConfig
from .kvcache import RankLayout, describe_kv_caches, device_ordinal, register_rank
from .link import NodeDown, NodeLink
from .metadata import BOARD_SLOTS, EARLY_SLOTS, LoadSpec, SaveSpec, StepMetadata
from .namespace import model_namespace
from .stats import Counters

__all__ = ["RegistrationRefused", "WorkerSide"]

log = logging.getLogger("kvferry.vllm")

_STOP = object()

#: How often an idle worker checks that the node still knows its instance.
PROBE_S = 5.0
PROBE_HASH = b"kvferry-vllm-probe"


#: A load the board shows running is still asked about this often: a node that died (or
#: whose connection dropped) writes no final word, and is noticed by the call failing.
LIVENESS_S = 0.25
#: A board wait for this many layers returns at the load's end.
ALL_LAYERS = 0xFFFFFFFF


class RegistrationRefused(RuntimeError):
    """The node refused this rank's registration at engine start; the message says why."""


@dataclass
class _Load:
    spec: LoadSpec
    event: Any
    started: float
    load_id: Optional[int] = None
    deadline: float = 0.0
    #: The completion board slot and tag the load reports to (None: no board).
    slot: Optional[int] = None
    tag: int = 0
    #: Reported (to ``_done``): by the loader, or by the thread that saw its end first.
    finished: bool = False
    #: When the node was last asked about it (or it started).
    checked: float = 0.0
    #: Started by the scheduler, in one of the board's EARLY_SLOTS (never the worker's).
    early: bool = False


@dataclass(eq=False)
class _SaveItem:
    spec: SaveSpec
    event: Any
    #: Not to be sent: its request was preempted and its blocks may be reused already.
    cancelled: bool = False


@dataclass
class _Started:
    """A load started by :meth:`WorkerSide.start_load` itself, for the loader to watch."""

    ld: _Load


@dataclass
class _Done:
    req_id: str
    sync: bool
    failed: Set[int]
    #: When it was reported (the worker's clock): from then on get_finished reports it.
    at: float = 0.0


class WorkerSide:
    def __init__(
        self,
        cfg: KvferryConfig,
        *,
        instance: str,
        model: str,
        kv_dtype: str,
        tp_rank: int,
        tp_size: int,
        num_blocks: int,
        backend: str = "",
        client_factory: Optional[Callable[[], Any]] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.instance = instance
        self.model = model
        #: The model as the node's namespace names it (any model name, escaped).
        self.model_ns = model_namespace(model)
        self._refused: Optional[str] = None
        # vLLM released the KV cache's memory (unregister_kv_caches); the node may still
        # hold the old registration where unregistering it failed.
        self._released = False
        self._stale = False
        self.kv_dtype = kv_dtype
        self.rank = tp_rank
        self.tp_size = tp_size
        self.num_blocks = num_blocks
        self.backend = backend
        self.counters = Counters()
        self.link = NodeLink(
            cfg, f"worker rank {tp_rank}", client_factory, clock, mailbox_for=instance
        )
        self._clock = clock
        self.layout: Optional[RankLayout] = None
        self.namespace: Optional[str] = None
        self._sessions: List[Any] = []
        self._last_probe = clock()
        self._reg_lock = threading.Lock()
        self._registered = False
        self._cuda = False

        self._lock = threading.Condition()
        self._done: List[_Done] = []
        self._errors: Set[int] = set()
        self._sync_outstanding = 0
        self._save_pending: Dict[str, int] = {}
        # Requests handed saves (vLLM delays freeing their blocks until reported).
        self._save_reqs: Set[str] = set()
        self._finishing: Set[str] = set()
        # Saves handed over and not yet sent, by request; the request of the one being sent.
        self._queued_saves: Dict[str, List[_SaveItem]] = {}
        self._saving_now: Optional[str] = None

        # The completion board (node protocol 3, board version 2): loads' layers seen landing
        # and their outcome without an RPC (a failure's details are polled for); None where
        # the node has none (older nodes, fake clients).
        self._board: Any = None
        self._board_tag = 0
        self._board_free: List[int] = []
        # This step's synchronous loads once started, for wait_for_layer_load.
        self._sync_started: List[_Load] = []
        # Asynchronous loads the node took with a board slot and not reported yet: vLLM's
        # own thread reads their end from the board in get_finished, so a load's end does
        # not wait for the loader thread to get the GIL back from a busy engine loop.
        self._async_on_board: Dict[int, _Load] = {}
        # Whether the step now running is one without a forward (StepMetadata.idle).
        self._idle_step = False
        self._sync_begun = 0
        self._layer_index: Dict[str, int] = {}

        self._load_q: "queue.Queue[Any]" = queue.Queue()
        self._save_q: "queue.Queue[Any]" = queue.Queue()
        self._threads: List[threading.Thread] = []

    # ---------------------------------------------------------------- registration

    @property
    def registered(self) -> bool:
        """Whether the node holds this rank's registration, as far as this rank knows."""
        return self._registered

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> RankLayout:
        """Detects the layout (raises :class:`~kvferry.vllm.kvcache.KvCacheLayoutError`
        naming the layer for tensors kvferry cannot register) and registers it; a node that
        is down is registered with later, and a registration the node refuses raises
        :class:`RegistrationRefused` (the engine does not start)."""
        self.layout = describe_kv_caches(kv_caches, self.num_blocks, self.backend)
        self._cuda = self.layout.device.startswith("cuda")
        self._layer_index = {lp.name: i for i, lp in enumerate(self.layout.layers)}
        log.info(
            "kvferry: rank %d KV: %d layers, %s, %d segment(s) of %d bytes, block stride %d, "
            "%d blocks on %s%s",
            self.rank, len(self.layout.layers), self.layout.kind, self.layout.segments,
            self.layout.segment_bytes, self.layout.block_stride, self.layout.num_blocks,
            self.layout.device,
            f" ({len(self.layout.shared)} shared layers)" if self.layout.shared else "",
        )
        self._ensure_registered(at_start=True)
        self._start_threads()
        return self.layout

    def _ensure_registered(self, at_start: bool = False) -> bool:
        if self._registered:
            return True
        assert self.layout is not None
        with self._reg_lock:
            if self._registered:
                return True
            if self._released:
                # vLLM released the KV cache's memory: nothing to register until it is back.
                return False
            try:
                ns = self.link.call("register", self._register)
            except NodeDown:
                return False
            except Exception as e:  # noqa: BLE001
                if getattr(e, "code", None) == "ALREADY_EXISTS":
                    self._registered = True
                    return True
                why = (
                    f"kvferry: rank {self.rank}: the node at {self.cfg.address} refused to "
                    f"register instance {self.instance!r} (model {self.model!r}, namespace "
                    f"model {self.model_ns!r}): {e}"
                )
                if at_start:
                    raise RegistrationRefused(why) from e
                # Later (a restarted node, say): every load and save tries again; said once
                # per reason, not once per step.
                self.counters.add("registration_refusals")
                if why != self._refused:
                    self._refused = why
                    log.error("%s; kvferry hits are off until it accepts", why)
                return False
            self._refused = None
            self.namespace = ns
            self._registered = True
            self.counters.add("registrations")
            log.info(
                "kvferry: rank %d registered as %s on %s (model %s, namespace %s)",
                self.rank, self.instance, self.cfg.address, self.model, ns,
            )
            return True

    def release(self) -> None:
        """vLLM 0.33+'s ``unregister_kv_caches`` (sleep, or a weight update that borrows the
        KV cache's memory; vLLM drained the transfers first): the memory goes, so the node
        forgets the instance (it would load into memory vLLM no longer reads) and nothing
        registers it again until :meth:`restore`. Every rank calls it; the first one's
        unregister removes the instance, the others find it gone."""
        with self._reg_lock:
            self._released = True
            self._registered = False
            self._unregister("release")

    def restore(self) -> None:
        """vLLM 0.33+'s ``restore_kv_caches``: the KV cache has memory again (new physical
        memory behind the same tensors), registered afresh (a refusal is logged, not
        raised: vLLM is waking up)."""
        with self._reg_lock:
            self._released = False
            if self._stale:
                self._unregister("restore")
        if self.layout is not None:
            self._ensure_registered()

    def _unregister(self, why: str) -> None:
        try:
            self.link.call("unregister", lambda c: c.unregister(self.instance))
            self._stale = False
        except Exception as e:  # noqa: BLE001
            if getattr(e, "code", None) == "NOT_FOUND":
                self._stale = False
                return
            self._stale = True
            log.warning(
                "kvferry: rank %d: unregistering %s (%s) failed: %s; tried again when vLLM "
                "restores its KV cache", self.rank, self.instance, why, e,
            )

    def _open_board(self, client: Any) -> Any:
        """A completion board for this registration, or None where the node (or a fake
        client) has none: loads are then watched by polling alone."""
        if not hasattr(client, "open_board"):
            return None
        try:
            return client.open_board(self.instance, self.rank, BOARD_SLOTS)
        except Exception as e:  # noqa: BLE001
            log.info("kvferry: rank %d: no completion board (%s); polling loads", self.rank, e)
            return None

    def _register(self, client: Any) -> str:
        assert self.layout is not None
        board = self._open_board(client)
        ns = register_rank(
            client,
            self.layout,
            instance=self.instance,
            model=self.model_ns,
            # The element order inside a block joins the namespace: engines that lay the
            # same block out differently never share it.
            dtype_name=f"{self.kv_dtype};{self.layout.element_order}",
            rank=self.rank,
            tp_size=self.tp_size,
            device=device_ordinal(self.layout) if self._cuda else 0,
            board=board,
        )
        with self._lock:
            self._board = board
            # The last EARLY_SLOTS are the scheduler's (load_start "scheduler").
            own = 0 if board is None else board.slots - (
                EARLY_SLOTS if board.slots == BOARD_SLOTS else 0)
            self._board_free = list(range(own))
        # A session ties the registration to this process: when it ends, the node
        # unregisters the instance. Earlier sessions stay open (closing one that is still
        # alive would unregister what was just registered); they go at shutdown.
        try:
            self._sessions.append(client.open_session([self.instance]))
        except Exception as e:  # noqa: BLE001
            log.debug("kvferry: rank %d: no session: %s", self.rank, e)
        return ns

    def _lost_registration(self, e: BaseException) -> None:
        if isinstance(e, NodeDown) or getattr(e, "code", None) == "NOT_FOUND":
            self._registered = False

    # ---------------------------------------------------------------- threads

    def _start_threads(self) -> None:
        if self._threads:
            return
        for name, target in (("loads", self._loader), ("saves", self._saver)):
            t = threading.Thread(
                target=target, name=f"kvferry-{name}-r{self.rank}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def _record_event(self) -> Any:
        if not self._cuda:
            return None
        import torch

        assert self.layout is not None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(torch.device(self.layout.device)))
        return ev

    # ---------------------------------------------------------------- loads

    def start_load(self, meta: Optional[StepMetadata]) -> None:
        """Hands this step's loads to the loader thread and returns at once. Synchronous
        loads (load_mode "sync"; vLLM runs this step's forward on them) are started here
        with a completion board, and ``wait_for_layer_load`` waits for each layer; without
        one they finish before this returns."""
        if meta is None or not meta.loads or self.layout is None:
            if meta is not None and meta.loads and self.layout is None:
                # No KV registered: nothing can be loaded; vLLM recomputes.
                for spec in meta.loads:
                    self._finish(spec, set(spec.dest_blocks), None)
            return
        ev = self._record_event()
        now = self._clock()
        sync = [spec for spec in meta.loads if spec.sync]
        with self._lock:
            self._sync_outstanding += len(sync)
            self._sync_started = []
            self._sync_begun = 0
            board = self._board
        for spec in meta.loads:
            ld = _Load(spec, ev, now, deadline=now + self.cfg.load_timeout_s, checked=now)
            if spec.early is not None and spec.sync:
                # Started by the scheduler when it allocated the blocks: watched from here.
                self._adopt(ld, board)
                continue
            inline = board is not None and (spec.sync or meta.idle)
            if not inline:
                self._load_q.put(ld)
                continue
            # With a board, the forward starts once the loads are started, and
            # wait_for_layer_load waits for each layer as it lands. Started here: the
            # forward waits for the start, and a hand-over to the loader and back would
            # cost two thread switches. The loader watches it from then on. An
            # asynchronous load of a step without a forward starts here too: nothing else
            # runs in such a step, and the loader would first have to win the GIL from
            # vLLM's engine loop (up to the interpreter's 5 ms switch interval).
            try:
                started = self._begin(ld)
            except Exception as e:  # noqa: BLE001 - never lose a load
                log.exception("kvferry: rank %d: load: %s", self.rank, e)
                self._finish(spec, set(spec.dest_blocks), None, ld)
                started = None
            if started is not None:
                self._load_q.put(_Started(started))
        if board is not None:
            # The loader may be asleep on the board until a load ends: these start now.
            board.interrupt()
        elif sync:
            self.wait_for_sync_loads()

    def _adopt(self, ld: _Load, board: Any) -> None:
        """Takes over a synchronous load the scheduler started (``spec.early``): its forward
        waits on its board slot as on one this worker started, and the loader watches it."""
        slot, tag, load_id = ld.spec.early
        ld.load_id, ld.early = load_id, True
        if board is not None:
            ld.slot, ld.tag = slot, tag
        with self._lock:
            self._sync_started.append(ld)
            self._sync_begun += 1
            self._lock.notify_all()
        self._load_q.put(_Started(ld))

    def _finish(
        self,
        spec: LoadSpec,
        failed: Set[int],
        completion: Optional[dict],
        ld: Optional[_Load] = None,
    ) -> None:
        """Reports a load (once: the loader and a thread waiting on the board may both see
        its end). A load that ended (ok on the board, or with a completion) counts its
        seconds as this worker saw them, from ``start_load``; an ok one its bytes from the
        layout, so a success needs nothing from the node beyond the board's word."""
        if ld is not None:
            with self._lock:
                if ld.finished:
                    return
                ld.finished = True
        c = self.counters
        c.add("loads")
        if ld is not None and (completion is not None or not failed):
            secs = max(0.0, self._clock() - ld.started)
            c.add("load_seconds", secs)
            c.sample_load(secs)
        if completion is not None:
            c.add("loaded_bytes", int(completion.get("bytes") or 0))
        elif not failed and self.layout is not None:
            c.add("loaded_bytes", len(spec.dest_blocks) * self.layout.block_bytes)
        if failed:
            c.add("load_failures")
            c.add("failed_blocks", len(failed))
        elif self.rank == 0:
            c.add("loaded_tokens", spec.tokens)
            c.add("loaded_blocks", len(spec.dest_blocks))
        with self._lock:
            if ld is not None:
                self._async_on_board.pop(id(ld), None)
            self._done.append(_Done(spec.req_id, spec.sync, failed, self._clock()))
            if ld is not None and ld.slot is not None and self._board is not None:
                if not ld.early:
                    self._board_free.append(ld.slot)
                ld.slot = None
            if spec.sync:
                self._sync_outstanding -= 1
            self._lock.notify_all()

    def _begin(self, ld: _Load) -> Optional[_Load]:
        started = self._begin_load(ld)
        if started is None and ld.spec.sync:
            # Finished already (failed): nothing to wait for layer by layer.
            with self._lock:
                self._sync_begun += 1
                self._lock.notify_all()
        return started

    def _begin_load(self, ld: _Load) -> Optional[_Load]:
        spec = ld.spec
        dest = set(spec.dest_blocks)
        if spec.lease is None or not spec.dest_blocks:
            self._finish(spec, dest, None)
            return None
        if ld.event is not None:
            try:
                ld.event.synchronize()
            except Exception as e:  # noqa: BLE001
                log.warning("kvferry: rank %d: CUDA event: %s", self.rank, e)
        if not self._ensure_registered():
            log.debug("kvferry: rank %d: not registered; load of %s fails", self.rank, spec.req_id)
            self._finish(spec, dest, None)
            return None
        with self._lock:
            if self._board is not None and self._board_free:
                ld.slot = self._board_free.pop()
                self._board_tag = (self._board_tag + 1) & 0xFFFFFFFF
                ld.tag = self._board_tag

        def load(c: Any) -> int:
            args = (spec.lease, self.instance, self.rank, list(spec.dest_blocks))
            # A synchronous load's forward runs each layer as it lands: one copy batch per
            # layer, so the last layers' compute does not wait for a long final batch
            # (sync_batches "grouped" leaves the node's layer groups).
            kw = {"per_layer": True} if spec.sync and self.cfg.per_layer_sync else {}
            if ld.slot is None:
                return c.load(*args, **kw)
            return c.load(*args, board_slot=ld.slot, board_tag=ld.tag, **kw)

        try:
            ld.load_id = self.link.call("load", load)
        except Exception as e:  # noqa: BLE001
            self._lost_registration(e)
            if getattr(e, "code", None) == "FAILED_PRECONDITION" and ld.slot is not None:
                # The node lost the board (restarted): re-registered with a new one later.
                with self._lock:
                    self._board = None
            if not isinstance(e, NodeDown):
                log.warning("kvferry: rank %d: load of %s refused: %s", self.rank, spec.req_id, e)
            self._finish(spec, dest, None, ld)
            return None
        with self._lock:
            if spec.sync:
                self._sync_started.append(ld)
                self._sync_begun += 1
                self._lock.notify_all()
            elif ld.slot is not None and not ld.finished:
                self._async_on_board[id(ld)] = ld
        return ld

    def _cancel(self, load_id: int) -> None:
        """Asks the node to stop a load given up on (CancelLoad), so it copies no more into
        blocks vLLM recomputes now; best effort (a node older than protocol 9 cannot)."""
        try:
            if self.link.call("cancel_load",
                              lambda c: c.cancel_load(self.instance, self.rank, load_id)):
                self.counters.add("loads_cancelled")
        except Exception as e:  # noqa: BLE001
            log.debug("kvferry: rank %d: cancel of load %d: %s", self.rank, load_id, e)

    def _poll(self, pending: List[_Load]) -> List[_Load]:
        still = []
        board = self._board
        for ld in pending:
            spec = ld.spec
            slot = ld.slot
            if board is not None and slot is not None and self._clock() <= ld.deadline:
                try:
                    v = board.view(slot)
                except Exception:  # noqa: BLE001
                    v = {}
                if v.get("tag") == ld.tag:
                    if not v.get("done") and not self._liveness_due(ld):
                        # Still running, as the node's own board says: no RPC needed.
                        still.append(ld)
                        continue
                    if v.get("done") and v.get("ok"):
                        # The board's final word is the outcome: nothing to ask the node.
                        self._finish(spec, set(), None, ld)
                        continue
                    # Failed: which blocks and why come from the node (below).
            if ld.finished:
                # Reported by wait_for_layer_load, which saw the end first (it marks the load
                # before its slot is freed, so a slot already reused lands here too).
                continue
            try:
                comp = self.link.call("poll_load", lambda c, i=ld.load_id: c.poll_load(i))
            except Exception as e:  # noqa: BLE001
                self._lost_registration(e)
                if not isinstance(e, NodeDown):
                    log.warning("kvferry: rank %d: load %s: %s", self.rank, ld.load_id, e)
                self._finish(spec, set(spec.dest_blocks), None, ld)
                continue
            if comp is None:
                if self._clock() > ld.deadline:
                    log.warning(
                        "kvferry: rank %d: load of %s (%d blocks) not done after %.1f s; its "
                        "blocks are recomputed",
                        self.rank, spec.req_id, len(spec.dest_blocks), self.cfg.load_timeout_s,
                    )
                    self._cancel(ld.load_id)
                    self._finish(spec, set(spec.dest_blocks), None, ld)
                else:
                    still.append(ld)
                continue
            dest = set(spec.dest_blocks)
            failed = set(comp.get("failed_blocks") or ()) & dest
            if not comp.get("ok"):
                failed = failed or dest
                log.warning(
                    "kvferry: rank %d: load of %s failed (%s: %s); %d block(s) recomputed",
                    self.rank, spec.req_id, comp.get("error_kind"), comp.get("error"), len(failed),
                )
            self._finish(spec, failed, comp, ld)
        return still

    def _liveness_due(self, ld: _Load) -> bool:
        """Whether to ask the node about a load its board shows running: every LIVENESS_S,
        and at once once the link saw the connection go (its mailbox's session ended)."""
        now = self._clock()
        if self.link.connection_lost() or now - ld.checked >= LIVENESS_S:
            ld.checked = now
            return True
        return False

    def _watch_board(self, pending: List[_Load]) -> bool:
        """Sleeps on the board until one of ``pending`` ends, :meth:`start_load` hands over
        new loads, or the first deadline; False (nothing waited) where a load is not on the
        board (it is polled for instead)."""
        board = self._board
        if board is None or any(ld.slot is None for ld in pending):
            return False
        left = min(ld.deadline for ld in pending) - self._clock()
        try:
            board.wait_ends([(ld.slot, ld.tag) for ld in pending], min(max(left, 0.0), LIVENESS_S))
        except Exception as e:  # noqa: BLE001 - polled for instead
            log.debug("kvferry: rank %d: board wait: %s", self.rank, e)
            return False
        return True

    def _loader(self) -> None:
        pending: List[_Load] = []
        idle = 0.0002
        while True:
            item = None
            if not (pending and self._watch_board(pending)):
                try:
                    item = self._load_q.get(timeout=idle if pending else 0.5)
                except queue.Empty:
                    pass
            items = [] if item is None else [item]
            while True:
                try:
                    items.append(self._load_q.get_nowait())
                except queue.Empty:
                    break
            for it in items:
                if it is _STOP:
                    for ld in pending:
                        self._finish(ld.spec, set(ld.spec.dest_blocks), None, ld)
                    return
                if isinstance(it, _Started):
                    pending.append(it.ld)
                    continue
                try:
                    started = self._begin(it)
                except Exception as e:  # noqa: BLE001 - never lose a load
                    log.exception("kvferry: rank %d: load: %s", self.rank, e)
                    self._finish(it.spec, set(it.spec.dest_blocks), None)
                    started = None
                if started is not None:
                    pending.append(started)
                    idle = 0.0002
            if pending:
                try:
                    pending = self._poll(pending)
                except Exception as e:  # noqa: BLE001
                    log.exception("kvferry: rank %d: polling loads: %s", self.rank, e)
                    for ld in pending:
                        self._finish(ld.spec, set(ld.spec.dest_blocks), None, ld)
                    pending = []
                idle = min(idle * 2, 0.002)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Returns once layer ``layer_name`` of this step's synchronous loads has landed (or
        those loads ended), as the node's completion board shows it; at the last layer it
        also waits for their results, so failed blocks are reported this step. Without a
        board the loads finished in :meth:`start_load` already."""
        with self._lock:
            loads = list(self._sync_started)
            board = self._board
        if not loads:
            return
        index = self._layer_index.get(layer_name)
        last = len(self._layer_index) - 1
        if index is None:
            # A layer the registration does not know (a shared layer's alias): wait for all.
            index = last
        if board is not None:
            deadline = self._clock() + self.cfg.load_timeout_s
            for ld in loads:
                slot = ld.slot
                if slot is None or ld.finished:
                    continue
                left = max(0.0, deadline - self._clock())
                # At the last layer, the end: an ok one is reported from here at once (the
                # board's word is the outcome), a failed one by the loader with its details.
                want = ALL_LAYERS if index >= last else index + 1
                try:
                    v = board.wait(slot, ld.tag, want, left)
                except Exception as e:  # noqa: BLE001
                    log.warning("kvferry: rank %d: board wait: %s", self.rank, e)
                    continue
                if v.get("tag") == ld.tag and v.get("ok"):
                    self._finish(ld.spec, set(), None, ld)
                    continue
                if v.get("tag") == ld.tag and not v.get("done") and v.get("layers", 0) <= index:
                    log.warning(
                        "kvferry: rank %d: layer %s of %s not landed after %.1f s",
                        self.rank, layer_name, ld.spec.req_id, self.cfg.load_timeout_s,
                    )
        if index >= last:
            self.wait_for_sync_loads()
            with self._lock:
                self._sync_started = []

    def wait_for_loads(self, req_ids: Set[str], timeout_s: float) -> Optional[float]:
        """Waits until :meth:`get_finished` (and the load errors) would report the loads of
        ``req_ids``; returns when the last of them was reported (the worker's clock), or None
        after ``timeout_s``. Not a vLLM hook: for tests and the bench."""
        want = set(req_ids)
        with self._lock:
            if not self._lock.wait_for(
                lambda: want <= {d.req_id for d in self._done}, timeout=timeout_s
            ):
                return None
            return max(d.at for d in self._done if d.req_id in want)

    def wait_for_sync_loads(self) -> None:
        """Waits for this step's synchronous loads (load_mode "sync"); bounded by
        load_timeout_ms (the loader fails a load that runs longer)."""
        with self._lock:
            if self._sync_outstanding <= 0:
                return
            limit = self.cfg.load_timeout_s + 2 * self.cfg.deadline_s + 1.0
            self._lock.wait_for(lambda: self._sync_outstanding <= 0, timeout=limit)

    # ---------------------------------------------------------------- saves

    def submit_saves(self, meta: Optional[StepMetadata]) -> None:
        """Hands this step's saves to the saver thread (after the step's kernels)."""
        if meta is None or not meta.saves:
            return
        with self._lock:
            # vLLM keeps these requests' blocks until get_finished reports them.
            self._save_reqs.update(spec.req_id for spec in meta.saves)
        if self.layout is None:
            return
        ev = self._record_event()
        items = [_SaveItem(spec, ev) for spec in meta.saves]
        with self._lock:
            for it in items:
                rid = it.spec.req_id
                self._save_pending[rid] = self._save_pending.get(rid, 0) + 1
                self._queued_saves.setdefault(rid, []).append(it)
        for it in items:
            self._save_q.put(it)

    def _save_one(self, spec: SaveSpec, ev: Any) -> None:
        if ev is not None:
            ev.synchronize()
        if not self._ensure_registered():
            self.counters.add("save_failures")
            return
        try:
            res = self.link.call(
                "save",
                lambda c: c.save(
                    self.instance, self.rank, list(spec.hashes), list(spec.block_ids),
                    **({"tenant": spec.tenant} if getattr(spec, "tenant", None) else {}),
                ),
            )
        except Exception as e:  # noqa: BLE001
            self._lost_registration(e)
            self.counters.add("save_failures")
            if not isinstance(e, NodeDown):
                log.warning("kvferry: rank %d: save of %s failed: %s", self.rank, spec.req_id, e)
            return
        self.counters.add("saves")
        self.counters.add("saved_blocks", int(res.get("written") or 0))
        self.counters.add("saved_bytes", int(res.get("bytes") or 0))

    def _probe(self) -> None:
        """While idle: registers again after a node restart even when nothing is loaded or
        saved (a consumer-only engine would otherwise never be found again). A query of one
        hash no block has is the cheap way to learn whether the node knows the instance."""
        now = self._clock()
        if now - self._last_probe < PROBE_S or self.layout is None:
            return
        self._last_probe = now
        if not self._registered:
            self._ensure_registered()
            return
        try:
            self.link.call("probe", lambda c: c.query(self.instance, [PROBE_HASH]))
        except Exception as e:  # noqa: BLE001
            self._lost_registration(e)
            if getattr(e, "code", None) == "NOT_FOUND":
                log.warning(
                    "kvferry: rank %d: the node no longer knows instance %s (restarted?); "
                    "registering again", self.rank, self.instance,
                )
                self._ensure_registered()

    def _saver(self) -> None:
        while True:
            try:
                item = self._save_q.get(timeout=PROBE_S)
            except queue.Empty:
                self._probe()
                continue
            if item is _STOP:
                return
            spec = item.spec
            with self._lock:
                queued = self._queued_saves.get(spec.req_id, [])
                if item in queued:
                    queued.remove(item)
                if not queued:
                    self._queued_saves.pop(spec.req_id, None)
                if not item.cancelled:
                    self._saving_now = spec.req_id
            try:
                if item.cancelled:
                    self.counters.add("saves_cancelled")
                else:
                    self._save_one(spec, item.event)
            except Exception as e:  # noqa: BLE001
                log.exception("kvferry: rank %d: save: %s", self.rank, e)
                self.counters.add("save_failures")
            finally:
                with self._lock:
                    self._saving_now = None
                    left = self._save_pending.get(spec.req_id, 1) - 1
                    if left > 0:
                        self._save_pending[spec.req_id] = left
                    else:
                        self._save_pending.pop(spec.req_id, None)
                    self._lock.notify_all()

    def handle_preemptions(self, meta: Optional[StepMetadata]) -> None:
        """Preempted requests' blocks are free: their saves finish before the forward. Those
        still queued when the wait runs out are never sent (the forward may overwrite their
        blocks); the one being sent is waited for to its end, which the node's fence bounds
        (a save the client gave up on is never sealed, see ``EngineClient.save``)."""
        if meta is None or not meta.preempted:
            return
        gone = set(meta.preempted)
        limit = self.cfg.deadline_s * (self._save_q.qsize() + 2)
        with self._lock:
            if self._lock.wait_for(
                lambda: not any(r in self._save_pending for r in gone), timeout=limit
            ):
                return
            cancelled = 0
            for rid in gone:
                for it in self._queued_saves.get(rid, ()):
                    if not it.cancelled:
                        it.cancelled = True
                        cancelled += 1
            if cancelled:
                log.warning(
                    "kvferry: rank %d: %d save(s) of preempted requests not sent: the node "
                    "is slow or down and their blocks are reused now", self.rank, cancelled,
                )
            bound = 3 * self.cfg.deadline_s + 1.0
            if not self._lock.wait_for(lambda: self._saving_now not in gone, timeout=bound):
                log.error(
                    "kvferry: rank %d: a save of preempted request %s still runs after %.1f s",
                    self.rank, self._saving_now, bound,
                )

    # ---------------------------------------------------------------- results

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Set[str], Set[str]]:
        """(requests whose saves are done, requests whose async loads are done); the
        failed blocks of those loads are reported by the next
        :meth:`get_block_ids_with_load_errors` (the same step). vLLM 0.26 asks this."""
        sending, recving, _ = self._results(finished_req_ids, by_request=False)
        return sending, recving

    def get_transfer_results(
        self, finished_req_ids: Set[str]
    ) -> Tuple[Set[str], Set[str], Set[str]]:
        """(saves done, async loads done, async loads that failed: also among the done),
        as vLLM 0.33+ asks: a failed asynchronous load is reported by request (vLLM then
        recomputes it, or fails it, as its kv_load_failure_policy says), not by block. The
        failed blocks of synchronous loads still go to
        :meth:`get_block_ids_with_load_errors` (vLLM takes no request-level failure for
        a request that runs this step)."""
        return self._results(finished_req_ids, by_request=True)

    def _results(
        self, finished_req_ids: Set[str], by_request: bool
    ) -> Tuple[Set[str], Set[str], Set[str]]:
        sending: Set[str] = set()
        recving: Set[str] = set()
        failed: Set[str] = set()
        with self._lock:
            started = bool(self._sync_started)
        if started:
            # Synchronous loads end within their step even if not every layer was waited for.
            self.wait_for_sync_loads()
            with self._lock:
                self._sync_started = []
        self._read_async_ends()
        with self._lock:
            done, self._done = self._done, []
            for d in done:
                if not d.sync:
                    recving.add(d.req_id)
                    if d.failed and by_request:
                        failed.add(d.req_id)
                        continue
                self._errors |= d.failed
            self._finishing |= set(finished_req_ids or ()) & self._save_reqs
            for rid in list(self._finishing):
                if rid not in self._save_pending:
                    self._finishing.discard(rid)
                    self._save_reqs.discard(rid)
                    sending.add(rid)
        return sending, recving, failed

    def begin_step(self, meta: Optional[StepMetadata]) -> None:
        """The step's metadata as vLLM binds it (before ``start_load``): whether it is a
        step without a forward, which :meth:`get_finished` may wait in."""
        self._idle_step = bool(meta is not None and meta.idle)

    def _read_async_ends(self) -> None:
        """Reports the asynchronous loads whose board shows an ok end, from the calling
        thread (vLLM's, in get_finished): the loader would report them too, but only once it
        has the GIL, which a busy engine loop hands over every 5 ms. Failed ones are left to
        the loader (their details need a call). In a step without a forward, waits up to
        ``idle_wait_ms`` for one of them to end first (the GIL released): no request is
        scheduled in such a step, and the one whose load ends is scheduled in the next. (With
        vLLM's async scheduling the previous step's forward may still run on the GPU meanwhile;
        its output is then taken at most ``idle_wait_ms`` later.)"""
        board = self._board
        # For this step only: a step whose metadata vLLM did not bind never waits.
        idle, self._idle_step = self._idle_step, False
        with self._lock:
            loads = [ld for ld in self._async_on_board.values() if ld.slot is not None]
        if board is None or not loads:
            return
        views = self._board_views(board, loads)
        wait = self.cfg.idle_wait_s if idle else 0.0
        if wait > 0 and views and not any(v.get("done") for _, _, v in views):
            # For the oldest: a rank's loads share the node's copy lane, so it ends first.
            # (A wait for its end, not wait_ends: that would take the interrupt start_load
            # leaves the loader.)
            ld, slot, _ = min(views, key=lambda x: x[0].started)
            try:
                board.wait(slot, ld.tag, ALL_LAYERS, wait)
            except Exception as e:  # noqa: BLE001 - the loader reports them instead
                log.debug("kvferry: rank %d: idle board wait: %s", self.rank, e)
            views = self._board_views(board, loads)
        for ld, _, v in views:
            if v.get("done") and v.get("ok"):
                self._finish(ld.spec, set(), None, ld)

    @staticmethod
    def _board_views(board: Any, loads: List[_Load]) -> List[Tuple[_Load, int, Dict[str, Any]]]:
        """(load, slot, what its slot says) for the loads their slot still shows."""
        out = []
        for ld in loads:
            slot = ld.slot
            if slot is None:
                continue
            try:
                v = board.view(slot)
            except Exception:  # noqa: BLE001
                continue
            if v.get("tag") == ld.tag:
                out.append((ld, slot, v))
        return out

    def get_block_ids_with_load_errors(self) -> Set[int]:
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def take_stats(self) -> Dict[str, Any]:
        return self.counters.take()

    def shutdown(self) -> None:
        for q in (self._load_q, self._save_q):
            q.put(_STOP)
        board = self._board
        if board is not None:
            board.interrupt()
        for t in self._threads:
            t.join(timeout=self.cfg.deadline_s * 2 + 1)
        self._threads = []
        for session in self._sessions:
            try:
                session.close()
            except Exception:  # noqa: BLE001
                pass
        self._sessions = []
