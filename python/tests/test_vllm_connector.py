"""kvferry.vllm.KvferryConnector driven by vLLM 0.33's real Scheduler, on CPU.

Each test starts its own ``kvferry node`` (``[device] kind = "host"``). The engine is
vLLM's ``Scheduler`` built from a ``VllmConfig`` (a tiny Llama ``config.json`` written by
the test, ``DeviceConfig("cpu")``, ``num_gpu_blocks`` set by hand, a ``KVTransferConfig``
naming the connector by ``kv_connector_module_path``); the worker side is a second
``KvferryConnector`` whose KV is memfd-backed CPU tensors in vLLM 0.33's layout, written
by a deterministic forward pass (see ``vllm_engine.py``).

Run with the interpreter of ``scripts/vllm-env`` (vLLM 0.33.0 + pytest) after installing
the package into it (``scripts/python-env "$(dirname "$(dirname "$(scripts/vllm-env)")")"``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_engine import Engine, prompt  # noqa: E402
from vllm_support import Node, block_contents, expected_block, free_port  # noqa: E402

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

    assert vllm.__version__ in SUPPORTED_VLLM


def test_cross_layer_layout_asked_for_only_when_configured(tmp_path, node):
    from vllm_engine import vllm_config

    from kvferry.vllm import KvferryConnector

    vc = vllm_config(tmp_path, {"address": node.addr, "kv_layout": "cross_layer"})
    assert KvferryConnector.get_required_kvcache_layout(vc) == "BLHNC"
    vc = vllm_config(tmp_path, {"address": node.addr})
    assert KvferryConnector.get_required_kvcache_layout(vc) is None


def test_unknown_extra_config_key_refused_at_start(tmp_path, node):
    with pytest.raises(ValueError, match=r"unknown key 'adress'.*known keys: address"):
        Engine(tmp_path, {"address": node.addr, "adress": "x"})
    with pytest.raises(ValueError, match="'address' is required"):
        Engine(tmp_path, {})
    with pytest.raises(ValueError, match="deadline_ms"):
        Engine(tmp_path, {"address": node.addr, "deadline_ms": "fast"})


@pytest.mark.parametrize(
    "layout, async_scheduling",
    [("LBNHC", True), ("BLHNC", True), ("LBNHC", False)],
    ids=["LBNHC-async-scheduler", "BLHNC-async-scheduler", "LBNHC-scheduler"],
)
def test_second_prompt_gets_its_prefix_from_kvferry(tmp_path, node, layout, async_scheduling):
    extra = {"kv_layout": "cross_layer"} if layout == "BLHNC" else {}
    eng = engine(tmp_path, node.addr, layout=layout, extra=extra,
                 async_scheduling=async_scheduling)
    want = "AsyncScheduler" if async_scheduling else "Scheduler"
    assert type(eng.scheduler).__name__ == want
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
        eng.step()
        b = eng.requests["b"]
        assert status(b) == "WAITING_FOR_REMOTE_KVS"  # an asynchronous load
        assert b.num_computed_tokens == 96  # 6 full blocks of 16 matched
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
        assert so.has_sync_kv_loads
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


def test_node_killed_mid_load_reports_exactly_the_failed_blocks(tmp_path, node):
    eng = engine(tmp_path, node.addr)
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
        eng.run(until=lambda: eng.invalid_reported or "b" in eng.finished, max_steps=500)
        assert eng.invalid_reported == planned["dest"] and len(planned["dest"]) == 6
        # Reported in one step, together with the request's finished load.
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
        assert eng.invalid_reported, "the stalled load's blocks are reported"
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
