"""``KvferryRadixCache``: SGLang's ``RadixCache`` with kvferry behind it, selected with
``--radix-cache-backend kvferry`` (registered by the ``sglang.srt.plugins`` entry point
:func:`kvferry.sglang.plugin.register`).

SGLang 0.5.16 and 0.5.23 have no KV connector hook; an outside cache plugs in as the radix
cache the scheduler builds. This one keeps SGLang's tree and adds two things:

- **match_prefix**: after SGLang's own GPU match, the node is asked for the pages past it
  (a lease). Slots are allocated from SGLang's allocator (evicting first if needed, with the
  matched node locked so the eviction cannot take it), the pages are loaded straight into
  them, and the loaded pages are inserted into the tree; the request then matches them as
  its own prefix. The load is waited for here, on the scheduler's thread (at most
  ``load_timeout_ms``): the forward that follows reads those slots. A miss, a node that is
  down or slow, or a load that fails part way costs hits only: what did not land is freed
  and recomputed. A load given up on at ``load_timeout_ms`` may still be written by the
  node: its slots are kept out of the allocator until it is seen to end (counted as
  ``parked_loads``), on every TP rank alike.
- **cache_finished_req / cache_unfinished_req**: after SGLang inserted the request's pages,
  the full pages not yet in kvferry are saved, in the background; the tree node holding them
  is locked until the save ended, so eviction cannot reuse the slots it reads.

With TP > 1 every rank runs the same calls in lockstep: rank 0's lease is broadcast, and the
ranks agree on the pages that landed (the fewest) before inserting, so their trees stay the
same. A request with an ``extra_key`` (SGLang's cache salt and LoRA id) has its pages named
by hashes salted with that key (:meth:`KvferryConnector.request_salt`), so two tenants with
equal token ids never share a block on the node, as they never share one in SGLang's tree.
EAGLE's bigram keys are left to SGLang alone: their pages are named differently from what
kvferry's hashes cover.
"""

from __future__ import annotations

import itertools
from array import array
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from .connector import KvferryConnector

__all__ = ["KvferryRadixCache"]

log = logging.getLogger("kvferry.sglang")

#: How long an eviction waits for running saves to release the nodes it could take.
EVICT_WAIT_S = 5.0

# agree(n) -> the fewest n over the TP ranks (identity with one rank).
Agree = Callable[[int], int]


