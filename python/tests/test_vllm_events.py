"""kvferry's tiers in vLLM's own KV event stream, against vLLM's real scheduler on CPU
(whichever supported release the interpreter has): a block the engine saved to the node is
published by vLLM's own ``ZmqEventPublisher`` as ``BlockStored(medium="CPU")`` with vLLM's
block hash, parent, tokens and block size, and as ``BlockRemoved(medium="CPU")`` once the
node evicts it. The subscriber is pyzmq with vLLM's own msgspec decoder."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_engine import Engine, prompt  # noqa: E402
from vllm_support import Node, free_port  # noqa: E402

BS = 16


@pytest.fixture
def events_node(tmp_path):
    # Blocks of the test engine are 16 KiB: 8 slots of 32 KiB, so a second prompt of 6
    # blocks evicts most of the first one's.
    n = Node(tmp_path, "py-vllm-events", pool="256KiB", slot="32KiB",
             extra='[events]\npublish = "tcp://127.0.0.1:0"\n')
    yield n
    n.kill()


def test_saved_blocks_reach_vllms_event_stream_and_leave_it_when_evicted(tmp_path, events_node):
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # vLLM's publisher binds a wildcard endpoint (as `vllm serve` is usually told).
    kec = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                         endpoint=f"tcp://*:{port}", topic="engine-a")
    extra = {"address": events_node.addr, "deadline_ms": 500, "retry_ms": 100,
             "events": events_node.listening["events"]}
    eng = Engine(tmp_path, extra, kv_events=kec)
    sub.connect(f"tcp://127.0.0.1:{port}")
    # What vLLM publishes for a block hash (an int where VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as external
    except ImportError:
        def external(h):
            return h
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    stored, removed = [], []

    def pump(until, timeout=20.0):
        end = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < end, (stored, removed)
            eng.step()  # take_events runs in each step's update_from_output
            while sub.poll(20):
                topic, _seq, payload = sub.recv_multipart()
                assert topic == b"engine-a"
                for e in dec.decode(payload).events:
                    if isinstance(e, BlockStored) and e.medium == "CPU":
                        stored.append(e)
                    elif isinstance(e, BlockRemoved) and e.medium == "CPU":
                        removed.append(e)

    try:
        time.sleep(0.3)  # the publisher's connect before its first batch
        a = prompt(100)
        req = eng.add("a", a)
        vllm_hashes = [external(h) for h in list(req.block_hashes)[:6]]
        eng.run()
        pump(lambda: len(stored) >= 6)
        assert len(stored) == 6, stored
        for i, e in enumerate(stored):
            assert e.block_hashes == [vllm_hashes[i]]
            assert e.parent_block_hash == (vllm_hashes[i - 1] if i else None)
            assert e.token_ids == a[i * BS:(i + 1) * BS]
            assert e.block_size == BS
            assert (e.lora_id, e.lora_name) == (None, None)
        assert not removed
        # A second prompt of 6 other blocks through 8 slots: the node evicts the first's.
        eng.add("b", prompt(100, seed=2))
        eng.run()
        pump(lambda: len(stored) >= 12 and len(removed) >= 1)
        gone = [h for e in removed for h in e.block_hashes]
        assert len(gone) >= 4, removed
        assert set(gone) <= set(vllm_hashes), "only blocks of this engine, by vLLM's hash"
    finally:
        eng.shutdown()
        sub.close()
