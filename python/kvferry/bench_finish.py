"""A load's end as vLLM's worker sees it, against the board alone: ``python -m kvferry.bench
finish``.

Starts a ``kvferry node`` (``--kvferry-bin``), registers KV through the connector's own worker
(:class:`kvferry.vllm.WorkerSide`, as vLLM's ``register_kv_caches`` hands it: one tensor per
layer, or vLLM's cross-layer blocks), saves N blocks from it, then, for every N, times in the
same run, each taking the first turn in every other round:

* ``board``: the Load call with a slot of the worker's own completion board, until the
  board's final word says ok (the floor: nothing but the node's copy and the word);
* ``async``: the worker's path for ``load_mode = "async"``: ``start_load`` until the moment
  ``get_finished`` would report the load (the loader thread picks it up, starts it, and sees
  its end; vLLM asks at its next step);
* ``sync``: ``load_mode = "sync"``: ``start_load`` until ``wait_for_layer_load`` of the last
  layer returns (the end: in vLLM the earlier layers' waits sit between the forward's
  layers, not on the load's way);
* ``sync-layers`` (ask for it in ``--modes``): the same with every layer waited for in order,
  back to back (28 calls cost ~0.1 ms of Python on their own).

Each is the median over ``--iters`` rounds (after one untimed), with the worker's path over the
board's as a ratio. The worker's client counts its ``poll_load`` calls (``polls``): the
board's word is a successful load's outcome, so none is needed to report one. Every
destination is checked against its source block (and every other block against its canary)
after the first and the last round. ``--device cuda`` puts the KV in CUDA memory on a CUDA node (the worker then
orders the node's copies after a CUDA event, as in vLLM); ``--device cpu`` in memfds on a
host node. Prints a table, or one JSON object with ``--json``; exits non-zero when a check
fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Tuple

from .bench import CANARY, Node, _verify

#: A board wait for this many layers returns at the load's end.
ALL_LAYERS = 0xFFFFFFFF
#: Tokens per block and KV heads of the layout (the segment's bytes set the rest).
BLOCK_TOKENS = 16
HEADS = 8


class CountingClient:
    """A client that counts the calls made on it (the worker's, in the bench and the board
    tests: a successful load must make none)."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.calls: Dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def counted(*a: Any, **kw: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*a, **kw)

        return counted


def _kv(layout: str, layers: int, nb: int, seg: int, device: str):
    """``({layer: tensor}, planes, block dim)``: what vLLM would hand the connector, and the
    physical tensors under it (for the checks)."""
    import torch

    import kvferry.torch as kt

    c = seg // (BLOCK_TOKENS * HEADS)

    def empty(shape):
        if device == "cuda":
            return torch.zeros(shape, dtype=torch.uint8, device="cuda:0")
        return kt.memfd_empty(shape, torch.uint8)

    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    if layout == "per-layer":
        planes = [empty((nb, BLOCK_TOKENS, HEADS, c)) for _ in names]
        # vLLM's logical (blocks, heads, tokens, 2 x head size) over a (B, N, H, C) allocation.
        return {n: t.permute(0, 2, 1, 3) for n, t in zip(names, planes)}, planes, 0
    big = empty((nb, layers, HEADS, BLOCK_TOKENS, c))
    return {n: big[:, i] for i, n in enumerate(names)}, [big], 0


def _borrow_slot(w: Any) -> int:
    # The worker's own board and client, so both paths share everything but the worker.
    with w._lock:
        return w._board_free.pop()


