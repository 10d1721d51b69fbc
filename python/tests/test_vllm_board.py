"""A load's outcome as the worker learns it: from the completion board's final word, with no
call for a success and one ``poll_load`` (the details) for a failure. Against a real
``kvferry node`` (successes, async and sync, counted at the worker's client) and a fake
node whose board says what the test wants (failures). Needs torch (memfd-backed CPU
tensors); never imports vLLM.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_support import Node, kv_tensors  # noqa: E402
from kvferry.bench_finish import CountingClient as Counting  # noqa: E402
from kvferry.vllm import WorkerSide, parse_extra_config  # noqa: E402
from kvferry.vllm.config import ConfigError  # noqa: E402
from kvferry.vllm.kvcache import layer_names  # noqa: E402
from kvferry.vllm.metadata import LoadSpec, StepMetadata  # noqa: E402

BS, NB, HEADS, HEAD = 16, 24, 2, 32


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.kill()


def blk(t, b):
    return t[b]


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_a_successful_load_is_reported_from_the_board_without_any_call(node, layout):
    import kvferry

    cfg = parse_extra_config({"address": node.addr})
    made: List[Counting] = []

    def factory():
        c = Counting(kvferry.EngineClient(node.addr, deadline_s=10.0))
        made.append(c)
        return c

    kv = kv_tensors(3, NB, HEADS, BS, HEAD, layout)
    w = WorkerSide(cfg, instance=f"board-{layout}", model="m", kv_dtype="float32", tp_rank=0,
                   tp_size=1, num_blocks=NB, client_factory=factory)
    w.register_kv_caches(kv)
    try:
        assert w._board is not None, "the node gave the worker no board"
        c = w.link.client()
        g = torch.Generator().manual_seed(5)
        for t in kv.values():
            t.copy_(torch.rand(t.shape, generator=g))
        src = [1, 2, 3, 4]
        hashes = [f"{layout}-{i}".encode() for i in src]
        saved = c.save(w.instance, 0, hashes, src)
        assert saved["written"] == 4, saved
        want = [[blk(t, b).clone() for t in kv.values()] for b in src]
        names = list(layer_names(w.layout))
        for round_, (sync, dest) in enumerate([(False, [10, 11, 12, 13]), (True, [14, 15, 16, 17]),
                                               (False, [18, 19, 20, 21])]):
            q = c.query(w.instance, hashes)
            assert q["local_blocks"] == 4, q
            rid = f"r{round_}"
            w.start_load(StepMetadata(loads=[LoadSpec(rid, q["lease"], dest, 4 * BS, sync=sync)]))
            if sync:
                for name in names:
                    w.wait_for_layer_load(name)
            else:
                assert w.wait_for_loads({rid}, 10.0)
            _, recving = w.get_finished(set())
            assert (rid in recving) is not sync
            assert w.get_block_ids_with_load_errors() == set()
            for i, b in enumerate(dest):
                assert all(torch.equal(blk(t, b), x) for t, x in zip(kv.values(), want[i])), b
        # Not one PollLoad: the board's word was each load's outcome.
        calls = {k: v for c in made for k, v in c.calls.items()}
        assert calls.get("poll_load", 0) == 0, calls
        assert calls.get("load", 0) == 3, calls
        s = w.take_stats()
        assert s["loads"] == 3 and "load_failures" not in s, s
        # What the node would have said, from the layout: every byte of every block.
        assert s["loaded_bytes"] == 3 * 4 * w.layout.block_bytes, s
        assert s["load_seconds"] > 0 and len(s["load_seconds_samples"]) == 3, s
    finally:
        w.shutdown()


class FakeBoard:
    """A completion board whose loads end as the fake node says."""

    def __init__(self, slots: int = 8):
        self.slots = slots
        self._cv = threading.Condition()
        self._v: Dict[int, Dict[str, Any]] = {}
        self._interrupted = False

    def set(self, slot: int, **v: Any) -> None:
        with self._cv:
            self._v[slot] = dict(v)
            self._cv.notify_all()

    def view(self, slot: int) -> Dict[str, Any]:
        with self._cv:
            return dict(self._v.get(slot, {"tag": 0, "state": "idle", "layers": 0,
                                           "done": False, "ok": False, "failed_blocks": 0}))

    def wait(self, slot: int, tag: int, layers: int, timeout_s: float = 10.0) -> Dict[str, Any]:
        def ready():
            v = self._v.get(slot, {})
            return v.get("tag") == tag and (v.get("done") or v.get("layers", 0) >= layers)

        with self._cv:
            self._cv.wait_for(ready, timeout=timeout_s)
        return self.view(slot)

    def wait_ends(self, loads, timeout_s: float = 10.0) -> List[Dict[str, Any]]:
        def ended():
            return [dict(self._v[s], slot=s) for s, t in loads
                    if self._v.get(s, {}).get("tag") == t and self._v[s].get("done")]

        with self._cv:
            self._cv.wait_for(lambda: ended() or self._interrupted, timeout=timeout_s)
            self._interrupted = False
            return ended()

    def interrupt(self) -> None:
        with self._cv:
            self._interrupted = True
            self._cv.notify_all()


class FakeNode:
    """Registration, loads that end on the board as ``outcomes`` says (by lease), and a
    PollLoad that answers a failure's details; every call counted."""

    def __init__(self, outcomes: Dict[str, Optional[List[int]]], poll_fails: bool = False):
        self.board = FakeBoard()
        self.outcomes = outcomes  # lease -> None (ok) or the failed blocks
        self.poll_fails = poll_fails
        self.calls: Dict[str, int] = {}
        self.loads: Dict[int, str] = {}
        self.polled: List[int] = []
        self.per_layer: Dict[str, bool] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def open_board(self, instance, rank, slots):
        self._count("open_board")
        return self.board

    def send_memfd(self, *a, **kw):
        return 1

    def register(self, *a, **kw):
        self._count("register")
        return "ns"

    def open_session(self, instances):
        class S:
            def close(self):
                pass

        return S()

    def load(self, lease, instance, rank, dest, board_slot=None, board_tag=0, per_layer=False):
        self._count("load")
        self.per_layer[lease] = per_layer
        load_id = len(self.loads) + 1
        self.loads[load_id] = lease
        failed = self.outcomes[lease]
        if failed == "stall":
            self.board.set(board_slot, tag=board_tag, state="running", layers=0, done=False,
                           ok=False, failed_blocks=0)
        elif failed is None:
            self.board.set(board_slot, tag=board_tag, state="ok", layers=3, done=True, ok=True,
                           failed_blocks=0)
        else:
            self.board.set(board_slot, tag=board_tag, state="failed", layers=0, done=True,
                           ok=False, failed_blocks=len(failed))
        return load_id

    def poll_load(self, load_id):
        self._count("poll_load")
        self.polled.append(load_id)
        if self.poll_fails:
            raise RuntimeError("the node went away")
        failed = self.outcomes[self.loads[load_id]]
        if failed == "stall":
            return None
        if failed is None:
            return {"ok": True, "bytes": 1, "seconds": 0.001, "failed_blocks": []}
        return {"ok": False, "failed_blocks": failed, "error_kind": "transfer",
                "error": "injected failure", "bytes": 0, "seconds": 0.001}

    def query(self, *a, **kw):
        return {"lease": None, "local_blocks": 0}

    def cancel_load(self, instance, rank, load_id):
        self._count("cancel_load")
        self.cancelled = getattr(self, "cancelled", []) + [load_id]
        return True


