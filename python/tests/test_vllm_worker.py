"""The connector's halves without vLLM: layouts detected from tensors, TP ranks sharing one
lease, hashes stable across processes, settings refused at start, load failures reported
block by block. Needs torch (memfd-backed CPU tensors) and a ``kvferry node`` binary; never
imports vLLM, so it also runs where vLLM is not installed (e.g. beside PyTorch on a GPU
machine).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_support import Node, empty, kv_tensors  # noqa: E402
from kvferry.vllm import (  # noqa: E402
    ConfigError,
    KvCacheLayoutError,
    SchedulerSide,
    WorkerSide,
    describe_kv_caches,
    parse_extra_config,
)
from kvferry.vllm.metadata import LoadSpec, StepMetadata  # noqa: E402

BS, NB, HEADS, HEAD = 16, 24, 2, 32

CUDA = torch.cuda.is_available()
#: Where the KV lives in the node tests: CPU memfds on a host node, and on a machine with a
#: GPU also CUDA allocations (registered by CUDA IPC handle) on a cuda node.
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def memfd_empty(shape, dtype):
    return empty(shape, dtype, "cpu")


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.kill()


def test_importable_without_vllm():
    code = (
        "import sys, kvferry.vllm\n"
        "from kvferry.vllm import WorkerSide, SchedulerSide, describe_kv_caches\n"
        "assert 'vllm' not in sys.modules, 'vllm imported'\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_config_is_checked():
    cfg = parse_extra_config({"address": "127.0.0.1:7200", "direct_gpu": True, "deadline_ms": 250})
    assert cfg.direct_gpu and cfg.deadline_s == 0.25 and cfg.mailbox
    assert cfg.load_mode == "auto" and cfg.may_load_async and not cfg.async_load
    for mode, every, some in (("async", True, True), ("sync", False, False)):
        c = parse_extra_config({"address": "h:1", "load_mode": mode})
        assert (c.async_load, c.may_load_async) == (every, some), mode
    assert not parse_extra_config({"address": "h:1", "mailbox": False}).mailbox
    with pytest.raises(ConfigError, match=r"unknown keys 'adress', 'timeout'"):
        parse_extra_config({"address": "h:1", "adress": "x", "timeout": 3})
    with pytest.raises(ConfigError, match="required"):
        parse_extra_config({"token": "t"})
    with pytest.raises(ConfigError, match="host:port"):
        parse_extra_config({"address": "localhost"})
    with pytest.raises(ConfigError, match="true or false"):
        parse_extra_config({"address": "h:1", "direct_gpu": "yes"})
    with pytest.raises(ConfigError, match="positive integer"):
        parse_extra_config({"address": "h:1", "load_timeout_ms": 0})
    with pytest.raises(ConfigError, match='"load_mode" must be "auto", "async" or "sync"'):
        parse_extra_config({"address": "h:1", "load_mode": "eager"})


def test_hashes_are_the_same_in_every_process():
    code = (
        "from kvferry.vllm.hashing import ChainHasher, engine_salt\n"
        "h = ChainHasher(engine_salt('m', 'bfloat16;LBNHC', 16, 2), 16)\n"
        "print(','.join(x.hex() for x in h.upto(list(range(100)), 6)))\n"
    )
    outs = set()
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        outs.add(out.stdout.strip())
    assert len(outs) == 1
    hashes = outs.pop().split(",")
    assert len(hashes) == 6 and len(set(hashes)) == 6 and all(len(h) == 64 for h in hashes)
    from kvferry.vllm.hashing import ChainHasher, engine_salt

    # Another model, dtype, block size, TP size or layout: other hashes.
    for salt in (
        engine_salt("m2", "bfloat16;LBNHC", 16, 2),
        engine_salt("m", "float16;LBNHC", 16, 2),
        engine_salt("m", "bfloat16;LBNHC", 16, 1),
        engine_salt("m", "bfloat16;BLHNC", 16, 2),
    ):
        assert ChainHasher(salt, 16).upto(list(range(100)), 1)[0].hex() != hashes[0]


# ------------------------------------------------------------------------------ model names

NODE_PART = re.compile(r"^[!-.0-~]{1,128}$")  # printable ASCII without '/', as the node takes


@pytest.mark.parametrize("name", [
    "llama8b",
    "meta-llama/Llama-3.1-8B-Instruct",
    "/models/llama",
    "C:\\models\\llama 3",
    "modèle/été",
    "100%/a",
    "/very/long/" + "x" * 300,
])
def test_every_model_name_is_a_namespace_the_node_takes(name):
    from kvferry.vllm.namespace import model_namespace

    ns = model_namespace(name)
    assert NODE_PART.match(ns), ns
    if NODE_PART.match(name) and "%" not in name:
        assert ns == name  # names that were valid stay as they were
    if len(name) < 50:
        assert "%~" not in ns


def test_model_names_never_share_a_namespace():
    from kvferry.vllm.namespace import model_namespace

    names = [
        "meta-llama/Llama-3.1-8B", "meta-llama%2FLlama-3.1-8B", "meta-llama_Llama-3.1-8B",
        "meta-llama%252FLlama-3.1-8B", "/models/llama", "%2Fmodels%2Fllama", "models/llama",
        "a b", "a%20b", "a_b", "é", "%C3%A9",
        "/long/" + "x" * 200 + "1", "/long/" + "x" * 200 + "2",
        ("%2F" * 60)[:125],
    ]
    spaces = {model_namespace(n) for n in names}
    assert len(spaces) == len(names)
    with pytest.raises(ValueError, match="non-empty"):
        model_namespace("")


def test_registration_refused_at_start_and_said_once_later(node, monkeypatch, caplog):
    import logging

    import kvferry.vllm.worker as worker_mod
    from kvferry.vllm.worker import RegistrationRefused

    cfg = parse_extra_config({"address": node.addr, "deadline_ms": 500})
    kv = kv_tensors(2, NB, HEADS, BS, HEAD, "LBNHC")
    # Escaped, any name registers...
    w = WorkerSide(cfg, instance="named", model="meta-llama/Llama-3.1-8B-Instruct",
                   kv_dtype="float32", tp_rank=0, tp_size=1, num_blocks=NB)
    try:
        w.register_kv_caches(kv)
        assert w.registered
        assert w.namespace.startswith("meta-llama%2FLlama-3.1-8B-Instruct/"), w.namespace
    finally:
        w.shutdown()
    # ...and a name the node refuses (the escape undone) stops the engine at start, with
    # the node's reason.
    monkeypatch.setattr(worker_mod, "model_namespace", lambda name: name)
    w = WorkerSide(cfg, instance="refused", model="meta-llama/Llama-3.1-8B-Instruct",
                   kv_dtype="float32", tp_rank=0, tp_size=1, num_blocks=NB)
    with pytest.raises(RegistrationRefused, match=r"refused to register instance 'refused'"
                       r".*meta-llama/Llama-3.1-8B-Instruct.*namespace model must be"):
        w.register_kv_caches(kv)
    # Refused later (after a node restart, say): said once, not once per load or save.
    w._start_threads()
    try:
        caplog.set_level(logging.ERROR, logger="kvferry.vllm")
        for _ in range(5):
            assert not w._ensure_registered()
        said = [r for r in caplog.records if "refused to register" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
        assert w.take_stats().get("registration_refusals") == 5
    finally:
        w.shutdown()


# ------------------------------------------------------------------------------ layouts

def old_layouts(kind, device="cpu"):
    """Layouts of older vLLM backends, each layer its own memfd (or CUDA allocation)."""
    names = [f"model.layers.{i}.attn" for i in range(2)]
    if kind == "flash_attn":
        return {n: empty((2, NB, BS, HEADS, HEAD), torch.float16, device) for n in names}
    if kind == "flashinfer":
        return {n: empty((NB, 2, BS, HEADS, HEAD), torch.float16, device) for n in names}
    if kind == "mla":
        return {n: empty((NB, BS, 576), torch.bfloat16, device) for n in names}
    raise ValueError(kind)


@pytest.mark.parametrize(
    "layout, kind, segments, seg_bytes, stride",
    [
        ("LBNHC", "attention", 1, HEADS * BS * 2 * HEAD * 4, HEADS * BS * 2 * HEAD * 4),
        ("LBHNC", "attention", 1, HEADS * BS * 2 * HEAD * 4, HEADS * BS * 2 * HEAD * 4),
        ("BLHNC", "cross_layer", 1, HEADS * BS * 2 * HEAD * 4, 2 * HEADS * BS * 2 * HEAD * 4),
        ("flash_attn", "attention", 2, BS * HEADS * HEAD * 2, BS * HEADS * HEAD * 2),
        ("flashinfer", "attention", 1, 2 * BS * HEADS * HEAD * 2, 2 * BS * HEADS * HEAD * 2),
        ("mla", "attention", 1, BS * 576 * 2, BS * 576 * 2),
    ],
)
def test_layout_detected(layout, kind, segments, seg_bytes, stride):
    kv = kv_tensors(2, NB, HEADS, BS, HEAD, layout) if layout.isupper() else old_layouts(layout)
    d = describe_kv_caches(kv, NB)
    got = (d.kind, d.segments, d.segment_bytes, d.block_stride)
    assert got == (kind, segments, seg_bytes, stride)
    assert d.num_blocks == NB and len(d.layers) == 2
    if layout == "flash_attn":
        t = next(iter(kv.values()))
        assert d.layers[0].addresses == [t.data_ptr(), t.data_ptr() + NB * seg_bytes]


def test_layouts_refused_naming_the_layer():
    kv = kv_tensors(2, NB, HEADS, BS, HEAD, "LBHNC")
    bad = dict(kv)
    # Half of the head dimension: a block is not densely packed.
    wide = memfd_empty((NB, HEADS, BS, 4 * HEAD), torch.float32)
    bad["model.layers.1.self_attn.attn"] = wide[..., : 2 * HEAD]
    with pytest.raises(KvCacheLayoutError, match=r"layer 'model.layers.1.self_attn.attn'.*densely"):
        describe_kv_caches(bad, NB)
    bad = dict(kv)
    bad["model.layers.1.self_attn.attn"] = memfd_empty((NB, HEADS, BS, HEAD), torch.float32)
    with pytest.raises(KvCacheLayoutError, match=r"model.layers.1.self_attn.attn.*same shape"):
        describe_kv_caches(bad, NB)
    with pytest.raises(KvCacheLayoutError, match=r"no dimension .* 99 blocks"):
        describe_kv_caches(kv, 99)
    with pytest.raises(KvCacheLayoutError, match="one tensor per layer"):
        describe_kv_caches({"l0": [kv["model.layers.0.self_attn.attn"]] * 2}, NB)


def test_shared_kv_layers_registered_once():
    kv = kv_tensors(2, NB, HEADS, BS, HEAD, "LBHNC")
    kv["model.layers.2.self_attn.attn"] = kv["model.layers.0.self_attn.attn"]
    d = describe_kv_caches(kv, NB)
    assert len(d.layers) == 2
    assert d.shared == {"model.layers.2.self_attn.attn": "model.layers.0.self_attn.attn"}


# ------------------------------------------------------------------------------ against a node

def blk(t, b):
    """Block ``b`` of a layer tensor (the block dimension is 1 in the old FlashAttention
    layout ``(2, num_blocks, ...)``)."""
    return t[:, b] if t.shape[0] == 2 and t.shape[1] == NB else t[b]


def fill(kv, block_ids, seed):
    g = torch.Generator().manual_seed(seed)
    for t in kv.values():
        for b in block_ids:
            v = blk(t, b)
            v.copy_(torch.rand(v.shape, generator=g).to(t.dtype))
    if CUDA:
        torch.cuda.synchronize()


def canary(kv, value=-7.0):
    """Every byte of the KV set to a canary (the loads must touch only their blocks)."""
    for t in kv.values():
        t.fill_(value)


def snapshot(kv, block_ids):
    return [[blk(t, b).clone() for t in kv.values()] for b in block_ids]


def req(rid, toks):
    return NS(request_id=rid, all_token_ids=toks, num_computed_tokens=0, mm_features=[],
              prompt_embeds=None, lora_request=None, cache_salt=None)


def sched_out(counts, block_ids):
    state = NS(get_block_ids=lambda rid: (block_ids[rid],))
    return NS(num_scheduled_tokens=counts, preempted_req_ids=set(), kv_connector_block_state=state,
              scheduled_spec_decode_tokens={})


def save_prompt(sched, w, toks, ids, rid="a"):
    """Request ``rid`` of ``toks`` computed into blocks ``ids``, saved by worker ``w`` and
    finished: its full blocks are on the node."""
    a = req(rid, toks)
    sched.get_num_new_matched_tokens(a, 0)
    meta = sched.build_connector_meta(sched_out({rid: len(toks)}, {rid: ids}))
    w.submit_saves(meta)
    wait_finished([w], {rid}, "save")
    sched.request_finished(a)


def wait_finished(workers, rids, what):
    got = [set() for _ in workers]
    end = time.monotonic() + 20
    while time.monotonic() < end and not all(g >= rids for g in got):
        for w, g in zip(workers, got):
            sending, recving = w.get_finished(rids)
            g |= sending if what == "save" else recving
        time.sleep(0.005)
    assert all(g >= rids for g in got), got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLHNC", "flash_attn", "flashinfer", "mla"])
def test_tp2_one_lease_each_rank_its_share(tmp_path, layout, device):
    node = Node(tmp_path, device="host" if device == "cpu" else "cuda")
    cfg = parse_extra_config({"address": node.addr})
    inst = f"tp2-{layout}-{device}"
    dtype = "float16" if layout in ("flash_attn", "flashinfer") else "float32"
    kvs, workers = [], []
    for rank in range(2):
        if layout.isupper():
            kv = kv_tensors(2, NB, HEADS, BS, HEAD, layout, device=device)
        else:
            kv = old_layouts(layout, device)
        kvs.append(kv)
        w = WorkerSide(cfg, instance=inst, model="m", kv_dtype=dtype, tp_rank=rank, tp_size=2,
                       num_blocks=NB)
        w.register_kv_caches(kv)
        workers.append(w)
    sched = SchedulerSide(cfg, instance=inst, model="m", kv_dtype=dtype, block_size=BS, tp_size=2)
    try:
        toks = list(range(500, 500 + 4 * BS + 5))
        a_ids = [3, 4, 5, 6, 7]
        for rank, kv in enumerate(kvs):
            fill(kv, a_ids, seed=rank + 1)  # every rank holds its own bytes
        before = [snapshot(kv, a_ids[:4]) for kv in kvs]
        a = req("a", toks)
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        meta = sched.build_connector_meta(sched_out({"a": len(toks)}, {"a": a_ids}))
        assert [len(s.hashes) for s in meta.saves] == [4]
        # Rank 0 alone does not make a block queryable: every rank's part must be there.
        workers[0].submit_saves(meta)
        wait_finished(workers[:1], {"a"}, "save")
        assert sched.get_num_new_matched_tokens(req("probe", toks), 0) == (0, False)
        sched.request_finished(req("probe", toks))
        workers[1].submit_saves(meta)
        wait_finished(workers[1:], {"a"}, "save")
        assert sched.request_finished(a) == (True, None)  # saves were handed out
        sched.update_connector_output(NS(finished_sending={"a"}))

        b = req("b", toks)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * BS, True)
        b_ids = [10, 11, 12, 13, 14]
        for kv in kvs:
            canary(kv)
        if CUDA:
            torch.cuda.synchronize()
        around = [snapshot(kv, [i for i in range(NB) if i not in b_ids[:4]]) for kv in kvs]
        sched.update_state_after_alloc(b, NS(get_block_ids=lambda: (b_ids,)), 4 * BS)
        meta = sched.build_connector_meta(sched_out({}, {}))
        (load,) = meta.loads
        assert load.dest_blocks == b_ids[:4]
        for w in workers:  # one lease, loaded by every rank
            w.start_load(meta)
        wait_finished(workers, {"b"}, "load")
        for rank, (w, kv) in enumerate(zip(workers, kvs)):
            assert w.get_block_ids_with_load_errors() == set()
            after = snapshot(kv, b_ids[:4])
            for i in range(4):
                assert all(torch.equal(x, y) for x, y in zip(after[i], before[rank][i])), (rank, i)
            # Every other block still holds the canary.
            rest = snapshot(kv, [i for i in range(NB) if i not in b_ids[:4]])
            assert all(
                torch.equal(x, y) for r, a in zip(rest, around[rank]) for x, y in zip(r, a)
            ), f"rank {rank}: a byte outside the destination blocks changed"
        assert sched.request_finished(b) == (False, None)
        # The query and the loads went through request mailboxes (the config's default).
        assert sched.link.client().has_mailbox
        assert all(w.link.client().has_mailbox for w in workers)
        s = workers[0].take_stats()
        assert s["loaded_tokens"] == 4 * BS and s["loaded_blocks"] == 4, s
    finally:
        for w in workers:
            w.shutdown()
        node.kill()


def test_failed_loads_report_exactly_their_blocks(node):
    cfg = parse_extra_config({"address": node.addr, "load_timeout_ms": 2000})
    kv = kv_tensors(2, NB, HEADS, BS, HEAD, "LBNHC")
    w = WorkerSide(cfg, instance="fail", model="m", kv_dtype="float32", tp_rank=0, tp_size=1,
                   num_blocks=NB)
    w.register_kv_caches(kv)
    try:
        meta = StepMetadata(loads=[
            LoadSpec("lost", None, [1, 2, 3], 48),  # the lease was lost before the load
            LoadSpec("bogus", "00" * 16, [7, 8], 32),  # a lease the node does not know
        ])
        w.start_load(meta)
        wait_finished([w], {"lost", "bogus"}, "load")
        assert w.get_block_ids_with_load_errors() == {1, 2, 3, 7, 8}
        assert w.get_block_ids_with_load_errors() == set()  # reported once
        s = w.take_stats()
        assert s["load_failures"] == 2 and s["failed_blocks"] == 5, s
    finally:
        w.shutdown()


def test_node_down_costs_one_deadline_then_nothing(tmp_path):
    from vllm_support import free_port

    cfg = parse_extra_config({"address": f"127.0.0.1:{free_port()}", "deadline_ms": 300,
                              "connect_timeout_ms": 300, "retry_ms": 5000})
    sched = SchedulerSide(
        cfg, instance="x", model="m", kv_dtype="float32", block_size=BS, tp_size=1
    )
    t0 = time.monotonic()
    assert sched.get_num_new_matched_tokens(req("a", list(range(64))), 0) == (0, False)
    first = time.monotonic() - t0
    t1 = time.monotonic()
    for i in range(50):
        assert sched.get_num_new_matched_tokens(req(f"r{i}", list(range(64))), 0) == (0, False)
    rest = time.monotonic() - t1
    assert first < 3 and rest < 0.5, (first, rest)
    s = sched.take_stats()
    assert s["query_failures"] == 1 and s["queries_skipped"] == 50, s


def test_worker_registers_again_after_a_node_restart(node, monkeypatch):
    import kvferry.vllm.worker as worker_mod

    monkeypatch.setattr(worker_mod, "PROBE_S", 0.1)
    cfg = parse_extra_config({"address": node.addr, "retry_ms": 50, "deadline_ms": 500})
    kv = kv_tensors(2, NB, HEADS, BS, HEAD, "LBNHC")
    w = WorkerSide(cfg, instance="restart", model="m", kv_dtype="float32", tp_rank=0,
                   tp_size=1, num_blocks=NB)
    w.register_kv_caches(kv)
    sched = SchedulerSide(cfg, instance="restart", model="m", kv_dtype="float32",
                          block_size=BS, tp_size=1)
    try:
        assert w.take_stats().get("registrations") == 1
        node.kill()
        node.start()  # same address, empty: it knows no instance
        end = time.monotonic() + 20
        regs = 0
        while time.monotonic() < end and not regs:
            regs += w.take_stats().get("registrations", 0)
            time.sleep(0.05)
        assert regs == 1, "the worker registered again by itself"
        # Saves and hits work again.
        toks = list(range(900, 900 + 2 * BS))
        a = req("a", toks)
        sched.get_num_new_matched_tokens(a, 0)
        meta = sched.build_connector_meta(sched_out({"a": len(toks)}, {"a": [1, 2]}))
        w.submit_saves(meta)
        wait_finished([w], {"a"}, "save")
        assert sched.get_num_new_matched_tokens(req("b", toks), 0) == (2 * BS, True)
    finally:
        w.shutdown()


def test_released_kv_is_forgotten_by_the_node_and_registered_again_on_restore(
        node, monkeypatch):
    # vLLM 0.33+ releases the KV cache's memory for sleep or a weight update
    # (unregister_kv_caches) and gives it back later (restore_kv_caches).
    import kvferry
    import kvferry.vllm.worker as worker_mod

    monkeypatch.setattr(worker_mod, "PROBE_S", 0.05)
    cfg = parse_extra_config({"address": node.addr, "retry_ms": 50, "deadline_ms": 500})
    kv = kv_tensors(2, NB, HEADS, BS, HEAD, "LBNHC")
    ranks = [WorkerSide(cfg, instance="sleepy", model="m", kv_dtype="float32", tp_rank=r,
                        tp_size=2, num_blocks=NB) for r in range(2)]
    sched = SchedulerSide(cfg, instance="sleepy", model="m", kv_dtype="float32",
                          block_size=BS, tp_size=2)
    probe = kvferry.EngineClient(node.addr, deadline_s=5.0)
    try:
        for w in ranks:
            w.register_kv_caches(kv if w.rank == 0 else kv_tensors(2, NB, HEADS, BS, HEAD))
            assert w.take_stats().get("registrations") == 1
        for w in ranks:
            w.release()  # every rank; the first removes the instance
        with pytest.raises(Exception) as gone:
            probe.query("sleepy", [b"x" * 32])
        assert getattr(gone.value, "code", None) == "NOT_FOUND", gone.value
        time.sleep(0.5)  # the idle probes do not register it behind vLLM's back
        assert not any(w.registered for w in ranks)
        assert not any(w.take_stats().get("registrations") for w in ranks)
        for w in ranks:
            w.restore()
            assert w.registered and w.take_stats().get("registrations") == 1
        # Saves and hits work again.
        toks = list(range(700, 700 + 2 * BS))
        a = req("a", toks)
        sched.get_num_new_matched_tokens(a, 0)
        meta = sched.build_connector_meta(sched_out({"a": len(toks)}, {"a": [1, 2]}))
        for w in ranks:
            w.submit_saves(meta)
        wait_finished(ranks, {"a"}, "save")
        assert sched.get_num_new_matched_tokens(req("b", toks), 0) == (2 * BS, True)
    finally:
        for w in ranks:
            w.shutdown()


def test_multimodal_inputs_and_salts_change_the_hashes():
    from kvferry.vllm.hashing import ChainHasher, engine_salt, lora_key, request_salt

    base = engine_salt("m", "bfloat16;LBNHC", 16, 1)
    toks = [7] * 64
    plain = ChainHasher(base, 16).upto(toks, 4)
    # An image over tokens 20..35 (blocks 1 and 2): same token ids, other content.
    cat = ChainHasher(base, 16, [("img-cat", 20, 16)]).upto(toks, 4)
    dog = ChainHasher(base, 16, [("img-dog", 20, 16)]).upto(toks, 4)
    assert cat[0] == dog[0] == plain[0]  # block 0 lies before the image
    assert cat[1] != dog[1] and cat[1] != plain[1]
    assert cat[3] != dog[3]  # chained: every later block differs too
    lora_a = ("lora-a", 1, "/adapters/a")
    assert ChainHasher(request_salt(base, lora_a, None), 16).upto(toks, 1) != plain[:1]
    assert ChainHasher(request_salt(base, None, "salt"), 16).upto(toks, 1) != plain[:1]
    assert request_salt(base, None, None) == base
    # Every tenant field counts, and no two tenants' fields run together.
    salts = [
        request_salt(base, t, s)
        for t, s in [
            (lora_a, None), (("lora-b", 1, "/adapters/a"), None),
            (("lora-a", 2, "/adapters/a"), None), (("lora-a", 1, "/adapters/b"), None),
            (("lora-a", 1, ""), None), (("", 0, ""), None), (None, "s1"), (None, "s2"),
            (lora_a, "s1"), (("lora-a", 1, "/adapters/as1"), None), (None, None),
            (("ab", 0, "c"), None), (("a", 0, "bc"), None),
        ]
    ]
    assert len(set(salts)) == len(salts)
    assert request_salt(base, None, "") == base  # an empty cache salt is no salt (as vLLM)
    assert lora_key(None) is None
    lr = NS(lora_name="sql", lora_int_id=3, lora_path="/a/sql")
    assert lora_key(lr) == ("sql", 3, "/a/sql")
    assert lora_key(NS(lora_name="sql")) == ("sql", 0, "")  # a release without id or path


def test_requests_kvferry_cannot_name_are_never_queried():
    cfg = parse_extra_config({"address": "127.0.0.1:9"})
    calls = []

    def factory():
        calls.append(1)
        raise AssertionError("no node call expected")

    sched = SchedulerSide(cfg, instance="x", model="m", kv_dtype="float32", block_size=BS,
                          tp_size=1, client_factory=factory)
    embeds = req("e", list(range(64)))
    embeds.prompt_embeds = object()  # prompt embeddings: no token ids to hash
    assert sched.get_num_new_matched_tokens(embeds, 0) == (0, False)
    short = req("s", list(range(BS - 1)))  # no full block
    assert sched.get_num_new_matched_tokens(short, 0) == (0, False)
    assert calls == []


def test_vllm_taking_fewer_blocks_than_leased_loads_exactly_those(node):
    cfg = parse_extra_config({"address": node.addr})
    kv = kv_tensors(2, NB, HEADS, BS, HEAD, "LBNHC")
    w = WorkerSide(cfg, instance="fewer", model="m", kv_dtype="float32", tp_rank=0, tp_size=1,
                   num_blocks=NB)
    w.register_kv_caches(kv)
    sched = SchedulerSide(cfg, instance="fewer", model="m", kv_dtype="float32", block_size=BS,
                          tp_size=1)
    try:
        toks = list(range(3000, 3000 + 4 * BS))
        fill(kv, [1, 2, 3, 4], seed=9)
        want = snapshot(kv, [1, 2])
        save_prompt(sched, w, toks, [1, 2, 3, 4])
        b = req("b", toks)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * BS, True)
        # vLLM allocates (and loads) only 2 of the 4 blocks: the lease is redone for 2.
        sched.update_state_after_alloc(b, NS(get_block_ids=lambda: ([10, 11],)), 2 * BS)
        meta = sched.build_connector_meta(sched_out({}, {}))
        (load,) = meta.loads
        assert load.dest_blocks == [10, 11] and load.lease is not None
        w.start_load(meta)
        wait_finished([w], {"b"}, "load")
        assert w.get_block_ids_with_load_errors() == set()
        got = snapshot(kv, [10, 11])
        assert all(torch.equal(x, y) for g, h in zip(got, want) for x, y in zip(g, h))
    finally:
        w.shutdown()


def test_auto_load_mode_loads_sync_when_alone_and_async_beside_running_requests(node):
    from kvferry.vllm.kvcache import layer_names

    cfg = parse_extra_config({"address": node.addr})
    assert cfg.load_mode == "auto"  # the default
    kv = kv_tensors(2, NB, HEADS, BS, HEAD, "LBNHC")
    w = WorkerSide(cfg, instance="auto", model="m", kv_dtype="float32", tp_rank=0, tp_size=1,
                   num_blocks=NB)
    w.register_kv_caches(kv)
    sched = SchedulerSide(cfg, instance="auto", model="m", kv_dtype="float32", block_size=BS,
                          tp_size=1, async_scheduling=False)
    # Under vLLM's async scheduling (its default) "auto" is always asynchronous: a failed
    # synchronous load would leave the request stuck there.
    under_async = SchedulerSide(cfg, instance="auto", model="m", kv_dtype="float32",
                                block_size=BS, tp_size=1)
    try:
        toks = list(range(7000, 7000 + 4 * BS))
        fill(kv, [1, 2, 3, 4], seed=5)
        want = snapshot(kv, [1, 2, 3, 4])
        save_prompt(sched, w, toks, [1, 2, 3, 4])
        sched.update_connector_output(NS(finished_sending={"a"}))

        lone = req("lone", toks)
        assert under_async.get_num_new_matched_tokens(lone, 0) == (4 * BS, True)
        under_async.request_finished(lone)
        # Alone: synchronous, so one token is left for this step's forward (3 of 4 blocks).
        b = req("b", toks)
        assert sched.get_num_new_matched_tokens(b, 0) == (3 * BS, False)
        canary(kv)
        sched.update_state_after_alloc(b, NS(get_block_ids=lambda: ([10, 11, 12, 13],)),
                                       3 * BS)
        meta = sched.build_connector_meta(sched_out({"b": 1}, {"b": [10, 11, 12, 13]}))
        (load,) = meta.loads
        assert load.sync and load.dest_blocks == [10, 11, 12]
        w.start_load(meta)
        for name in layer_names(w.layout):
            w.wait_for_layer_load(name)
        assert w.get_block_ids_with_load_errors() == set()
        got = snapshot(kv, [10, 11, 12])
        assert all(torch.equal(x, y) for g, h in zip(got, want[:3]) for x, y in zip(g, h))
        rest = snapshot(kv, [i for i in range(NB) if i not in (1, 2, 3, 4, 10, 11, 12)])
        assert all(bool((t == -7.0).all()) for r in rest for t in r), "a canary changed"

        # Beside a running request (b decodes): asynchronous, every full block.
        c = req("c", toks)
        assert sched.get_num_new_matched_tokens(c, 0) == (4 * BS, True)
        sched.request_finished(c)
        # b ends: alone again.
        sched.request_finished(b)
        d = req("d", toks)
        assert sched.get_num_new_matched_tokens(d, 0) == (3 * BS, False)
        sched.update_state_after_alloc(d, NS(get_block_ids=lambda: ([14, 15, 16, 17],)),
                                       3 * BS)
        # A second hit in the same step as d's sync load: asynchronous.
        e = req("e", toks)
        assert sched.get_num_new_matched_tokens(e, 0) == (4 * BS, True)
        sched.update_state_after_alloc(e, NS(get_block_ids=lambda: ([18, 19, 20, 21],)),
                                       4 * BS)
        meta = sched.build_connector_meta(sched_out({"d": 1}, {"d": [14, 15, 16, 17]}))
        assert [(s.req_id, s.sync) for s in meta.loads] == [("d", True), ("e", False)]
        w.start_load(meta)
        for name in layer_names(w.layout):
            w.wait_for_layer_load(name)
        wait_finished([w], {"e"}, "load")
        got = snapshot(kv, [14, 15, 16, 18, 19, 20, 21])
        for g, h in zip(got, want[:3] + want):
            assert all(torch.equal(x, y) for x, y in zip(g, h))
        s = sched.take_stats()
        assert (s["sync_hits"], s["async_hits"]) == (2, 2), s
        for r in (d, e):
            sched.request_finished(r)
    finally:
        w.shutdown()
