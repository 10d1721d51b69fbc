"""What the connector gives up on leaves nothing behind: driven by vLLM's real scheduler on
CPU (see ``vllm_engine.py``), against real ``kvferry node`` processes.

- A node stalled (SIGSTOP) past the call deadline while a save and a query wait on it: the
  connector gives up, vLLM reuses the saved blocks for another request; when the node
  resumes, the stale save is not sealed (a later hit is byte-exact) and the stale query
  leaves no lease and no pin.
- TP 2 with a rank whose loads always fail: the request is recomputed after that one
  failure (no load, fail, hit again loop) and no lease is left.
- A node SIGKILLed while a load runs on it: the load fails within a second, not at
  ``load_timeout_ms``.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvferry  # noqa: E402
from vllm_engine import Engine, prompt  # noqa: E402
from nodeproc import cluster_node  # noqa: E402
from vllm_support import Node, block_contents, expected_block  # noqa: E402

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


def reset_cache(eng) -> None:
    """Empties vLLM's own prefix cache (once the blocks it waits on for saves are free), so
    a prefix can only come from kvferry."""
    for _ in range(200):
        if eng.scheduler.reset_prefix_cache():
            return
        eng.step()
        time.sleep(0.01)
    raise AssertionError("vLLM's prefix cache did not empty")


def status(req) -> str:
    return str(req.status).rsplit(".", 1)[-1]


def settled(n: Node, timeout: float = 10.0) -> dict:
    """The node's stats once no lease and no pin is left (or after ``timeout``)."""
    c = kvferry.EngineClient(n.addr)
    end = time.monotonic() + timeout
    while True:
        s = c.stats()
        if (s["leases_live"], s["pinned_blocks"], s["pins"]) == (0, 0, 0):
            return s
        if time.monotonic() > end:
            return s
        time.sleep(0.05)


def abandoned(n: Node, op: str) -> float:
    for line in n.metrics().splitlines():
        if line.startswith(f'kvferry_abandoned_total{{op="{op}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("mailbox", [True, False], ids=["mailbox", "grpc"])
def test_a_stalled_node_resuming_seals_no_abandoned_save_and_keeps_no_abandoned_lease(
    tmp_path, node, mailbox
):
    # 15 usable blocks: the request run while the node is stalled takes every free one, so
    # it overwrites the blocks of the request whose save the connector gave up on.
    eng = engine(tmp_path, node.addr, num_blocks=16, extra={"mailbox": mailbox})
    try:
        p = prompt(48, seed=51)
        eng.add("p", p, max_tokens=1)
        eng.run()
        assert eng.stats.get("saved_blocks") == 3, eng.stats

        a = prompt(48, seed=52)
        eng.add("a", a, max_tokens=1)
        stalled_at = {}

        def stall(so):
            # a's prefill is scheduled: its save goes to a node that no longer answers.
            node.pause()
            stalled_at["t"] = time.monotonic()

        eng.step(before_worker=stall)
        try:
            a_blocks = eng.block_ids("a")[:3] if "a" in eng.scheduler.requests else []
            # The connector gives up on the save (after its deadline); vLLM frees a's blocks.
            eng.run(until=lambda: "a" not in eng.scheduler.requests, max_steps=500, sleep=0.01)
            assert eng.stats.get("save_failures"), eng.stats
            # A query the connector gives up on: p's prefix would hit.
            assert eng.scheduler.reset_prefix_cache()
            eng.add("c", p + prompt(16, seed=53), max_tokens=1)
            so = eng.step()
            assert not so.kv_connector_metadata.loads  # no hit: the node is stalled
            # A request filling every block while the node is stalled: a's among them.
            eng.add("d", prompt(14 * BS, seed=54), max_tokens=1)
            d_blocks = set()

            def note_d(so):
                if "d" in eng.scheduler.requests:
                    d_blocks.update(eng.block_ids("d"))

            for _ in range(200):
                if "d" in eng.finished:
                    break
                eng.step(before_worker=note_d)
                time.sleep(0.01)
            assert "d" in eng.finished and "c" in eng.finished
            assert set(a_blocks) & d_blocks, (a_blocks, sorted(d_blocks))
        finally:
            node.stop_signal(signal.SIGCONT)
        # The node resumes and serves what was posted while it was stopped.
        s = settled(node)
        assert (s["leases_live"], s["pinned_blocks"], s["pins"]) == (0, 0, 0), s
        # The node discarded what reached it after the fences. A gRPC save the client gave
        # up on is usually cancelled (its stream reset) before the resumed node reads it;
        # a query is kept waiting for so that a late lease is released.
        assert abandoned(node, "query") >= 1, node.metrics()
        if mailbox:
            assert abandoned(node, "save") >= 1, node.metrics()

        # a's prompt again: whatever kvferry serves for it is a's own bytes. First the
        # scheduler's backoff after the failures passes (it queries nothing meanwhile).
        link = eng.connector.scheduler_side.link
        until = time.monotonic() + 40
        while link.resting() and time.monotonic() < until:
            time.sleep(0.05)
        hits = []
        for i in range(2):
            reset_cache(eng)
            rid = f"a{i}"
            eng.add(rid, a, max_tokens=1)
            so = eng.step()
            loads = [ld for ld in so.kv_connector_metadata.loads if ld.req_id == rid]
            hits.append(sum(len(ld.dest_blocks) for ld in loads))
            r = eng.requests[rid]
            eng.run(until=lambda r=r: status(r) != "WAITING_FOR_REMOTE_KVS", max_steps=200)
            for ld in loads:
                for j, blk in enumerate(ld.dest_blocks):
                    want = expected_block(eng.kv, a, j, BS)
                    got = block_contents(eng.kv, blk)
                    assert all(torch.equal(x, y) for x, y in zip(got, want)), (rid, j)
            eng.run(max_steps=200)
        # The first a missed (nothing of a was sealed) and saved it; the second hit it.
        assert hits == [0, 3], hits
        assert eng.invalid_reported == set()
        assert settled(node)["leases_live"] == 0
    finally:
        eng.shutdown()


class FailingLoads:
    """A client whose loads the node refuses (as a rank whose registration went bad)."""

    def __init__(self, inner):
        self._inner = inner
        self.loads = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, *args, **kwargs):
        self.loads += 1
        raise kvferry.FailedPrecondition("injected: rank 1 cannot load", "FAILED_PRECONDITION",
                                         "load")