def fake_worker(fake: FakeNode, **extra) -> WorkerSide:
    cfg = parse_extra_config({"address": "127.0.0.1:1", "load_timeout_ms": 5000,
                              "mailbox": False, **extra})
    kv = kv_tensors(3, NB, HEADS, BS, HEAD, "LBNHC")
    w = WorkerSide(cfg, instance="fake", model="m", kv_dtype="float32", tp_rank=0, tp_size=1,
                   num_blocks=NB, client_factory=lambda: fake)
    w.register_kv_caches(kv)
    assert w._board is fake.board
    return w


def test_a_failed_load_is_read_from_the_board_and_its_details_fetched_once():
    fake = FakeNode({"ok-lease": None, "bad-lease": [8], "worse-lease": [5, 6, 7]})
    w = fake_worker(fake)
    try:
        w.start_load(StepMetadata(loads=[
            LoadSpec("ok", "ok-lease", [1, 2], 2 * BS),
            LoadSpec("bad", "bad-lease", [8, 9], 2 * BS),  # one of its two blocks failed
            LoadSpec("worse", "worse-lease", [5, 6, 7], 3 * BS),
        ]))
        assert w.wait_for_loads({"ok", "bad", "worse"}, 10.0)
        _, recving = w.get_finished(set())
        assert recving == {"ok", "bad", "worse"}
        # Exactly the failed blocks the details name; the success asked nothing.
        assert w.get_block_ids_with_load_errors() == {8, 5, 6, 7}
        assert fake.calls["load"] == 3
        assert fake.calls["poll_load"] == 2, fake.calls
        ok_id = next(i for i, lease in fake.loads.items() if lease == "ok-lease")
        assert ok_id not in fake.polled
        # Async loads land in a few long batches: the node's choice.
        assert fake.per_layer == {"ok-lease": False, "bad-lease": False, "worse-lease": False}
        s = w.take_stats()
        assert s["load_failures"] == 2 and s["failed_blocks"] == 4, s
        assert s["loaded_blocks"] == 2 and s["loaded_bytes"] == 2 * w.layout.block_bytes, s
    finally:
        w.shutdown()


