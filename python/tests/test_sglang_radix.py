"""kvferry.sglang's radix cache backend (``--radix-cache-backend kvferry``) on CPU, with
SGLang's own classes: its ``Req``, ``ReqToTokenPool``, ``PagedTokenToKVPoolAllocator`` and
``MHATokenToKVPool`` (per-layer tensors moved into memfds, which is how CPU memory reaches a
node), against a real ``kvferry node``.

SGLang's scheduler needs a model runner, so it is not started: the cache is driven the way
the scheduler drives it. ``Req.init_next_round_input`` (SGLang's code) calls
``match_prefix``; the test then does what the scheduler's prefill does (a row in
``req_to_token``, slots for the tokens not matched, the forward's KV written into them) and
hands the request back through SGLang's insert call (0.5.16: ``cache_finished_req``; 0.5.23:
``checkpoint`` and ``on_release``).
"""

from __future__ import annotations

import re
import time
from array import array

import pytest

from sglang_support import CANARY, Node, page_bytes, sglang_or_skip

memory_pool = sglang_or_skip()
torch = pytest.importorskip("torch")

import kvferry  # noqa: E402
from kvferry.torch import memfd_empty  # noqa: E402

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from kvferry.sglang import KvferryConnector  # noqa: E402
from kvferry.sglang.radix import KvferryRadixCache  # noqa: E402

PS = 16
SIZE = 256
MODEL = "Qwen/Qwen3-0.6B"
NEW_API = not hasattr(Req, "req_pool_idx") and hasattr(
    KvferryRadixCache.__mro__[1], "checkpoint") and not hasattr(
    KvferryRadixCache.__mro__[1], "cache_finished_req")


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path, pool="32MiB", slot="64KiB")
    yield n
    n.kill()


class Engine:
    """One SGLang engine's memory: KV pool, allocator, request rows, and the cache."""

    def __init__(self, addr: str, instance: str, *, tp_rank=0, tp_size=1, broadcast=None,
                 agree=None, **cfg):
        p = memory_pool.MHATokenToKVPool(
            size=SIZE, page_size=PS, dtype=torch.float16, head_num=2, head_dim=32,
            layer_num=3, device="cpu", enable_memory_saver=False,
        )
        p.k_buffer = [self._memfd(t) for t in p.k_buffer]
        p.v_buffer = [self._memfd(t) for t in p.v_buffer]
        self.kv = p
        self.alloc = PagedTokenToKVPoolAllocator(SIZE, PS, torch.float16, "cpu", p, False)
        self.rows = memory_pool.ReqToTokenPool(size=8, max_context_len=1024, device="cpu",
                                               enable_memory_saver=False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.rows,
                                 token_to_kv_pool_allocator=self.alloc, page_size=PS)
        config = {"address": addr, "instance": instance, "deadline_ms": 2000,
                  "retry_ms": 100, **cfg}
        self.conn = KvferryConnector(p, model=MODEL, config=config, tp_rank=tp_rank,
                                     tp_size=tp_size, broadcast=broadcast)
        self.cache = KvferryRadixCache(params, connector=self.conn, agree=agree)

    @staticmethod
    def _memfd(t):
        m = memfd_empty(tuple(t.shape), t.dtype, "sglang-kv")
        m.copy_(t)
        return m

    def tensors(self):
        return list(self.kv.k_buffer) + list(self.kv.v_buffer)

    def canary(self):
        for t in self.tensors():
            t.view(torch.uint8).fill_(CANARY)

    def page(self, slot_page: int):
        return [page_bytes(torch, t[slot_page * PS:(slot_page + 1) * PS])
                for t in self.tensors()]

    def match(self, rid: str, toks, extra_key=None, lora_id=None):
        """SGLang's own match call: Req.init_next_round_input -> match_prefix."""
        kw = {"lora_id": lora_id} if lora_id else {}
        req = Req(rid, "", array("q", toks), SamplingParams(), extra_key=extra_key, **kw)
        req.init_next_round_input(self.cache)
        return req

    def prefix(self, req):
        got = getattr(req, "prefix_indices", None)
        if got is None or NEW_API:
            got = self.cache.prefix_device_indices(req)
        return got

    def prefill(self, req, seed: int):
        """What the scheduler's prefill does: a row, slots past the prefix, the forward's
        KV (random bytes) in them. The slots of every token, in order."""
        toks = list(req.origin_input_ids)
        prefix = self.prefix(req)
        assert self.rows.alloc([req]) is not None
        idx = req.kv.req_pool_idx if NEW_API else req.req_pool_idx
        rest = len(toks) - len(prefix)
        new = self.alloc.alloc(-(-rest // PS) * PS)[:rest]
        slots = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
        self.rows.req_to_token[idx, : len(toks)] = slots.to(torch.int32)
        g = torch.Generator().manual_seed(seed)
        for t in self.tensors():
            rows = t[new]
            r = rows.view(torch.uint8)
            r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=g))
            t[new] = rows
        return slots

    def finish(self, req):
        """The scheduler hands the finished request back to the cache."""
        n = len(req.origin_input_ids)
        if NEW_API:
            self.cache.checkpoint(req, up_to=n)
            self.cache.on_release(req, checkpointed=True)
        else:
            self.cache.cache_finished_req(req, kv_len_to_handle=n)

    def saves_ended(self, timeout=10.0):
        end = time.monotonic() + timeout
        while self.cache.pending_saves():
            self.cache._drain_saves(0.05)
            assert time.monotonic() < end, "saves did not end"