def test_tp2_a_rank_whose_loads_fail_costs_one_recompute_and_no_lease(tmp_path, node):
    eng = engine(tmp_path, node.addr, tp=2)
    try:
        toks = prompt(70, seed=61)
        eng.add("a", toks)
        eng.run()
        assert eng.stats.get("saved_blocks", 0) >= 4, eng.stats
        # Rank 1 saves fine but every load of it fails.
        link = eng.workers[1].worker_side.link
        failing = FailingLoads(link.client())
        link._client = failing
        make = link._factory
        link._factory = lambda: FailingLoads(make())
        assert eng.scheduler.reset_prefix_cache()
        eng.add("b", toks)
        planned = 0
        for _ in range(300):
            if "b" in eng.finished:
                break
            so = eng.step()
            planned += sum(1 for ld in so.kv_connector_metadata.loads if ld.req_id == "b")
            time.sleep(0.005)
        assert "b" in eng.finished, f"{planned} loads planned, b not finished"
        assert 1 <= planned <= 2, planned
        assert eng.outputs["b"] == eng.outputs["a"]
        s = settled(node)
        assert (s["leases_live"], s["pinned_blocks"]) == (0, 0), s
        # The blocks whose load failed are not offered to the next request either.
        eng.add("c", toks)
        eng.run(max_steps=300)
        assert "c" in eng.finished and eng.outputs["c"] == eng.outputs["a"]
        assert settled(node)["leases_live"] == 0
    finally:
        eng.shutdown()


def test_a_load_whose_node_is_killed_fails_within_a_second(tmp_path):
    from vllm_support import free_port

    ports = {"na": free_port(), "nb": free_port()}
    nb = cluster_node(tmp_path, "nb", ports)
    na = cluster_node(tmp_path, "na", ports)
    try:
        toks = prompt(64, seed=71)
        # The blocks live on node B only (another engine saved them there).
        owner = engine(tmp_path / "owner", nb.addr, extra={"instance": "owner"})
        try:
            owner.add("a", toks)
            owner.run()
            assert owner.stats.get("saved_blocks") == 4, owner.stats
        finally:
            owner.shutdown()
        eng = engine(tmp_path / "eng", na.addr,
                     extra={"instance": "eng", "load_timeout_ms": 9750, "deadline_ms": 2000})
        try:
            eng.add("b", toks)
            planned = {}

            def stall_owner(so):
                # A leased B's blocks (pinned there); B stops answering, so A's load of
                # them stays in flight until A is killed.
                planned["loads"] = list(so.kv_connector_metadata.loads)
                nb.pause()

            eng.step(before_worker=stall_owner)
            b = eng.requests["b"]
            assert len(planned["loads"]) == 1 and status(b) == "WAITING_FOR_REMOTE_KVS"
            time.sleep(0.5)
            assert status(b) == "WAITING_FOR_REMOTE_KVS"
            na.kill()
            killed = time.monotonic()
            while status(b) == "WAITING_FOR_REMOTE_KVS" and time.monotonic() - killed < 15:
                eng.step()
                time.sleep(0.01)
            took = time.monotonic() - killed
            assert status(b) != "WAITING_FOR_REMOTE_KVS"
            assert took < 1.0, f"the load failed {took:.2f} s after its node was killed"
            eng.run(max_steps=500)
            assert "b" in eng.finished
        finally:
            eng.shutdown()
    finally:
        nb.stop_signal(signal.SIGCONT)
        na.kill()
        nb.kill()