class KvferryRadixCache(RadixCache):
    """SGLang's ``RadixCache`` over ``params`` with ``connector`` (a :class:`KvferryConnector`
    over ``params.token_to_kv_pool_allocator.get_kvcache()``) behind it."""

    def __init__(self, params: Any, *, connector: KvferryConnector,
                 agree: Optional[Agree] = None):
        self.kvferry = connector
        self._agree = agree or (lambda n: n)
        # request id -> pages of it known to be in kvferry (loaded or saved).
        self._held_pages: Dict[str, int] = {}
        # Slots of loads given up on (``load_timeout_ms`` passed) that the node may still
        # write, oldest first: freed only once the load has ended on every rank.
        self._parked: List[Tuple[str, Any]] = []
        # save id -> the tree node it locked.
        self._saving: Dict[str, Any] = {}
        self._save_ids = itertools.count()
        super().__init__(params)
        if self.kvferry.page_size != self.page_size:
            raise ValueError(f"kvferry.sglang: the KV pool's page size "
                             f"{self.kvferry.page_size} is not the cache's {self.page_size}")

    # -- loads -------------------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> Any:
        self._drain_saves()
        res = super().match_prefix(params)
        req = getattr(params, "req", None)
        key = params.key
        if self.disable or req is None or self.is_eagle:
            return res
        aligned = key.page_aligned(self.page_size)
        have = len(self._indices(res))
        self._held_pages.setdefault(req.rid, have // self.page_size)
        if len(aligned) - have < self.page_size:
            return res
        tokens = list(aligned.raw_token_ids()[: len(aligned)])
        try:
            landed = self._load(req.rid, tokens, have, res, key.extra_key,
                                getattr(req, "lora_id", None))
        except Exception as e:  # noqa: BLE001 - a failed load is a miss, never a crash
            log.warning("kvferry: %s: loading past the GPU prefix failed (%s); no hit",
                        req.rid, e)
            self.kvferry.release_load_state(req.rid)
            landed = 0
        if landed == 0:
            return res
        self._held_pages[req.rid] = (have + landed) // self.page_size
        return super().match_prefix(params)

    def _load(self, rid: str, tokens: list, have: int, res: Any,
              extra_key: Optional[str] = None, lora_id: Optional[str] = None) -> int:
        """Loads the node's pages past ``have`` tokens into new slots and inserts them;
        the tokens inserted (0 on a miss or a failure)."""
        self._free_parked()
        hit = self.kvferry.get_new_hit_length(rid, tokens, have, extra_key=extra_key,
                                              lora_id=lora_id)
        hit = self._agree(hit)
        if hit <= 0:
            self.kvferry.release_load_state(rid)
            return 0
        alloc = self.token_to_kv_pool_allocator
        if alloc.available_size() < hit:
            # The matched prefix must survive the eviction that makes room past it.
            self.inc_lock_ref(res.last_device_node)
            try:
                self.evict(EvictParams(num_tokens=hit))
            finally:
                self.dec_lock_ref(res.last_device_node)
        slots = alloc.alloc(hit) if alloc.available_size() >= hit else None
        if slots is None:
            log.info("kvferry: %s: no free slots for %d hit tokens; recomputed", rid, hit)
            self.kvferry.release_load_state(rid)
            self._agree(0)
            return 0
        landed = 0
        try:
            if self.kvferry.start_load_kv(rid, slots):
                landed = self.kvferry.wait_load(rid)
            else:
                self.kvferry.check_completed_load_tasks()
        finally:
            # One agreement for both facts: a rank whose load is still running (timed out,
            # so it reports 0) sends 0; every other rank 2 x landed + 1. The minimum is 0
            # when any rank's node may still write the slots: then every rank parks them,
            # so the allocators stay in step.
            pending = self.kvferry.load_pending(rid)
            mine = 0 if pending else 2 * min(max(landed, 0), hit) + 1
            agreed = self._agree(mine)
            landed = agreed // 2
            landed -= landed % self.page_size
            if agreed == 0:
                log.warning("kvferry: %s: a load past load_timeout_ms still runs; its %d "
                            "slots are kept until it ends", rid, hit)
                self._parked.append((rid, slots))
                self.kvferry.rank.counters["parked_loads"] += 1
            elif landed < hit:
                alloc.free(slots[landed:])
        if landed == 0:
            return 0
        value = torch.cat([self._indices(res).to(torch.int64),
                           slots[:landed].to(torch.int64)])
        key = RadixKey(array("q", tokens[: have + landed]), extra_key)
        inserted = self.insert(InsertParams(key=key, value=value))
        # A page the tree already held (it cannot, with one scheduler thread; kept exact):
        # the tree keeps its own slot, the loaded copy is freed.
        dup = min(max(inserted.prefix_len - have, 0), landed)
        if dup:
            alloc.free(slots[:dup])
        return landed

    def _free_parked(self) -> None:
        """Frees the slots of given-up loads that have ended on every rank, oldest first."""
        if not self._parked:
            return
        self.kvferry.check_completed_load_tasks()
        ended = 0
        for rid, _ in self._parked:
            if self.kvferry.load_pending(rid):
                break
            ended += 1
        ended = self._agree(ended)
        for _, slots in self._parked[:ended]:
            self.token_to_kv_pool_allocator.free(slots)
        del self._parked[:ended]

    def _indices(self, res: Any) -> Any:
        # 0.5.16 answers the matched slots; 0.5.23 the matched length and the node.
        got = getattr(res, "device_indices", None)
        return got if got is not None else self.path_device_indices(res.last_device_node)

    # -- saves -------------------------------------------------------------------------------
    # 0.5.16 inserts through cache_finished_req / cache_unfinished_req; 0.5.23 through
    # checkpoint (running and finished requests alike), then on_release.

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kw: Any) -> None:
        n = kw.get("kv_len_to_handle")
        token_ids = (list(req.origin_input_ids) + list(req.output_ids))
        token_ids = token_ids[:n] if n is not None else token_ids
        insert = is_insert and not self.disable_finished_insert
        super().cache_finished_req(req, is_insert, **kw)
        if insert:
            self._save(req, token_ids)
        self._held_pages.pop(req.rid, None)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kw: Any) -> None:
        super().cache_unfinished_req(req, chunked, **kw)
        self._save(req, list(req.get_fill_ids()))

    def checkpoint(self, req: Any, *, up_to: int, **kw: Any) -> None:
        super().checkpoint(req, up_to=up_to, **kw)
        self._save(req, list(req.full_untruncated_fill_ids[:up_to]))

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._held_pages.pop(req.rid, None)

    def _save(self, req: Any, token_ids: list) -> None:
        if self.disable or self.is_eagle:
            return
        extra_key = getattr(req, "extra_key", None)
        key = RadixKey(array("q", token_ids), extra_key).page_aligned(self.page_size)
        m = super().match_prefix(MatchPrefixParams(key=key))
        indices = self._indices(m)
        pages = len(indices) // self.page_size
        first = self._held_pages.get(req.rid, 0)
        if pages <= first:
            return
        sid = f"{req.rid}#{next(self._save_ids)}"
        self.inc_lock_ref(m.last_device_node)
        try:
            started = self.kvferry.start_store_kv(
                sid, token_ids[: pages * self.page_size], indices, first_page=first,
                extra_key=extra_key, lora_id=getattr(req, "lora_id", None))
        except Exception as e:  # noqa: BLE001 - a failed save costs hits, never a crash
            log.warning("kvferry: %s: save failed to start (%s)", req.rid, e)
            started = False
        if not started:
            self.dec_lock_ref(m.last_device_node)
            return
        self._saving[sid] = m.last_device_node
        self._held_pages[req.rid] = pages

    def _drain_saves(self, wait_s: float = 0.0) -> None:
        end = time.monotonic() + wait_s
        while self._saving:
            for sid, _ok in self.kvferry.check_completed_store_tasks():
                node = self._saving.pop(sid, None)
                if node is not None:
                    self.dec_lock_ref(node)
            if not self._saving or time.monotonic() >= end:
                return
            time.sleep(0.001)

    def pending_saves(self) -> int:
        return len(self._saving)

    def evict(self, params: Any) -> Any:
        # Nodes locked by running saves cannot go; let the saves end first if they are
        # what stands between the eviction and the space it needs.
        self._drain_saves(EVICT_WAIT_S if self._saving else 0.0)
        return super().evict(params)

    def check_hicache_events(self) -> Any:
        self._drain_saves()
        return super().check_hicache_events()

    def reset(self) -> None:
        if getattr(self, "_saving", None):
            self._drain_saves(EVICT_WAIT_S)
            self._saving.clear()
        super().reset()
