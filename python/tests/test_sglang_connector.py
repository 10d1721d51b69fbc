"""kvferry.sglang.KvferryConnector on CPU: loads into and saves out of SGLang's own device
pools (``MHATokenToKVPool``, ``MLATokenToKVPool``, built by SGLang on CPU; their per-layer
tensors moved into memfds, which is how CPU memory reaches a node, where on a GPU the same
tensors go by CUDA IPC), called in the order a scheduler makes the calls, against a real
``kvferry node``. Pages saved by one engine and loaded into another's pool equal the
originals byte for byte; every slot not loaded keeps its canary.

Run with the interpreter of ``scripts/sglang-env`` (SGLang + pytest).
"""

from __future__ import annotations

import logging
import time

import pytest

from sglang_support import CANARY, Node, free_port, page_bytes, sglang_or_skip

memory_pool = sglang_or_skip()
torch = pytest.importorskip("torch")

import kvferry  # noqa: E402
from kvferry.layout import LayoutError  # noqa: E402
from kvferry.sglang import KvferryConnector  # noqa: E402
from kvferry.torch import memfd_empty  # noqa: E402
from kvferry.vllm.hashing import chain_hashes as vllm_chain, engine_salt  # noqa: E402

PS = 16
MODEL = "Qwen/Qwen3-0.6B"


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path, pool="32MiB", slot="64KiB")
    yield n
    n.kill()


def into_memfd(ts):
    out = []
    for t in ts:
        m = memfd_empty(tuple(t.shape), t.dtype, "sglang-kv")
        m.copy_(t)
        out.append(m)
    return out


def gpu_pool(kind: str):
    if kind == "mha":
        p = memory_pool.MHATokenToKVPool(
            size=256, page_size=PS, dtype=torch.float16, head_num=2, head_dim=32,
            layer_num=3, device="cpu", enable_memory_saver=False,
        )
        p.k_buffer, p.v_buffer = into_memfd(p.k_buffer), into_memfd(p.v_buffer)
        return p
    p = memory_pool.MLATokenToKVPool(
        size=256, page_size=PS, dtype=torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=32,
        layer_num=2, device="cpu", enable_memory_saver=False,
    )
    p.kv_buffer = into_memfd(p.kv_buffer)
    return p


def tensors(pool):
    return list(getattr(pool, "k_buffer", None) or pool.kv_buffer) + list(
        getattr(pool, "v_buffer", None) or [])


def fill(pool, seed):
    g = torch.Generator().manual_seed(seed)
    for t in tensors(pool):
        r = t.view(torch.uint8)
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=g))


def canary(pool):
    for t in tensors(pool):
        t.view(torch.uint8).fill_(CANARY)


def page(pool, p):
    return [page_bytes(torch, t[p * PS:(p + 1) * PS]) for t in tensors(pool)]


def slots(first_page, n):
    return torch.arange(first_page * PS, (first_page + n) * PS, dtype=torch.int64)


def connector(addr, pool, instance, **kw):
    config = {"address": addr, "instance": instance, "deadline_ms": 2000, "retry_ms": 100}
    config.update(kw.pop("config", {}))
    return KvferryConnector(pool, model=MODEL, config=config, **kw)


def prompt(n_pages, salt=0):
    return [(13 * i + salt) % 30000 + 1 for i in range(n_pages * PS)]


