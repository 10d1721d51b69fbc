"""The node's own KV events: a real ``kvferry node`` with ``[events]``, a pyzmq subscriber,
and vLLM's own msgspec decoder (``KVEventBatch`` from ``vllm.distributed.kv_events``), so
what the node sends is what existing vLLM subscribers read."""

from __future__ import annotations

import time

import pytest

import kvferry
from kvpattern import HostKv, block_hash, rank_block
from nodeproc import Node as NodeProc
from nodeproc import free_port

zmq = pytest.importorskip("zmq")
kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOPIC = "kv@py-events:"


@pytest.fixture
def events_node(tmp_path):
    # 256 KiB slots in 16 MiB: 64 blocks, so 80 puts evict.
    n = NodeProc(
        tmp_path, "py-events", pool="16MiB",
        extra='[events]\npublish = "tcp://127.0.0.1:0"\nreplay = "tcp://127.0.0.1:0"\n'
        f'topic = "{TOPIC}"\nbuffer-events = 100000\n',
    )
    yield n
    n.stop()


def decoder():
    return msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)


def put(client, kv, instance, blocks):
    return client.put_blocks(
        instance, 0,
        [(block_hash(b), rank_block(b, 0, kv.layers, kv.segments, kv.seg_bytes)) for b in blocks],
    )


def replay(endpoint, start, timeout_s=10.0):
    """vLLM's replay protocol: a DEALER sends ["", seq]; the answer is
    ["", topic, seq, payload]... then ["", "", END_SEQ, reason]."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart([b"", start.to_bytes(8, "big")])
        return read_replay(s, timeout_s)
    finally:
        s.close()


def read_replay(s, timeout_s):
    out = []
    end = time.monotonic() + timeout_s
    while True:
        assert s.poll(int(max(0.0, end - time.monotonic()) * 1000)), "no end marker"
        frames = s.recv_multipart()
        assert frames[0] == b""
        _, topic, seq, payload = frames
        if seq == END_SEQ:
            return out, payload
        out.append((topic, int.from_bytes(seq, "big"), payload))


def stored_and_removed(messages):
    """(topic, seq, payload) -> per medium, the hashes stored and removed, in order, after
    the node's start (``AllBlocksCleared``, sequence 0, on the bare prefix topic)."""
    dec = decoder()
    stored, removed = {}, {}
    for topic, seq, payload in messages:
        batch = dec.decode(payload)
        for e in batch.events:
            if isinstance(e, kv_events.BlockStored):
                stored.setdefault(e.medium, []).extend(e.block_hashes)
            elif isinstance(e, kv_events.BlockRemoved):
                removed.setdefault(e.medium, []).extend(e.block_hashes)
            elif isinstance(e, kv_events.AllBlocksCleared):
                assert (seq, topic) == (0, TOPIC.encode()), (seq, topic)
                stored, removed = {}, {}
            else:
                raise AssertionError(f"unexpected event {e!r}")
    return stored, removed


