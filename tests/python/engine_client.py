#!/usr/bin/env python3
"""A kvferry engine client in Python, as an inference engine without a GPU would write it.

It generates the gRPC stubs from actors/proto/kvferry/v1/engine.proto at run time (grpcio and
grpcio-tools from PyPI), passes its host KV to the node as a memfd over the node's Unix
socket (SCM_RIGHTS), registers it, holds a session, optionally puts pattern blocks, then
query -> asynchronous load -> completion (stream, then poll) -> verify every byte of its KV:
loaded segments hold the pattern kvferry's Rust fixture writes (the same function, ported),
every other byte still holds the canary. Exits non-zero on any mismatch; prints one line
`PY-OK {json}` on success.
"""

import argparse
import json
import mmap
import os
import queue
import socket
import sys
import tempfile
import time

CANARY = 0xA5
MASK = (1 << 64) - 1


def mix(z):
    """splitmix64's finaliser, as in actors/src/fixture.rs."""
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def segment_pattern(n, block, rank, layer, seg):
    seed = mix(block ^ (rank << 48) ^ (layer << 32) ^ (seg << 24))
    words = (n + 7) // 8
    out = b"".join(mix(seed ^ i).to_bytes(8, "little") for i in range(words))
    return out[:n]


def block_hash(i):
    return i.to_bytes(8, "big")


def fail(msg):
    print(f"PY-FAIL {msg}", flush=True)
    sys.exit(1)


def load_stubs(proto_root):
    from grpc_tools import protoc  # noqa: WPS433 (imported late: only once grpc is known)

    out = tempfile.mkdtemp(prefix="kvferry-py-stubs-")
    rc = protoc.main(
        [
            "protoc",
            f"-I{proto_root}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            "kvferry/v1/engine.proto",
        ]
    )
    if rc != 0:
        fail(f"protoc failed with {rc}")
    sys.path.insert(0, out)
    from kvferry.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402

    return engine_pb2, engine_pb2_grpc


