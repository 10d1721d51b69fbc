"""The scheduler half of the connector: queries, leases, load and save plans.

It runs in vLLM's engine-core process, inside the scheduler loop, so nothing here may
block for long or raise: a node that is down or slow makes ``get_num_new_matched_tokens``
answer 0 within the configured deadline (then 0 at once while the node is left alone),
logs it and counts it. Nothing here imports vLLM: requests, block lists and scheduler
outputs are read by attribute, as vLLM 0.26 to 0.34 shape them (block tables from 0.33's
``kv_connector_block_state``, or followed from each step's new and cached requests).

Per request:

1. ``get_num_new_matched_tokens(request, k_tokens)``: hashes of the full blocks beyond
   vLLM's own prefix hit are queried; the node leases the longest prefix it holds (n
   blocks) and the answer is ``n * block_size`` tokens, loaded asynchronously or
   synchronously: ``load_mode = "auto"`` (the default) loads synchronously while no other
   request runs and vLLM schedules synchronously (the forward waits layer by layer and
   nobody else waits for it), else asynchronously (the running requests' steps go on while
   it loads). The lease is kept for
   the request, so asking again (vLLM does when it could not allocate) costs nothing.
2. ``update_state_after_alloc``: the lease and the request's new blocks become a load for
   the workers (every TP rank loads its share of the one lease). A lease vLLM did not use
   is released.
3. ``build_connector_meta``: this step's loads, and saves of every full block the step
   completes (blocks that came from kvferry are not saved again).
4. ``request_finished``: releases an unconsumed lease; if saves of the request were
   handed to workers, vLLM keeps its blocks until the workers report the saves done.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from .config import KvferryConfig
from .events import block_infos
from ..namespace import keeps_tenants, tenant_part
from .hashing import ChainHasher, MmSpan, engine_salt, lora_key, request_salt
from .link import NodeDown, NodeLink
from .metadata import BOARD_SLOTS, EARLY_SLOTS, LoadSpec, SaveSpec, StepMetadata
from .stats import Counters

__all__ = ["SchedulerSide"]

log = logging.getLogger("kvferry.vllm")

#: A lease kept for a request that waits longer than this is queried again (leases expire
#: on the node after its lease TTL, 600 s by default).
LEASE_REUSE_S = 60.0

#: Blocks whose load failed are not offered as hits again for this long (any request), and
#: at most this many are remembered: a rank whose loads keep failing must not trap requests
#: in load, fail, hit again.
FAILED_BLOCK_S = 60.0
MAX_FAILED_BLOCKS = 4096


@dataclass
class _Req:
    request: Any
    hasher: Optional[ChainHasher]  # None: not cacheable by kvferry (prompt embeddings)
    # The unconsumed lease: (first block, blocks, lease id, when, loaded asynchronously).
    lease: Optional[Tuple[int, int, str, float, bool]] = None
    # Blocks [load_start, load_end) came from kvferry: not saved again.
    load_start: int = 0
    load_end: int = 0
    # Blocks below this were handed to workers to save (or skipped).
    saved_upto: int = 0
    # Block ids of the request when vLLM's block state is not available.
    block_ids: List[int] = field(default_factory=list)
    # Of the last lease: blocks the node held itself (the rest came from peers).
    local_blocks: int = 0
    # The load handed to the workers: its lease, destination blocks and block hashes.
    load_lease: Optional[str] = None
    load_dest: List[int] = field(default_factory=list)
    load_hashes: List[bytes] = field(default_factory=list)
    # A load of this request failed: vLLM recomputes it, kvferry offers it no more hits.
    load_failed: bool = False
    # The node tenant of its blocks (its LoRA adapter, escaped); None: the model's own.
    tenant: Optional[str] = None


def _mm_spans(request: Any) -> Optional[Tuple[MmSpan, ...]]:
    spans = []
    for f in getattr(request, "mm_features", None) or ():
        ident = getattr(f, "identifier", None)
        pos = getattr(f, "mm_position", None)
        if not ident or pos is None:
            return None
        spans.append((str(ident), int(pos.offset), int(pos.length)))
    return tuple(spans)


class SchedulerSide:
    def __init__(
        self,
        cfg: KvferryConfig,
        *,
        instance: str,
        model: str,
        kv_dtype: str,
        block_size: int,
        tp_size: int,
        layout_tag: str = "",
        load: bool = True,
        save: bool = True,
        client_factory: Optional[Callable[[], Any]] = None,
        clock: Callable[[], float] = time.monotonic,
        events: Any = None,
        async_scheduling: bool = True,
        early_loads: bool = False,
    ):
        self.cfg = cfg
        self.instance = instance
        self.block_size = block_size
        self.load_enabled = load
        self.save_enabled = save
        self.counters = Counters()
        self.link = NodeLink(cfg, "scheduler", client_factory, clock, mailbox_for=instance)
        self._clock = clock
        # vLLM's AsyncScheduler schedules the next step before this one's output is in: a
        # failed synchronous load leaves the request stuck there (it drops the output and
        # keeps its placeholder), so "auto" loads synchronously only without it.
        self.async_scheduling = async_scheduling
        # load_start "scheduler" where it is safe (see build_connector_meta); the board tag
        # of the last load started here.
        self.early_loads = early_loads
        self._early_tag = 0
        self._salt = engine_salt(model, f"{kv_dtype};{layout_tag}", block_size, tp_size)
        self._reqs: Dict[str, _Req] = {}
        self._pending_loads: List[LoadSpec] = []
        # Requests whose saves were handed to workers and not reported done.
        self._saving: Set[str] = set()
        self._max_hashes: Optional[int] = None
        self._last_local = 0
        self._direct_refusal_logged = False
        # Requests vLLM scheduled and has not finished (load_mode "auto" asks whether any
        # other runs).
        self._live: Set[str] = set()
        # Whether the node keeps tenants apart (asked with the first LoRA request).
        self._tenants: Optional[bool] = None
        # The node's Capabilities, once asked (query size, protocol).
        self._caps: Optional[dict] = None
        # Hashes of blocks whose load failed lately -> when (oldest first).
        self._failed: "OrderedDict[bytes, float]" = OrderedDict()
        # The node's tiers as this engine's KV events (kvferry.vllm.events); None: off.
        self.events = events

    # ---------------------------------------------------------------- per-request state

    def _state(self, request: Any) -> _Req:
        rid = request.request_id
        r = self._reqs.get(rid)
        if r is None:
            hasher = None
            mm = _mm_spans(request)
            if getattr(request, "prompt_embeds", None) is None and mm is not None:
                salt = request_salt(
                    self._salt,
                    lora_key(getattr(request, "lora_request", None)),
                    getattr(request, "cache_salt", None),
                )
                hasher = ChainHasher(salt, self.block_size, mm)
            r = _Req(request, hasher, tenant=self._tenant(request))
            self._reqs[rid] = r
        else:
            r.request = request
        return r

    def _hashes(self, r: _Req, blocks: int) -> List[bytes]:
        assert r.hasher is not None
        return r.hasher.upto(r.request.all_token_ids, blocks)

    def on_new_request(self, request: Any) -> None:
        self._state(request)

    def may_load_async(self, request: Any) -> bool:
        """Whether a hit of ``request`` would load asynchronously (vLLM 0.34 asks before
        any query, so this says "may"): in load_mode "async", for a request kvferry can
        name that has a full block (and in "auto", where it would be asynchronous only
        with other requests running)."""
        if not (self.load_enabled and self.cfg.may_load_async):
            return False
        if getattr(request, "prompt_embeds", None) is not None or _mm_spans(request) is None:
            return False
        return int(getattr(request, "num_tokens", 0) or 0) >= self.block_size

    # ---------------------------------------------------------------- node calls

    def _capabilities(self) -> dict:
        """The node's Capabilities, asked once (and again after a failure)."""
        if self._caps is None:
            self._caps = self.link.call("capabilities", lambda c: c.capabilities())
        return self._caps

    def _max_query(self) -> int:
        if self._max_hashes is None:
            try:
                caps = self._capabilities()
                self._max_hashes = int(caps.get("max_hashes") or 0) or 4096
            except NodeDown:
                raise
            except Exception as e:  # noqa: BLE001
                log.warning("kvferry: capabilities of the node failed: %s", e)
                return 4096
        return self._max_hashes

    def _tenant(self, request: Any) -> Optional[str]:
        """The node tenant of ``request``'s blocks: its LoRA adapter's name, escaped, where the
        node keeps tenants apart (protocol 9; an older node keeps the adapter's blocks among
        the model's, where its salted hashes still never meet another adapter's)."""
        lora = getattr(request, "lora_request", None)
        name = getattr(lora, "lora_name", None) if lora else None
        if not name:
            return None
        if self._tenants is None:
            try:
                caps = self._capabilities()
            except Exception as e:  # noqa: BLE001 - asked again with the next adapter request
                log.debug("kvferry: capabilities of the node failed: %s", e)
                return None
            self._tenants = keeps_tenants(caps, log, "blocks")
        return tenant_part(str(name)) if self._tenants else None

    def _query(self, hashes: List[bytes], tenant: Optional[str] = None) -> Tuple[int, Optional[str]]:
        """(blocks leased, lease id) for the longest held prefix of ``hashes``; (0, None)
        on a miss or any failure (never raises). ``self._last_local``: how many of the
        leased blocks the node holds itself (the rest come from its peers)."""
        self._last_local = 0
        if not hashes:
            return 0, None
        try:
            hashes = hashes[: self._max_query()]
            self.link.client()  # NodeDown(skipped) at once while the node is left alone
            self.counters.add("queries")
            self.counters.add("queried_blocks", len(hashes))
            ans = self.link.call(
                "query",
                lambda c: c.query(
                    self.instance, hashes, direct_gpu=self.cfg.direct_gpu,
                    **({"tenant": tenant} if tenant else {}),
                ),
            )
        except NodeDown as e:
            self.counters.add("queries_skipped" if e.skipped else "query_failures")
            return 0, None
        except Exception as e:  # noqa: BLE001 - NotFound (not registered yet) and the like
            code = getattr(e, "code", None)
            if code == "NOT_FOUND":
                log.debug("kvferry: query: %s (the workers have not registered yet?)", e)
            else:
                log.warning("kvferry: query failed: %s", e)
            self.counters.add("query_failures")
            return 0, None
        n = int(ans.get("local_blocks") or 0) + int(ans.get("remote_blocks") or 0)
        lease = ans.get("lease")
        if self.cfg.direct_gpu and ans.get("direct") == "refused":
            self.counters.add("direct_refused")
            if not self._direct_refusal_logged:
                self._direct_refusal_logged = True
                log.warning(
                    "kvferry: the node refused direct GPU loads (%s); remote blocks load "
                    "staged through host memory",
                    ans.get("direct_reason") or "no reason given",
                )
        if not lease or n <= 0:
            return 0, None
        n = min(n, len(hashes))
        self._last_local = min(n, int(ans.get("local_blocks") or 0))
        self.counters.add("hit_blocks", n)
        return n, lease

    def _load_async(self, rid: str) -> bool:
        """Whether a hit of request ``rid`` loads asynchronously now. In "auto": under
        vLLM's async scheduling always (see ``async_scheduling``); else while another request
        runs or has a load in this step. Alone, the forward waiting layer by layer costs
        nobody else anything and ends about when the copy does."""
        if self.cfg.load_mode != "auto":
            return self.cfg.async_load
        if self.async_scheduling:
            return True
        return bool(self._pending_loads) or any(other != rid for other in self._live)

    def _release(self, lease: str) -> None:
        try:
            self.link.call("release", lambda c: c.release(lease))
        except NodeDown:
            pass  # the node expires it
        except Exception as e:  # noqa: BLE001
            log.debug("kvferry: release %s: %s", lease, e)

    # ---------------------------------------------------------------- vLLM's calls

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> Tuple[int, bool]:
        if not self.load_enabled:
            return 0, False
        r = self._state(request)
        if r.hasher is None or r.load_failed:
            return 0, False
        bs = self.block_size
        k = num_computed_tokens // bs
        ntok = len(request.all_token_ids)
        load_async = self._load_async(request.request_id)
        # An async load may cover every token (vLLM recomputes the last one); a sync load
        # must leave one token for this step's forward.
        full = ntok // bs if load_async else (ntok - 1) // bs
        if full <= k:
            self._drop_lease(r)
            return 0, False
        if r.lease is not None:
            start, n, _, when, was_async = r.lease
            if start == k and was_async == load_async and self._clock() - when < LEASE_REUSE_S:
                return n * bs, load_async
            self._drop_lease(r)
        if self.link.resting():
            # The node failed lately: no hashing, no call, no wait.
            self.counters.add("queries_skipped")
            return 0, False
        wanted = self._hashes(r, full)[k:]
        hashes = self._without_failed(wanted)
        self.counters.add("withheld_blocks", len(wanted) - len(hashes))
        n, lease = self._query(hashes, r.tenant)
        if not n or lease is None:
            return 0, False
        r.lease = (k, n, lease, self._clock(), load_async)
        r.local_blocks = self._last_local
        self.counters.add("async_hits" if load_async else "sync_hits")
        return n * bs, load_async

    def _drop_lease(self, r: _Req) -> None:
        if r.lease is not None:
            self._release(r.lease[2])
            r.lease = None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        r = self._reqs.get(request.request_id)
        if r is None:
            return
        ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        if ids:
            r.block_ids = ids
        if num_external_tokens <= 0:
            self._drop_lease(r)
            return
        if r.lease is None:
            # Called a second time after the load (more blocks): nothing to load.
            return
        bs = self.block_size
        start, n, lease, _, load_async = r.lease
        r.lease = None
        m = num_external_tokens // bs
        if m < n:
            # vLLM took fewer blocks than leased: a lease is loaded whole, so lease exactly m.
            self._release(lease)
            got, lease = self._query(self._hashes(r, start + m)[start:], r.tenant)
            r.local_blocks = self._last_local
            if got < m:
                if lease:
                    self._release(lease)
                lease = None
        dest = ids[start : start + m]
        if len(dest) < m:
            log.warning(
                "kvferry: request %s has %d blocks, a load needs blocks %d..%d; not loading",
                request.request_id, len(ids), start, start + m,
            )
            if lease:
                self._release(lease)
            lease = None
        r.load_start, r.load_end = start, start + m
        r.load_lease, r.load_dest = lease, list(dest)
        r.load_hashes = self._hashes(r, start + m)[start:] if lease else []
        self.counters.add("hit_tokens", m * bs)
        # Live from here: an async load waits unscheduled, and a sync one of another request
        # would share the copy with it.
        self._live.add(request.request_id)
        self._pending_loads.append(
            LoadSpec(request.request_id, lease, dest, m * bs, sync=not load_async)
        )

    def _without_failed(self, hashes: List[bytes]) -> List[bytes]:
        """``hashes`` up to the first whose load failed within FAILED_BLOCK_S."""
        now = self._clock()
        while self._failed:
            h, when = next(iter(self._failed.items()))
            if now - when < FAILED_BLOCK_S:
                break
            self._failed.popitem(last=False)
        for i, h in enumerate(hashes):
            if h in self._failed:
                return hashes[:i]
        return hashes

    def _load_failed(self, r: _Req, blocks: Optional[Set[int]] = None) -> None:
        """The load of ``r`` failed (on some rank; ``blocks``: which of its destinations,
        None: all): vLLM recomputes the request, so kvferry offers it no more hits, and the
        failed blocks none to anyone for FAILED_BLOCK_S; the lease, which a rank may not
        have consumed, is released."""
        if r.load_failed:
            return
        r.load_failed = True
        now = self._clock()
        for d, h in zip(r.load_dest, r.load_hashes):
            if blocks is None or d in blocks:
                self._failed[h] = now
                self._failed.move_to_end(h)
        while len(self._failed) > MAX_FAILED_BLOCKS:
            self._failed.popitem(last=False)
        if r.load_lease is not None:
            self._release(r.load_lease)
            r.load_lease = None

    def hit_sources(self, request: Any, num_external_tokens: int) -> Tuple[int, int]:
        """(tokens from the node's own memory, tokens from its peers) of a load."""
        r = self._reqs.get(request.request_id)
        local = min(num_external_tokens, (r.local_blocks if r else 0) * self.block_size)
        if r is None:
            local = num_external_tokens
        return local, num_external_tokens - local

    def build_connector_meta(self, so: Any) -> StepMetadata:
        meta = StepMetadata(loads=self._pending_loads)
        self._pending_loads = []
        meta.idle = int(getattr(so, "total_num_scheduled_tokens", 1) or 0) == 0
        if self.cfg.load_mode == "auto" and not self.async_scheduling:
            # Only "auto" asks what runs (see _load_async).
            self._live.update(getattr(so, "num_scheduled_tokens", None) or ())
        meta.preempted = set(getattr(so, "preempted_req_ids", None) or ())
        for rid in meta.preempted:
            r = self._reqs.get(rid)
            if r is not None:
                # Its blocks are freed; on its return it starts from its new prefix hit.
                r.load_start = r.load_end = 0
                r.load_dest = []
                r.block_ids = []
        self._track_block_ids(so)
        if self.early_loads and not meta.preempted:
            # vLLM schedules synchronously, so no kernel of an earlier step runs; the
            # blocks of requests preempted now may still be read by their saves.
            self._start_early(meta.loads)
        if self.save_enabled:
            self._plan_saves(so, meta)
        return meta

    def _start_early(self, loads: List[LoadSpec]) -> None:
        """Starts this step's synchronous loads now, before the step reaches the worker
        (load_start "scheduler"), each reporting to one of the board's EARLY_SLOTS; a load
        the node refuses is left to the worker."""
        slots = iter(range(BOARD_SLOTS - EARLY_SLOTS, BOARD_SLOTS))
        kw = {"per_layer": True} if self.cfg.per_layer_sync else {}
        for spec in loads:
            if not spec.sync or spec.lease is None or not spec.dest_blocks:
                continue
            slot = next(slots, None)
            if slot is None:
                return
            self._early_tag = self._early_tag % 0xFFFFFFFF + 1
            tag, lease, dest = self._early_tag, spec.lease, list(spec.dest_blocks)

            def load(c: Any) -> int:
                return c.load(lease, self.instance, 0, dest, board_slot=slot, board_tag=tag, **kw)

            try:
                load_id = self.link.call("load", load)
            except Exception as e:  # noqa: BLE001 - the worker starts it instead
                self.counters.add("early_load_refusals")
                log.debug("kvferry: early load of %s refused: %s", spec.req_id, e)
                continue
            spec.early = (slot, tag, int(load_id))
            self.counters.add("early_loads")

    def _track_block_ids(self, so: Any) -> None:
        """Block ids per request for when SchedulerOutput has no kv_connector_block_state."""
        if getattr(so, "kv_connector_block_state", None) is not None:
            return
        for nr in getattr(so, "scheduled_new_reqs", None) or ():
            r = self._reqs.get(nr.req_id)
            if r is not None:
                r.block_ids = list(nr.block_ids[0]) if nr.block_ids else []
        cached = getattr(so, "scheduled_cached_reqs", None)
        if cached is None:
            return
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for rid, new in zip(cached.req_ids, cached.new_block_ids):
            r = self._reqs.get(rid)
            if r is None or new is None:
                continue
            if rid in resumed:
                r.block_ids = list(new[0])
            else:
                r.block_ids.extend(new[0])

    def _plan_saves(self, so: Any, meta: StepMetadata) -> None:
        bs = self.block_size
        state = getattr(so, "kv_connector_block_state", None)
        spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        for rid, scheduled in so.num_scheduled_tokens.items():
            r = self._reqs.get(rid)
            if r is None or r.hasher is None:
                continue
            req = r.request
            tokens = req.all_token_ids
            done = req.num_computed_tokens + scheduled - len(spec.get(rid, ()))
            upto = min(done, len(tokens)) // bs
            if upto <= r.saved_upto:
                continue
            if state is not None:
                got = state.get_block_ids(rid)
                ids = list(got[0]) if got else []
            else:
                ids = r.block_ids
            upto = min(upto, len(ids))
            hashes = self._hashes(r, upto)
            picks = [
                i for i in range(r.saved_upto, upto) if not r.load_start <= i < r.load_end
            ]
            r.saved_upto = max(r.saved_upto, upto)
            if not picks:
                continue
            meta.saves.append(SaveSpec(rid, [hashes[i] for i in picks], [ids[i] for i in picks],
                                       tenant=r.tenant))
            self._saving.add(rid)
            if self.events is not None:
                infos = block_infos(req, picks, bs, getattr(self.events, "convert", lambda h: h))
                for i, info in infos.items():
                    self.events.saving(hashes[i], info)

    def update_connector_output(self, output: Any) -> None:
        for rid in getattr(output, "finished_sending", None) or ():
            self._saving.discard(rid)
        failed_rids = set(getattr(output, "failed_recving", None) or ())
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        for rid, r in self._reqs.items():
            if r.load_dest and (rid in failed_rids or invalid.intersection(r.load_dest)):
                self._load_failed(r, invalid.intersection(r.load_dest) or None)
                r.load_dest = []
        for rid in getattr(output, "finished_recving", None) or ():
            r = self._reqs.get(rid)
            if r is not None:
                # Its blocks are the request's own from here: no later error is about them.
                r.load_dest = []
        for rid in getattr(output, "failed_recving", None) or ():
            # vLLM 0.33+ recomputes a request whose load failed: the blocks the load was to
            # bring are computed, so they are saved like any other.
            r = self._reqs.get(rid)
            if r is not None:
                r.load_start = r.load_end = 0

    def request_finished(self, request: Any, block_ids: Any = None) -> Tuple[bool, Optional[dict]]:
        self._live.discard(request.request_id)
        r = self._reqs.pop(request.request_id, None)
        if r is not None:
            self._drop_lease(r)
        return request.request_id in self._saving, None

    def take_events(self) -> List[Any]:
        """vLLM events for what the node stored and dropped of this engine's saves since the
        last step (none when events are off)."""
        if self.events is None:
            return []
        try:
            return self.events.take()
        except Exception as e:  # noqa: BLE001 - events never fail a step
            log.warning("kvferry: reading the node's events failed: %s", e)
            return []

    def take_stats(self) -> Dict[str, Any]:
        return self.counters.take()

    def shutdown(self) -> None:
        if self.events is not None:
            self.events.close()
        for r in list(self._reqs.values()):
            self._drop_lease(r)