def test_a_sync_load_ends_at_its_last_layer_ok_without_a_call_failed_with_its_blocks():
    fake = FakeNode({"ok-lease": None, "bad-lease": [3, 4]})
    w = fake_worker(fake)
    names = list(layer_names(w.layout))
    try:
        w.start_load(StepMetadata(loads=[LoadSpec("s-ok", "ok-lease", [1, 2], 2 * BS,
                                                  sync=True)]))
        for name in names:
            w.wait_for_layer_load(name)
        assert fake.calls.get("poll_load", 0) == 0, fake.calls
        w.start_load(StepMetadata(loads=[LoadSpec("s-bad", "bad-lease", [3, 4], 2 * BS,
                                                  sync=True)]))
        for name in names:
            w.wait_for_layer_load(name)
        # Reported within the step: by block (a sync load runs this step's forward).
        _, recving = w.get_finished(set())
        assert recving == set()
        assert w.get_block_ids_with_load_errors() == {3, 4}
        assert fake.calls["poll_load"] == 1, fake.calls
        # The forward waits layer by layer, so each layer is asked to land on its own.
        assert fake.per_layer == {"ok-lease": True, "bad-lease": True}
    finally:
        w.shutdown()


def test_sync_batches_grouped_leaves_a_sync_load_to_the_node_layer_groups():
    fake = FakeNode({"ok-lease": None})
    w = fake_worker(fake, sync_batches="grouped")
    try:
        w.start_load(StepMetadata(loads=[LoadSpec("s-ok", "ok-lease", [1, 2], 2 * BS,
                                                  sync=True)]))
        for name in layer_names(w.layout):
            w.wait_for_layer_load(name)
        assert fake.per_layer == {"ok-lease": False}
        _, recving = w.get_finished(set())
        assert w.get_block_ids_with_load_errors() == set()
    finally:
        w.shutdown()
    with pytest.raises(ConfigError, match="sync_batches"):
        parse_extra_config({"address": "127.0.0.1:1", "sync_batches": "per-layer"})
    with pytest.raises(ConfigError, match="load_start"):
        parse_extra_config({"address": "127.0.0.1:1", "load_start": "early"})
    assert parse_extra_config({"address": "127.0.0.1:1"}).load_start == "worker"