def save(conn, rid, toks, src):
    assert conn.start_store_kv(rid, toks, src)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        done = conn.check_completed_store_tasks()
        if done:
            return done
        time.sleep(0.005)
    raise AssertionError("save did not end")


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_saved_pages_load_into_another_engines_slots_byte_for_byte(node, kind):
    a_pool, b_pool = gpu_pool(kind), gpu_pool(kind)
    a, b = connector(node.addr, a_pool, "engine-a"), connector(node.addr, b_pool, "engine-b")
    fill(a_pool, seed=1)
    toks = prompt(4) + [5, 6, 7]  # 4 full pages and a partial one (never saved)
    assert save(a, "r1", toks, slots(2, 5)) == [("r1", True)]

    canary(b_pool)
    # The scheduler's order: hit length, (slots assigned), load, completion.
    assert b.get_new_hit_length("r1", toks, 0) == 4 * PS
    assert b.start_load_kv("r1", slots(9, 4))
    # Layer by layer: the node reports each landed layer on the rank's completion board.
    assert b.rank.board is not None
    layers = len(b.layout.layers)
    for layer in range(layers):
        assert b.wait_for_layer("r1", layer, timeout_s=10)
    with pytest.raises(ValueError):
        b.wait_for_layer("r1", layers)
    assert b.wait_load("r1") == 4 * PS
    assert not b.wait_for_layer("r1", 0)  # ended and reported: nothing to wait for
    for i in range(4):
        assert page(b_pool, 9 + i) == page(a_pool, 2 + i), f"page {i}"
    want = [bytes([CANARY]) * len(x) for x in page(b_pool, 0)]
    for p in range(b_pool.size // PS + 1):
        if not 9 <= p < 13:
            assert page(b_pool, p) == want, f"page {p} was written"
    assert b.counters["loaded_blocks"] == 4 and b.counters["node_failures"] == 0
    assert kvferry.EngineClient(node.addr).stats()["leases_live"] == 0


def test_only_pages_past_the_engines_own_prefix_are_leased_and_loaded(node):
    a_pool, b_pool = gpu_pool("mha"), gpu_pool("mha")
    a, b = connector(node.addr, a_pool, "engine-a"), connector(node.addr, b_pool, "engine-b")
    fill(a_pool, seed=2)
    toks = prompt(5)
    save(a, "r", toks, slots(1, 5))
    canary(b_pool)
    # SGLang's radix cache already holds 2 pages: 3 more come from the node.
    assert b.get_new_hit_length("r", toks, 2 * PS) == 3 * PS
    assert b.start_load_kv("r", slots(12, 3))
    assert b.wait_load("r") == 3 * PS
    for i in range(3):
        assert page(b_pool, 12 + i) == page(a_pool, 3 + i)
    # A prompt that differs in page 1 hits page 0 only.
    other = toks[:PS] + prompt(4, salt=9)
    assert b.get_new_hit_length("o", other, 0) == PS
    b.release_load_state("o")
    assert kvferry.EngineClient(node.addr).stats()["leases_live"] == 0


def test_tp_ranks_share_rank_0s_lease(node):
    """Two MHA TP ranks (each with its heads): rank 0 queries, both load from one lease."""
    pools = [gpu_pool("mha"), gpu_pool("mha")]
    box = {}

    def broadcast(obj):  # rank 0 runs first here, as SGLang's TP group would order it
        if "v" not in box or obj[0] is not None:
            box["v"] = obj
        return box["v"]

    saver = [connector(node.addr, pools[r], "tp-a", tp_rank=r, tp_size=2, broadcast=broadcast)
             for r in range(2)]
    for r in range(2):
        fill(pools[r], seed=10 + r)
    toks = prompt(3)
    for r in range(2):
        box.clear()
        save(saver[r], "r", toks, slots(1, 3))
    dst = [gpu_pool("mha"), gpu_pool("mha")]
    box.clear()
    loader = [connector(node.addr, dst[r], "tp-b", tp_rank=r, tp_size=2, broadcast=broadcast)
              for r in range(2)]
    box.clear()
    hits = [loader[r].get_new_hit_length("q", toks, 0) for r in range(2)]
    assert hits == [3 * PS, 3 * PS]
    assert kvferry.EngineClient(node.addr).stats()["leases_live"] == 1
    for r in range(2):
        assert loader[r].start_load_kv("q", slots(6, 3))
    assert [loader[r].wait_load("q") for r in range(2)] == [3 * PS, 3 * PS]
    for r in range(2):
        for i in range(3):
            assert page(dst[r], 6 + i) == page(pools[r], 1 + i)
    assert kvferry.EngineClient(node.addr).stats()["leases_live"] == 0


def test_a_node_down_costs_hits_never_an_exception(caplog):
    caplog.set_level(logging.WARNING, logger="kvferry.sglang")
    pool = gpu_pool("mha")
    t0 = time.monotonic()
    c = connector(f"127.0.0.1:{free_port()}", pool, "engine-down",
                  config={"deadline_ms": 300, "connect_timeout_ms": 300})
    toks = prompt(2)
    assert c.get_new_hit_length("r", toks, 0) == 0
    assert not c.start_load_kv("r", slots(1, 2))
    assert c.start_store_kv("r", toks, slots(1, 2))
    assert save_result(c) == [("r", False)]
    c.release_load_state("r")
    assert time.monotonic() - t0 < 10
    assert c.counters["node_failures"] >= 1
    assert any("127.0.0.1" in r.getMessage() for r in caplog.records)


def save_result(c):
    end = time.monotonic() + 10
    while time.monotonic() < end:
        done = c.check_completed_store_tasks()
        if done:
            return done
        time.sleep(0.005)
    return []


def test_a_node_killed_after_the_lease_fails_the_load_not_the_engine(tmp_path):
    n = Node(tmp_path, pool="32MiB", slot="64KiB")
    try:
        a_pool, b_pool = gpu_pool("mha"), gpu_pool("mha")
        a = connector(n.addr, a_pool, "engine-a", config={"deadline_ms": 500})
        b = connector(n.addr, b_pool, "engine-b", config={"deadline_ms": 500})
        fill(a_pool, seed=3)
        toks = prompt(2)
        save(a, "r", toks, slots(1, 2))
        canary(b_pool)
        assert b.get_new_hit_length("r", toks, 0) == 2 * PS
        n.kill()
        b.start_load_kv("r", slots(4, 2))
        assert not b.wait_for_layer("r", 0, timeout_s=2)
        assert b.wait_load("r", timeout_s=5) == 0
        assert b.counters["load_failures"] >= 1
        assert page(b_pool, 4)[0] == bytes([CANARY]) * len(page(b_pool, 4)[0])
        # The next request against a restarted node works.
        n.start()
        time.sleep(1.0)  # past the link's back-off
        assert b.get_new_hit_length("r2", toks, 0) == 0  # the new node holds nothing
        end = time.monotonic() + 10
        while save(a, "r3", toks, slots(1, 2)) != [("r3", True)]:
            assert time.monotonic() < end, "saving to the restarted node never worked"
            time.sleep(0.2)
        assert b.get_new_hit_length("r4", toks, 0) == 2 * PS
        assert b.start_load_kv("r4", slots(4, 2))
        assert b.wait_load("r4") == 2 * PS
        assert page(b_pool, 4) == page(a_pool, 1)
    finally:
        n.kill()


def test_slots_outside_the_pool_are_refused_and_nothing_is_written(node):
    a_pool, b_pool = gpu_pool("mha"), gpu_pool("mha")
    a, b = connector(node.addr, a_pool, "engine-a"), connector(node.addr, b_pool, "engine-b")
    fill(a_pool, seed=4)
    toks = prompt(2)
    save(a, "r", toks, slots(1, 2))
    canary(b_pool)
    assert b.get_new_hit_length("r", toks, 0) == 2 * PS
    assert not b.start_load_kv("r", slots(16, 2))  # the pool has 17 pages: 17 is past it
    assert b.wait_load("r") == 0
    want = [bytes([CANARY]) * len(x) for x in page(b_pool, 0)]
    assert all(page(b_pool, p) == want for p in range(17))
    assert kvferry.EngineClient(node.addr).stats()["leases_live"] == 0
    # The next load works.
    assert b.get_new_hit_length("r2", toks, 0) == 2 * PS
    assert b.start_load_kv("r2", slots(15, 2))
    assert b.wait_load("r2") == 2 * PS
    assert page(b_pool, 15) == page(a_pool, 1)


def test_a_layout_kvferry_cannot_describe_is_refused_naming_it(node):
    p = memory_pool.MHATokenToKVPool(
        size=256, page_size=PS, dtype=torch.float16, head_num=2, head_dim=32, layer_num=2,
        device="cpu", enable_memory_saver=False, v_head_dim=16,
    )
    with pytest.raises(LayoutError, match="v_head_dim"):
        connector(node.addr, p, "engine-bad")
    p = gpu_pool("mha")
    p.kv_cache_layout = "vectorized_5d"
    with pytest.raises(LayoutError, match="vectorized_5d"):
        connector(node.addr, p, "engine-bad")


def test_sglang_and_vllm_hashes_of_one_prompt_differ(node):
    c = connector(node.addr, gpu_pool("mha"), "engine-h")
    toks = prompt(2)
    ours = c.page_hashes(toks)
    vllm = vllm_chain(engine_salt(MODEL, "float16", PS, 1), toks, PS)
    assert len(ours) == 2 and not set(ours) & set(vllm)
    # Another LoRA is another prefix.
    lora = connector(node.addr, gpu_pool("mha"), "engine-l", config={"lora": "adapter-1"})
    assert not set(lora.page_hashes(toks)) & set(ours)