def _return_slot(w: Any, slot: int) -> None:
    with w._lock:
        w._board_free.append(slot)


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    import kvferry
    from kvferry.vllm import WorkerSide, parse_extra_config
    from kvferry.vllm.kvcache import layer_names
    from kvferry.vllm.metadata import LoadSpec, StepMetadata

    seg = args.segment_kib << 10
    if seg % (BLOCK_TOKENS * HEADS):
        raise SystemExit(f"--segment-kib must split into {BLOCK_TOKENS} tokens x {HEADS} heads")
    layers = args.layers
    block_bytes = layers * seg
    sizes = sorted(args.blocks)
    nb = 2 * max(sizes) + 2
    cuda = args.device == "cuda"
    node = Node(args.kvferry_bin, args.device,
                pool_bytes=(len(args.layouts) * sum(sizes) + 64) * block_bytes,
                slot_bytes=block_bytes)
    out: Dict[str, Any] = {"device": args.device, "layers": layers, "segment_bytes": seg,
                           "block_bytes": block_bytes, "iters": args.iters,
                           "modes": args.modes, "layouts": {}}
    ok = True
    try:
        node.client()  # up and answering
        cfg = parse_extra_config({"address": node.addr, "load_timeout_ms": 60000,
                                  "deadline_ms": 60000})
        clients: List[CountingClient] = []

        def factory() -> Any:
            c = CountingClient(kvferry.EngineClient(node.addr, deadline_s=60.0))
            clients.append(c)
            return c

        for layout in args.layouts:
            kv, planes, dim = _kv(layout, layers, nb, seg, args.device)
            instance = f"finish-{layout}"
            w = WorkerSide(cfg, instance=instance, model="bench-finish", kv_dtype="uint8",
                           tp_rank=0, tp_size=1, num_blocks=nb, client_factory=factory)
            w.register_kv_caches(kv)
            board = w._board
            if board is None:
                raise SystemExit("the worker has no completion board (an older node?)")
            c = w.link.client()
            names = list(layer_names(w.layout))
            rows = []
            try:
                for n in sizes:
                    src = list(range(n))
                    dst = [n + 1 + i for i in range(n)]
                    hashes = [f"{layout}-{n}-{i}".encode() for i in range(n)]
                    d_idx = torch.tensor(dst, device=planes[0].device)
                    gen = torch.Generator(device=planes[0].device).manual_seed(n)
                    for t in planes:
                        t.fill_(CANARY)
                        head = t.narrow(dim, 0, n)
                        head.copy_(torch.randint(0, 255, head.shape, dtype=torch.uint8,
                                                 device=t.device, generator=gen))
                    if cuda:
                        torch.cuda.synchronize()
                    saved = c.save(instance, 0, hashes, src)
                    if saved["written"] + saved["present"] != n:
                        raise SystemExit(f"save of {n} blocks stored {saved}")
                    times: Dict[str, List[float]] = {m: [] for m in ["board"] + args.modes}
                    verified = True
                    polls_before = c.calls.get("poll_load", 0)
                    tag = 1 << 31  # apart from the worker's own tags
                    for it in range(args.iters + 1):
                        order = ["board"] + args.modes
                        if it % 2:
                            order.reverse()
                        for mode in order:
                            for t in planes:
                                t.index_fill_(dim, d_idx, CANARY)
                            if cuda:
                                torch.cuda.synchronize()
                            q = c.query(instance, hashes)
                            if q["local_blocks"] != n:
                                raise SystemExit(f"query of {n} hit {q}")
                            if mode == "board":
                                tag += 1
                                slot = _borrow_slot(w)
                                try:
                                    t0 = time.perf_counter()
                                    c.load(q["lease"], instance, 0, dst, board_slot=slot,
                                           board_tag=tag)
                                    v = board.wait(slot, tag, ALL_LAYERS, 60.0)
                                    took = time.perf_counter() - t0
                                finally:
                                    _return_slot(w, slot)
                                if not v.get("ok"):
                                    raise SystemExit(f"load of {n} on the board: {v}")
                            else:
                                rid = f"{layout}-{n}-{it}-{mode}"
                                spec = LoadSpec(rid, q["lease"], dst, n * BLOCK_TOKENS,
                                                sync=mode != "async")
                                # The worker's clock: its reports carry their time on it.
                                t0 = time.monotonic()
                                w.start_load(StepMetadata(loads=[spec]))
                                if mode != "async":
                                    for name in names if mode == "sync-layers" else names[-1:]:
                                        w.wait_for_layer_load(name)
                                    took = time.monotonic() - t0
                                else:
                                    # When get_finished would first report it (not when
                                    # this thread woke up to look).
                                    at = w.wait_for_loads({rid}, 60.0)
                                    if at is None:
                                        raise SystemExit(f"load of {n} not done after 60 s")
                                    took = at - t0
                                _, recving = w.get_finished(set())
                                errors = w.get_block_ids_with_load_errors()
                                if errors or (mode == "async" and rid not in recving):
                                    raise SystemExit(f"load of {n} ({mode}) failed: {errors}")
                            if it > 0:
                                times[mode].append(took)
                            if it in (0, args.iters):
                                if cuda:
                                    torch.cuda.synchronize()
                                verified &= _verify(planes, dim, src, dst, nb)
                    row: Dict[str, Any] = {"blocks": n, "bytes": n * block_bytes,
                                           "verified": bool(verified),
                                           "poll_load_calls": c.calls.get("poll_load", 0)
                                           - polls_before}
                    board_s = statistics.median(times["board"])
                    row["board_ms"] = board_s * 1e3
                    for m in args.modes:
                        s = statistics.median(times[m])
                        row[f"{m}_ms"] = s * 1e3
                        row[f"{m}_over_board"] = s / board_s
                        row[f"{m}_extra_ms"] = (s - board_s) * 1e3
                    ok &= row["verified"]
                    rows.append(row)
                    # As it goes (the whole run takes minutes at 256 blocks on a CPU).
                    print(f"{layout} {n} blocks: board {row['board_ms']:.3f} ms"
                          + "".join(f", {m} {row[m + '_ms']:.3f} ms" for m in args.modes),
                          file=sys.stderr, flush=True)
            finally:
                w.shutdown()
                del kv, planes
            out["layouts"][layout] = rows
    finally:
        node.stop()
    out["verified"] = ok
    return out