def prompt(n_pages, salt=0, tail=3):
    return [(13 * i + salt) % 30000 + 1 for i in range(n_pages * PS)] + [7] * tail


def test_a_prefix_saved_by_another_engine_loads_into_this_ones_slots_byte_for_byte(node):
    a, b = Engine(node.addr, "engine-a"), Engine(node.addr, "engine-b")
    toks = prompt(4)
    ra = a.match("a1", toks)
    assert len(a.prefix(ra)) == 0
    a_slots = a.prefill(ra, seed=1)
    a.finish(ra)
    a.saves_ended()
    assert a.conn.counters["node_failures"] == 0

    b.canary()
    rb = b.match("b1", toks)
    got = b.prefix(rb)
    assert len(got) == 4 * PS, "the 4 whole pages A saved are B's prefix"
    loaded_pages = set()
    for i in range(4):
        bp, ap = int(got[i * PS]) // PS, int(a_slots[i * PS]) // PS
        assert got[i * PS] % PS == 0
        assert b.page(bp) == a.page(ap), f"page {i}"
        loaded_pages.add(bp)
    want = [bytes([CANARY]) * len(x) for x in b.page(0)]
    for p in range(SIZE // PS + 1):
        if p not in loaded_pages:
            assert b.page(p) == want, f"page {p} was written"
    # The loaded pages are SGLang's: in B's tree, counted, and matched with no node call.
    assert b.cache.evictable_size() + b.cache.protected_size() == 4 * PS
    assert b.conn.counters["loaded_blocks"] == 4
    assert kvferry.EngineClient(node.addr).stats()["leases_live"] == 0
    rb2 = b.match("b2", toks)
    assert torch.equal(b.prefix(rb2), got)
    assert b.conn.counters["loaded_blocks"] == 4


def test_only_pages_past_sglangs_own_prefix_come_from_the_node(node):
    a, b = Engine(node.addr, "engine-a"), Engine(node.addr, "engine-b")
    long = prompt(6)
    ra = a.match("a1", long)
    a.prefill(ra, seed=2)
    a.finish(ra)
    a.saves_ended()
    # B holds the first 2 pages already (a shorter prompt loaded them; SGLang matches at
    # most all tokens but the last, so 2 pages and a partial one).
    rb = b.match("b1", long[: 2 * PS + 3])
    assert len(b.prefix(rb)) == 2 * PS
    assert b.conn.counters["loaded_blocks"] == 2
    before = b.conn.counters["loaded_blocks"]
    rb2 = b.match("b2", long)
    assert len(b.prefix(rb2)) == 6 * PS
    assert b.conn.counters["loaded_blocks"] - before == 4, "only the 4 pages past the prefix"


def test_pages_this_engine_computed_are_saved_past_what_it_loaded(node):
    a, b, c = (Engine(node.addr, n) for n in ("engine-a", "engine-b", "engine-c"))
    ra = a.match("a1", prompt(2))
    a.prefill(ra, seed=3)
    a.finish(ra)
    a.saves_ended()
    # B loads A's 2 pages and computes 3 more; C then finds all 5.
    toks = prompt(5)
    rb = b.match("b1", toks)
    assert len(b.prefix(rb)) == 2 * PS
    b.prefill(rb, seed=4)
    b.finish(rb)
    b.saves_ended()
    rc = c.match("c1", toks)
    assert len(c.prefix(rc)) == 5 * PS
    assert c.conn.counters["loaded_blocks"] == 5


def _saved(eng, rid, toks, seed, **key):
    """A request of ``toks`` (of ``key``: extra_key, lora_id) computed and saved whole by
    ``eng``: the slots of its tokens."""
    r = eng.match(rid, toks, **key)
    slots = eng.prefill(r, seed=seed)
    eng.finish(r)
    eng.saves_ended()
    assert eng.conn.counters["saved_blocks"] == len(toks) // PS
    return slots


def test_tenants_with_equal_tokens_and_other_extra_keys_never_share_pages(node):
    """SGLang's extra_key (cache salt, LoRA id) salts kvferry's hashes: a tenant finds its
    own pages on the node, never another tenant's with the same token ids."""
    a, b = Engine(node.addr, "engine-a"), Engine(node.addr, "engine-b")
    toks = prompt(3)
    a_slots = _saved(a, "a1", toks, 7, extra_key="salt-1")

    b.canary()
    for rid, key in (("b1", "salt-2"), ("b2", None), ("b3", "")):
        r = b.match(rid, toks, extra_key=key)
        assert len(b.prefix(r)) == 0, f"extra_key {key!r} found another tenant's pages"
    assert b.conn.counters["hit_blocks"] == 0
    assert b.conn.counters["queries"] == 3
    want = [bytes([CANARY]) * len(x) for x in b.page(0)]
    assert all(b.page(p) == want for p in range(SIZE // PS + 1))

    rb = b.match("b4", toks, extra_key="salt-1")
    got = b.prefix(rb)
    assert len(got) == 3 * PS
    for i in range(3):
        assert b.page(int(got[i * PS]) // PS) == a.page(int(a_slots[i * PS]) // PS)
    # B's tree holds them under the tenant's key only.
    assert len(b.prefix(b.match("b5", toks, extra_key="salt-1"))) == 3 * PS
    assert len(b.prefix(b.match("b6", toks))) == 0
    hashes = {k: tuple(a.conn.page_hashes(toks, extra_key=k))
              for k in (None, "", "salt-1", "salt-2")}
    assert len(set(hashes.values())) == 4
    assert kvferry.EngineClient(node.addr).stats()["leases_live"] == 0


def test_lora_adapters_are_node_tenants_of_their_own(node):
    """A request of SGLang's LoRA adapter (``Req.lora_id``, which SGLang also adds to its
    extra_key) saves into and queries the node tenant of that adapter: its pages sit in a
    namespace of their own (own RAM use, quota, label), the same adapter on another engine
    loads them byte for byte, another adapter and the base model find none."""
    a, b = Engine(node.addr, "engine-a"), Engine(node.addr, "engine-b")
    toks = prompt(3)
    a_slots = _saved(a, "a1", toks, 11, lora_id="adapter-one")
    text = node.metrics()
    assert re.search(r'kvferry_namespace_ram_bytes\{namespace="[^"]*/adapter-one"\} [1-9]',
                     text), text

    b.canary()
    for rid, lora in (("b1", "adapter-two"), ("b2", None)):
        r = b.match(rid, toks, lora_id=lora)
        assert len(b.prefix(r)) == 0, f"lora {lora!r} found adapter-one's pages"
    assert b.conn.counters["hit_blocks"] == 0
    rb = b.match("b3", toks, lora_id="adapter-one")
    got = b.prefix(rb)
    assert len(got) == 3 * PS
    for i in range(3):
        assert b.page(int(got[i * PS]) // PS) == a.page(int(a_slots[i * PS]) // PS)
    assert b.conn.counters["loaded_blocks"] == 3
    assert kvferry.EngineClient(node.addr).stats()["leases_live"] == 0


def test_two_tp_ranks_load_each_its_own_heads_from_one_lease(node, tmp_path):
    """TP 2 through the radix cache: two processes (one per rank, as SGLang runs them) in a
    gloo group, each rank's engines over SGLang's classes (see ``sglang_tp_rank.py``): rank
    0's lease loads both ranks' heads byte for byte, a rank whose load lands fewer pages
    makes both insert the fewest, and the node is left with nothing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    helper = Path(__file__).with_name("sglang_tp_rank.py")
    init = tmp_path / "tp-init"
    procs = [subprocess.Popen([sys.executable, str(helper), str(r), str(init), node.addr],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{err[-4000:]}"
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [g["rank"] for g in got] == [0, 1]
    assert got[0]["pages"] != got[1]["pages"], "each rank loads its own heads"
    stats = kvferry.EngineClient(node.addr).stats()
    assert stats["leases_live"] == 0 and stats["transfers_in_flight"] == 0


def test_a_node_down_costs_hits_never_an_exception(tmp_path):
    e = Engine("127.0.0.1:1", "engine-down", deadline_ms=300, connect_timeout_ms=300)
    toks = prompt(3)
    t0 = time.monotonic()
    r = e.match("r1", toks)
    assert len(e.prefix(r)) == 0
    e.prefill(r, seed=5)
    e.finish(r)  # the save fails in the background: no exception
    e.saves_ended()
    assert time.monotonic() - t0 < 10
    assert e.conn.counters["node_failures"] >= 1
    # SGLang's own tree still works: the request's pages are its prefix now.
    r2 = e.match("r2", toks)
    assert len(e.prefix(r2)) == 3 * PS


def test_a_node_killed_after_saving_costs_hits_and_frees_the_slots(node):
    a, b = Engine(node.addr, "engine-a"), Engine(node.addr, "engine-b")
    ra = a.match("a1", prompt(3))
    a.prefill(ra, seed=6)
    a.finish(ra)
    a.saves_ended()
    node.kill()
    free = b.alloc.available_size()
    rb = b.match("b1", prompt(3))
    assert len(b.prefix(rb)) == 0
    assert b.alloc.available_size() == free, "no slot kept for a load that never happened"


def test_a_load_given_up_on_keeps_its_slots_until_it_ends_then_frees_them(node):
    """wait_load gives up at load_timeout_ms while the node may still write the slots: they
    must not go back to SGLang's allocator (another request would get them, and the late
    bytes would land in its KV) until the load is seen to end; then they are freed, and the
    next load is byte-exact."""
    a = Engine(node.addr, "engine-a")
    b = Engine(node.addr, "engine-b", load_timeout_ms=200)
    toks = prompt(3)
    ra = a.match("a1", toks)
    a_slots = a.prefill(ra, seed=8)
    a.finish(ra)
    a.saves_ended()

    # The node's answer is held back: to the connector the load is still running.
    real_poll, held = b.conn._poll, [True]
    b.conn._poll = lambda ld: None if held[0] else real_poll(ld)
    asked, real_cancel = [], b.conn.rank.cancel_load
    b.conn.rank.cancel_load = lambda lid: asked.append(lid) or real_cancel(lid)
    free = b.alloc.available_size()
    rb = b.match("b1", toks)
    assert len(b.prefix(rb)) == 0, "a load that did not end in time is a miss"
    assert b.conn.counters["load_failures"] == 1
    assert b.conn.counters["parked_loads"] == 1
    # The node is asked to stop the load (CancelLoad). It had ended already (only this
    # side's poll is held back), so nothing was cancelled.
    assert len(asked) == 1 and asked[0] > 0
    assert b.conn.counters["cancelled_loads"] == 0
    assert b.alloc.available_size() == free - 3 * PS, "its slots are not handed out again"
    assert b.conn.load_pending("b1")

    # Still running at the next load: the slots stay parked.
    b.match("b2", prompt(2, salt=5))
    assert b.alloc.available_size() == free - 3 * PS

    held[0] = False
    b.canary()
    rb3 = b.match("b3", toks)
    assert not b.conn.load_pending("b1")
    got = b.prefix(rb3)
    assert len(got) == 3 * PS, "the next load hits"
    # The given-up load counted once, as a failure, not again when it ended.
    assert b.conn.counters["load_failures"] == 1
    assert b.conn.counters["loaded_blocks"] == 3, "the b3 load's 3 pages, no more"
    for i in range(3):
        bp, ap = int(got[i * PS]) // PS, int(a_slots[i * PS]) // PS
        assert b.page(bp) == a.page(ap), f"page {i}"
    # The parked slots went back: only the tree's 3 loaded pages are out of the pool.
    assert b.alloc.available_size() + b.cache.evictable_size() + \
        b.cache.protected_size() == free
    assert kvferry.EngineClient(node.addr).stats()["leases_live"] == 0


def test_the_plugin_registers_the_backend_sglang_looks_up():
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    from kvferry.sglang import plugin

    plugin.register()
    plugin.register()  # SGLang loads plugins in every process; twice is fine
    assert get_radix_cache_factory("kvferry") is plugin.factory


def test_settings_come_from_the_environment_and_are_checked(monkeypatch, tmp_path):
    from kvferry.sglang import ConfigError, plugin

    monkeypatch.setenv(plugin.CONFIG_ENV, '{"address": "127.0.0.1:7300"}')
    assert plugin.load_config() == {"address": "127.0.0.1:7300"}
    f = tmp_path / "kvferry.json"
    f.write_text('{"instance": "x"}')
    monkeypatch.setenv(plugin.CONFIG_ENV, f"@{f}")
    assert plugin.load_config() == {"instance": "x"}
    monkeypatch.setenv(plugin.CONFIG_ENV, "[1]")
    with pytest.raises(ConfigError):
        plugin.load_config()
    monkeypatch.setenv(plugin.CONFIG_ENV, "{nope")
    with pytest.raises(ConfigError):
        plugin.load_config()


def test_the_factory_builds_the_cache_from_sglangs_build_context(node, monkeypatch):
    """What create_tree_cache calls for --radix-cache-backend kvferry, with the fields of
    SGLang's TreeCacheBuildContext it reads."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    from kvferry.sglang import plugin

    plugin.register()
    monkeypatch.setenv(plugin.CONFIG_ENV, f'{{"address": "{node.addr}", "instance": "f"}}')
    e = Engine(node.addr, "engine-a")
    ctx = SimpleNamespace(
        params=e.cache.__dict__.get("_params") or CacheInitParams(
            disable=False, req_to_token_pool=e.rows, token_to_kv_pool_allocator=e.alloc,
            page_size=PS),
        server_args=SimpleNamespace(model_path=MODEL, served_model_name=None),
        tp_rank=0, tp_size=1, tp_group=None,
    )
    cache = get_radix_cache_factory("kvferry")(ctx)
    assert isinstance(cache, KvferryRadixCache)
    assert cache.kvferry.model == MODEL and cache.page_size == PS
    assert cache.kvferry.rank.registration >= 0
    cache.kvferry.close()
