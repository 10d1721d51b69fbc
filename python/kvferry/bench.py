"""Load time as an engine sees it: ``python -m kvferry.bench``.

Starts a ``kvferry node`` (``--kvferry-bin``), registers KV the way vLLM allocates it (one
tensor per layer, FlashAttention layout, and vLLM's cross-layer blocks), saves N blocks from
it, then times from this Python client: the query of N hashes, the load of the leased blocks
into every third block (Load RPC to the completion seen here, on the rank's completion
board, as vLLM's worker sees it: the board's final word, no call), and the save. The baseline is
a raw copy of the same bytes in the same run: pinned host memory to the GPU in one piece
(``--device cuda``), or a plain CPU copy (``--device cpu``, KV in memfds on a host node).

Every load is checked: each destination block equals its source block in every layer, and
every block that is neither holds the canary. Prints a table, or one JSON object with
``--json``; exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

CANARY = 0xA5
#: A board wait for this many layers returns at the load's end.
ALL_LAYERS = 0xFFFFFFFF


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """A ``kvferry node`` process for the benchmark, stopped on exit."""

    def __init__(self, binary: str, device: str, pool_bytes: int, slot_bytes: int):
        self.dir = tempfile.mkdtemp(prefix="kvferry-bench-")
        self.addr = f"127.0.0.1:{_free_port()}"
        cfg = os.path.join(self.dir, "node.toml")
        with open(cfg, "w") as f:
            f.write(
                f'node-id = "bench"\n[pool]\nsize = "{pool_bytes}B"\nslot-bytes = "{slot_bytes}B"\n'
                f'[device]\nkind = "{"cuda" if device == "cuda" else "host"}"\ncount = 1\n'
                f'[metrics]\nlisten = ""\n'
                f'[engine]\nlisten = "{self.addr}"\nfd-dir = "{self.dir}"\n'
            )
        self.log = open(os.path.join(self.dir, "node.log"), "w")
        self.proc = subprocess.Popen(
            [binary, "node", "--config", cfg], stdout=self.log, stderr=subprocess.STDOUT
        )

    def client(self):
        import kvferry

        end = time.monotonic() + 60
        while True:
            try:
                c = kvferry.EngineClient(self.addr, deadline_s=60.0, connect_timeout_s=1.0)
                if c.health():
                    return c
            except kvferry.KvferryError:
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                self.log.flush()
                raise SystemExit(
                    f"kvferry node did not start: {open(self.log.name).read()[-2000:]}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _median_ms(xs: List[float]) -> float:
    return statistics.median(xs) * 1e3


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    import kvferry.torch as kt

    seg = args.segment_kib << 10
    layers = args.layers
    block_bytes = layers * 2 * seg
    sizes = sorted(args.blocks)
    total = sum(sizes)
    nb = 4 * max(sizes) + 4
    cuda = args.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    node = Node(
        args.kvferry_bin, args.device, pool_bytes=(len(args.layouts) * total + 64) * block_bytes,
        slot_bytes=block_bytes,
    )
    out: Dict[str, Any] = {"device": args.device, "layers": layers, "segment_bytes": seg,
                           "block_bytes": block_bytes, "iters": args.iters, "layouts": {}}
    ok = True
    try:
        c = node.client()
        caps = c.capabilities()
        out["node_device"] = caps["device_kind"]
        for layout in args.layouts:
            empty = (lambda shape: torch.empty(shape, dtype=torch.uint8, device=dev)) if cuda \
                else (lambda shape: kt.memfd_empty(shape, torch.uint8))
            if layout == "per_layer":
                tensors = [empty((2, nb, seg)) for _ in range(layers)]
                kv_name = "flash_attn"
            else:
                tensors = empty((nb, layers, 2, seg))
                kv_name = "cross_layer"
            instance = f"bench-{layout}"
            # The outcome as the engine's worker learns it: the board's final word.
            board = c.open_board(instance, 0, 8)
            kt.register_kv(c, instance, f"bench-{layout}", tensors, kv_name, device=0,
                           dtype_name="u8", board=board)
            tag = 0
            session = c.open_session([instance])

            planes = tensors if layout == "per_layer" else [tensors]
            dim = 1 if layout == "per_layer" else 0  # the block dimension

            rows = []
            for n in sizes:
                src = list(range(n))
                dst = [n + 1 + 3 * i for i in range(n)]  # every third block after the sources
                hashes = [f"{layout}-{n}-{i}".encode() for i in range(n)]
                gen = torch.Generator(device=dev).manual_seed(n)
                d_idx = torch.tensor(dst, device=dev)
                for t in planes:
                    t.fill_(CANARY)
                    head = t.narrow(dim, 0, n)
                    head.copy_(torch.randint(0, 255, head.shape, dtype=torch.uint8, device=dev,
                                             generator=gen))
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                saved = c.save(instance, 0, hashes, src)
                save_s = time.perf_counter() - t0
                if saved["written"] + saved["present"] != n:
                    raise SystemExit(f"save of {n} blocks stored {saved}")
                query_s, load_s, node_s = [], [], []
                verified = True
                for it in range(args.iters + 1):  # the first one warms up, untimed
                    for t in planes:
                        t.index_fill_(dim, d_idx, CANARY)
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    q = c.query(instance, hashes)
                    t1 = time.perf_counter()
                    if q["local_blocks"] != n:
                        raise SystemExit(f"query of {n} hit {q}")
                    tag += 1
                    lid = c.load(q["lease"], instance, 0, dst, board_slot=0, board_tag=tag)
                    end = board.wait(0, tag, ALL_LAYERS, 60.0)
                    t2 = time.perf_counter()
                    if not end["done"]:
                        raise SystemExit(f"load of {n}: no end on the board within 60 s")
                    # The details (the node's own seconds; a failure's error) by a poll,
                    # outside the timed span.
                    done = c.poll_load(lid)
                    if not end["ok"] or done is None or not done["ok"]:
                        raise SystemExit(f"load of {n} failed: {end} {done}")
                    if it > 0:
                        query_s.append(t1 - t0)
                        load_s.append(t2 - t1)
                        node_s.append(done["seconds"])
                    if it in (0, args.iters):
                        verified &= _verify(planes, dim, src, dst, nb)
                # Raw: the same bytes, pinned host to GPU in one copy (CPU: one memcpy).
                raw_s = []
                host = torch.empty(n * block_bytes, dtype=torch.uint8,
                                   pin_memory=cuda)
                host.fill_(1)
                target = torch.empty(n * block_bytes, dtype=torch.uint8, device=dev)
                for it in range(args.iters + 1):
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    target.copy_(host, non_blocking=True)
                    if cuda:
                        torch.cuda.synchronize()
                    if it > 0:
                        raw_s.append(time.perf_counter() - t0)
                del host, target
                row = {
                    "blocks": n,
                    "bytes": n * block_bytes,
                    "query_ms": _median_ms(query_s),
                    "load_ms": _median_ms(load_s),
                    "node_load_ms": _median_ms(node_s),
                    "raw_ms": _median_ms(raw_s),
                    "save_ms": save_s * 1e3,
                    "load_vs_raw": statistics.median(raw_s) / statistics.median(load_s),
                    "verified": bool(verified),
                }
                ok &= row["verified"]
                rows.append(row)
            session.close()  # unregisters the instance
            out["layouts"][layout] = rows
    finally:
        node.stop()
    out["verified"] = ok
    return out


def _verify(planes, dim: int, src: List[int], dst: List[int], nb: int) -> bool:
    """Destinations equal their sources in every plane; every other block holds the canary."""
    import torch

    dev = planes[0].device
    s_idx = torch.tensor(src, device=dev)
    d_idx = torch.tensor(dst, device=dev)
    touched = set(src) | set(dst)
    rest = torch.tensor([i for i in range(nb) if i not in touched], dtype=torch.long, device=dev)
    for n, t in enumerate(planes):
        if not torch.equal(t.index_select(dim, d_idx), t.index_select(dim, s_idx)):
            print(f"tensor {n}: a destination differs from its source block", file=sys.stderr)
            return False
        if not bool((t.index_select(dim, rest) == CANARY).all()):
            print(f"tensor {n}: written outside the destinations", file=sys.stderr)
            return False
    return True


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["finish"]:
        # A load's end as vLLM's worker sees it, against the board alone.
        from . import bench_finish

        return bench_finish.main(argv[1:])
    if argv[:1] == ["vllm"]:
        # TTFT in a real vLLM engine (kvferry.bench_vllm): imports vLLM only in its engines.
        from . import bench_vllm

        return bench_vllm.main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m kvferry.bench",
                                description=__doc__.split("\n\n")[0],
                                epilog="python -m kvferry.bench vllm --help: time to first token "
                                "in a real vLLM engine")
    p.add_argument("--kvferry-bin", default=os.environ.get("KVFERRY_BIN", "kvferry"))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--blocks", default="1,16,64,256,1024",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--segment-kib", type=int, default=32)
    p.add_argument("--layouts", default="per_layer,cross_layer",
                   type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for layout in args.layouts:
        if layout not in ("per_layer", "cross_layer"):
            p.error(f"unknown layout {layout!r} (per_layer, cross_layer)")
    if args.iters < 1 or args.layers < 1 or args.segment_kib < 1 or min(args.blocks) < 1:
        p.error("--iters, --layers, --segment-kib and --blocks must be positive")
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for layout, rows in out["layouts"].items():
            print(f"{layout} ({out['device']}, {args.layers} layers x 2 x {args.segment_kib} KiB)")
            print("blocks  query_ms  load_ms  node_ms   raw_ms  load/raw  save_ms  verified")
            for r in rows:
                print(f"{r['blocks']:6d} {r['query_ms']:9.3f} {r['load_ms']:8.3f} "
                      f"{r['node_load_ms']:8.3f} {r['raw_ms']:8.3f} {r['load_vs_raw']:9.2f} "
                      f"{r['save_ms']:8.2f}  {r['verified']}")
    return 0 if out["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