class HostKv:
    """Split K/V per layer inside one memfd: plane = view_offset + blocks * stride + tail."""

    TAIL = 4096

    def __init__(self, layers, segments, segment_bytes, num_blocks, view_offset):
        self.layers = layers
        self.segments = segments
        self.seg = segment_bytes
        self.num_blocks = num_blocks
        self.view_offset = view_offset
        self.stride = segment_bytes
        self.plane = view_offset + num_blocks * self.stride + self.TAIL
        self.size = self.plane * layers * segments
        self.fd = os.memfd_create("kvferry-py-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size)
        self.reset()

    def reset(self):
        self.map[:] = bytes([CANARY]) * self.size

    def base(self, layer, seg):
        return (layer * self.segments + seg) * self.plane

    def at(self, layer, seg, block):
        return self.base(layer, seg) + self.view_offset + block * self.stride

    def verify(self, expected, rank):
        """expected: [(dest block, pattern block)]. Returns bytes of pattern checked."""
        img = bytearray(self.map[:])
        checked = 0
        for dst, block in expected:
            for layer in range(self.layers):
                for s in range(self.segments):
                    off = self.at(layer, s, dst)
                    want = segment_pattern(self.seg, block, rank, layer, s)
                    got = bytes(img[off : off + self.seg])
                    if got != want:
                        i = next(k for k in range(self.seg) if got[k] != want[k])
                        fail(
                            f"dest block {dst} (pattern {block}) layer {layer} seg {s} "
                            f"byte {i}: {got[i]:#04x}, expected {want[i]:#04x}"
                        )
                    img[off : off + self.seg] = bytes([CANARY]) * self.seg
                    checked += self.seg
        stray = next((i for i, b in enumerate(img) if b != CANARY), None)
        if stray is not None:
            fail(f"byte {stray} of the KV memfd was written outside the destinations")
        return checked


def send_memfd(path, kv, instance, rank, token):
    line = f"memfd {instance} {rank} 0 {kv.size}"
    if token:
        line += f" {token}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        socket.send_fds(s, [(line + "\n").encode()], [kv.fd])
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = s.recv(256)
            if not chunk:
                break
            reply += chunk
    words = reply.decode().split()
    if len(words) < 2 or words[0] != "ok":
        fail(f"the fd socket refused the memfd: {reply!r}")
    return int(words[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--token", default="")
    ap.add_argument("--proto", required=True, help="the folder holding kvferry/v1/engine.proto")
    ap.add_argument("--instance", default="py-engine")
    ap.add_argument("--model", default="m")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--segment-bytes", type=int, default=1024)
    ap.add_argument("--num-blocks", type=int, default=16)
    ap.add_argument("--put", type=int, default=0, help="put pattern blocks 0..N first")
    ap.add_argument("--query", type=int, required=True, help="query hashes 0..N")
    ap.add_argument("--expect-local", type=int, required=True)
    ap.add_argument("--expect-remote", type=int, required=True)
    ap.add_argument("--direct", action="store_true")
    a = ap.parse_args()

    import grpc

    pb, pb_grpc = load_stubs(a.proto)
    channel = grpc.insecure_channel(a.address)
    grpc.channel_ready_future(channel).result(timeout=20)
    stub = pb_grpc.EngineStub(channel)
    md = [("authorization", f"Bearer {a.token}")] if a.token else []

    def call(method, req):
        return method(req, metadata=md, timeout=20)

    caps = call(stub.Capabilities, pb.CapabilitiesRequest())
    if "memfd" not in caps.memory_kinds or not caps.fd_socket:
        fail(f"the node takes no memfds: {caps}")
    before = call(stub.Stats, pb.StatsRequest())

    kv = HostKv(a.layers, 2, a.segment_bytes, a.num_blocks, view_offset=128)
    handle = send_memfd(caps.fd_socket, kv, a.instance, 0, a.token)
    layers = [
        pb.LayerLayout(split=pb.Split(k_base=kv.base(l, 0), v_base=kv.base(l, 1)))
        for l in range(a.layers)
    ]
    call(
        stub.RegisterInstance,
        pb.RegisterInstanceRequest(
            instance=a.instance,
            model=a.model,
            dtype="bf16",
            shape=pb.KvShape(layers=a.layers, tp_size=1, segments=2, segment_bytes=a.segment_bytes),
            rank=0,
            device=0,
            layout=pb.KvLayout(
                kind=pb.GROUP_KIND_ATTENTION,
                layers=layers,
                block_stride=kv.stride,
                num_blocks=a.num_blocks,
                view_offset=kv.view_offset,
            ),
            memory_handle=handle,
        ),
    )

    # The session: the node unregisters the instance when this stream ends.
    binds = queue.Queue()

    def session_requests():
        while True:
            item = binds.get()
            if item is None:
                return
            yield pb.SessionRequest(bind=item)

    session = stub.Session(session_requests(), metadata=md)
    binds.put(a.instance)
    bound = next(session)
    if bound.bound != a.instance:
        fail(f"session bound {bound.bound!r}")

    seg_count = a.layers * 2
    for start in range(0, a.put, 8):
        blocks = []
        for i in range(start, min(a.put, start + 8)):
            data = b"".join(
                segment_pattern(a.segment_bytes, i, 0, l, s)
                for l in range(a.layers)
                for s in range(2)
            )
            assert len(data) == seg_count * a.segment_bytes
            blocks.append(pb.PutBlock(hash=block_hash(i), data=data))
        call(stub.PutBlocks, pb.PutBlocksRequest(instance=a.instance, rank=0, blocks=blocks))

    hashes = [block_hash(i) for i in range(a.query)]
    # Destinations scattered over the KV, last block first.
    hit = a.expect_local + a.expect_remote
    dests = [(a.num_blocks - 1 - 2 * i) % a.num_blocks for i in range(hit)]
    if len(set(dests)) != len(dests):
        dests = list(range(a.num_blocks - 1, a.num_blocks - 1 - hit, -1))
    runs = []
    for how in ("stream", "poll"):
        kv.reset()
        q = call(
            stub.Query,
            pb.QueryRequest(instance=a.instance, hashes=hashes, direct_gpu=a.direct),
        )
        got = (q.local_blocks, q.remote_blocks)
        if got != (a.expect_local, a.expect_remote) or not q.lease:
            fail(
                f"query hit {got} local/remote blocks (lease {q.lease!r}), expected "
                f"{(a.expect_local, a.expect_remote)}"
            )
        if a.direct and q.direct != pb.DIRECT_GRANTED:
            fail(f"direct not granted: {q.direct_reason}")
        completions = None
        if how == "stream":
            completions = stub.Completions(
                pb.CompletionsRequest(instance=a.instance, rank=0), metadata=md, timeout=30
            )
        t = time.monotonic()
        load_id = call(
            stub.Load,
            pb.LoadRequest(lease=q.lease, instance=a.instance, rank=0, dest_blocks=dests),
        ).load_id
        if how == "stream":
            done = next(c for c in completions if c.load_id == load_id)
            completions.cancel()
        else:
            while True:
                p = call(stub.PollLoad, pb.PollLoadRequest(load_id=load_id))
                if not p.pending:
                    done = p.completion
                    break
                time.sleep(0.002)
        seconds = time.monotonic() - t
        if done.status != pb.LOAD_OK:
            fail(f"load {load_id} failed: {done.error_kind}: {done.error}")
        checked = kv.verify([(d, i) for i, d in enumerate(dests)], 0)
        runs.append(
            {
                "completion": how,
                "path": done.path,
                "bytes": done.bytes,
                "verified_bytes": checked,
                "local_blocks": q.local_blocks,
                "remote_blocks": q.remote_blocks,
                "stages": {s.name: s.seconds for s in done.stages},
                "client_seconds": seconds,
            }
        )

    # Ending the session unregisters the instance.
    binds.put(None)
    session.cancel()
    for _ in range(500):
        after = call(stub.Stats, pb.StatsRequest())
        if after.instances == before.instances and after.leases_live == 0:
            break
        time.sleep(0.01)
    else:
        fail(f"the session's end left state behind: {after}")
    print("PY-OK " + json.dumps({"instance": a.instance, "runs": runs}), flush=True)


if __name__ == "__main__":
    main()
