"""kvferry.EngineClient against a real node: the Engine API, byte for byte, and its errors."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

import kvferry
from kvpattern import HostKv, block_hash, rank_block, scattered
from nodeproc import free_port

CAPABILITY_KEYS = {
    "node_id", "version", "protocol", "device_kind", "device_count", "device_names",
    "providers", "direct_possible", "direct_reason", "fd_socket", "memory_kinds",
    "max_message_bytes", "completion_retention", "handle_ttl_ms", "max_hashes",
    "max_layers", "max_regions", "max_blocks", "max_hash_bytes", "slot_bytes",
    "max_mailboxes", "max_lookup_hashes",
}
COMPLETION_KEYS = {
    "load_id", "instance", "rank", "ok", "error_kind", "error", "bytes", "blocks", "path",
    "seconds", "stages", "failed_blocks",
}


def settle(client, before, timeout=5.0):
    """Waits until the node's instances and leases are back to ``before``'s."""
    end = time.monotonic() + timeout
    while True:
        s = client.stats()
        if s["instances"] == before["instances"] and s["leases_live"] == before["leases_live"]:
            return s
        if time.monotonic() > end:
            raise AssertionError(f"state left behind: {s}, before {before}")
        time.sleep(0.01)


def put_pattern(client, kv, instance, blocks, rank=0):
    return client.put_blocks(
        instance, rank,
        [(block_hash(b), rank_block(b, rank, kv.layers, kv.segments, kv.seg_bytes)) for b in blocks],
    )


def test_capabilities_health_stats(client, node):
    caps = client.capabilities()
    assert set(caps) == CAPABILITY_KEYS
    assert caps["node_id"] == "py-node"
    assert caps["version"] == kvferry.__version__
    assert caps["protocol"] >= 2
    assert caps["device_kind"] == "host"
    assert "memfd" in caps["memory_kinds"]
    assert caps["fd_socket"] == node.fd_socket
    # The limits the node enforces, as it advertises them (the test node's slot: 256 KiB).
    assert (caps["max_hashes"], caps["max_blocks"], caps["max_hash_bytes"]) == (4096, 4096, 32)
    assert caps["max_layers"] >= 128 and caps["max_regions"] >= 2 * caps["max_layers"]
    assert caps["slot_bytes"] == 256 << 10
    assert caps["max_lookup_hashes"] == 65536
    assert client.health() is True
    stats = client.stats()
    assert {"instances", "leases_live", "memory_handles", "sessions", "loads_ok"} <= set(stats)
    assert repr(client) == f"EngineClient({node.addr!r})"


def test_put_query_load_wait_and_poll(client):
    before = client.stats()
    kv = HostKv.allocate("flash_attn", layers=3)
    with client.open_session() as session:
        ns = kv.register(client, "py-load")
        session.bind("py-load")
        assert session.instances == ["py-load"]
        stored = put_pattern(client, kv, "py-load", range(6))
        assert (stored["written"], stored["sealed"]) == (6, 6)
        rank_bytes = kv.layers * kv.segments * kv.seg_bytes
        assert stored["bytes"] == 6 * rank_bytes
        hashes = [block_hash(i) for i in range(9)]
        for how in ("wait", "poll"):
            kv.reset()
            q = client.query("py-load", hashes)
            assert (q["local_blocks"], q["remote_blocks"]) == (6, 0), q
            assert q["namespace"] == ns
            assert q["direct"] == "not_requested" and q["direct_reason"] is None
            assert isinstance(q["lease"], str) and len(q["lease"]) == 32
            dests = scattered(6, kv.num_blocks)
            load_id = client.load(q["lease"], "py-load", 0, dests)
            if how == "wait":
                done = client.wait_load(load_id, 10)
            else:
                end = time.monotonic() + 10
                while (done := client.poll_load(load_id)) is None:
                    assert time.monotonic() < end, "no completion"
                    time.sleep(0.001)
            assert set(done) == COMPLETION_KEYS
            assert done["ok"], done
            assert (done["load_id"], done["instance"], done["rank"]) == (load_id, "py-load", 0)
            assert (done["error_kind"], done["error"], done["failed_blocks"]) == (None, None, [])
            assert done["blocks"] == 6 and done["bytes"] == 6 * rank_bytes
            assert done["path"] == "local"
            assert done["seconds"] >= 0 and all(v >= 0 for v in done["stages"].values())
            assert kv.verify(zip(dests, range(6))) == 6 * rank_bytes
            # It ended: nothing of it runs to cancel, nor under another rank or id.
            assert client.cancel_load("py-load", 0, load_id) is False
            assert client.cancel_load("py-load", 1, load_id + 1) is False
            # The completion was consumed; the lease too (one rank).
            with pytest.raises(kvferry.NotFound):
                client.poll_load(load_id)
            with pytest.raises(kvferry.NotFound):
                client.wait_load(load_id, 0)
            with pytest.raises(kvferry.NotFound) as e:
                client.release(q["lease"])
            assert (e.value.code, e.value.method) == ("NOT_FOUND", "release")
        # A miss: no lease.
        miss = client.query("py-load", [b"nothing here"])
        assert miss["lease"] is None and miss["local_blocks"] == 0
    assert session.closed
    settle(client, before)


def test_query_and_load_through_a_request_mailbox(client, node):
    """The same answers, bytes and refusals as the calls; the node counts the requests its
    mailbox served, and its thread goes when the client does."""
    before = client.stats()
    mailboxed = kvferry.EngineClient(node.addr, deadline_s=10.0)
    assert mailboxed.has_mailbox is False
    assert mailboxed.attach_mailbox("py-mbox") is True
    assert mailboxed.has_mailbox is True
    kv = HostKv.allocate("flash_attn", layers=3)
    with client.open_session() as session:
        kv.register(client, "py-mbox")
        session.bind("py-mbox")
        # Blocks of their own: the node is shared by the module's tests.
        put_pattern(client, kv, "py-mbox", range(700, 704))
        hashes = [block_hash(i) for i in range(700, 706)]
        q = mailboxed.query("py-mbox", hashes)
        plain = client.query("py-mbox", hashes)
        assert (q["local_blocks"], q["remote_blocks"]) == (4, 0) == (
            plain["local_blocks"],
            plain["remote_blocks"],
        )
        client.release(plain["lease"])
        dests = scattered(4, kv.num_blocks)
        done = mailboxed.wait_load(mailboxed.load(q["lease"], "py-mbox", 0, dests), 10)
        assert done["ok"] and done["blocks"] == 4, done
        assert kv.verify(zip(dests, range(700, 704))) == 4 * kv.layers * kv.segments * kv.seg_bytes
        # Refused as the call is: the lease was consumed by its one rank.
        for c in (mailboxed, client):
            with pytest.raises(kvferry.NotFound) as e:
                c.load(q["lease"], "py-mbox", 0, dests)
            assert e.value.method == "load"
        served = [
            line for line in node.metrics().splitlines()
            if line.startswith("kvferry_engine_mailbox_requests_total ")
        ]
        assert served and float(served[0].split()[1]) >= 3, served
    del mailboxed
    end = time.monotonic() + 10
    while "kvferry_engine_mailboxes 0" not in node.metrics().splitlines():
        assert time.monotonic() < end, "the mailbox's thread outlived its client"
        time.sleep(0.02)
    settle(client, before)


def test_a_completion_board_shows_the_load_without_an_rpc(client):
    before = client.stats()
    kv = HostKv.allocate("flash_attn", layers=3)
    board = client.open_board("py-board", 0, slots=4)
    assert board.slots == 4 and board.handle > 0
    assert board.view(2) == {"tag": 0, "state": "idle", "layers": 0, "done": False, "ok": False,
                             "failed_blocks": 0}
    with client.open_session() as session:
        kv.register(client, "py-board", board=board)
        session.bind("py-board")
        put_pattern(client, kv, "py-board", range(5))
        q = client.query("py-board", [block_hash(i) for i in range(5)])
        dests = scattered(5, kv.num_blocks)
        load_id = client.load(q["lease"], "py-board", 0, dests, board_slot=2, board_tag=9)
        first = board.wait(2, 9, 1, timeout_s=10)
        assert first["tag"] == 9 and first["layers"] >= 1, first
        end = board.wait(2, 9, 1 << 20, timeout_s=10)
        # The final word is the outcome: nothing more is needed to know it went well.
        assert end == {"tag": 9, "state": "ok", "layers": 3, "done": True, "ok": True,
                       "failed_blocks": 0}
        assert board.wait_ends([(2, 9)], timeout_s=10) == [dict(end, slot=2)]
        # Written after the result: PollLoad has its details at once.
        done = client.poll_load(load_id)
        assert done is not None and done["ok"], done
        assert kv.verify(zip(dests, range(5))) == 5 * kv.layers * kv.segments * kv.seg_bytes
        # A slot past the board is refused, and the lease survives it.
        q = client.query("py-board", [block_hash(0)])
        with pytest.raises(kvferry.InvalidArgument):
            client.load(q["lease"], "py-board", 0, [1], board_slot=4, board_tag=1)
        client.release(q["lease"])
        # Waiting for a tag the slot never shows returns at the timeout with what it says.
        t = time.monotonic()
        stale = board.wait(2, 10, 1, timeout_s=0.05)
        assert time.monotonic() - t >= 0.04 and stale["tag"] == 9
    settle(client, before)


def test_save_then_load(client):
    before = client.stats()
    kv = HostKv.allocate("flashinfer", layers=2, itemsize=4)
    with client.open_session() as session:
        kv.register(client, "py-save")
        session.bind("py-save")
        src = [0, 1, 2, 3]
        for dest, block in zip(src, range(100, 104)):
            kv.write_block(dest, block)
        saved = client.save("py-save", 0, [block_hash(b) for b in range(100, 104)], src)
        assert set(saved) == {"written", "present", "sealed", "bytes", "seconds", "not_stored"}
        assert (saved["written"], saved["sealed"]) == (4, 4), saved
        again = client.save("py-save", 0, [block_hash(100)], [0])
        assert (again["written"], again["present"]) == (0, 1)
        q = client.query("py-save", [block_hash(b) for b in range(100, 104)])
        assert q["local_blocks"] == 4
        dests = [12, 9, 15, 4]
        done = client.wait_load(client.load(q["lease"], "py-save", 0, dests), 10)
        assert done["ok"], done
        kv.verify(list(zip(src, range(100, 104))) + list(zip(dests, range(100, 104))))
        # A lease released before loading: the load is refused.
        q = client.query("py-save", [block_hash(100)])
        client.release(q["lease"])
        with pytest.raises(kvferry.NotFound):
            client.load(q["lease"], "py-save", 0, [5])
    settle(client, before)


def test_session_end_unregisters(client):
    before = client.stats()
    kv = HostKv.allocate("mla", layers=2)
    kv.register(client, "py-sess")
    assert client.stats()["instances"] == before["instances"] + 1
    session = client.open_session(["py-sess"])
    assert repr(session) == "Session(['py-sess'], open)"
    session.close()
    session.close()  # twice: harmless
    settle(client, before)
    with pytest.raises(kvferry.FailedPrecondition):
        session.bind("py-sess")
    # Unregister by hand, and a session that binds an unknown instance.
    kv.register(client, "py-sess")
    assert client.unregister("py-sess") == 0
    with client.open_session() as s:
        with pytest.raises(kvferry.KvferryError) as e:
            s.bind("py-never-registered")
        assert e.value.method == "Session.bind"
    settle(client, before)


def test_invalid_input_is_refused_before_sending(client):
    with pytest.raises(kvferry.InvalidArgument) as e:
        client.query("py-x", [b""])
    assert (e.value.code, e.value.method) == ("INVALID_ARGUMENT", "query")
    assert isinstance(e.value, ValueError)
    with pytest.raises(kvferry.InvalidArgument):
        client.query("py-x", [b"x" * 33])
    with pytest.raises(kvferry.InvalidArgument):
        client.release("not hex")
    with pytest.raises(kvferry.InvalidArgument):
        client.query("", [b"x"])
    with pytest.raises(kvferry.InvalidArgument):
        client.send_memfd("py-x", 0, 0, -1, 4096)
    with pytest.raises(kvferry.InvalidArgument):
        kvferry.EngineClient("127.0.0.1:1", deadline_s=-1)
    # Unknown lease, instance, load: NOT_FOUND from the node.
    with pytest.raises(kvferry.NotFound):
        client.release("00" * 16)
    with pytest.raises(kvferry.NotFound):
        client.load("00" * 16, "py-x", 0, [0])
    with pytest.raises(kvferry.NotFound):
        client.poll_load(123456789)
    with pytest.raises(kvferry.NotFound):
        client.unregister("py-x")


def test_node_refuses_a_bad_registration_naming_the_layer(client, node):
    before = client.stats()
    kv = HostKv.allocate("flash_attn", layers=3)
    regs = kv.layout.register_kwargs()
    buf = kv.buffers[1]
    # Layer 1's V plane starts past the end of its memfd.
    handle = client.send_memfd("py-bad", 0, 0, buf.fd, buf.length)
    planes = [(0, 0, 0, 0)] * 3
    planes[1] = (0, 0, 0, buf.length)
    with pytest.raises(kvferry.InvalidArgument) as e:
        client.register(
            "py-bad", "m", "f16", layers=3, tp_size=1, segments=2,
            segment_bytes=regs["segment_bytes"], rank=0, device=0,
            block_stride=regs["block_stride"], num_blocks=regs["num_blocks"],
            regions=[("handle", handle)], planes=planes,
        )
    assert "layer 1" in str(e.value), e.value
    assert e.value.method == "register"
    # Client-side shape checks: planes of the wrong arity, a region that is not given.
    with pytest.raises(kvferry.InvalidArgument, match="layer 2"):
        client.register(
            "py-bad", "m", "f16", layers=3, tp_size=1, segments=2, segment_bytes=1024,
            rank=0, device=0, block_stride=1024, num_blocks=4,
            regions=[("handle", handle)], planes=[(0, 0, 0, 0), (0, 0, 0, 0), (0, 0)],
        )
    with pytest.raises(kvferry.InvalidArgument, match="layer 0"):
        client.register(
            "py-bad", "m", "f16", layers=1, tp_size=1, segments=1, segment_bytes=1024,
            rank=0, device=0, block_stride=1024, num_blocks=4,
            regions=[("handle", handle)], planes=[(3, 0)],
        )
    with pytest.raises(kvferry.InvalidArgument, match="segment"):
        client.register(
            "py-bad", "m", "f16", layers=1, tp_size=1, segments=1, segment_bytes=100,
            rank=0, device=0, block_stride=1024, num_blocks=4,
            regions=[("handle", handle)], planes=[(0, 0)],
        )
    assert client.stats()["instances"] == before["instances"]


def test_recurrent_groups_are_refused_by_name(client):
    before = client.stats()
    kv = HostKv.allocate("mla", layers=2)
    with pytest.raises(kvferry.KvferryError, match="(?i)recurrent") as e:
        kvferry.register_tensors(
            client, "py-mamba", "m", "f16", rank=0, tp_size=1, device=0,
            **{**kv.layout.register_kwargs(), "kind": "recurrent"},
        )
    assert e.value.method == "register"
    assert client.stats()["instances"] == before["instances"]


def test_token(tmp_path):
    from conftest import NodeProc

    n = NodeProc(tmp_path, name="py-token", token="s3cret")
    try:
        with pytest.raises(kvferry.Unauthenticated) as e:
            kvferry.EngineClient(n.addr)
        assert e.value.code == "UNAUTHENTICATED"
        c = kvferry.EngineClient(n.addr, token="s3cret")
        kv = HostKv.allocate("mla", layers=1)
        kv.register(c, "py-tok")  # the token goes on the fd socket too
        assert c.stats()["instances"] == 1
    finally:
        n.stop()


def test_a_node_that_is_down_is_unavailable():
    t = time.monotonic()
    with pytest.raises(kvferry.Unavailable) as e:
        kvferry.EngineClient(f"127.0.0.1:{free_port()}", connect_timeout_s=2)
    assert time.monotonic() - t < 2
    assert e.value.code == "UNAVAILABLE" and e.value.method == "EngineClient"


def test_a_node_that_dies_is_unavailable_within_the_deadline(fresh_node):
    c = kvferry.EngineClient(fresh_node.addr, deadline_s=2)
    assert c.health()
    fresh_node.stop()
    t = time.monotonic()
    with pytest.raises(kvferry.Unavailable) as e:
        c.query("py-x", [b"x"])
    assert time.monotonic() - t < 2.5
    assert e.value.method == "query"


def test_a_stalled_node_costs_the_deadline_and_the_gil_is_free():
    # A listener that accepts and never answers.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        addr = "127.0.0.1:%d" % s.getsockname()[1]
        ticks = 0
        stop = threading.Event()

        def count():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                time.sleep(0.001)

        th = threading.Thread(target=count)
        th.start()
        t = time.monotonic()
        try:
            with pytest.raises((kvferry.DeadlineExceeded, kvferry.Unavailable)):
                kvferry.EngineClient(addr, deadline_s=1, connect_timeout_s=1)
        finally:
            stop.set()
            th.join()
        spent = time.monotonic() - t
        assert spent < 3.5, spent
        # The other thread ran while the client waited without the GIL.
        assert ticks > 100 * spent, (ticks, spent)


# Python 3.12 warns about fork() with threads: that hazard is what this test is about.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_forked_child_is_told_to_make_its_own_client(client):
    import os

    pid = os.fork()
    if pid == 0:  # the child: the client's runtime threads stayed in the parent
        try:
            client.stats()
        except kvferry.FailedPrecondition as e:
            os._exit(0 if "another process" in str(e) else 2)
        except BaseException:
            os._exit(3)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.health()


def test_a_dmabuf_the_host_device_cannot_import_is_refused(client):
    # A host node imports memfds only; the refusal is typed and names the method.
    kv = HostKv.allocate("mla", layers=1)
    buf = kv.buffers[0]
    with pytest.raises(kvferry.KvferryError) as e:
        client.send_dmabuf("py-dmabuf", 0, 0, buf.fd, 0, buf.length)
    assert e.value.method == "send_dmabuf"
    assert e.value.code in ("FAILED_PRECONDITION", "INVALID_ARGUMENT"), e.value


def test_one_client_from_many_threads(client):
    from concurrent.futures import ThreadPoolExecutor

    kv = HostKv.allocate("mla", layers=2)
    with client.open_session() as session:
        kv.register(client, "py-threads", model="py-threads")
        session.bind("py-threads")
        put_pattern(client, kv, "py-threads", range(4))

        def engine_step(i):
            q = client.query("py-threads", [block_hash(b) for b in range(2)])
            dests = [2 * i, 2 * i + 1]
            done = client.wait_load(client.load(q["lease"], "py-threads", 0, dests), 10)
            return done["ok"] and client.health()

        # Eight threads share the client; every load goes to blocks of its own.
        with ThreadPoolExecutor(8) as pool:
            ok = list(pool.map(engine_step, range(8)))
        assert ok == [True] * 8
        kv.verify([(2 * i + j, j) for i in range(8) for j in range(2)])


def test_waits_answer_each_load_once_in_any_order(client):
    kv = HostKv.allocate("flash_attn", layers=2)
    with client.open_session() as session:
        kv.register(client, "py-wait", model="py-wait")
        session.bind("py-wait")
        put_pattern(client, kv, "py-wait", range(3))
        loads = []
        for dests in ([0, 1, 2], [5, 6, 7], [10, 11, 12]):
            q = client.query("py-wait", [block_hash(b) for b in range(3)])
            loads.append(client.load(q["lease"], "py-wait", 0, dests))
        # The last one first: the others stay with the node for their own waits.
        last = client.wait_load(loads[2], 10)
        assert last["ok"] and last["load_id"] == loads[2]
        rest = {client.wait_load(lid, 10)["load_id"] for lid in loads[:2]}
        assert rest == set(loads[:2])
        # Delivered: consumed, so neither a poll nor a wait finds them again, and a wait
        # for a load the node does not know answers at once rather than at its timeout.
        with pytest.raises(kvferry.NotFound):
            client.poll_load(loads[0])
        t0 = time.monotonic()
        with pytest.raises(kvferry.NotFound) as e:
            client.wait_load(loads[0], 5.0)
        assert e.value.method == "wait_load"
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(kvferry.InvalidArgument):
            client.wait_load(loads[0], -1.0)
        kv.verify([(d, b) for ds in ([0, 1, 2], [5, 6, 7], [10, 11, 12]) for b, d in enumerate(ds)])


def test_a_client_outlives_a_node_restart(tmp_path):
    from conftest import NodeProc

    first = NodeProc(tmp_path, name="py-restart")
    c = kvferry.EngineClient(first.addr, deadline_s=2)
    assert c.attach_mailbox("py-restart")
    kv = HostKv.allocate("mla", layers=1)
    kv.register(c, "py-restart")
    first.stop()
    with pytest.raises(kvferry.Unavailable):
        c.stats()
    # The mailbox's session went with the node: queries go as calls, and fail as they do.
    end = time.monotonic() + 5
    while c.has_mailbox:
        assert time.monotonic() < end, "the client still counts on a dead node's mailbox"
        time.sleep(0.01)
    with pytest.raises(kvferry.Unavailable):
        c.query("py-restart", [block_hash(1)])
    # The same config again: same engine address, same fd socket path.
    second = NodeProc(tmp_path, name="py-restart", listen=first.addr)
    try:
        # The same client object reconnects; the new node knows nothing of the old one.
        end = time.monotonic() + 5
        while True:
            try:
                assert c.stats()["instances"] == 0
                break
            except kvferry.Unavailable:
                assert time.monotonic() < end, "no reconnection within 5 s"
                time.sleep(0.05)
        kv.register(c, "py-restart")
        put_pattern(c, kv, "py-restart", [1])
        q = c.query("py-restart", [block_hash(1)])
        assert c.wait_load(c.load(q["lease"], "py-restart", 0, [3]), 5)["ok"]
        kv.verify([(3, 1)])
    finally:
        second.stop()


def test_a_stopped_node_is_deadline_exceeded_then_answers_again(fresh_node):
    import signal

    c = kvferry.EngineClient(fresh_node.addr, deadline_s=0.5)
    assert c.health()
    fresh_node.pause()
    try:
        t = time.monotonic()
        with pytest.raises(kvferry.DeadlineExceeded) as e:
            c.stats()
        assert e.value.code == "DEADLINE_EXCEEDED" and e.value.method == "stats"
        assert time.monotonic() - t < 2.0
    finally:
        os.kill(fresh_node.proc.pid, signal.SIGCONT)
    assert c.health()