def next_message(sub, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if sub.poll(100):
            return tuple(sub.recv_multipart())
    raise AssertionError("no event reached the subscriber")


def test_a_vllm_subscriber_decodes_the_nodes_stores_and_evictions(events_node):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(events_node.listening["events"])
    client = kvferry.EngineClient(events_node.addr, deadline_s=10.0)
    kv = HostKv.allocate("flash_attn", layers=3)
    # The slot of this node holds 256 KiB; a block of this KV is far smaller.
    ns = kv.register(client, "ev")
    time.sleep(1.0)  # ZMQ's slow joiner: the subscription reaches the PUB socket first.
    assert put(client, kv, "ev", range(4))["sealed"] == 4

    topic, seq, payload = next_message(sub)
    if int.from_bytes(seq, "big") == 0:
        # The node's start, if this subscriber was subscribed in time (see the restart test).
        assert topic == TOPIC.encode()
        (e,) = decoder().decode(payload).events
        assert isinstance(e, kv_events.AllBlocksCleared)
        topic, seq, payload = next_message(sub)
    assert topic == (TOPIC + ns).encode()
    assert len(seq) == 8 and int.from_bytes(seq, "big") == 1
    batch = decoder().decode(payload)
    assert isinstance(batch, kv_events.KVEventBatch)
    assert batch.ts == pytest.approx(time.time(), abs=60)
    (e,) = batch.events
    assert isinstance(e, kv_events.BlockStored)
    assert e.medium == "CPU"
    assert e.block_hashes == [block_hash(b) for b in range(4)]
    assert (e.parent_block_hash, e.token_ids, e.lora_id, e.lora_name) == (None, [], None, None)

    # 80 more blocks through 64 slots: the oldest are evicted (no SSD: they leave the node).
    # Puts of 40, so no put evicts a block it wrote itself.
    put(client, kv, "ev", range(4, 44))
    put(client, kv, "ev", range(44, 84))
    msgs, reason = replay(events_node.listening["events-replay"], 0)
    assert reason == b""
    seqs = [s for _, s, _ in msgs]
    assert seqs == list(range(len(seqs))), "replay from 0 is every event, in order, no gaps"
    stored, removed = stored_and_removed(msgs)
    assert stored["CPU"] == [block_hash(b) for b in range(84)]
    assert "CPU" in removed and len(removed["CPU"]) >= 84 - 64
    # What was removed was stored first, and is not held any more.
    assert set(removed["CPU"]) <= set(stored["CPU"])
    q = client.query("ev", removed["CPU"][:1])
    assert q["local_blocks"] == 0
    if q["lease"]:
        client.release(q["lease"])
    # A replay from the middle starts there.
    tail, _ = replay(events_node.listening["events-replay"], seqs[-1])
    assert [s for _, s, _ in tail] == [seqs[-1]]
    sub.close()


def test_bad_replay_requests_get_an_error_and_the_next_one_works(events_node):
    ctx = zmq.Context.instance()
    endpoint = events_node.listening["events-replay"]
    for bad in ([b"", b"\x01\x02"], [b"nonsense"], [b"", b"12345678", b"extra"]):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        s.send_multipart(bad)
        msgs, reason = read_replay(s, 10.0)
        s.close()
        assert msgs == []
        assert reason.startswith(b"error: "), reason
    client = kvferry.EngineClient(events_node.addr, deadline_s=10.0)
    kv = HostKv.allocate("flash_attn", layers=3)
    kv.register(client, "ev2")
    put(client, kv, "ev2", range(2))
    msgs, reason = replay(endpoint, 0)
    assert reason == b"" and len(msgs) == 2, "the start's AllBlocksCleared, then the put"
    assert 'kvferry_events_replays_total{status="refused"} 3' in events_node.metrics()


def test_a_subscriber_that_never_reads_does_not_hold_up_the_node(events_node):
    ctx = zmq.Context.instance()
    stuck = ctx.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(events_node.listening["events"])
    reader = ctx.socket(zmq.SUB)
    reader.setsockopt(zmq.SUBSCRIBE, b"")
    reader.connect(events_node.listening["events"])
    time.sleep(1.0)
    client = kvferry.EngineClient(events_node.addr, deadline_s=10.0)
    kv = HostKv.allocate("flash_attn", layers=3)
    kv.register(client, "ev3")
    start = time.monotonic()
    # Thousands of events (a store and an eviction per block past 64) the stuck one never reads.
    for i in range(0, 3000, 50):
        put(client, kv, "ev3", range(i, i + 50))
    assert time.monotonic() - start < 60
    # The node still answers, and a subscriber that reads gets the newest events.
    assert client.health() is True
    last = None
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if reader.poll(200):
            last = reader.recv_multipart()
        elif last is not None:
            break
    assert last is not None
    batch = decoder().decode(last[2])
    assert batch.events
    scrape = events_node.metrics()
    assert "kvferry_events_total" in scrape and "kvferry_events_dropped_total" in scrape
    stuck.close(linger=0)
    reader.close(linger=0)


def test_a_restarted_node_tells_its_subscribers_it_holds_nothing(tmp_path):
    """A router subscribed to a node that restarts (its SUB socket reconnects on its own)
    receives the new run's AllBlocksCleared, sequence 0, and drops what it believed; the
    replay socket answers it from sequence 0 too."""
    publish, replay_port = free_port(), free_port()
    extra = (f'[events]\npublish = "tcp://127.0.0.1:{publish}"\n'
             f'replay = "tcp://127.0.0.1:{replay_port}"\ntopic = "{TOPIC}"\n')
    node = NodeProc(tmp_path, "py-restart", pool="16MiB", extra=extra)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RECONNECT_IVL, 100)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(node.listening["events"])
    try:
        client = kvferry.EngineClient(node.addr, deadline_s=10.0)
        kv = HostKv.allocate("flash_attn", layers=3)
        kv.register(client, "ev")
        time.sleep(1.0)  # ZMQ's slow joiner
        put(client, kv, "ev", range(3))
        seen = []
        while not any(int.from_bytes(s, "big") >= 1 for _, s, _ in seen):
            seen.append(next_message(sub))
        node.stop()
        node.start()
        # The same endpoints: the subscriber is back within its reconnect interval, before
        # the new run's first message.
        assert node.listening["events"] == f"tcp://127.0.0.1:{publish}"
        topic, seq, payload = next_message(sub)
        assert (topic, int.from_bytes(seq, "big")) == (TOPIC.encode(), 0)
        (e,) = decoder().decode(payload).events
        assert isinstance(e, kv_events.AllBlocksCleared)
        msgs, reason = replay(node.listening["events-replay"], 0)
        assert reason == b""
        assert [s for _, s, _ in msgs] == [0]
        assert isinstance(decoder().decode(msgs[0][2]).events[0], kv_events.AllBlocksCleared)
    finally:
        sub.close()
        node.stop()
