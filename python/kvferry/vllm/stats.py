"""The connector's counters, as plain dicts that travel from workers to vLLM's loggers.

The scheduler side counts queries and hits, every worker counts its loads and saves; vLLM
sums them (``aggregate``) and hands them to its log line and to Prometheus. Tokens and
blocks of loads are counted by TP rank 0 only (every rank loads the same blocks); bytes,
failures and seconds by every rank.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List

__all__ = ["COUNTERS", "Counters", "merge", "reduce_summary"]

#: name -> help text (also the Prometheus documentation, as vllm:kvferry_<name>_total).
COUNTERS: Dict[str, str] = {
    "queries": "Queries sent to the kvferry node (one per request admission).",
    "query_failures": "Queries that failed because the node was down, slow or restarting.",
    "queries_skipped": "Queries not sent while a failed node was left alone (backoff).",
    "queried_blocks": "Full blocks asked for, beyond vLLM's own prefix cache hit.",
    "hit_blocks": "Blocks the node held (leased) for those queries.",
    "hit_tokens": "Tokens vLLM took from kvferry instead of computing them.",
    "sync_hits": "Hits loaded synchronously (load_mode \"sync\", or \"auto\" with no other "
    "request running): the forward runs each layer as it lands.",
    "async_hits": "Hits loaded asynchronously (load_mode \"async\", or \"auto\" beside running "
    "requests): the request runs once its load has ended.",
    "direct_refused": "Queries that asked for direct GPU loads and were refused by the node.",
    "loads": "Loads of a lease into a rank's KV (every rank).",
    "load_failures": "Loads that failed (their blocks are recomputed by vLLM).",
    "loaded_tokens": "Tokens loaded into vLLM's KV (counted by TP rank 0).",
    "loaded_blocks": "Blocks loaded into vLLM's KV (counted by TP rank 0).",
    "loaded_bytes": "Bytes loaded into vLLM's KV (every rank).",
    "failed_blocks": "Destination blocks of failed loads, reported to vLLM (every rank).",
    "load_seconds": "Seconds from a load's start to its completion, summed (every rank).",
    "saves": "Save calls (newly computed full blocks copied to the node; every rank).",
    "save_failures": "Saves that failed (the blocks are missing from the node, no more).",
    "saved_blocks": "Blocks written to the node by saves (every rank).",
    "saved_bytes": "Bytes written to the node by saves (every rank).",
    "registrations": "Registrations of a rank's KV with the node (again after a restart).",
    "loads_cancelled": "Loads given up on at load_timeout_ms that the node was asked to stop "
    "(CancelLoad) and that were still running.",
    "saves_cancelled": "Saves of preempted requests never sent: the node was too slow, and "
    "vLLM reuses their blocks.",
    "withheld_blocks": "Blocks not asked for because a load of them failed lately (vLLM "
    "computes them instead of loading them again).",
    "early_loads": "Synchronous loads the scheduler started the moment their blocks were "
    "allocated (load_start \"scheduler\").",
    "early_load_refusals": "Loads the scheduler tried to start early that the node refused "
    "(the worker then starts them, or vLLM recomputes their blocks).",
    "registration_refusals": "Registrations the node refused after the engine started "
    "(a refusal at start stops the engine).",
}

#: Individual load durations kept per interval (for the histogram), at most.
MAX_SAMPLES = 4096


class Counters:
    """Thread-safe counters; ``take()`` returns and resets them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Dict[str, float] = {}
        self._samples: List[float] = []

    def add(self, name: str, n: float = 1) -> None:
        assert name in COUNTERS, name
        if n:
            with self._lock:
                self._c[name] = self._c.get(name, 0) + n

    def sample_load(self, seconds: float) -> None:
        with self._lock:
            if len(self._samples) < MAX_SAMPLES:
                self._samples.append(seconds)

    def take(self) -> Dict[str, Any]:
        with self._lock:
            c, s = self._c, self._samples
            self._c, self._samples = {}, []
        if not c and not s:
            return {}
        out: Dict[str, Any] = dict(c)
        if s:
            out["load_seconds_samples"] = s
        return out


def merge(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if k == "load_seconds_samples":
            out[k] = (list(out.get(k, [])) + list(v))[:MAX_SAMPLES]
        else:
            out[k] = out.get(k, 0) + v
    return out


def reduce_summary(d: Dict[str, Any]) -> Dict[str, float]:
    """The interval's counters for vLLM's "KV Transfer metrics" log line."""
    out: Dict[str, float] = {k: d[k] for k in COUNTERS if d.get(k)}
    loads = d.get("loads", 0)
    if loads:
        out["avg_load_ms"] = round(1000.0 * d.get("load_seconds", 0.0) / loads, 3)
    q = d.get("queried_blocks", 0)
    if q:
        out["hit_rate"] = round(d.get("hit_blocks", 0) / q, 4)
    return out
