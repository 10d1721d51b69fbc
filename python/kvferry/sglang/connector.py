"""``KvferryConnector``: kvferry loads straight into SGLang's GPU KV pool and saves out of
it, page by page, through the calls of a KV connector:

=================================  =========================================================
call                               kvferry
=================================  =========================================================
``get_new_hit_length``             rank 0 queries the node for the pages past what SGLang
                                   already has on the GPU; the answer is a lease on them,
                                   handed to every TP rank (``broadcast``): one lease, one
                                   consume per rank
``release_load_state``             releases a lease nothing will load from
``start_load_kv``                  this rank's load of the lease into the page slots SGLang
                                   assigned (device memory, no staging in Python)
``check_completed_load_tasks``     the loads that ended, with the tokens that landed
``start_store_kv``                 a save of the request's full pages (in the background)
``check_completed_store_tasks``    the saves that ended
``wait_for_layer``                 (layer by layer) returns once a layer of the load landed:
                                   the node writes each landed layer to a completion board in
                                   shared memory, so the forward can start before the whole
                                   load ended (the role of a ``layer_done_counter``)
=================================  =========================================================

Pages are named by chained hashes over their token ids (:mod:`kvferry.hashing`) from a salt
naming the engine (``kvferry-sglang-v1``), model, LoRA, KV dtype, page size, the pool's byte
order and the ranks whose KV differs (TP size for MHA, PP rank, attention CP rank), so an
SGLang engine and a vLLM engine of one model never share blocks. The pool is described by
:func:`~kvferry.sglang.layouts.describe_device_pool` at start, which refuses a layout
kvferry cannot describe, naming it. A node down or slow costs hits: every call has a
deadline, a failure is logged and counted (``counters``) and answered as zero hits or a
failed load; nothing raises into the engine.

No SGLang release has a KV connector interface of this shape yet (0.5.16 and 0.5.23 plug
external caches in as a HiCache storage backend, :class:`kvferry.sglang.KvferryStorage`, or
as a whole radix cache, ``--radix-cache-backend``); the class takes plain arguments (request
id, token ids, device slot indices), so it needs no SGLang import and is driven by SGLang's
pool objects, or tensors in their layouts, directly; :mod:`kvferry.sglang.radix` drives it
from SGLang's radix cache calls (``--radix-cache-backend kvferry``).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..hashing import chain_hashes
from ..hashing import salt as make_salt
from .config import SglangConfig, parse_config
from .layouts import PoolLayout, describe_device_pool
from .rank import RankKv, landed_of, page_blocks
from .share import BroadcastExchange, LeaseShare

__all__ = ["HASH_TAG", "KvferryConnector"]

log = logging.getLogger("kvferry.sglang")

HASH_TAG = b"kvferry-sglang-v1"
#: Tags the salt of a request with an ``extra_key`` (SGLang's LoRA id and cache salt).
EXTRA_KEY_TAG = b"kvferry-sglang-extra-key-v1"

#: Loads of one rank that report to its completion board at once (more are polled).
BOARD_SLOTS = 64

# broadcast(obj) -> obj: rank 0's obj on every TP rank (SGLang's TP group
# broadcast_pyobj, or torch.distributed.broadcast_object_list).
Broadcast = Callable[[Any], Any]


@dataclass
class _Load:
    lease: Optional[str]
    first_page: int
    pages: int
    load_id: Optional[int] = None
    dest: List[int] = field(default_factory=list)
    #: (board slot, tag, registration) the load reports to; None: polled only.
    board: Optional[Tuple[int, int, int]] = None
    #: The load's completion, once polled.
    result: Optional[dict] = None
    #: Given up on at ``load_timeout_ms`` (and counted as a failure then): its end, when it
    #: comes, is not counted again.
    given_up: bool = False


class KvferryConnector:
    """One TP rank's connector over ``kv_pool`` (SGLang's ``MHATokenToKVPool`` or
    ``MLATokenToKVPool``, or an object with its ``k_buffer`` / ``v_buffer`` / ``kv_buffer``
    and ``page_size``). ``config``: the settings of :mod:`kvferry.sglang.config`."""

    def __init__(
        self,
        kv_pool: Any,
        *,
        model: str,
        config: Optional[Mapping[str, Any]] = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        cp_rank: int = 0,
        cp_size: int = 1,
        device: Optional[int] = None,
        broadcast: Optional[Broadcast] = None,
        client_factory: Optional[Callable[[], Any]] = None,
    ):
        self.cfg: SglangConfig = parse_config(config)
        self.layout: PoolLayout = describe_device_pool(kv_pool)
        if tp_size > 1 and broadcast is None and self.layout.kind == "mha":
            raise ValueError("kvferry.sglang: with TP > 1 the ranks share rank 0's lease: "
                             "pass broadcast (SGLang's TP group broadcast)")
        self.model = self.cfg.model or model
        self.page_size = self.layout.page_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # MLA KV is the same on every TP rank: each rank is an instance of one rank that
        # finds what rank 0 saved; MHA ranks hold their heads of one block.
        replicated = self.layout.kind == "mla"
        shares_lease = not replicated and tp_size > 1
        base = self.cfg.instance or f"sglang-{os.getppid()}"
        instance = base + (f"-pp{pp_rank}" if pp_size > 1 else "") + (
            f"-cp{cp_rank}" if cp_size > 1 else "") + (f"-tp{tp_rank}" if replicated else "")
        if device is None:
            dev = self.layout.device
            device = int(dev.split(":")[1]) if ":" in dev else 0
        self.salt = make_salt(
            HASH_TAG, self.model, self.cfg.lora, self.layout.dtype, self.page_size,
            self.layout.tag, self.layout.kind, 1 if replicated else tp_size, pp_rank, pp_size,
            cp_rank, cp_size,
        )
        self.rank = RankKv(
            self.cfg, instance=instance, rank=0 if replicated else tp_rank,
            tp_size=1 if replicated else tp_size, model=self.model, layout=self.layout,
            device=device, who=f"sglang connector rank {tp_rank}",
            client_factory=client_factory, board_slots=BOARD_SLOTS,
        )
        # Every rank runs get_new_hit_length in the same order (the scheduler thread), so
        # rank 0's lease goes by a TP-group broadcast.
        self.share = LeaseShare(self.rank, tp_rank, BroadcastExchange(broadcast)
                                if shares_lease and broadcast is not None else None)
        self._board_free: List[int] = []
        self._board_reg = -1
        self._board_tag = 0
        self._saves_by_rank0 = replicated
        self.rank.register()
        self._lock = threading.Lock()
        self._loads: Dict[str, _Load] = {}
        self._stores: Dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvferry-sglang-save")

    @property
    def counters(self) -> Dict[str, int]:
        return self.rank.counters

    # -- hashes ------------------------------------------------------------------------------

    def request_salt(self, extra_key: Optional[str] = None) -> bytes:
        """The salt of a request's chain: the engine's, or, for a request with SGLang's
        ``extra_key`` (its cache salt and LoRA id, which SGLang's own tree keeps apart), a
        salt of the engine's and that key, so two tenants never share a block on the node
        even where their token ids are equal."""
        if extra_key is None:
            return self.salt
        return make_salt(EXTRA_KEY_TAG, self.salt, str(extra_key))

    def page_hashes(self, token_ids: Sequence[int], pages: Optional[int] = None,
                    extra_key: Optional[str] = None) -> List[bytes]:
        """The chained hashes of the first ``pages`` full pages of ``token_ids``, of a
        request with ``extra_key``."""
        n = len(token_ids) // self.page_size
        n = n if pages is None else min(n, pages)
        return chain_hashes(self.request_salt(extra_key), token_ids[: n * self.page_size],
                            self.page_size)

    # -- loads -------------------------------------------------------------------------------

    def get_new_hit_length(self, rid: str, token_ids: Sequence[int],
                           num_computed_tokens: int = 0, extra_key: Optional[str] = None,
                           lora_id: Optional[str] = None) -> int:
        """Tokens past ``num_computed_tokens`` (page aligned: SGLang's own prefix hit) the
        node holds and leases for ``rid`` (of SGLang's ``extra_key``, if it has one, and in
        the node tenant of its LoRA adapter ``lora_id``); every TP rank calls it, rank 0
        asks the node."""
        self.release_load_state(rid)
        first = -(-int(num_computed_tokens) // self.page_size)
        hashes = self.page_hashes(token_ids, extra_key=extra_key)[first:]
        tenant = self.rank.tenant(lora_id) if self.share.asks else None
        lease, n = self.share.query(hashes, tenant)
        if lease is None or n <= 0:
            return 0
        with self._lock:
            self._loads[rid] = _Load(lease, first, n)
        return n * self.page_size

    def release_load_state(self, rid: str) -> None:
        """Drops ``rid``'s lease where no load started from it (rank 0 releases it)."""
        with self._lock:
            ld = self._loads.get(rid)
            if ld is None or ld.load_id is not None:
                return
            del self._loads[rid]
        self.share.release(ld.lease)

    def start_load_kv(self, rid: str, device_indices: Any) -> bool:
        """Starts loading ``rid``'s leased pages into the device slots ``device_indices``
        (token slots of the new tokens, ``page_size`` per page, from the first leased page
        on). False where nothing started (then :meth:`check_completed_load_tasks` reports 0
        tokens for it)."""
        with self._lock:
            ld = self._loads.get(rid)
        if ld is None or ld.lease is None:
            return False
        dest = page_blocks(device_indices, self.page_size, ld.pages)
        if len(dest) < ld.pages:
            log.warning("kvferry: %s: %d leased pages, %d whole aligned pages of slots; the "
                        "load is skipped", rid, ld.pages, len(dest))
            dest = []
        board = self._take_slot() if dest else None
        load_id = self.rank.start_load(ld.lease, dest, board[:2] if board else None) \
            if dest else None
        with self._lock:
            ld.dest = dest
            ld.board = board
            ld.load_id = load_id if load_id is not None else -1
        if load_id is None:
            self.share.release(ld.lease)
        return load_id is not None

    def load_pending(self, rid: str) -> bool:
        """Whether ``rid``'s load started and has not been seen to end (by
        :meth:`check_completed_load_tasks`): the node may still write its slots."""
        with self._lock:
            ld = self._loads.get(rid)
            return ld is not None and ld.load_id is not None and ld.load_id != -1

    def check_completed_load_tasks(self) -> Dict[str, int]:
        """The loads that ended since the last call: request id -> tokens that landed (from
        the first leased page; fewer than leased where the load failed part way)."""
        with self._lock:
            started = [(rid, ld) for rid, ld in self._loads.items() if ld.load_id is not None]
        done: Dict[str, int] = {}
        for rid, ld in started:
            if ld.load_id == -1:
                done[rid] = 0
                continue
            got = self._poll(ld)
            if got is None:
                continue
            landed = landed_of(got, ld.dest)
            if ld.given_up:
                pass  # counted as a failure when it was given up on
            elif landed < len(ld.dest):
                self.rank.counters["load_failures"] += 1
                log.warning("kvferry: %s: load failed (%s: %s); %d of %d pages landed", rid,
                            got.get("error_kind"), got.get("error"), landed, len(ld.dest))
            else:
                self.rank.counters["loaded_blocks"] += landed
            done[rid] = landed * self.page_size
        with self._lock:
            for rid in done:
                ld = self._loads.pop(rid, None)
                if ld is not None and ld.board is not None and ld.board[2] == self._board_reg:
                    self._board_free.append(ld.board[0])
        return done

    def _take_slot(self) -> Optional[Tuple[int, int, int]]:
        with self._lock:
            if self.rank.board is None:
                return None
            if self._board_reg != self.rank.registration:
                # A new registration (a restarted node) has a new board: every slot is free.
                self._board_reg = self.rank.registration
                self._board_free = list(range(self.rank.board.slots))
            if not self._board_free:
                return None
            self._board_tag = (self._board_tag + 1) & 0xFFFFFFFF
            return self._board_free.pop(), self._board_tag, self._board_reg

    def wait_for_layer(self, rid: str, layer: int, timeout_s: Optional[float] = None) -> bool:
        """Waits until layer ``layer`` (0-based, of this rank's layers) of ``rid``'s load
        landed, at most ``load_timeout_ms``; True once it did. False where the load failed,
        timed out or never started: the caller recomputes, after
        :meth:`check_completed_load_tasks` says how many tokens landed. Without a board (a
        node that has none) it waits for the whole load."""
        with self._lock:
            ld = self._loads.get(rid)
            board = self.rank.board
        if ld is None or ld.load_id in (None, -1):
            return False
        timeout = self.cfg.load_timeout_s if timeout_s is None else timeout_s
        layers = len(self.layout.layers)
        if not 0 <= layer < layers:
            raise ValueError(f"kvferry.sglang: layer {layer} of {layers}")
        if ld.board is None or board is None or ld.board[2] != self.rank.registration:
            return self._wait_whole(ld, timeout)
        slot, tag, _ = ld.board
        try:
            v = board.wait(slot, tag, layer + 1, timeout)
        except Exception as e:  # noqa: BLE001 - a failed wait is a failed layer
            log.warning("kvferry: %s: waiting on the board failed (%s)", rid, e)
            return False
        if v.get("tag") != tag:
            return False
        if v.get("done"):
            return bool(v.get("ok"))
        return int(v.get("layers", 0)) >= layer + 1

    def _poll(self, ld: _Load) -> Optional[dict]:
        """The load's completion (kept once seen: polling consumes it on the node)."""
        if ld.result is None and ld.load_id is not None and ld.load_id != -1:
            ld.result = self.rank.poll_load(ld.load_id)
        return ld.result

    def _wait_whole(self, ld: _Load, timeout: float) -> bool:
        import time

        end = time.monotonic() + timeout
        while True:
            got = self._poll(ld)
            if got is not None:
                return landed_of(got, ld.dest) == len(ld.dest)
            if time.monotonic() >= end:
                return False
            time.sleep(0.0005)

    def wait_load(self, rid: str, timeout_s: Optional[float] = None) -> int:
        """Waits for ``rid``'s load (at most ``load_timeout_ms``) and reports it as
        :meth:`check_completed_load_tasks` does; the tokens that landed (0 on a timeout,
        counted as a failure)."""
        import time

        end = time.monotonic() + (self.cfg.load_timeout_s if timeout_s is None else timeout_s)
        while True:
            done = self.check_completed_load_tasks()
            if rid in done:
                return done[rid]
            with self._lock:
                if rid not in self._loads:
                    return 0
            if time.monotonic() >= end:
                log.warning("kvferry: %s: load not complete in time; counted as failed", rid)
                with self._lock:
                    ld = self._loads.get(rid)
                    if ld is not None:
                        ld.given_up = True
                    load_id = ld.load_id if ld is not None else None
                self.rank.counters["load_failures"] += 1
                if load_id is not None and load_id != -1:
                    # The node stops copying, so the load (and its parked slots) ends soon.
                    self.rank.cancel_load(load_id)
                return 0
            time.sleep(0.0005)

    # -- saves -------------------------------------------------------------------------------

    def start_store_kv(self, rid: str, token_ids: Sequence[int], device_indices: Any,
                       first_page: int = 0, extra_key: Optional[str] = None,
                       lora_id: Optional[str] = None) -> bool:
        """Saves ``rid``'s full pages from page ``first_page`` on (``device_indices``: the
        device slots of all its tokens) in the background, into the node tenant of its LoRA
        adapter ``lora_id``. With MLA only TP rank 0 saves."""
        if self._saves_by_rank0 and self.tp_rank != 0:
            return False
        hashes = self.page_hashes(token_ids, extra_key=extra_key)
        src = page_blocks(device_indices, self.page_size, len(hashes))
        hashes, src = hashes[first_page : len(src)], src[first_page:]
        if not hashes:
            return False
        fut = self._pool.submit(self.rank.save, hashes, src, self.rank.tenant(lora_id))
        with self._lock:
            self._stores[rid] = fut
        return True

    def check_completed_store_tasks(self) -> List[Tuple[str, bool]]:
        """The saves that ended since the last call: (request id, saved)."""
        with self._lock:
            ended = [(rid, f) for rid, f in self._stores.items() if f.done()]
            for rid, _ in ended:
                del self._stores[rid]
        return [(rid, bool(f.result())) for rid, f in ended]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            loads, self._loads = list(self._loads.values()), {}
        for ld in loads:
            if ld.load_id is None:
                self.share.release(ld.lease)
        self.rank.unregister()
