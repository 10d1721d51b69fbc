#!/usr/bin/env python3
"""A kvferry engine client in Python, as an inference engine without a GPU would write it,
using the ``kvferry`` package (``pip install ./python``; see scripts/python-env).

It allocates its host KV the way vLLM does, one tensor per layer (``--layout``), each in a
memfd of its own (kvferry.memfd), registers them with the node (one region per memfd),
holds a session, optionally puts pattern blocks, then query -> asynchronous load ->
completion (a wait the node answers as the load ends, then polled) -> verifies every byte of its KV:
loaded segments hold the pattern kvferry's Rust fixture writes (python/tests/kvpattern.py,
the same function ported), every other byte of every memfd still holds the canary. Exits
non-zero on any mismatch; prints one line ``PY-OK {json}`` on success.
"""

import argparse
import json
import sys
import time
from pathlib import Path

# The test pattern and canaried KV, shared with the package's own tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python" / "tests"))

import kvferry  # noqa: E402
from kvpattern import HostKv, block_hash, rank_block, scattered  # noqa: E402


def fail(msg):
    print(f"PY-FAIL {msg}", flush=True)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--token", default="")
    ap.add_argument("--instance", default="py-engine")
    ap.add_argument("--model", default="m")
    ap.add_argument("--dtype", default="bf16", help="as the Rust fixture names its KV")
    ap.add_argument("--layout", default="flash_attn",
                    choices=["flash_attn", "flashinfer", "cross_layer"])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--segment-bytes", type=int, default=1024)
    ap.add_argument("--num-blocks", type=int, default=16)
    ap.add_argument("--put", type=int, default=0, help="put pattern blocks 0..N first")
    ap.add_argument("--query", type=int, required=True, help="query hashes 0..N")
    ap.add_argument("--expect-local", type=int, required=True)
    ap.add_argument("--expect-remote", type=int, required=True)
    ap.add_argument("--direct", action="store_true")
    a = ap.parse_args()

    try:
        client = kvferry.EngineClient(a.address, token=a.token or None, deadline_s=20.0)
    except kvferry.KvferryError as e:
        fail(f"no node at {a.address}: {e}")
    caps = client.capabilities()
    if "memfd" not in caps["memory_kinds"] or not caps["fd_socket"]:
        fail(f"the node takes no memfds: {caps}")
    before = client.stats()

    # bf16 KV, 16-token blocks of one head: head_dim makes the segment size asked for.
    block_size, itemsize = 16, 2
    if a.segment_bytes % (block_size * itemsize):
        fail(f"--segment-bytes {a.segment_bytes} is not a multiple of {block_size * itemsize}")
    kv = HostKv.allocate(a.layout, layers=a.layers, num_blocks=a.num_blocks,
                         block_size=block_size, heads=1,
                         head_dim=a.segment_bytes // (block_size * itemsize), itemsize=itemsize)
    assert kv.seg_bytes == a.segment_bytes
    # The node unregisters the instance when this session ends.
    session = client.open_session()
    kv.register(client, a.instance, a.model, dtype=a.dtype)
    session.bind(a.instance)

    for start in range(0, a.put, 8):
        client.put_blocks(a.instance, 0, [
            (block_hash(i), rank_block(i, 0, a.layers, 2, a.segment_bytes))
            for i in range(start, min(a.put, start + 8))
        ])

    hashes = [block_hash(i) for i in range(a.query)]
    hit = a.expect_local + a.expect_remote
    dests = scattered(hit, a.num_blocks)
    runs = []
    for how in ("wait", "poll"):
        kv.reset()
        q = client.query(a.instance, hashes, direct_gpu=a.direct)
        got = (q["local_blocks"], q["remote_blocks"])
        if got != (a.expect_local, a.expect_remote) or not q["lease"]:
            fail(f"query hit {got} local/remote blocks (lease {q['lease']!r}), expected "
                 f"{(a.expect_local, a.expect_remote)}")
        if a.direct and q["direct"] != "granted":
            fail(f"direct not granted: {q['direct_reason']}")
        t = time.monotonic()
        load_id = client.load(q["lease"], a.instance, 0, dests)
        if how == "wait":
            done = client.wait_load(load_id, 30)
        else:
            while (done := client.poll_load(load_id)) is None:
                if time.monotonic() - t > 30:
                    fail(f"load {load_id}: no completion within 30 s")
                time.sleep(0.002)
        seconds = time.monotonic() - t
        if not done["ok"]:
            fail(f"load {load_id} failed: {done['error_kind']}: {done['error']}")
        try:
            checked = kv.verify(list(zip(dests, range(hit))))
        except AssertionError as e:
            fail(str(e))
        runs.append({
            "completion": how,
            "path": done["path"],
            "bytes": done["bytes"],
            "verified_bytes": checked,
            "local_blocks": q["local_blocks"],
            "remote_blocks": q["remote_blocks"],
            "stages": done["stages"],
            "client_seconds": seconds,
        })

    session.close()
    for _ in range(500):
        after = client.stats()
        if after["instances"] == before["instances"] and after["leases_live"] == 0:
            break
        time.sleep(0.01)
    else:
        fail(f"the session's end left state behind: {after}")
    print("PY-OK " + json.dumps({"instance": a.instance, "layout": a.layout, "runs": runs}),
          flush=True)


if __name__ == "__main__":
    main()