def _parse_list(s: str) -> List[str]:
    return [x for x in s.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvferry.bench finish",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--kvferry-bin", default=os.environ.get("KVFERRY_BIN", "kvferry"))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--blocks", default="1,4,16,64,256",
                   type=lambda s: [int(x) for x in _parse_list(s)])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--segment-kib", type=int, default=64,
                   help="bytes of one block of one layer (K and V), in KiB")
    p.add_argument("--layouts", "--layout", default="per-layer,cross-layer", type=_parse_list)
    p.add_argument("--modes", default="async,sync", type=_parse_list)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for layout in args.layouts:
        if layout not in ("per-layer", "cross-layer"):
            p.error(f"unknown layout {layout!r} (per-layer, cross-layer)")
    for mode in args.modes:
        if mode not in ("async", "sync", "sync-layers"):
            p.error(f"unknown mode {mode!r} (async, sync, sync-layers)")
    if not args.layouts or not args.blocks:
        p.error("--layouts and --blocks name at least one")
    if args.iters < 1 or args.layers < 1 or args.segment_kib < 1 or min(args.blocks) < 1:
        p.error("--iters, --layers, --segment-kib and --blocks must be positive")
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for layout, rows in out["layouts"].items():
            print(f"{layout} ({out['device']}, {args.layers} layers x {args.segment_kib} KiB "
                  f"a block; medians of {args.iters})")
            head = "blocks  board_ms" + "".join(
                f"  {m + '_ms':>9} {m + '/board':>11} {'+ms':>7}" for m in args.modes)
            print(head + "  polls  verified")
            for r in rows:
                line = f"{r['blocks']:6d} {r['board_ms']:9.3f}"
                for m in args.modes:
                    line += (f"  {r[m + '_ms']:9.3f} {r[m + '_over_board']:11.3f} "
                             f"{r[m + '_extra_ms']:7.3f}")
                print(f"{line}  {r['poll_load_calls']:5d}  {r['verified']}")
    return 0 if out["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
