"""Time to first token in a real vLLM engine: ``python -m kvferry.bench vllm``.

Runs a real vLLM engine (the offline ``LLM`` API, the engine core in the same process) on a
Llama-3.1-8B-shaped model: a ``config.json`` written here, ``load_format="dummy"``, then every
weight drawn again from a seeded generator (projections N(0, 0.02), the output head N(0, 0.05)
so logits are sharp, norm gains 1), so the weights are the same in every engine process. No
tokenizer: prompts are seeded random token ids. Each prompt is a whole number of KV blocks
plus one token, so a hit from vLLM's own GPU prefix cache and a kvferry hit (async or sync)
both cover the same full blocks and compute the same one-token tail.

Each phase is its own engine process, one after the other, against one ``kvferry node``
(``--kvferry-bin``, ``[device] kind = "cuda"``) that this command starts:

* ``plain``: no connector, prefix caching off: the recompute (= a cold request without the
  connector).
* ``ref``: no connector, prefix caching on: the cold request, then vLLM's own GPU prefix-cache
  hit (the floor: no transfer at all) and the reference tokens and log-probabilities.
* ``kv-first``: KvferryConnector (its default ``load_mode``, "auto": a hit alone in the engine
  loads synchronously; per-layer KV), prefix caching off: the cold request, which saves (its
  cost against ``plain``), then kvferry hits in the same process.
* ``kv-second``: a second engine process, the default mode: hits on what ``kv-first`` saved.
* ``kv-async``: another one with ``load_mode = "async"``.
* ``kv-sync``: another one with ``load_mode = "sync"``.
* ``kv-sync-grouped``: sync with ``sync_batches = "grouped"`` (the node's layer groups rather
  than one copy batch per layer).
* ``kv-sync-early``: sync with ``load_start = "scheduler"`` (the scheduler starts the load as
  it allocates the blocks; with ``--no-async-scheduling`` only, else the worker starts it).
* ``kv-xl``: cross-layer KV (``kv_layout = "cross_layer"``), cold then hits in one process;
  skipped, saying so, where the connector does not offer vLLM's cross-layer blocks. On vLLM
  0.26 it runs on the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``): Model Runner V2, the
  default for this model, offers no cross-layer KV. ``--model-runner`` puts every phase on
  one runner (``v1`` compares per-layer and cross-layer on the same one); each phase's result
  says which runner it had.
* ``serve-ref`` and ``serve-kv`` (not in the default set): a serving run, as ``vllm bench serve
  --dataset-name random`` twice: ``--serve-prompts`` prompts of ``--serve-tokens`` random token
  ids, ``--serve-output`` tokens each, arriving at ``--serve-rate`` requests per second
  (Poisson, seeded; 0: all at once), through the engine's own request loop; then the same
  prompts again. ``serve-ref`` has no connector and vLLM's GPU prefix cache (the second pass
  hits it); ``serve-kv`` the connector without it (the first pass saves, the second loads).
  Each pass reports TTFT (mean, median, p99), end-to-end latency, its duration and output
  tokens per second.

TTFT is the wall time of ``LLM.generate`` for one request of one output token (greedy, top-5
log-probabilities), reported as the median over prompts (and ``--repeats`` hits of each). Each
cold request is followed by a pause (``--settle-ms``, in every phase), so its save lands before
the next request: the save cost is what a cold request pays for its own save.
**Correctness**: every kvferry hit's first-token log-probabilities and its greedy tokens
(``--check-tokens`` of them) equal those after vLLM's own prefix-cache hit, bit for bit; the
recompute's are shown beside them (they differ: the check has teeth). With ``--trace`` the
kvferry and reference phases also run traced hits at one size (``--trace-tokens``) and report
where the time goes (scheduler, RPCs to the node, the node's copy, the forward).

Progress lines start with ``[bench-vllm]`` (on stderr); the result is one JSON object (``--json``, and
``--out DIR``/bench-vllm.json with the engines' and the node's logs beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

#: Llama-3.1-8B's shape (what matters for the KV: 32 layers x 8 KV heads x 128, bf16).
LLAMA_8B: Dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

#: Token ids of prompts stay below Llama 3's special tokens.
MAX_TOKEN_ID = 128000

#: phase -> what it runs.
PHASES: Dict[str, Dict[str, Any]] = {
    "plain": {"connector": False, "prefix": False, "cold": True, "hits": False},
    "ref": {"connector": False, "prefix": True, "cold": True, "hits": True},
    "kv-first": {"connector": True, "prefix": False, "cold": True, "hits": True,
                 "load_mode": "auto", "kv_layout": "auto"},
    "kv-second": {"connector": True, "prefix": False, "cold": False, "hits": True,
                  "load_mode": "auto", "kv_layout": "auto"},
    "kv-async": {"connector": True, "prefix": False, "cold": False, "hits": True,
                 "load_mode": "async", "kv_layout": "auto"},
    "kv-sync": {"connector": True, "prefix": False, "cold": False, "hits": True,
                "load_mode": "sync", "kv_layout": "auto"},
    "kv-sync-grouped": {"connector": True, "prefix": False, "cold": False, "hits": True,
                        "load_mode": "sync", "kv_layout": "auto", "sync_batches": "grouped"},
    "kv-sync-early": {"connector": True, "prefix": False, "cold": False, "hits": True,
                      "load_mode": "sync", "kv_layout": "auto", "load_start": "scheduler"},
    "kv-xl": {"connector": True, "prefix": False, "cold": True, "hits": True,
              "load_mode": "async", "kv_layout": "cross_layer", "model_runner": "v1"},
    "serve-ref": {"connector": False, "prefix": True, "serve": True},
    "serve-kv": {"connector": True, "prefix": False, "serve": True, "load_mode": "auto",
                 "kv_layout": "auto"},
}

#: What runs without --phases: the TTFT phases (the serving run is asked for by name).
DEFAULT_PHASES = [name for name, ph in PHASES.items() if not ph.get("serve")]

#: --model-runner -> VLLM_USE_V2_MODEL_RUNNER ("auto": vLLM decides, except that kv-xl asks for
#: the V1 runner where vLLM has one: vLLM 0.26's Model Runner V2, its default for a dense
#: model, registers per-layer KV only).
MODEL_RUNNERS = {"auto": None, "v1": "0", "v2": "1"}

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the phase's process
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}

RESULT = "BENCH-VLLM-RESULT "


def say(msg: str) -> None:
    # On stderr: stdout is the result (--json), whole.
    print(f"[bench-vllm] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the plan


def prompt_lengths(tokens: Sequence[int], block_size: int) -> List[int]:
    """Each size rounded down to whole blocks, plus one token (the tail every hit computes)."""
    out = []
    for n in tokens:
        blocks = n // block_size
        if blocks < 1:
            raise ValueError(f"--tokens {n}: shorter than one block of {block_size}")
        out.append(blocks * block_size + 1)
    return out


def model_config(layers: int) -> Dict[str, Any]:
    cfg = dict(LLAMA_8B)
    cfg["num_hidden_layers"] = layers
    return cfg


def block_bytes(cfg: Dict[str, Any], block_size: int) -> int:
    """K and V of one block in every layer (bf16)."""
    return (2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
            * block_size)


def prompt_ids(seed: int, length: int, index: int) -> List[int]:
    """Prompt ``index`` of ``length`` tokens (negative index: a warm-up prompt)."""
    rng = random.Random(f"kvferry-bench-vllm/{seed}/{length}/{index}")
    return [rng.randrange(MAX_TOKEN_ID) for _ in range(length)]


def plan(args: argparse.Namespace) -> Dict[str, Any]:
    """Everything the phases share, as JSON (written to each phase's process)."""
    cfg = model_config(args.layers)
    lengths = prompt_lengths(args.tokens, args.block_size)
    bb = block_bytes(cfg, args.block_size)
    layouts = {PHASES[p]["kv_layout"] for p in args.phases if PHASES[p]["connector"]}
    blocks = sum((args.prompts + args.warmup) * (n // args.block_size) for n in lengths)
    serve_len = prompt_lengths([args.serve_tokens], args.block_size)[0]
    serving = any(PHASES[ph].get("serve") for ph in args.phases)
    if serving:
        blocks += args.serve_prompts * (serve_len // args.block_size)
    # Every kv layout is its own namespace on the node: the pool holds all of them, plus slack.
    pool = max(1, len(layouts)) * blocks * bb * 11 // 10 + 64 * bb
    max_len = max(lengths + ([serve_len] if serving else [])) + \
        max(args.check_tokens, args.serve_output if serving else 1, 1) + args.block_size
    trace = lengths[0] if args.trace_tokens is None else prompt_lengths(
        [args.trace_tokens], args.block_size)[0]
    if args.trace and trace not in lengths:
        raise ValueError(f"--trace-tokens {args.trace_tokens} is not one of --tokens")
    return {
        "model": cfg,
        "block_size": args.block_size,
        "block_bytes": bb,
        "lengths": lengths,
        "prompts": args.prompts,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "seed": args.seed,
        "check_tokens": args.check_tokens,
        "logprobs": args.logprobs,
        "max_model_len": max_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": not args.no_eager,
        "connector_model": args.connector_model,
        "pool_bytes": pool,
        "phases": list(args.phases),
        "trace_length": trace if args.trace else None,
        "trace_runs": args.trace_runs,
        "settle_ms": args.settle_ms,
        "model_runner": args.model_runner,
        "idle_wait_ms": args.idle_wait_ms,
        "no_async_scheduling": args.no_async_scheduling,
        "serve": {"prompts": args.serve_prompts, "length": serve_len,
                  "output": args.serve_output, "rate": args.serve_rate,
                  "max_seqs": args.serve_max_seqs},
    }


# ----------------------------------------------------------------------------- summary


def _median(xs: List[float]) -> Optional[float]:
    return round(statistics.median(xs), 3) if xs else None


def _runs(phase: Dict[str, Any], kind: str, length: int) -> List[Dict[str, Any]]:
    return [r for r in phase.get("runs", ()) if r["kind"] == kind and r["length"] == length
            and not r.get("warmup")]


def summarize(p: Dict[str, Any], phases: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Medians per size, the save cost, and the bit-for-bit verdict."""
    rows = {
        "recompute": ("plain", "cold"),
        "gpu_prefix_hit": ("ref", "hit"),
        "kvferry_hit_same_process_default": ("kv-first", "hit"),
        "kvferry_hit_second_process_default": ("kv-second", "hit"),
        "kvferry_hit_second_process_async": ("kv-async", "hit"),
        "kvferry_hit_second_process_sync": ("kv-sync", "hit"),
        "kvferry_hit_cross_layer_async": ("kv-xl", "hit"),
        "cold_no_connector": ("plain", "cold"),
        "cold_no_connector_prefix_caching": ("ref", "cold"),
        "cold_with_connector": ("kv-first", "cold"),
        "cold_with_connector_cross_layer": ("kv-xl", "cold"),
    }
    ttft: Dict[str, Dict[str, Optional[float]]] = {}
    for n in p["lengths"]:
        ttft[str(n)] = {
            name: _median([r["ms"] for r in _runs(phases.get(ph, {}), kind, n)])
            for name, (ph, kind) in rows.items()
        }
        t = ttft[str(n)]
        for hit in ("kvferry_hit_same_process_default", "kvferry_hit_second_process_default",
                    "kvferry_hit_second_process_async", "kvferry_hit_second_process_sync",
                    "kvferry_hit_cross_layer_async"):
            if t.get(hit) and t.get("gpu_prefix_hit"):
                t[hit.replace("kvferry_hit", "x_floor")] = round(t[hit] / t["gpu_prefix_hit"], 2)
            if t.get(hit) and t.get("recompute"):
                t[hit.replace("kvferry_hit", "speedup_vs_recompute")] = round(
                    t["recompute"] / t[hit], 2)
        for cold, name in (("cold_with_connector", "save_cost_pct"),
                           ("cold_with_connector_cross_layer", "save_cost_pct_cross_layer")):
            if t.get(cold) and t.get("cold_no_connector"):
                t[name] = round(100.0 * (t[cold] / t["cold_no_connector"] - 1.0), 2)
    serve = {name: ph["serve"] for name, ph in phases.items() if ph.get("serve")}
    return {"ttft_ms": ttft, "correctness": verdict(p, phases), "serve": serve}


def verdict(p: Dict[str, Any], phases: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Every kvferry hit against vLLM's own prefix-cache hit of the same prompt: the same
    first-token log-probabilities (bit for bit, as float hex) and the same greedy tokens."""
    ref = phases.get("ref", {})
    if ref.get("status") != "ok":
        return {"verdict": "NOT RUN",
                "why": "the ref phase (vLLM's own prefix-cache hit) did not run"}
    refs: Dict[Any, Dict[str, Any]] = {}
    for r in ref.get("runs", ()):
        if r["kind"] in ("hit", "check") and not r.get("warmup"):
            key = (r["length"], r["index"])
            e = refs.setdefault(key, {})
            if r["kind"] == "hit":
                e.setdefault("logprobs", r["logprobs"])
                if r["logprobs"] != e["logprobs"]:
                    e["unstable"] = True
            else:
                e["tokens"] = r["tokens"]
                e["check_logprobs"] = r["logprobs"]
    checked, failures = 0, []
    per_phase: Dict[str, Dict[str, int]] = {}
    # vLLM's two model runners need not agree bit for bit (other kernels, other reduction
    # orders), so a phase is compared only with a reference that ran on the same runner.
    not_compared: Dict[str, str] = {}
    for name, ph in phases.items():
        if not PHASES.get(name, {}).get("connector") or ph.get("status") != "ok":
            continue
        runner, ref_runner = ph.get("model_runner"), ref.get("model_runner")
        if runner and ref_runner and runner != ref_runner:
            not_compared[name] = (f"ran on model runner {runner}, the reference on "
                                  f"{ref_runner}: rerun with --model-runner {runner}")
            continue
        stats = per_phase.setdefault(name, {"runs": 0, "equal": 0})
        for r in ph.get("runs", ()):
            if r["kind"] not in ("hit", "check") or r.get("warmup"):
                continue
            e = refs.get((r["length"], r["index"]))
            if e is None:
                continue
            stats["runs"] += 1
            checked += 1
            want = e.get("logprobs") if r["kind"] == "hit" else e.get("check_logprobs")
            ok = r["logprobs"] == want
            if r["kind"] == "check":
                ok = ok and r["tokens"] == e.get("tokens")
            if ok:
                stats["equal"] += 1
            else:
                failures.append({"phase": name, "length": r["length"], "index": r["index"],
                                 "kind": r["kind"], "tokens": r.get("tokens"),
                                 "ref_tokens": e.get("tokens")})
    # The check has teeth where a recompute's first-token log-probabilities differ from the hit's.
    differ = total = 0
    for r in phases.get("plain", {}).get("runs", ()):
        e = refs.get((r["length"], r["index"]))
        if r["kind"] == "cold" and not r.get("warmup") and e is not None:
            total += 1
            differ += r["logprobs"] != e.get("logprobs")
    unstable = sorted(k for k, e in refs.items() if e.get("unstable"))
    if not checked:
        v = "NOT RUN"
    elif failures or unstable:
        v = "FAIL"
    else:
        v = "PASS"
    return {
        "verdict": v,
        "checked_runs": checked,
        "per_phase": per_phase,
        "failures": failures[:20],
        "ref_hits_unstable": [list(k) for k in unstable],
        "recompute_differs_from_hit": f"{differ}/{total}",
        "not_compared": not_compared,
    }


# ----------------------------------------------------------------------------- the parent


def run_phases(args: argparse.Namespace, p: Dict[str, Any]) -> Dict[str, Any]:
    from .bench import Node

    out_dir = args.out or tempfile.mkdtemp(prefix="kvferry-bench-vllm-")
    os.makedirs(out_dir, exist_ok=True)
    model_dir = os.path.join(out_dir if args.model_dir is None else args.model_dir, "llama8b-shape")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(p["model"], f, indent=1)
    p["model_dir"] = model_dir
    log_path = os.path.join(out_dir, "bench-vllm-engines.log")
    log = open(log_path, "a")
    say(f"prompts of {p['lengths']} tokens, {p['prompts']} each (+{p['warmup']} warm-up), "
        f"{p['repeats']} hits each; phases {', '.join(p['phases'])}; engine logs in {log_path}")
    node = None
    if any(PHASES[ph]["connector"] for ph in p["phases"]):
        # Started first: its pool is populated while the engines without it run.
        node = Node(args.kvferry_bin, "cuda", pool_bytes=p["pool_bytes"],
                    slot_bytes=p["block_bytes"])
        say(f"kvferry node at {node.addr} (pool {p['pool_bytes'] / 2**30:.1f} GiB of "
            f"{p['block_bytes'] >> 10} KiB slots), log {node.log.name}")
    phases: Dict[str, Dict[str, Any]] = {}
    t_all = time.perf_counter()
    try:
        for name in p["phases"]:
            spec = dict(p, phase=name, **PHASES[name])
            if PHASES[name]["connector"]:
                assert node is not None
                if "address" not in p:
                    t0 = time.perf_counter()
                    node.client()  # waits until it serves
                    say(f"node serving after {time.perf_counter() - t0:.1f} s more")
                    p["address"] = node.addr
                spec["address"] = node.addr
            say(f"phase {name}: starting (GPU memory in use: {_gpu_memory_used()})")
            phases[name] = run_child(spec, log, args.phase_timeout)
            r = phases[name]
            # What has run so far, in case a later phase runs out of time.
            with open(os.path.join(out_dir, "bench-vllm.json"), "w") as f:
                json.dump({"plan": p, "phases": phases, "partial": True}, f)
            say(f"phase {name}: {r['status']}"
                + (f" ({r.get('reason')})" if r.get("reason") else "")
                + (f", engine start {r['startup_s']:.1f} s" if "startup_s" in r else ""))
    finally:
        if node is not None:
            node.stop()
            try:
                import shutil

                shutil.copy(node.log.name, os.path.join(out_dir, "bench-vllm-node.log"))
            except OSError:
                pass
        log.close()
    result = {"plan": {k: v for k, v in p.items() if k != "model"}, "model": p["model"],
              "phases": phases, "wall_s": round(time.perf_counter() - t_all, 1)}
    result.update(summarize(p, phases))
    with open(os.path.join(out_dir, "bench-vllm.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def run_child(spec: Dict[str, Any], log, timeout: float) -> Dict[str, Any]:
    """One phase in its own process; its result is the line starting with RESULT."""
    env = dict(os.environ)
    env.update(ENV)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    cmd = [sys.executable, "-m", "kvferry.bench_vllm", "--child", f.name]
    log.write(f"\n===== phase {spec['phase']}: {' '.join(cmd)}\n")
    log.flush()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, bufsize=1)
    # A phase that hangs is killed, and the next one runs.
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    result: Optional[Dict[str, Any]] = None
    tail: List[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            log.write(line)
            if line.startswith(RESULT):
                result = json.loads(line[len(RESULT):])
                continue
            tail = (tail + [line.rstrip()])[-30:]
            if line.startswith("[bench-vllm]"):
                print(line.rstrip(), flush=True)
        proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.flush()
        os.unlink(f.name)
    if result is None:
        why = f"killed after {timeout:.0f} s" if time.perf_counter() - t0 >= timeout else \
            f"exit {proc.returncode}"
        return {"status": "failed", "reason": f"{why}, no result",
                "log_tail": tail, "wall_s": round(time.perf_counter() - t0, 1)}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def _gpu_memory_used() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or out.stderr.strip()[:100]
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"


# ----------------------------------------------------------------------------- a phase


class Tracer:
    """Wall-clock spans of the connector's and vLLM's steps (``--trace``): wrapped methods
    append (label, start, end) while a traced request runs; nothing when it does not."""

    def __init__(self) -> None:
        self.on = False
        self.spans: List[Any] = []
        self.sync = None  # torch.cuda.synchronize while tracing: the forward's GPU time

    def wrap(self, cls: Any, method: str, label: str, sync: bool = False,
             note: Any = None) -> bool:
        fn = getattr(cls, method, None)
        if fn is None:
            return False
        tracer = self

        def wrapped(*a: Any, **kw: Any) -> Any:
            if not tracer.on:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if sync and tracer.sync is not None:
                tracer.sync()
            extra = note(a, kw, out) if note is not None else None
            tracer.spans.append((label if not callable(label) else label(a), t0,
                                 time.perf_counter(), extra))
            return out

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        setattr(cls, method, wrapped)
        return True

    def install(self) -> List[str]:
        import torch

        from kvferry.vllm import link, scheduler, worker

        self.sync = torch.cuda.synchronize
        done = []

        def rpc_label(a: Any) -> str:
            return f"rpc.{a[1]}" if len(a) > 1 else "rpc"

        def finish_note(a: Any, kw: Any, out: Any) -> Any:
            comp = a[3] if len(a) > 3 else kw.get("completion")
            if comp:
                return {"node_seconds": comp.get("seconds"), "bytes": comp.get("bytes")}
            return None

        sched = scheduler.SchedulerSide
        targets = [
            (link.NodeLink, "call", rpc_label, False, None),
            (sched, "get_num_new_matched_tokens", "sched.matched_tokens", False, None),
            (sched, "update_state_after_alloc", "sched.after_alloc", False, None),
            (sched, "build_connector_meta", "sched.build_meta", False, None),
            (sched, "update_connector_output", "sched.connector_output", False, None),
            (worker.WorkerSide, "start_load", "worker.start_load", False, None),
            (worker.WorkerSide, "_begin_load", "worker.begin_load", False, None),
            (worker.WorkerSide, "_finish", "worker.load_finished", False, finish_note),
            (worker.WorkerSide, "wait_for_layer_load", "worker.wait_for_layer_load", False, None),
            (worker.WorkerSide, "get_finished", "worker.get_finished", False,
             lambda a, kw, out: {"recving": len(out[1])} if out and out[1] else None),
            (worker.WorkerSide, "submit_saves", "worker.submit_saves", False, None),
        ]
        try:
            from vllm.v1.core.sched.scheduler import Scheduler

            targets.append((Scheduler, "schedule", "vllm.schedule", False, None))
        except ImportError:
            pass
        try:
            from vllm.v1.engine.core import EngineCore

            targets.append((EngineCore, "step", "vllm.engine_step", False, None))
            targets.append((EngineCore, "step_with_batch_queue", "vllm.engine_step", False, None))
        except ImportError:
            pass
        # Synchronised while tracing, so the span is the forward's GPU time too. Both model
        # runners: vLLM 0.26 runs a dense model on Model Runner V2 unless told otherwise.
        for module in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):
            try:
                import importlib

                runner = getattr(importlib.import_module(module), "GPUModelRunner")
            except (ImportError, AttributeError):
                continue
            targets.append((runner, "execute_model", "vllm.execute_model", True, None))
            targets.append((runner, "sample_tokens", "vllm.sample_tokens", True, None))
        for cls, method, label, sync, note in targets:
            if self.wrap(cls, method, label, sync, note):
                done.append(f"{cls.__name__}.{method}")
        return done

    def take(self, t0: float) -> List[List[Any]]:
        spans, self.spans = self.spans, []
        return [[label, round((s - t0) * 1e3, 3), round((e - s) * 1e3, 3), extra]
                for label, s, e, extra in sorted(spans, key=lambda x: x[1])]


def _redraw_weights(model: Any, seed: int) -> int:
    """Every weight again from a seeded generator, the same in every process: projections
    N(0, 0.02), the output head N(0, 0.05) (logits with a spread of ~3, so sharp), norm gains 1."""
    import torch

    n = 0
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.named_parameters())):
            if "norm" in name:
                p.fill_(1.0)
            else:
                g = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
                std = 0.05 if "lm_head" in name else 0.02
                p.copy_(torch.randn(p.shape, generator=g, device=p.device,
                                    dtype=torch.float32).mul_(std))
            n += p.numel()
    torch.cuda.synchronize()
    return n


def _first_logprobs(completion: Any) -> Dict[str, str]:
    """The first output token's top log-probabilities as {token id: float.hex()}: exact."""
    lps = completion.logprobs
    if not lps:
        return {}
    first = lps[0]
    return {str(t): float(v.logprob).hex() for t, v in sorted(first.items())}


def child_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    name = spec["phase"]
    try:
        res = run_phase(spec)
    except Exception as e:  # noqa: BLE001 - the parent reports it and runs the next phase
        import traceback

        traceback.print_exc()
        res = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:500]}
    print(RESULT + json.dumps(res), flush=True)
    say(f"{name}: done")
    # vLLM's and the connector's threads need not be joined: the phase is over.
    os._exit(0)


def _choose_model_runner(spec: Dict[str, Any]) -> Optional[str]:
    """Sets VLLM_USE_V2_MODEL_RUNNER for this phase (before vLLM reads it): what
    --model-runner says, else what the phase asks for where vLLM has that runner."""
    import importlib.util

    want = spec.get("model_runner") or "auto"
    if want == "auto":
        want = PHASES.get(spec["phase"], {}).get("model_runner", "auto")
        if want == "v1" and importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is None:
            want = "auto"  # a vLLM without the V1 runner (0.34): its own
    value = MODEL_RUNNERS.get(want)
    if value is not None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = value
    return want


def _model_runner_used(llm: Any) -> Optional[str]:
    cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    v2 = getattr(cfg, "use_v2_model_runner", None)
    return None if v2 is None else ("v2" if v2 else "v1")


def run_phase(spec: Dict[str, Any]) -> Dict[str, Any]:
    name = spec["phase"]
    t_start = time.perf_counter()
    asked_runner = _choose_model_runner(spec)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    res: Dict[str, Any] = {"status": "ok", "vllm": vllm.__version__, "runs": []}
    if spec["connector"] and spec["kv_layout"] == "cross_layer":
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        from kvferry.vllm.connector import KvferryConnector

        base = KVConnectorBase_V1.prefer_cross_layer_blocks
        if KvferryConnector.prefer_cross_layer_blocks is base:
            return {"status": "skipped", "vllm": vllm.__version__,
                    "reason": "the connector does not offer vLLM's cross-layer blocks "
                              "(prefer_cross_layer_blocks) on this vLLM"}
    tracer = Tracer()
    if spec.get("trace_length"):
        res["traced"] = tracer.install()
    totals = _count_connector_stats() if spec["connector"] else None
    kw: Dict[str, Any] = dict(
        model=spec["model_dir"],
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=spec["enforce_eager"],
        dtype="bfloat16",
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_model_len"],  # a whole prompt in one step
        max_num_seqs=spec["serve"]["max_seqs"] if PHASES[name].get("serve") else 8,
        gpu_memory_utilization=spec["gpu_memory_utilization"],
        attention_backend="FLASH_ATTN",
        enable_prefix_caching=spec["prefix"],
        block_size=spec["block_size"],
        seed=0,
    )
    if spec.get("no_async_scheduling"):
        kw["async_scheduling"] = False
    if spec["connector"]:
        extra: Dict[str, Any] = {"address": spec["address"], "load_mode": spec["load_mode"],
                                 "kv_layout": spec["kv_layout"]}
        if spec.get("idle_wait_ms") is not None:
            extra["idle_wait_ms"] = spec["idle_wait_ms"]
        for key in ("sync_batches", "load_start"):
            if PHASES[name].get(key):
                extra[key] = PHASES[name][key]
        if spec.get("connector_model"):
            extra["model"] = spec["connector_model"]
        kw["kv_transfer_config"] = {
            "kv_connector": "KvferryConnector",
            "kv_connector_module_path": "kvferry.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    llm = LLM(**kw)
    res["model_runner"] = _model_runner_used(llm) or asked_runner
    try:
        res["async_scheduling"] = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    except AttributeError:
        res["async_scheduling"] = None
    seed = spec["seed"]
    params = llm.apply_model(lambda model: _redraw_weights(model, seed))
    res["parameters"] = params[0] if params else None
    res["startup_s"] = round(time.perf_counter() - t_start, 1)
    worker = None
    if spec["connector"]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = getattr(get_kv_transfer_group(), "worker_side", None)
        lay = getattr(worker, "layout", None)
        res["kv_layout"] = getattr(lay, "kind", None)
        res["kv_registered"] = bool(getattr(worker, "registered", False))
        if spec["kv_layout"] == "cross_layer" and res["kv_layout"] != "cross_layer":
            res["status"] = "failed"
            res["reason"] = f"asked for cross-layer KV, the worker registered {res['kv_layout']!r}"
            return res
    say(f"{name}: engine up in {res['startup_s']} s (vLLM {vllm.__version__}, model runner "
        f"{res['model_runner']}"
        + (f", KV {res.get('kv_layout')}, registered {res.get('kv_registered')}" if worker else "")
        + ")")

    if PHASES[name].get("serve"):
        res["serve"] = [serve_pass(llm, spec, 0)]
        say(f"{name}: pass 1 {res['serve'][0]}")
        time.sleep(1.0)  # the first pass's saves land before the second
        res["serve"].append(serve_pass(llm, spec, 1))
        say(f"{name}: pass 2 {res['serve'][1]}")
        if totals is not None:
            res["connector_stats"] = dict(totals)
        return res

    def gen(ids: List[int], max_tokens: int) -> Dict[str, Any]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=spec["logprobs"],
                            ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        o = out[0]
        c = o.outputs[0]
        return {"ms": round(dt * 1e3, 3), "tokens": list(c.token_ids),
                "logprobs": _first_logprobs(c), "cached": int(o.num_cached_tokens or 0)}

    def record(kind: str, length: int, index: int, r: Dict[str, Any]) -> None:
        r.update(kind=kind, length=length, index=index)
        if index < 0:
            r["warmup"] = True
        res["runs"].append(r)

    lengths = spec["lengths"]
    full = {n: (n - 1) // spec["block_size"] * spec["block_size"] for n in lengths}
    indices = [-(i + 1) for i in range(spec["warmup"])] + list(range(spec["prompts"]))
    prompts = {(n, i): prompt_ids(seed, n, i) for n in lengths for i in indices}
    # Warm-ups first (their own prompts: cold, and a hit where the phase has hits).
    order = [(n, i) for i in indices if i < 0 for n in lengths] + \
            [(n, i) for i in indices if i >= 0 for n in lengths]
    settle = spec["settle_ms"] / 1e3
    if spec["cold"]:
        for n, i in order:
            r = gen(prompts[(n, i)], 1)
            record("cold", n, i, r)
            # In every phase alike: a cold request's save (~0.1 s at 32K) lands before the
            # next request, so each cold TTFT carries its own save, not the previous one's.
            time.sleep(settle)
            if i < 0 and spec["hits"]:
                record("hit", n, i, gen(prompts[(n, i)], 1))
        if spec["connector"]:
            time.sleep(1.0)  # the last saves land before the hits
        colds = [r for r in res["runs"] if r["kind"] == "cold" and "warmup" not in r]
        say(f"{name}: cold " + ", ".join(
            f"{n}: {_median([r['ms'] for r in colds if r['length'] == n])} ms" for n in lengths))
    if spec["hits"]:
        for rep in range(spec["repeats"]):
            for n, i in order:
                if i < 0 and (rep > 0 or spec["cold"]):
                    continue
                r = gen(prompts[(n, i)], 1)
                record("hit", n, i, r)
                if r["cached"] != full[n] and i >= 0:
                    r["partial"] = True
        for n, i in order:
            if i >= 0:
                record("check", n, i, gen(prompts[(n, i)], spec["check_tokens"]))
        hits = [r for r in res["runs"] if r["kind"] == "hit" and "warmup" not in r]
        partial = [r for r in hits if r.get("partial")]
        if partial:
            res["partial_hits"] = len(partial)
        say(f"{name}: hits " + ", ".join(
            f"{n}: {_median([r['ms'] for r in hits if r['length'] == n])} ms" for n in lengths)
            + (f"; {len(partial)} of {len(hits)} hits covered fewer tokens than the full blocks"
               if partial else ""))
        if spec.get("trace_length") and (spec["connector"] or spec["prefix"]):
            n = spec["trace_length"]
            traced = []
            for k in range(spec["trace_runs"]):
                i = k % spec["prompts"]
                tracer.on = True
                t0 = time.perf_counter()
                r = gen(prompts[(n, i)], 1)
                tracer.on = False
                traced.append({"ms": r["ms"], "cached": r["cached"], "spans": tracer.take(t0)})
                time.sleep(0.05)
            res["trace"] = {"length": n, "runs": traced, "summary": summarize_trace(traced)}
    if totals is not None:
        res["connector_stats"] = dict(totals)
    return res


def _pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


def _serve_index(index: Dict[str, int], rid: str, k: int) -> Optional[int]:
    """The prompt an engine output is of: by the id given or answered, else by the prefix
    the id was made from (a vLLM that appends to request ids in its outputs)."""
    if rid in index:
        return index[rid]
    m = re.match(rf"serve{k}-(\d+)(?!\d)", rid)
    return int(m.group(1)) if m else None


def serve_pass(llm: Any, spec: Dict[str, Any], k: int) -> Dict[str, Any]:
    """One pass of the serving run through the engine's own request loop: the prompts
    arrive (Poisson at the rate, seeded; all at once at rate 0), and each request's first
    token and end are timed as the engine hands them out."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sv = spec["serve"]
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=sv["output"], temperature=0.0, ignore_eos=True,
                        detokenize=False)
    prompts = [prompt_ids(spec["seed"] + 1000, sv["length"], i) for i in range(sv["prompts"])]
    rng = random.Random(spec["seed"] + 7)
    at, t = [], 0.0
    for _ in prompts:
        at.append(t)
        t += rng.expovariate(sv["rate"]) if sv["rate"] > 0 else 0.0
    index: Dict[str, int] = {}
    sent: Dict[int, float] = {}
    first: Dict[int, float] = {}
    done: Dict[int, float] = {}
    cached = 0
    nxt = 0
    t0 = time.perf_counter()
    while len(done) < len(prompts):
        now = time.perf_counter()
        while nxt < len(prompts) and t0 + at[nxt] <= now:
            rid = f"serve{k}-{nxt}"
            got = eng.add_request(rid, TokensPrompt(prompt_token_ids=prompts[nxt]), sp)
            index[rid] = nxt
            if isinstance(got, str):
                index[got] = nxt
            sent[nxt] = time.perf_counter()
            nxt += 1
        if not eng.has_unfinished_requests():
            if nxt >= len(prompts):
                break  # the engine holds none of them: the rest are reported missing
            time.sleep(max(0.0, min(0.001, t0 + at[nxt] - time.perf_counter())))
            continue
        for o in eng.step():
            i = _serve_index(index, str(o.request_id), k)
            if i is None:
                continue
            now = time.perf_counter()
            if i not in first and o.outputs and len(o.outputs[0].token_ids) > 0:
                first[i] = now
                cached += int(getattr(o, "num_cached_tokens", 0) or 0)
            if o.finished:
                done[i] = now
    dur = time.perf_counter() - t0
    ttft = [1e3 * (first[i] - sent[i]) for i in first]
    e2e = [1e3 * (done[i] - sent[i]) for i in done]
    return {"requests": len(done), "missing": len(prompts) - len(done),
            "duration_s": round(dur, 3),
            "ttft_mean_ms": round(statistics.mean(ttft), 2) if ttft else None,
            "ttft_median_ms": _median(ttft), "ttft_p99_ms": _pct(ttft, 0.99),
            "e2e_mean_ms": round(statistics.mean(e2e), 2) if e2e else None,
            "output_tok_s": round(len(done) * sv["output"] / dur, 1),
            "cached_tokens_mean": round(cached / max(1, len(first)))}


def _count_connector_stats() -> Dict[str, float]:
    """The connector's counters summed over the phase (vLLM takes and resets them every step)."""
    from kvferry.vllm import stats

    totals: Dict[str, float] = {}
    add = stats.Counters.add

    def counting(self: Any, name: str, n: float = 1) -> None:
        totals[name] = totals.get(name, 0) + n
        add(self, name, n)

    stats.Counters.add = counting  # type: ignore[method-assign]
    return totals


def summarize_trace(traced: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per span label: how many per request, and the median over requests of its first start,
    its total time and (for loads) the node's own copy time; all in ms from generate()."""
    per: Dict[str, Dict[str, List[float]]] = {}
    for run in traced:
        seen: Dict[str, List[float]] = {}
        for label, start, dur, extra in run["spans"]:
            s = seen.setdefault(label, [start, 0.0, 0.0, 0.0])
            s[1] += dur
            s[2] += 1
            if extra and extra.get("node_seconds"):
                s[3] += extra["node_seconds"] * 1e3
        for label, (start, total, count, node_ms) in seen.items():
            d = per.setdefault(label, {"first_start_ms": [], "total_ms": [], "count": [],
                                       "node_copy_ms": []})
            d["first_start_ms"].append(start)
            d["total_ms"].append(total)
            d["count"].append(count)
            if node_ms:
                d["node_copy_ms"].append(node_ms)
    out: Dict[str, Any] = {"ttft_ms": _median([r["ms"] for r in traced])}
    for label, d in sorted(per.items(), key=lambda kv: statistics.median(kv[1]["first_start_ms"])):
        out[label] = {k: _median(v) for k, v in d.items() if v}
    return out


# ----------------------------------------------------------------------------- command line


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvferry.bench vllm",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--kvferry-bin", default=os.environ.get("KVFERRY_BIN", "kvferry"))
    p.add_argument("--tokens", type=_ints, default=[2048, 10000, 32768],
                   help="prompt sizes (each rounded to whole blocks, plus one token)")
    p.add_argument("--prompts", type=int, default=3, help="prompts per size")
    p.add_argument("--warmup", type=int, default=1, help="warm-up prompts per size and phase")
    p.add_argument("--repeats", type=int, default=2, help="hits of each prompt per phase")
    p.add_argument("--phases", default=",".join(DEFAULT_PHASES),
                   type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--layers", type=int, default=LLAMA_8B["num_hidden_layers"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-tokens", type=int, default=8,
                   help="greedy tokens compared after each hit")
    p.add_argument("--logprobs", type=int, default=5)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--no-eager", action="store_true",
                   help="let vLLM compile and capture CUDA graphs (minutes per engine start)")
    p.add_argument("--connector-model", default="",
                   help='the connector\'s "model" setting (default: unset, so blocks are shared '
                   "under the served model name, here the model folder's path)")
    p.add_argument("--trace", action="store_true",
                   help="also run traced hits and report where their time goes")
    p.add_argument("--trace-tokens", type=int, default=None,
                   help="the prompt size traced (one of --tokens; default the second)")
    p.add_argument("--trace-runs", type=int, default=5)
    p.add_argument("--settle-ms", type=int, default=300,
                   help="pause after each cold request (its save lands before the next one)")
    p.add_argument("--model-runner", choices=sorted(MODEL_RUNNERS), default="auto",
                   help="vLLM's model runner for every phase (VLLM_USE_V2_MODEL_RUNNER); auto: "
                   "vLLM's choice, V1 for kv-xl where vLLM has it")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="every phase with vLLM's async scheduling off (then the connector's "
                   "default load_mode, auto, loads a hit alone in the engine synchronously)")
    p.add_argument("--idle-wait-ms", type=int, default=None,
                   help="the connector's idle_wait_ms (default: the connector's own)")
    p.add_argument("--serve-prompts", type=int, default=12,
                   help="serve phases: prompts per pass")
    p.add_argument("--serve-tokens", type=int, default=10000,
                   help="serve phases: tokens per prompt (whole blocks, plus one)")
    p.add_argument("--serve-output", type=int, default=64,
                   help="serve phases: output tokens per request")
    p.add_argument("--serve-rate", type=float, default=0.0,
                   help="serve phases: requests per second, Poisson arrivals (0: all at once)")
    p.add_argument("--serve-max-seqs", type=int, default=16,
                   help="serve phases: vLLM's max_num_seqs")
    p.add_argument("--phase-timeout", type=float, default=600.0)
    p.add_argument("--model-dir", default=None, help="where config.json goes (default --out)")
    p.add_argument("--out", default=None, help="folder for bench-vllm.json and the logs")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (and write config.json) without running anything")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.child:
        return args
    for ph in args.phases:
        if ph not in PHASES:
            p.error(f"unknown phase {ph!r} ({', '.join(PHASES)})")
    if min([args.prompts, args.layers, args.block_size, args.check_tokens, args.logprobs,
            args.trace_runs] + args.tokens, default=0) < 1:
        p.error("--prompts, --layers, --block-size, --check-tokens, --logprobs, --trace-runs "
                "and --tokens must be positive")
    short = [n for n in args.tokens if n < args.block_size]
    if short:
        p.error(f"--tokens {short[0]}: shorter than one block of {args.block_size} tokens")
    if args.idle_wait_ms is not None and not 0 <= args.idle_wait_ms <= 100:
        p.error("--idle-wait-ms must be within 0..100")
    if args.warmup < 0 or args.repeats < 1 or args.settle_ms < 0:
        p.error("--warmup and --settle-ms must be >= 0 and --repeats >= 1")
    if min(args.serve_prompts, args.serve_output, args.serve_max_seqs) < 1 or \
            args.serve_tokens < args.block_size or args.serve_rate < 0:
        p.error("--serve-prompts, --serve-output and --serve-max-seqs must be positive, "
                "--serve-tokens at least one block and --serve-rate >= 0")
    if not 0.05 <= args.gpu_memory_utilization <= 0.95:
        p.error("--gpu-memory-utilization must be within 0.05..0.95")
    if args.trace and args.trace_tokens is None:
        args.trace_tokens = args.tokens[1] if len(args.tokens) > 1 else args.tokens[0]
    return args


def print_table(result: Dict[str, Any]) -> None:
    ttft = result["ttft_ms"]
    names = list(next(iter(ttft.values())).keys()) if ttft else []
    say("TTFT medians in ms (x_floor = / GPU prefix-cache hit; save cost = cold with connector "
        "vs without)")
    say(f"{'':44s}" + "".join(f"{n:>12s}" for n in ttft))
    for name in names:
        cells = "".join(f"{'-' if ttft[n].get(name) is None else ttft[n][name]:>12}" for n in ttft)
        say(f"{name:44s}{cells}")
    c = result["correctness"]
    say(f"correctness (kvferry hit == vLLM GPU prefix-cache hit, bit for bit): {c['verdict']} "
        f"({c.get('checked_runs', 0)} runs: {c.get('per_phase')}; recompute differs from the hit "
        f"in {c.get('recompute_differs_from_hit')} prompts)")
    for name, why in (c.get("not_compared") or {}).items():
        say(f"  {name} not compared: {why}")
    for name, passes in (result.get("serve") or {}).items():
        for i, s in enumerate(passes):
            say(f"{name} pass {i + 1} ({'cold' if i == 0 else 'again'}): " + ", ".join(
                f"{k} {v}" for k, v in s.items()))
    for name, ph in result["phases"].items():
        tr = ph.get("trace")
        if tr:
            say(f"where the time goes, {name}, {tr['length']} tokens (median over "
                f"{len(tr['runs'])} traced hits):")
            for label, d in tr["summary"].items():
                say(f"  {label}: {d}")


def summary(result: Dict[str, Any]) -> Dict[str, Any]:
    """The result without the individual runs (those are in bench-vllm.json)."""
    phases = {}
    for name, ph in result["phases"].items():
        d = {k: v for k, v in ph.items() if k not in ("runs", "trace", "log_tail")}
        if ph.get("trace"):
            d["trace_summary"] = ph["trace"]["summary"]
        if ph.get("status") == "failed":
            d["log_tail"] = ph.get("log_tail", [])[-8:]
        phases[name] = d
    return {"ttft_ms": result["ttft_ms"], "correctness": result["correctness"],
            "serve": result.get("serve", {}),
            "phases": phases, "wall_s": result["wall_s"],
            "plan": {k: v for k, v in result["plan"].items() if k != "model_dir"}}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    if args.child:
        return child_main(args.child)
    p = plan(args)
    if args.dry_run:
        if args.out:
            d = os.path.join(args.out, "llama8b-shape")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(p["model"], f, indent=1)
        print(json.dumps(p, indent=1))
        return 0
    result = run_phases(args, p)
    if not args.json:
        print_table(result)
    print(json.dumps(summary(result), indent=None if args.json else 1), flush=True)
    ok = result["correctness"]["verdict"] in ("PASS", "NOT RUN") and all(
        ph["status"] in ("ok", "skipped") for ph in result["phases"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
