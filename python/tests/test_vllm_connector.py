"""kvferry.vllm.KvferryConnector driven by vLLM's real Scheduler, on CPU, with whichever
supported release the interpreter has (0.26, 0.33, 0.34).

Each test starts its own ``kvferry node`` (``[device] kind = "host"``). The engine is
vLLM's ``Scheduler`` built from a ``VllmConfig`` (a tiny Llama ``config.json`` written by
the test, ``DeviceConfig("cpu")``, ``num_gpu_blocks`` set by hand, a ``KVTransferConfig``
naming the connector by ``kv_connector_module_path``); the worker side is a second
``KvferryConnector`` whose KV is memfd-backed CPU tensors in the layout that release
allocates, written by a deterministic forward pass and driven as that release's model
runner drives it (see ``vllm_engine.py``). Where releases differ, a test says which
behaviour it expects of which.

Run with the interpreter of ``scripts/vllm-env VERSION`` (vLLM + pytest) after installing
the package into it (``scripts/python-env "$(dirname "$(dirname "$(scripts/vllm-env)")")"``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_engine import Engine, prompt, runner  # noqa: E402
from vllm_support import Node, block_contents, expected_block, free_port  # noqa: E402

import kvferry  # noqa: E402

BS = 16


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.kill()


def engine(tmp_path, addr, **kw):
    extra = {"address": addr, "deadline_ms": 500, "retry_ms": 100}
    extra.update(kw.pop("extra", {}))
    return Engine(tmp_path, extra, **kw)


def blocks_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def status(req) -> str:
    return str(req.status).rsplit(".", 1)[-1]


def test_vllm_version():
    import vllm

    from kvferry.vllm import SUPPORTED_VLLM
    from kvferry.vllm.compat import TESTED_VLLM

    assert vllm.__version__ in SUPPORTED_VLLM and SUPPORTED_VLLM == TESTED_VLLM


def test_cross_layer_layout_asked_for_only_when_configured(tmp_path, node):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_engine import kv_cache_config, vllm_config

    from kvferry.vllm import KvferryConnector

    for kv_layout, cross in (("cross_layer", True), ("auto", False)):
        vc = vllm_config(tmp_path, {"address": node.addr, "kv_layout": kv_layout})
        w = KvferryConnector(vc, KVConnectorRole.WORKER, kv_cache_config(vc, 64))
        if runner().cross_layer_register:
            # vLLM 0.26: asked for by prefer_cross_layer_blocks; its layouts are NHD/HND,
            # so a BLHNC answer would be refused there.
            assert KvferryConnector.get_required_kvcache_layout(vc) is None
            assert w.prefer_cross_layer_blocks is cross
        else:
            # vLLM 0.33+: asked for as a KV cache layout.
            want = "BLHNC" if cross else None
            assert KvferryConnector.get_required_kvcache_layout(vc) == want
            assert not w.prefer_cross_layer_blocks


def test_unknown_extra_config_key_refused_at_start(tmp_path, node):
    with pytest.raises(ValueError, match=r"unknown key 'adress'.*known keys: address"):
        Engine(tmp_path, {"address": node.addr, "adress": "x"})
    with pytest.raises(ValueError, match="'address' is required"):
        Engine(tmp_path, {})
    with pytest.raises(ValueError, match="deadline_ms"):
        Engine(tmp_path, {"address": node.addr, "deadline_ms": "fast"})


@pytest.mark.parametrize(
    "layout, async_scheduling, load_mode",
    [("LBNHC", True, None), ("BLHNC", True, None), ("LBNHC", False, None),
     ("LBNHC", False, "async")],
    ids=["LBNHC-async-scheduler", "BLHNC-async-scheduler", "LBNHC-scheduler-auto",
         "LBNHC-scheduler-async"],
)
def test_second_prompt_gets_its_prefix_from_kvferry(tmp_path, node, layout, async_scheduling,
                                                    load_mode):
    extra = {"kv_layout": "cross_layer"} if layout == "BLHNC" else {}
    if load_mode:
        extra["load_mode"] = load_mode
    eng = engine(tmp_path, node.addr, layout=layout, extra=extra,
                 async_scheduling=async_scheduling)
    want = "AsyncScheduler" if async_scheduling else "Scheduler"
    assert type(eng.scheduler).__name__ == want
    # Cross-layer KV as this vLLM hands it over: a load is then one copy per block.
    want_kind = "cross_layer" if layout == "BLHNC" else "attention"
    assert eng.worker.worker_side.layout.kind == want_kind
    try:
        toks = prompt(100)
        eng.add("a", toks)
        eng.step()  # prefill of a: computed and saved
        a_ids = eng.block_ids("a")
        a_blocks = [block_contents(eng.kv, b) for b in a_ids[:6]]
        eng.run()
        assert eng.stats.get("saved_blocks") == 6, eng.stats
        # vLLM's own prefix cache would serve the second prompt: empty it, so the prefix
        # has to come from kvferry.
        assert eng.scheduler.reset_prefix_cache()
        eng.stats = {}
        eng.add("b", toks)
        so = eng.step()
        b = eng.requests["b"]
        (load,) = so.kv_connector_metadata.loads
        # The default ("auto") loads a lone hit synchronously where vLLM schedules
        # synchronously: its forward runs in the step of its load.
        sync = not async_scheduling and load_mode is None
        assert load.sync == sync
        if sync:
            assert status(b) == "RUNNING"
        else:
            assert status(b) == "WAITING_FOR_REMOTE_KVS"  # an asynchronous load
        assert b.num_computed_tokens >= 96  # 6 full blocks of 16 matched
        b_ids = eng.block_ids("b")
        eng.run(until=lambda: status(b) == "RUNNING" or "b" in eng.finished)
        assert eng.invalid_reported == set()
        for i in range(6):
            got = block_contents(eng.kv, b_ids[i])
            assert blocks_equal(got, a_blocks[i]), f"block {i}"
            assert blocks_equal(got, expected_block(eng.kv, toks, i, BS)), f"block {i}"
        eng.run()
        # Only the 4 tokens after the loaded prefix (and the decode step) were computed.
        assert eng.scheduled_tokens["b"] == 100 - 96 + 1
        assert eng.outputs["b"] == eng.outputs["a"]
        s = eng.stats
        assert s["hit_tokens"] == 96 and s["loaded_tokens"] == 96, s
        assert s["loads"] == 1 and not s.get("load_failures"), s
    finally:
        eng.shutdown()


def test_tokens_beyond_vllms_local_prefix_hit(tmp_path, node):
    eng = engine(tmp_path, node.addr)
    try:
        toks = prompt(100, seed=3)
        eng.add("a", toks)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()
        # vLLM caches the first 4 blocks locally again...
        eng.add("short", toks[:65])
        eng.run()
        # ...so of the 6 full blocks of the prompt, kvferry brings blocks 4 and 5.
        eng.add("c", toks)
        so = eng.step()
        c = eng.requests["c"]
        assert c.num_computed_tokens == 96
        (load,) = so.kv_connector_metadata.loads
        ids = eng.block_ids("c")
        assert load.dest_blocks == ids[4:6] and load.tokens == 32
        eng.run()
        for i in range(6):
            assert blocks_equal(block_contents(eng.kv, ids[i]), expected_block(eng.kv, toks, i, BS))
    finally:
        eng.shutdown()


def test_sync_load_mode(tmp_path, node):
    eng = engine(tmp_path, node.addr, extra={"load_mode": "sync"})
    try:
        toks = prompt(90, seed=4)
        eng.add("a", toks)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()
        eng.add("b", toks)
        so = eng.step()
        assert getattr(so, "has_sync_kv_loads", True)  # 0.26 has no such flag
        (load,) = so.kv_connector_metadata.loads
        assert load.sync and len(load.dest_blocks) == 5
        b = eng.requests["b"]
        # Loaded before this step's forward, which computed the rest of the prompt.
        assert eng.scheduled_tokens["b"] == 90 - 80
        ids = eng.block_ids("b")
        for i in range(5):
            assert blocks_equal(block_contents(eng.kv, ids[i]), expected_block(eng.kv, toks, i, BS))
        eng.run()
        assert eng.invalid_reported == set() and "b" in eng.finished
        assert status(b) != "WAITING_FOR_REMOTE_KVS"
    finally:
        eng.shutdown()


def test_a_sync_load_started_by_the_scheduler(tmp_path, node):
    """load_start "scheduler": a synchronous load starts from the scheduler as vLLM
    allocates its blocks, so its bytes are in before the step reaches the worker, which
    starts no load of its own and only watches it; a load the node refuses the scheduler
    leaves to the worker."""
    eng = engine(tmp_path, node.addr, async_scheduling=False,
                 extra={"load_mode": "sync", "load_start": "scheduler"})
    calls = []
    side = eng.worker.worker_side
    real_call = side.link.call
    side.link.call = lambda what, fn: (calls.append(what), real_call(what, fn))[1]
    try:
        toks = prompt(90, seed=6)
        eng.add("a", toks)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()

        def landed_before_the_worker(so):
            (load,) = so.kv_connector_metadata.loads
            assert load.sync and load.early is not None and len(load.dest_blocks) == 5
            want = [expected_block(eng.kv, toks, i, BS) for i in range(5)]
            end = time.monotonic() + 10
            while not all(blocks_equal(block_contents(eng.kv, b), w)
                          for b, w in zip(load.dest_blocks, want)):
                assert time.monotonic() < end, "the scheduler's load never landed"
                time.sleep(0.005)
            calls.clear()

        eng.stats = {}
        eng.add("b", toks)
        eng.step(before_worker=landed_before_the_worker)
        assert "load" not in calls, calls
        assert eng.scheduled_tokens["b"] == 90 - 80
        eng.run()
        assert eng.invalid_reported == set() and eng.outputs["b"] == eng.outputs["a"]
        s = eng.stats
        assert s.get("early_loads") == 1 and s.get("loaded_blocks") == 5, s
        assert not s.get("load_failures") and not s.get("early_load_refusals"), s

        # The node refuses the scheduler's load: the worker loads, byte for byte.
        sched = eng.connector.scheduler_side
        real = sched.link.call

        def refuse_loads(what, fn):
            if what == "load":
                raise RuntimeError("refused for the test")
            return real(what, fn)

        sched.link.call = refuse_loads
        assert eng.scheduler.reset_prefix_cache()
        eng.stats = {}
        eng.add("c", toks)
        so = eng.step()
        (load,) = so.kv_connector_metadata.loads
        assert load.early is None and "load" in calls
        ids = eng.block_ids("c")
        for i in range(5):
            assert blocks_equal(block_contents(eng.kv, ids[i]), expected_block(eng.kv, toks, i, BS))
        eng.run()
        s = eng.stats
        assert s.get("early_load_refusals") == 1 and not s.get("early_loads"), s
        assert eng.invalid_reported == set() and eng.outputs["c"] == eng.outputs["a"]
        assert kvferry.EngineClient(node.addr).stats()["leases_live"] == 0
    finally:
        eng.shutdown()


def test_load_start_scheduler_is_declined_where_unsafe(tmp_path, node, caplog):
    """Under vLLM's async scheduling (a step may still run on the blocks it allocates) the
    scheduler starts no load itself, and says so."""
    import logging

    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        eng = engine(tmp_path, node.addr, async_scheduling=True,
                     extra={"load_mode": "sync", "load_start": "scheduler"})
    try:
        assert eng.connector.scheduler_side.early_loads is False
        assert "vLLM schedules asynchronously" in caplog.text, caplog.text
        toks = prompt(40, seed=8)
        eng.add("a", toks)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()
        eng.add("b", toks)
        so = eng.step()
        (load,) = so.kv_connector_metadata.loads
        assert load.early is None
        eng.run()
        assert eng.outputs["b"] == eng.outputs["a"] and not eng.stats.get("early_loads")
    finally:
        eng.shutdown()


def failures_reported(eng) -> bool:
    return bool(eng.invalid_reported or eng.failed_recving)


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_node_killed_mid_load_is_reported_and_recomputed(tmp_path, node, load_mode):
    # A failed synchronous load under vLLM's AsyncScheduler leaves the request stuck on
    # every release tested (0.26, 0.33, 0.34): vLLM drops the step's output of a request
    # it reschedules for invalid blocks but keeps that output's placeholder, so it never
    # schedules the request again. vLLM's own scheduler shows what kvferry reports.
    eng = engine(tmp_path, node.addr, extra={"load_mode": load_mode},
                 async_scheduling=load_mode == "async")
    try:
        toks = prompt(100, seed=6)
        eng.add("a", toks)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()
        eng.stats = {}
        eng.add("b", toks)
        planned = {}

        def kill_after_lease(so):
            # The lease is granted and the load handed to the workers: the node dies now.
            (load,) = so.kv_connector_metadata.loads
            planned["dest"] = set(load.dest_blocks)
            node.kill()

        eng.step(before_worker=kill_after_lease)
        b = eng.requests["b"]
        eng.run(until=lambda: failures_reported(eng) or "b" in eng.finished, max_steps=500)
        assert len(planned["dest"]) == 6
        if load_mode == "async" and runner().transfer_results:
            # vLLM 0.33+: an asynchronous load's failure is the request's, through
            # failed_recving, in the step that reports its load finished.
            assert eng.failed_recving == {"b"} and eng.invalid_reported == set()
            assert {"b"} in eng.failed_steps
        else:
            # vLLM 0.26, and synchronous loads everywhere: exactly the failed blocks, in one
            # step (an asynchronous load's together with its finished load).
            assert eng.invalid_reported == planned["dest"] and not eng.failed_recving
            assert planned["dest"] in eng.invalid_steps
        # vLLM recomputes the prompt (kv_load_failure_policy = "recompute") and finishes.
        eng.run(max_steps=500)
        assert "b" in eng.finished and eng.outputs["b"] == eng.outputs["a"]
        assert eng.scheduled_tokens["b"] >= 100
        ids_ok = status(b)
        assert "ERROR" not in ids_ok
        s = eng.stats
        assert s.get("load_failures") == 1 and s.get("failed_blocks") == 6, s
        # With the node gone, later requests schedule without hits.
        eng.add("c", prompt(50, seed=9))
        eng.run(max_steps=500)
        assert "c" in eng.finished
    finally:
        eng.shutdown()


def test_stalled_node_costs_a_deadline_not_a_hang(tmp_path, node):
    eng = engine(tmp_path, node.addr, extra={"load_timeout_ms": 1500})
    try:
        toks = prompt(64, seed=8)
        eng.add("a", toks)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()
        eng.add("b", toks)

        def stall(so):
            node.stop_signal(signal.SIGSTOP)

        t0 = time.monotonic()
        eng.step(before_worker=stall)
        eng.run(until=lambda: "b" in eng.finished, max_steps=2000, sleep=0.01)
        took = time.monotonic() - t0
        assert failures_reported(eng), "the stalled load is reported failed"
        assert took < 20, took
        # Scheduling a new request while the node is stalled: one deadline, then backoff.
        t1 = time.monotonic()
        eng.add("c", prompt(40, seed=10))
        eng.run(max_steps=2000, sleep=0.01)
        assert time.monotonic() - t1 < 10
    finally:
        node.stop_signal(signal.SIGCONT)
        eng.shutdown()


def test_node_down_at_start_gives_zero_hits_and_scheduling_goes_on(tmp_path):
    port = free_port()
    t0 = time.monotonic()
    eng = engine(tmp_path, f"127.0.0.1:{port}")
    try:
        toks = prompt(80, seed=11)
        for i in range(3):
            eng.add(f"r{i}", toks)
            eng.run(max_steps=100)
            assert f"r{i}" in eng.finished
            assert eng.scheduled_tokens[f"r{i}"] >= 1
        assert time.monotonic() - t0 < 60
        s = eng.stats
        assert not s.get("hit_tokens") and not s.get("loads"), s
        assert s.get("query_failures", 0) + s.get("queries_skipped", 0) >= 1, s
        # The node comes up: the worker registers again by itself, saves resume, and
        # hits follow once the connector's backoff (retry_ms 100, doubling) has passed.
        n = Node(tmp_path, name="late", port=port)
        try:
            hit, i, until = False, 0, time.monotonic() + 30
            while not hit and time.monotonic() < until:
                assert eng.scheduler.reset_prefix_cache()
                rid = f"late{i}"
                eng.add(rid, toks)
                eng.step()
                # A hit is an asynchronous load of the 5 full blocks (a miss computes all).
                r = eng.requests[rid]
                hit = status(r) == "WAITING_FOR_REMOTE_KVS" and r.num_computed_tokens == 80
                eng.run(max_steps=100)
                i += 1
                time.sleep(0.2)
            assert hit, eng.stats
            assert eng.worker.worker_side.registered
            assert eng.stats.get("registrations") == 1, (eng.stats, eng.stats_log[-40:])
            assert eng.invalid_reported == set()
        finally:
            n.kill()
    finally:
        eng.shutdown()


def test_direct_loads_only_when_granted(tmp_path, node):
    eng = engine(tmp_path, node.addr, extra={"direct_gpu": True})
    try:
        toks = prompt(48, seed=12)
        eng.add("a", toks)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()
        eng.add("b", toks)
        eng.run()
        s = eng.stats
        # A node without peers has no remote suffix to read into GPU memory: it refuses
        # direct loads (with its reason), and the lease loads staged, correctly.
        assert s.get("direct_refused", 0) >= 1, s
        assert s.get("loaded_tokens") == 48 and not s.get("load_failures"), s
    finally:
        eng.shutdown()


def test_two_engine_processes_hit_each_others_blocks(tmp_path, node):
    here = Path(__file__).resolve().parent
    script = here / "vllm_engine.py"

    def run(mode, instance, seed):
        env = dict(os.environ, PYTHONHASHSEED=str(seed))
        p = subprocess.run(
            [sys.executable, str(script), f"--{mode}", "--address", node.addr,
             "--instance", instance, "--tokens", "100", "--tmp", str(tmp_path / instance)],
            env=env, capture_output=True, text=True, timeout=300,
        )
        line = next((x for x in p.stdout.splitlines() if x.startswith("ENGINE ")), None)
        assert p.returncode == 0 and line, p.stdout[-3000:] + p.stderr[-3000:]
        return json.loads(line[len("ENGINE "):])

    saved = run("save", "engine-one", 1)
    assert saved["saved_blocks"] == 6, saved
    got = run("load", "engine-two", 2)
    assert got["pythonhashseed"] == "2" and saved["pythonhashseed"] == "1"
    assert got["matched_tokens"] == 96, got
    assert got["bytes_ok"] and got["invalid"] == [], got


def test_stats_and_prometheus(tmp_path, node):
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    from kvferry.vllm import KvferryConnector

    eng = engine(tmp_path, node.addr)
    try:
        toks = prompt(40, seed=13)
        eng.add("a", toks)
        eng.run()
        eng.scheduler.reset_prefix_cache()
        eng.add("b", toks)
        eng.run()
        data = eng.stats
        stats = KvferryConnector.build_kv_connector_stats(data)
        summary = stats.reduce()
        assert summary["hit_tokens"] == 32 and summary["loaded_tokens"] == 32, summary
        assert "avg_load_ms" in summary
        prom = KvferryConnector.build_prom_metrics(
            eng.vc, {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
            ["model_name", "engine"], {0: ["tiny", "0"]},
        )
        prom.observe(data, 0)
        v = REGISTRY.get_sample_value(
            "vllm:kvferry_hit_tokens_total", {"model_name": "tiny", "engine": "0"}
        )
        assert v == 32
        n = REGISTRY.get_sample_value(
            "vllm:kvferry_load_duration_seconds_count", {"model_name": "tiny", "engine": "0"}
        )
        assert n == 1
        # vLLM's periodic "KV Transfer metrics" log line.
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

        logging_ = KVConnectorLogging(eng.vc.kv_transfer_config)
        logging_.observe(data)
        lines = []
        logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
        assert lines and "hit_tokens=32" in lines[0] and "avg_load_ms=" in lines[0], lines
    finally:
        eng.shutdown()


def test_tp2_ranks_load_their_share_of_one_lease(tmp_path, node):
    eng = engine(tmp_path, node.addr, tp=2)
    try:
        assert [w.worker_side.rank for w in eng.workers] == [0, 1]
        toks = prompt(70, seed=14)
        eng.add("a", toks)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()
        eng.add("b", toks)
        so = eng.step()
        b = eng.requests["b"]
        assert status(b) == "WAITING_FOR_REMOTE_KVS" and b.num_computed_tokens == 64
        (load,) = so.kv_connector_metadata.loads  # one lease for both ranks
        eng.run(until=lambda: status(b) != "WAITING_FOR_REMOTE_KVS")
        assert eng.invalid_reported == set()
        for rank, kv in enumerate(eng.kvs):  # each rank got its own bytes
            for i, blk in enumerate(load.dest_blocks):
                want = expected_block(kv, toks, i, BS, rank=rank)
                assert blocks_equal(block_contents(kv, blk), want), (rank, i)
        eng.run()
        assert eng.outputs["b"] == eng.outputs["a"]
    finally:
        eng.shutdown()


# ------------------------------------------------------------------------------ model names

@pytest.mark.parametrize("served", [
    "meta-llama/Llama-3.1-8B-Instruct",
    "/models/llama",
    ["org/llama-8b", "llama"],
], ids=["hf-id", "path", "served-name-list"])
def test_every_model_name_gets_hits(tmp_path, node, served):
    eng = engine(tmp_path, node.addr, served_model_name=served)
    try:
        side = eng.worker.worker_side
        name = served[0] if isinstance(served, list) else served
        assert side.model == name and side.registered
        # The node's namespace holds the name escaped (its '/' refused there).
        assert side.namespace.split("/")[0] == name.replace("/", "%2F"), side.namespace
        toks = prompt(64, seed=21)
        eng.add("a", toks)
        eng.run()
        assert eng.stats.get("saved_blocks") == 4, eng.stats
        assert eng.scheduler.reset_prefix_cache()
        eng.stats = {}
        eng.add("b", toks)
        eng.step()
        assert status(eng.requests["b"]) == "WAITING_FOR_REMOTE_KVS"
        eng.run()
        assert eng.invalid_reported == set() and not eng.failed_recving
        assert eng.stats.get("loaded_tokens") == 64, eng.stats
        assert eng.scheduled_tokens["b"] <= 2  # the last prompt token again, and a decode
        assert eng.outputs["b"] == eng.outputs["a"]
    finally:
        eng.shutdown()


def test_two_models_never_share_blocks(tmp_path, node):
    toks = prompt(64, seed=22)
    # A name and the escaped form of another (a lossy escape would merge them).
    one = engine(tmp_path / "one", node.addr, served_model_name="org/model",
                 extra={"instance": "one"})
    try:
        one.add("a", toks)
        one.run()
        assert one.stats.get("saved_blocks") == 4
    finally:
        one.shutdown()
    two = engine(tmp_path / "two", node.addr, served_model_name="org%2Fmodel",
                 extra={"instance": "two"})
    try:
        assert two.worker.worker_side.namespace != one.worker.worker_side.namespace
        two.add("b", toks)
        two.step()
        assert status(two.requests["b"]) != "WAITING_FOR_REMOTE_KVS"
        two.run()
        assert two.stats.get("queries") and not two.stats.get("hit_tokens"), two.stats
        assert two.scheduled_tokens["b"] >= 64  # computed, not loaded
    finally:
        two.shutdown()


def _tenant(kind: str, which: str) -> dict:
    from vllm.lora.request import LoRARequest

    if kind == "lora":
        # Two adapters on one base model; their ids and paths as `--lora-modules` gives them.
        lid = {"a": 1, "b": 2}[which]
        return {"lora_request": LoRARequest(f"adapter-{which}", lid, f"/adapters/{which}")}
    if kind == "lora-repointed":
        # One adapter name pointed at another adapter (vLLM 0.34 salts with the path too).
        return {"lora_request": LoRARequest("adapter", 1, f"/adapters/{which}")}
    return {"cache_salt": f"tenant-{which}"}


@pytest.mark.parametrize("kind", ["lora", "lora-repointed", "cache-salt"])
def test_two_tenants_with_equal_tokens_never_hit_each_others_blocks(tmp_path, node, kind):
    toks = prompt(80, seed=31)
    eng = engine(tmp_path, node.addr)
    try:
        eng.add("a1", toks, **_tenant(kind, "a"))
        eng.run()
        assert eng.stats.get("saved_blocks") == 5, eng.stats
        # Only kvferry could serve what follows.
        assert eng.scheduler.reset_prefix_cache()
        eng.stats = {}
        eng.add("b1", toks, **_tenant(kind, "b"))
        eng.step()
        assert status(eng.requests["b1"]) != "WAITING_FOR_REMOTE_KVS"
        eng.run()
        assert eng.stats.get("queries") and not eng.stats.get("hit_tokens"), eng.stats
        assert eng.scheduled_tokens["b1"] >= 80  # computed, not loaded
        # b's own blocks are now saved beside a's: both tenants hit their own, and only those.
        assert eng.stats.get("saved_blocks") == 5, eng.stats
        for rid, which in [("a2", "a"), ("b2", "b")]:
            assert eng.scheduler.reset_prefix_cache()
            eng.stats = {}
            eng.add(rid, toks, **_tenant(kind, which))
            eng.run()
            assert eng.stats.get("hit_tokens") == 80, (rid, eng.stats)  # all 5 blocks
            assert eng.invalid_reported == set()
            assert eng.outputs[rid] == eng.outputs["a1"]
        if kind == "lora":
            # Each adapter's blocks are in a node namespace of their own (model/dtype/
            # fingerprint/adapter): its own RAM use, quota and label.
            text = node.metrics()
            for which in "ab":
                assert re.search(r'kvferry_namespace_ram_bytes\{namespace="[^"]*/adapter-'
                                 + which + r'"\} [1-9]', text), text
        # No tenant at all is a tenant of its own too.
        assert eng.scheduler.reset_prefix_cache()
        eng.stats = {}
        eng.add("plain", toks)
        eng.run()
        assert not eng.stats.get("hit_tokens"), eng.stats
    finally:
        eng.shutdown()


def test_a_registration_the_node_refuses_stops_the_engine_at_start(tmp_path, node,
                                                                   monkeypatch):
    import kvferry.vllm.worker as worker_mod
    from kvferry.vllm.worker import RegistrationRefused

    # Without the escape, the node refuses a Hugging Face id: the engine does not start,
    # and says why (before, it ran on with no hits and a warning per step).
    monkeypatch.setattr(worker_mod, "model_namespace", lambda name: name)
    with pytest.raises(RegistrationRefused, match=r"meta-llama/Llama-3.1-8B-Instruct.*"
                       r"namespace model must be 1 to 128 printable characters"):
        engine(tmp_path, node.addr, served_model_name="meta-llama/Llama-3.1-8B-Instruct")


# ------------------------------------------------------------------------------ preemption

def test_preempted_request_resumes_from_kvferry(tmp_path, node):
    # 12 blocks of 16 tokens (one is vLLM's null block), no prefix cache of vLLM's own: two
    # requests decoding past 5 blocks each cannot both stay, so one is preempted and, when
    # it resumes, gets its computed blocks back from kvferry. vLLM 0.34 hands the resumed
    # request over as a new one; 0.26 and 0.33 too, or as a cached one in resumed_req_ids.
    eng = engine(tmp_path, node.addr, num_blocks=12, prefix_caching=False)
    try:
        a, b = prompt(72, seed=31), prompt(72, seed=32)
        eng.add("a", a, max_tokens=40)
        eng.add("b", b, max_tokens=40)
        preempted, resumed_new, resumed_cached = set(), set(), set()
        for _ in range(400):
            if not eng.scheduler.has_requests():
                break
            so = eng.step()
            preempted |= set(so.preempted_req_ids or ())
            resumed_new |= {r.req_id for r in so.scheduled_new_reqs} & preempted
            resumed_cached |= set(getattr(so.scheduled_cached_reqs, "resumed_req_ids", ())
                                  or ()) & preempted
            time.sleep(0.002)
        assert preempted, "no request was preempted"
        assert {"a", "b"} <= eng.finished
        # 0.34 has the new scheme alone; 0.26 and 0.33 use it with their V2 model runner
        # (vLLM's choice: Triton present), the cached one with V1.
        if runner().resumed_as_new or getattr(eng.scheduler, "use_v2_model_runner", True):
            assert resumed_new == preempted and not resumed_cached
        else:
            assert resumed_cached == preempted and not resumed_new
        s = eng.stats
        assert s.get("hit_tokens", 0) >= 64 and s.get("loaded_tokens", 0) >= 64, s
        assert eng.invalid_reported == set() and not eng.failed_recving
        # The same tokens as each prompt computed alone.
        ref = engine(tmp_path / "ref", node.addr, prefix_caching=False,
                     extra={"instance": "ref", "model": "ref"})
        try:
            ref.add("a", a, max_tokens=40)
            ref.add("b", b, max_tokens=40)
            ref.run(max_steps=400)
            assert eng.outputs["a"] == ref.outputs["a"] and len(ref.outputs["a"]) == 40
            assert eng.outputs["b"] == ref.outputs["b"]
        finally:
            ref.shutdown()
    finally:
        eng.shutdown()


# ------------------------------------------------------------------------------ bad input

def test_an_untested_release_starts_with_a_warning_naming_it(tmp_path, node, monkeypatch,
                                                            caplog):
    import dataclasses
    import logging

    import kvferry.vllm.connector as conn

    monkeypatch.setattr(conn, "API", dataclasses.replace(conn.API, version="0.30.1"))
    caplog.set_level(logging.WARNING, logger="kvferry.vllm")
    eng = engine(tmp_path, node.addr)
    try:
        said = [r.getMessage() for r in caplog.records if "0.30.1" in r.getMessage()]
        assert said and "not a release kvferry is tested with (0.26.x, 0.33.x, 0.34.x)" in said[0]
        toks = prompt(48, seed=41)
        eng.add("a", toks)
        eng.run()
        assert eng.stats.get("saved_blocks") == 3  # and it works
    finally:
        eng.shutdown()
    caplog.clear()
    monkeypatch.undo()
    eng = engine(tmp_path / "tested", node.addr)
    eng.shutdown()
    assert not [r for r in caplog.records if "not a release kvferry" in r.getMessage()]


def test_a_missing_hook_refuses_to_start_naming_it(tmp_path, node, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvferry.vllm.compat import MissingHook

    monkeypatch.delattr(KVConnectorBase_V1, "get_block_ids_with_load_errors")
    with pytest.raises(MissingHook, match=r"no get_block_ids_with_load_errors\(\)"):
        engine(tmp_path, node.addr)
    monkeypatch.undo()
    # Finished transfers are reported through whichever of the two the release has.
    for name in ("get_transfer_results", "get_finished"):
        if hasattr(KVConnectorBase_V1, name):
            monkeypatch.delattr(KVConnectorBase_V1, name)
    with pytest.raises(MissingHook, match=r"neither get_transfer_results\(\) nor get_finish"):
        engine(tmp_path, node.addr)
    monkeypatch.undo()

    # A hook vLLM would call with more arguments than the connector takes.
    def three(self, request, num_computed_tokens, more):
        raise AssertionError("not called")

    monkeypatch.setattr(KVConnectorBase_V1, "get_num_new_matched_tokens", three)
    with pytest.raises(MissingHook, match=r"calls KVConnectorBase_V1.get_num_new_matched_"
                       r"tokens\(request, num_computed_tokens, more\)"):
        engine(tmp_path, node.addr)


def test_a_kv_cache_it_cannot_describe_is_refused_naming_the_layer(tmp_path, node):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_engine import kv_cache_config, vllm_config

    from kvferry.vllm import KvCacheLayoutError, KvferryConnector

    vc = vllm_config(tmp_path, {"address": node.addr})
    w = KvferryConnector(vc, KVConnectorRole.WORKER, kv_cache_config(vc, 64))
    try:
        name = "model.layers.1.self_attn.attn"
        good = {"model.layers.0.self_attn.attn": torch.zeros(64, 2, 16, 64)}
        with pytest.raises(KvCacheLayoutError, match=rf"layer '{name}'.*no dimension"):
            w.register_kv_caches({**good, name: torch.zeros(3, 5)})
        strided = torch.zeros(64, 2, 16, 128)[..., ::2]  # every other element
        with pytest.raises(KvCacheLayoutError, match=rf"layer '{name}'.*densely packed"):
            w.register_kv_caches({**good, name: strided})
        assert not w.worker_side.registered
    finally:
        w.shutdown()


def test_cross_layer_kv_laid_out_by_heads_is_refused_naming_the_layer(tmp_path, node):
    # vLLM 0.26's FlashAttention with the HND layout lays a cross-layer block out as
    # (heads, layers, tokens, ...): a layer's part of a block is not one range.
    if not runner().cross_layer_register:
        pytest.skip("vLLM 0.33+ asks for cross-layer KV as a layout (BLHNC), never as this")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_engine import kv_cache_config, vllm_config

    from kvferry.vllm import KvCacheLayoutError, KvferryConnector

    class HndFlashAttention:
        @staticmethod
        def get_name():
            return "FLASH_ATTN"

        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension=False):
            return (1, 2, 0, 3, 4)  # vLLM 0.26 FlashAttention, HND, with layers

    vc = vllm_config(tmp_path, {"address": node.addr, "kv_layout": "cross_layer"})
    w = KvferryConnector(vc, KVConnectorRole.WORKER, kv_cache_config(vc, 64))
    try:
        big = torch.zeros(64, 2, 2, 16, 64)  # (blocks, heads, layers, tokens, 2 * head)
        with pytest.raises(KvCacheLayoutError,
                           match=r"layer 'model.layers.0.self_attn.attn'.*densely packed"):
            w.register_cross_layers_kv_cache(big, HndFlashAttention)
    finally:
        w.shutdown()


def test_what_vllm_034_asks_before_any_query(tmp_path, node):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if not hasattr(KVConnectorBase_V1, "kv_cache_access"):
        pytest.skip("vLLM 0.34+ asks kv_cache_access, may_load_async, lookahead hashes")
    from vllm.config import KVTransferConfig
    from vllm.config.kv_transfer import KVCacheAccess

    from kvferry.vllm import ConfigError, KvferryConnector, parse_extra_config

    def ktc(**extra):
        return KVTransferConfig(kv_connector="KvferryConnector",
                                kv_connector_module_path="kvferry.vllm", kv_role="kv_both",
                                kv_connector_extra_config={"address": node.addr, **extra})

    # No CUDA driver here: the extensible KV cache cannot be exported, so LEGACY_IPC
    # (vLLM then allocates the KV cache without it); asked for by name, as asked (vLLM
    # itself refuses EXPORTS_FD on a CPU: the extensible cache is CUDA's and ROCm's).
    assert KvferryConnector.kv_cache_access(ktc()) == KVCacheAccess.LEGACY_IPC
    assert ktc().kv_cache_access() == KVCacheAccess.LEGACY_IPC  # vLLM's own view of it
    got = KvferryConnector.kv_cache_access(ktc(kv_cache_access="exports_fd"))
    assert got == KVCacheAccess.EXPORTS_FD
    with pytest.raises(ConfigError, match=r"'kv_cache_access' must be one of auto"):
        parse_extra_config({"address": node.addr, "kv_cache_access": "vmm"})
    with pytest.raises(ValueError, match=r"kv_cache_access'\] = 'vmm': expected one of auto"):
        engine(tmp_path, node.addr, extra={"kv_cache_access": "vmm"})  # vLLM asks first
    assert KvferryConnector.supports_lookahead_block_hashes(ktc()) is False
    # Sleep mode remaps the KV cache, which the node's registration cannot follow: vLLM
    # refuses it at start.
    assert KvferryConnector.supports_sleep_mode(ktc()) is False
    for mode, want in (("async", True), ("sync", False)):
        eng = engine(tmp_path / mode, node.addr, extra={"load_mode": mode})
        try:
            req = eng.add("a", prompt(40, seed=51))
            assert eng.connector.may_load_async(req) is want
            short = eng.add("b", prompt(10, seed=52))  # no full block: nothing to load
            assert eng.connector.may_load_async(short) is False
        finally:
            eng.shutdown()


def test_kv_released_and_restored_by_vllm_is_registered_afresh(tmp_path, node):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if not hasattr(KVConnectorBase_V1, "restore_kv_caches"):
        pytest.skip("vLLM 0.33+ releases and restores the KV cache's memory")
    eng = engine(tmp_path, node.addr)
    try:
        toks = prompt(48, seed=61)
        eng.add("a", toks)
        eng.run()
        # What vLLM does around a weight update that borrows the KV cache's memory.
        eng.worker.unregister_kv_caches()
        assert not eng.worker.worker_side.registered
        eng.worker.restore_kv_caches()
        assert eng.worker.worker_side.registered
        assert eng.scheduler.reset_prefix_cache()
        eng.stats = {}
        eng.add("b", toks)
        eng.run()
        assert eng.stats.get("loaded_tokens") == 48 and eng.stats.get("registrations") == 1
        assert eng.outputs["b"] == eng.outputs["a"] and eng.invalid_reported == set()
    finally:
        eng.shutdown()


def test_vllm_026_model_runners_decide_cross_layer_kv(tmp_path, node, monkeypatch, caplog):
    """vLLM 0.26 decides cross-layer KV in its model runners, tried here with its own code:
    the V1 runner's use_uniform_kv_cache asks the connector (prefer_cross_layer_blocks) and
    allocate_uniform_kv_caches lays one tensor out, whose views the connector describes as
    vLLM's layers see them; Model Runner V2 (0.26's default for a dense model) hands
    per-layer tensors to register_kv_caches, which the connector registers per layer and
    says why at start."""
    if not runner().cross_layer_register:
        pytest.skip("vLLM 0.26's cross-layer API (0.33+ asks for a BLHNC layout)")
    import dataclasses
    import logging

    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
    from vllm.v1.worker.utils import AttentionGroup
    from vllm_engine import kv_cache_config, vllm_config
    from vllm_support import kv_tensors

    from kvferry.vllm import KvferryConnector
    from kvferry.vllm.kvcache import cross_layer_views, describe_kv_caches

    nb = 64
    made = []

    def connector(kv_layout):
        vc = vllm_config(tmp_path, {"address": node.addr, "kv_layout": kv_layout})
        kvc = kv_cache_config(vc, nb)
        w = KvferryConnector(vc, KVConnectorRole.WORKER, kvc)
        made.append(w)
        return vc, kvc, w

    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    try:
        vc, kvc, w = connector("cross_layer")
        group = kvc.kv_cache_groups[0]
        with set_current_vllm_config(vc):
            indexes = FlashAttentionBackend.indexes_kv_by_block_stride()
        spec = dataclasses.replace(group.kv_cache_spec, indexes_kv_by_block_stride=indexes)
        groups = [[AttentionGroup(FlashAttentionBackend, list(group.layer_names), spec, 0)]]
        mixin = KVConnectorModelRunnerMixin
        # The V1 runner: cross-layer blocks where the connector asks for them.
        kv_transfer_state._KV_CONNECTOR_AGENT = w
        with set_current_vllm_config(vc):
            assert mixin.use_uniform_kv_cache(groups)
            views, big, backend = mixin.allocate_uniform_kv_caches(
                kvc, groups, vc.cache_config.cache_dtype, torch.device("cpu"),
                [vc.cache_config.block_size])
            ours = cross_layer_views(big, backend, kvc)
        assert set(ours) == set(views)
        for name, t in views.items():
            assert (ours[name].data_ptr(), ours[name].stride(), ours[name].shape) == \
                (t.data_ptr(), t.stride(), t.shape), name
        assert describe_kv_caches(ours, nb, "FLASH_ATTN").kind == "cross_layer"
        _, _, auto = connector("auto")
        kv_transfer_state._KV_CONNECTOR_AGENT = auto
        assert not mixin.use_uniform_kv_cache(groups)

        # Model Runner V2: per-layer tensors, whatever the connector prefers. vLLM picks it
        # for this model where Triton has a GPU (here it falls back to V1: no driver), so
        # the config says V2 as it does on the GPU host.
        vc, kvc, w = connector("cross_layer")
        monkeypatch.setattr(type(vc), "use_v2_model_runner", property(lambda self: True))
        kv_transfer_state._KV_CONNECTOR_AGENT = w
        kv = kv_tensors(2, nb, 2, BS, 32, "LBNHC")
        with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
            ActiveKVConnector(vc, kv)
        assert w.worker_side.layout.kind == "attention"
        why = [r.getMessage() for r in caplog.records if "cross_layer" in r.getMessage()]
        assert len(why) == 1 and "VLLM_USE_V2_MODEL_RUNNER=0" in why[0], why
    finally:
        for w in made:
            w.shutdown()
