"""`python -m kvferry.bench vllm` without a GPU: its arguments, the plan and the model's
config.json it writes, and the summary it makes of the engines' runs (medians, the save
cost, the bit-for-bit verdict). The engines themselves need vLLM on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

from kvferry import bench_vllm as bv


def run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "kvferry.bench", "vllm", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_plans_whole_blocks_plus_one_and_writes_an_8b_config(tmp_path):
    out = run("--dry-run", "--out", str(tmp_path), "--tokens", "40,100", "--prompts", "2",
              "--warmup", "1", "--phases", "ref,kv-first,kv-xl")
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    # 40 -> 2 blocks of 16 + 1, 100 -> 6 blocks + 1: every hit computes a one-token tail.
    assert p["lengths"] == [33, 97]
    assert p["block_bytes"] == 2 * 32 * 8 * 128 * 2 * 16  # 2 MiB: K and V of 32 layers
    blocks = 3 * (2 + 6)
    # Two layouts (per-layer, cross-layer) are two namespaces on the node.
    assert p["pool_bytes"] == 2 * blocks * p["block_bytes"] * 11 // 10 + 64 * p["block_bytes"]
    assert p["max_model_len"] == 97 + 8 + 16
    cfg = json.loads((tmp_path / "llama8b-shape" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["vocab_size"]) == (4096, 32, 8, 128, 128256)
    assert cfg["rope_scaling"]["rope_type"] == "llama3"


def test_refuses_bad_arguments():
    out = run("--phases", "ref,kv-fast")
    assert out.returncode == 2 and "unknown phase 'kv-fast'" in out.stderr
    out = run("--tokens", "2048,8")
    assert out.returncode == 2 and "--tokens 8: shorter than one block" in out.stderr
    out = run("--repeats", "0")
    assert out.returncode == 2 and "--repeats" in out.stderr
    out = run("--settle-ms", "-1")
    assert out.returncode == 2 and "--settle-ms" in out.stderr


def test_prompts_are_the_same_in_every_process_and_differ_between_prompts():
    a = bv.prompt_ids(0, 33, 1)
    assert a == bv.prompt_ids(0, 33, 1) and len(a) == 33
    assert a != bv.prompt_ids(0, 33, 2) and a != bv.prompt_ids(1, 33, 1)
    assert max(a) < bv.MAX_TOKEN_ID


def _run(kind, n, i, ms, lp, tokens=None):
    return {"kind": kind, "length": n, "index": i, "ms": ms, "logprobs": lp,
            "tokens": tokens or [1], "cached": n - 1}


def _phases(kv_lp):
    good = {"7": (-0.5).hex(), "9": (-1.25).hex()}
    recompute = {"7": (-0.5000001).hex(), "9": (-1.25).hex()}
    ref = {"status": "ok", "runs": [
        _run("cold", 33, 0, 100.0, recompute), _run("hit", 33, 0, 10.0, good),
        _run("hit", 33, 0, 12.0, good), _run("check", 33, 0, 30.0, good, [7, 3]),
        _run("hit", 33, -1, 99.0, good) | {"warmup": True},
    ]}
    return {
        "plain": {"status": "ok", "runs": [_run("cold", 33, 0, 98.0, recompute)]},
        "ref": ref,
        "kv-first": {"status": "ok", "runs": [
            _run("cold", 33, 0, 99.0, recompute), _run("hit", 33, 0, 20.0, kv_lp),
            _run("hit", 33, 0, 24.0, good), _run("check", 33, 0, 40.0, good, [7, 3]),
        ]},
        "kv-xl": {"status": "skipped", "reason": "no cross-layer"},
    }


def test_summary_medians_save_cost_and_a_passing_verdict():
    good = {"7": (-0.5).hex(), "9": (-1.25).hex()}
    p = {"lengths": [33]}
    s = bv.summarize(p, _phases(good))
    t = s["ttft_ms"]["33"]
    assert t["recompute"] == 98.0 and t["gpu_prefix_hit"] == 11.0
    assert t["kvferry_hit_same_process_default"] == 22.0 and t["x_floor_same_process_default"] == 2.0
    assert t["kvferry_hit_cross_layer_async"] is None  # skipped, not zero
    assert t["save_cost_pct"] == round(100 * (99.0 / 98.0 - 1), 2)
    c = s["correctness"]
    assert c["verdict"] == "PASS" and c["checked_runs"] == 3
    assert c["recompute_differs_from_hit"] == "1/1"


def test_a_log_probability_one_ulp_off_fails_the_verdict():
    off = {"7": (-0.5).hex(), "9": float.fromhex((-1.25).hex()).__sub__(2 ** -52).hex()}
    c = bv.summarize({"lengths": [33]}, _phases(off))["correctness"]
    assert c["verdict"] == "FAIL"
    assert c["failures"][0]["phase"] == "kv-first" and c["failures"][0]["kind"] == "hit"


def test_different_greedy_tokens_fail_the_verdict():
    good = {"7": (-0.5).hex(), "9": (-1.25).hex()}
    ph = _phases(good)
    ph["kv-first"]["runs"][3]["tokens"] = [7, 4]
    assert bv.summarize({"lengths": [33]}, ph)["correctness"]["verdict"] == "FAIL"


def test_a_phase_on_another_model_runner_is_not_compared_with_the_reference():
    # vLLM 0.26's V1 and V2 runners differ in their last bits; a cross-layer phase on V1
    # against a reference on V2 once failed 4 of 12 runs on the H200 with correct KV.
    good = {"7": (-0.5).hex(), "9": (-1.25).hex()}
    off = {"7": (-0.5).hex(), "9": (-1.5).hex()}
    ph = _phases(good)
    ph["ref"]["model_runner"] = "v2"
    ph["kv-first"]["model_runner"] = "v2"
    ph["kv-xl"] = {"status": "ok", "model_runner": "v1", "runs": [_run("hit", 33, 0, 20.0, off)]}
    c = bv.summarize({"lengths": [33]}, ph)["correctness"]
    assert c["verdict"] == "PASS" and c["checked_runs"] == 3
    assert "kv-xl" not in c["per_phase"] and "v1" in c["not_compared"]["kv-xl"]
    # On the same runner the same bytes are compared, and a difference fails.
    ph["ref"]["model_runner"] = "v1"
    ph["kv-first"]["model_runner"] = "v1"
    c = bv.summarize({"lengths": [33]}, ph)["correctness"]
    assert c["verdict"] == "FAIL" and c["not_compared"] == {}
    assert c["failures"][0]["phase"] == "kv-xl"


def test_no_verdict_without_the_reference_phase():
    good = {"7": (-0.5).hex()}
    ph = _phases(good)
    ph["ref"] = {"status": "failed", "reason": "engine did not start"}
    assert bv.summarize({"lengths": [33]}, ph)["correctness"]["verdict"] == "NOT RUN"


def test_trace_summary_takes_medians_per_label():
    runs = [
        {"ms": 50.0, "spans": [["rpc.query", 0.5, 0.2, None], ["worker.load_finished", 30.0, 0.01,
                                                                {"node_seconds": 0.025}]]},
        {"ms": 60.0, "spans": [["rpc.query", 0.7, 0.4, None], ["rpc.query", 5.0, 0.2, None]]},
    ]
    s = bv.summarize_trace(runs)
    assert s["ttft_ms"] == 55.0
    assert s["rpc.query"] == {"first_start_ms": 0.6, "total_ms": 0.4, "count": 1.5}
    assert s["worker.load_finished"]["node_copy_ms"] == 25.0
    assert list(s)[:2] == ["ttft_ms", "rpc.query"]  # labels in the order they first start


def test_the_cross_layer_phase_asks_for_the_v1_model_runner_where_vllm_has_one(monkeypatch):
    """vLLM 0.26's Model Runner V2 (its default for a dense model) registers per-layer KV
    only, so kv-xl asks for the V1 runner; --model-runner puts every phase on one."""
    import importlib.util

    has_v1 = {"yes": True}
    real = importlib.util.find_spec

    def find_spec(name, *a, **kw):
        if name == "vllm.v1.worker.gpu_model_runner":
            return object() if has_v1["yes"] else None
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    import os

    assert bv._choose_model_runner({"phase": "kv-first", "model_runner": "auto"}) == "auto"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    assert bv._choose_model_runner({"phase": "kv-xl", "model_runner": "auto"}) == "v1"
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    assert bv._choose_model_runner({"phase": "kv-first", "model_runner": "v2"}) == "v2"
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    # vLLM 0.34 has Model Runner V2 alone: kv-xl runs on it (0.34 lays cross-layer KV out
    # as BLHNC there).
    has_v1["yes"] = False
    assert bv._choose_model_runner({"phase": "kv-xl", "model_runner": "auto"}) == "auto"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def test_the_plan_carries_the_model_runner_and_the_idle_wait(tmp_path):
    out = run("--dry-run", "--tokens", "40", "--model-runner", "v1", "--idle-wait-ms", "0")
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    assert (p["model_runner"], p["idle_wait_ms"]) == ("v1", 0)
    out = run("--idle-wait-ms", "101")
    assert out.returncode == 2 and "--idle-wait-ms" in out.stderr
    out = run("--model-runner", "v3")
    assert out.returncode == 2 and "--model-runner" in out.stderr


def test_the_serving_run_is_planned_only_when_asked_for_and_its_passes_are_summarized(tmp_path):
    assert "serve-kv" not in bv.DEFAULT_PHASES and "kv-first" in bv.DEFAULT_PHASES
    out = run("--dry-run", "--out", str(tmp_path / "a"), "--tokens", "40", "--prompts", "2",
              "--warmup", "1", "--phases", "ref,kv-first")
    plain = json.loads(out.stdout)
    out = run("--dry-run", "--out", str(tmp_path / "b"), "--tokens", "40", "--prompts", "2",
              "--warmup", "1", "--phases", "serve-ref,serve-kv", "--serve-prompts", "5",
              "--serve-tokens", "200", "--serve-output", "20")
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    # 200 -> 12 blocks + 1 token; five of them more in the pool, and room for 20 outputs.
    assert p["serve"] == {"prompts": 5, "length": 193, "output": 20, "rate": 0.0,
                          "max_seqs": 16}
    bb = p["block_bytes"]
    assert p["pool_bytes"] - plain["pool_bytes"] == 5 * 12 * bb * 11 // 10
    assert p["max_model_len"] == 193 + 20 + 16
    for bad in (["--serve-prompts", "0"], ["--serve-tokens", "3"], ["--serve-rate", "-1"]):
        out = run("--phases", "serve-kv", *bad)
        assert out.returncode == 2 and "--serve-" in out.stderr, bad
    passes = [{"ttft_median_ms": 300.0}, {"ttft_median_ms": 40.0}]
    s = bv.summarize(p, {"serve-kv": {"status": "ok", "serve": passes}, "ref": {}})
    assert s["serve"] == {"serve-kv": passes}
    assert bv._pct([5.0, 1.0, 3.0, 2.0, 4.0], 0.99) == 5.0 and bv._pct([], 0.5) is None


def test_a_serving_pass_times_every_request_through_the_engine_loop():
    """serve_pass against a stand-in engine that answers under suffixed request ids (as some
    vLLM releases do) and takes two steps per request: every request is found and timed."""
    from types import SimpleNamespace as NS

    class Eng:
        def __init__(self):
            self.live = {}

        def add_request(self, rid, prompt, params):
            self.live[rid + "-a1b2"] = 0
            return None

        def has_unfinished_requests(self):
            return bool(self.live)

        def step(self):
            out = []
            for rid in list(self.live):
                self.live[rid] += 1
                n = self.live[rid]
                out.append(NS(request_id=rid, finished=n == 2, num_cached_tokens=16,
                              outputs=[NS(token_ids=[1] * n)]))
                if n == 2:
                    del self.live[rid]
            return out

    spec = {"seed": 0, "serve": {"prompts": 5, "length": 33, "output": 2, "rate": 0.0}}
    import sys as _sys
    import types
    fake = types.ModuleType("vllm")
    fake.SamplingParams = lambda **kw: kw
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kw: kw
    saved = {m: _sys.modules.get(m) for m in ("vllm", "vllm.inputs")}
    _sys.modules.update({"vllm": fake, "vllm.inputs": inputs})
    try:
        r = bv.serve_pass(NS(llm_engine=Eng()), spec, 1)
    finally:
        for m, v in saved.items():
            if v is None:
                _sys.modules.pop(m, None)
            else:
                _sys.modules[m] = v
    assert (r["requests"], r["missing"]) == (5, 0), r
    assert r["ttft_median_ms"] is not None and r["cached_tokens_mean"] == 16
    assert bv._serve_index({}, "serve1-12", 1) == 12 and bv._serve_index({}, "serve0-1", 1) is None