def test_a_load_given_up_on_is_cancelled_on_the_node_and_its_blocks_recomputed():
    fake = FakeNode({"slow-lease": "stall"})
    w = fake_worker(fake, load_timeout_ms=300)
    try:
        w.start_load(StepMetadata(loads=[LoadSpec("slow", "slow-lease", [1, 2], 2 * BS)]))
        assert w.wait_for_loads({"slow"}, 10.0)
        _, recving = w.get_finished(set())
        assert recving == {"slow"}
        assert w.get_block_ids_with_load_errors() == {1, 2}
        # The node is asked to stop copying into blocks vLLM now recomputes.
        assert fake.calls.get("cancel_load") == 1 and fake.cancelled == [1], fake.calls
        assert w.take_stats().get("loads_cancelled") == 1
    finally:
        w.shutdown()


def test_a_failure_whose_details_cannot_be_fetched_fails_every_block():
    fake = FakeNode({"bad-lease": [2]}, poll_fails=True)
    w = fake_worker(fake)
    try:
        w.start_load(StepMetadata(loads=[LoadSpec("bad", "bad-lease", [1, 2, 3], 3 * BS)]))
        assert w.wait_for_loads({"bad"}, 10.0)
        w.get_finished(set())
        assert w.get_block_ids_with_load_errors() == {1, 2, 3}
        assert fake.calls["poll_load"] == 1
    finally:
        w.shutdown()


def test_a_load_started_while_the_loader_sleeps_on_the_board_starts_at_once():
    """The loader sleeps on the board while a load runs; a new load interrupts it rather than
    waiting for the running one to end."""
    fake = FakeNode({"slow": None, "quick": None})
    w = fake_worker(fake)
    real_load = fake.load

    def load(lease, instance, rank, dest, board_slot=None, board_tag=0):
        if lease == "slow":  # accepted, and still running
            fake._count("load")
            fake.loads[len(fake.loads) + 1] = lease
            fake.board.set(board_slot, tag=board_tag, state="running", layers=0, done=False,
                           ok=False, failed_blocks=0)
            fake.slow = (board_slot, board_tag)
            return len(fake.loads)
        return real_load(lease, instance, rank, dest, board_slot, board_tag)

    fake.load = load
    try:
        w.start_load(StepMetadata(loads=[LoadSpec("slow", "slow", [1], BS)]))
        time.sleep(0.05)  # the loader is asleep on the board now
        t0 = time.monotonic()
        w.start_load(StepMetadata(loads=[LoadSpec("quick", "quick", [2], BS)]))
        assert w.wait_for_loads({"quick"}, 10.0)
        assert time.monotonic() - t0 < 0.3
        slot, tag = fake.slow
        fake.board.set(slot, tag=tag, state="ok", layers=3, done=True, ok=True, failed_blocks=0)
        assert w.wait_for_loads({"slow"}, 10.0)
        assert fake.calls.get("poll_load", 0) == 0
    finally:
        w.shutdown()


def _stop_loader(w: WorkerSide) -> None:
    """Ends the worker's loader thread: what a loader that cannot get the GIL back from a busy
    engine loop would do in the meantime (nothing)."""
    from kvferry.vllm.worker import _STOP

    w._load_q.put(_STOP)
    w._threads[0].join(timeout=10)
    assert not w._threads[0].is_alive()


def test_a_step_without_a_forward_starts_its_load_and_reports_its_end_on_its_own_thread():
    """In a step where vLLM runs no forward (the one that schedules an async hit), the load
    starts before start_load returns and its end is reported by that step's get_finished,
    with no loader thread at all: a loader waiting for the GIL (up to 5 ms behind a busy
    engine loop) is on neither path."""
    fake = FakeNode({"ok-lease": None, "later": None})
    w = fake_worker(fake)
    try:
        _stop_loader(w)
        meta = StepMetadata(loads=[LoadSpec("a", "ok-lease", [1, 2], 2 * BS)], idle=True)
        w.begin_step(meta)
        w.start_load(meta)
        assert fake.calls.get("load", 0) == 1, fake.calls
        _, recving = w.get_finished(set())
        assert recving == {"a"}
        assert w.get_block_ids_with_load_errors() == set()
        assert fake.calls.get("poll_load", 0) == 0, fake.calls
        # A step with a forward hands its loads to the loader (none here): not started.
        meta = StepMetadata(loads=[LoadSpec("b", "later", [3], BS)])
        w.begin_step(meta)
        w.start_load(meta)
        assert fake.calls["load"] == 1, fake.calls
    finally:
        w.shutdown()


class _Watched(FakeBoard):
    """A fake board that records who waited on it for a load, and how long they could."""

    def __init__(self) -> None:
        super().__init__()
        self.end_waits: List[Any] = []

    def wait(self, slot, tag, layers, timeout_s: float = 10.0):
        self.end_waits.append((threading.current_thread().name, timeout_s))
        return super().wait(slot, tag, layers, timeout_s)


def _running_load(fake: FakeNode) -> None:
    """Loads of lease "slow" are taken and keep running until the test ends them."""
    real = fake.load

    def load(lease, instance, rank, dest, board_slot=None, board_tag=0):
        if lease != "slow":
            return real(lease, instance, rank, dest, board_slot, board_tag)
        fake._count("load")
        fake.loads[len(fake.loads) + 1] = lease
        fake.board.set(board_slot, tag=board_tag, state="running", layers=0, done=False,
                       ok=False, failed_blocks=0)
        fake.slow = (board_slot, board_tag)
        return len(fake.loads)

    fake.load = load


def test_a_step_without_a_forward_waits_boundedly_for_a_running_load_to_end():
    fake = FakeNode({})
    fake.board = _Watched()
    _running_load(fake)
    cfg = parse_extra_config({"address": "127.0.0.1:1", "mailbox": False, "idle_wait_ms": 100})
    w = WorkerSide(cfg, instance="idle", model="m", kv_dtype="float32", tp_rank=0, tp_size=1,
                   num_blocks=NB, client_factory=lambda: fake)
    w.register_kv_caches(kv_tensors(3, NB, HEADS, BS, HEAD, "LBNHC"))
    me = threading.current_thread().name
    try:
        _stop_loader(w)
        idle = StepMetadata(loads=[LoadSpec("s", "slow", [1, 2], 2 * BS)], idle=True)
        w.begin_step(idle)
        w.start_load(idle)
        # Nothing ends: the step waits once, for at most idle_wait_ms, and reports nothing.
        _, recving = w.get_finished(set())
        assert recving == set()
        assert [t for n, t in fake.board.end_waits if n == me] == [0.1]
        # A step with a forward never waits, even with the load still running.
        w.begin_step(StepMetadata())
        w.get_finished(set())
        # Nor does one whose metadata vLLM did not bind (the flag lasts one step).
        w.get_finished(set())
        assert len([n for n, _ in fake.board.end_waits if n == me]) == 1
        # The load ends while an idle step waits: that step reports it.
        slot, tag = fake.slow
        threading.Timer(0.02, lambda: fake.board.set(
            slot, tag=tag, state="ok", layers=3, done=True, ok=True, failed_blocks=0)).start()
        w.begin_step(StepMetadata(idle=True))
        _, recving = w.get_finished(set())
        assert recving == {"s"}
        assert fake.calls.get("poll_load", 0) == 0, fake.calls
        # Nothing left on the board: an idle step has nothing to wait for.
        w.begin_step(StepMetadata(idle=True))
        w.get_finished(set())
        assert len([n for n, _ in fake.board.end_waits if n == me]) == 2
    finally:
        w.shutdown()


def test_idle_wait_ms_is_bounded_and_may_be_off():
    from kvferry.vllm import ConfigError

    assert parse_extra_config({"address": "h:1"}).idle_wait_ms == 2
    assert parse_extra_config({"address": "h:1", "idle_wait_ms": 0}).idle_wait_s == 0.0
    for bad in (-1, 101, 2.5, True, "2"):
        with pytest.raises(ConfigError, match="idle_wait_ms"):
            parse_extra_config({"address": "h:1", "idle_wait_ms": bad})
