"""The GPU half of the SGLang tests (not collected by pytest; needs a CUDA GPU, PyTorch and
a ``kvferry`` binary, not SGLang):

    KVFERRY_BIN=target/debug/kvferry python3 python/tests/gpu_sglang.py

CUDA tensors are allocated in SGLang's device pool layouts, as ``MHATokenToKVPool`` and
``MLATokenToKVPool`` allocate them (per layer ``k_buffer[l]`` / ``v_buffer[l]`` of
``(pages * page_size, heads, head_dim)``, MHA with the HND page layout ``(pages, heads,
page_size, head_dim)``, MLA ``kv_buffer[l]`` of ``(tokens, 1, kv_lora_rank + rope)``; page
size 64, SGLang's default), each with a canary page before and after it. Engine A's
:class:`kvferry.sglang.KvferryConnector` saves pages out of its pool into a ``kvferry node``
with a CUDA device; engine B's loads them into other page slots of a pool filled with a
canary, and every byte of B's pool is checked: loaded pages equal A's, every other page and
both guard pages keep the canary. Then TP=2 MHA, two ranks sharing one lease, and the HiCache
host pool (one rank, then two sharing rank 0's lease). Exits 0 when
every case passed; prints one line per case. ``--cpu`` runs the same cases on CPU (memfd
tensors, a node with a host device), to check the script where there is no GPU.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import kvferry  # noqa: E402
from kvferry.sglang import KvferryConnector  # noqa: E402
from nodeproc import Node  # noqa: E402

PS = 64
CANARY = 0x5A
MODEL = "gpu-sglang-test"
DEV = "cpu" if "--cpu" in sys.argv else "cuda"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def guarded(shape, dtype, page_rows):
    """A tensor of ``shape`` inside a larger allocation with ``page_rows`` guard rows of
    canary before and after it (so a write outside the tensor is seen)."""
    full_shape = (shape[0] + 2 * page_rows, *shape[1:])
    if DEV == "cuda":
        full = torch.empty(full_shape, dtype=dtype, device="cuda")
    else:
        from kvferry.torch import memfd_empty

        full = memfd_empty(full_shape, dtype, "gpu-sglang")
    full.view(torch.uint8).fill_(CANARY)
    return full, full[page_rows:page_rows + shape[0]]


def mha_pool(layers=4, pages=24, heads=8, dim=128, hnd=False, dtype=torch.bfloat16):
    shape = (pages, heads, PS, dim) if hnd else (pages * PS, heads, dim)
    rows = 1 if hnd else PS
    ks, vs, fulls = [], [], []
    for _ in range(layers):
        fk, k = guarded(shape, dtype, rows)
        fv, v = guarded(shape, dtype, rows)
        ks.append(k)
        vs.append(v)
        fulls += [fk, fv]
    pool = SimpleNamespace(page_size=PS, k_buffer=ks, v_buffer=vs, use_hnd=hnd)
    return pool, fulls


def mla_pool(layers=4, pages=24, dim=576, dtype=torch.bfloat16):
    kvs, fulls = [], []
    for _ in range(layers):
        f, t = guarded((pages * PS, 1, dim), dtype, PS)
        kvs.append(t)
        fulls.append(f)
    return SimpleNamespace(page_size=PS, kv_buffer=kvs), fulls


def tensors(pool):
    return list(getattr(pool, "k_buffer", None) or pool.kv_buffer) + list(
        getattr(pool, "v_buffer", None) or [])


def page(pool, p, hnd=False):
    return [t[p] if hnd else t[p * PS:(p + 1) * PS] for t in tensors(pool)]


def fill(pool, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    for t in tensors(pool):
        r = t.view(torch.uint8)
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, device=DEV, generator=g))


def canary(pool, fulls):
    for f in fulls:
        f.view(torch.uint8).fill_(CANARY)


def check(b_pool, b_fulls, a_pool, loaded, hnd, pages):
    """``loaded``: {B page: A page}. Every byte of B checked."""
    sync()
    for bp, ap in loaded.items():
        for x, y in zip(page(b_pool, bp, hnd), page(a_pool, ap, hnd)):
            if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                raise AssertionError(f"page {bp} differs from A's page {ap}")
    for p in range(pages):
        if p in loaded:
            continue
        for x in page(b_pool, p, hnd):
            if not bool(x.view(torch.uint8).eq(CANARY).all()):
                raise AssertionError(f"page {p} was written (not loaded)")
    for t in tensors(b_pool):
        # The allocation holding t: guard rows before and after it.
        (f,) = [f for f in b_fulls if f.data_ptr() <= t.data_ptr() < f.data_ptr() + f.nbytes]
        row = t[0].nbytes
        start = (t.data_ptr() - f.data_ptr()) // row
        for g in (f[:start], f[start + t.shape[0]:]):
            if g.numel() == 0 or not bool(g.view(torch.uint8).eq(CANARY).all()):
                raise AssertionError("a guard page around a layer tensor was written")


def wait_saves(c, n=1):
    end, got = time.monotonic() + 30, []
    while time.monotonic() < end and len(got) < n:
        got += c.check_completed_store_tasks()
        time.sleep(0.002)
    if [ok for _, ok in got] != [True] * n:
        raise AssertionError(f"saves: {got}")


def prompt(pages, salt=0):
    return [(31 * i + salt) % 50000 + 1 for i in range(pages * PS)]


def slots(first_page, n):
    return torch.arange(first_page * PS, (first_page + n) * PS, dtype=torch.int64,
                        device=DEV)


def one_case(addr, name, make, hnd=False):
    a_pool, _ = make()
    b_pool, b_fulls = make()
    cfg = {"address": addr, "deadline_ms": 5000}
    a = KvferryConnector(a_pool, model=MODEL, config={**cfg, "instance": f"{name}-a"})
    b = KvferryConnector(b_pool, model=MODEL, config={**cfg, "instance": f"{name}-b"})
    fill(a_pool, seed=1)
    sync()
    toks = prompt(8)
    if not a.start_store_kv("r", toks, slots(3, 8)):
        raise AssertionError("no save started")
    wait_saves(a)
    canary(b_pool, b_fulls)
    hit = b.get_new_hit_length("r", toks, 2 * PS)  # SGLang holds 2 pages itself
    if hit != 6 * PS:
        raise AssertionError(f"hit {hit}, expected {6 * PS}")
    t0 = time.perf_counter()
    if not b.start_load_kv("r", slots(14, 6)):
        raise AssertionError("no load started")
    for layer in range(len(b.layout.layers)):  # layer by layer, from the completion board
        if not b.wait_for_layer("r", layer, timeout_s=30):
            raise AssertionError(f"layer {layer} did not land")
    t_layers = time.perf_counter() - t0
    landed = b.wait_load("r")
    dt = time.perf_counter() - t0
    if landed != 6 * PS:
        raise AssertionError(f"landed {landed}")
    pages = len(tensors(b_pool)[0]) if hnd else tensors(b_pool)[0].shape[0] // PS
    check(b_pool, b_fulls, a_pool, {14 + i: 5 + i for i in range(6)}, hnd, pages)
    nbytes = sum(x.numel() * x.element_size() for x in page(b_pool, 14, hnd)) * 6
    print(f"ok  {name}: 6 pages ({nbytes / 2**20:.1f} MiB) loaded into {DEV} KV; every layer "
          f"seen on the board after {t_layers * 1e3:.2f} ms, the load reported after "
          f"{dt * 1e3:.2f} ms; every byte checked")
    for c in (a, b):
        c.close()


def tp2_case(addr):
    box = {}

    def broadcast(obj):
        if "v" not in box or obj[0] is not None:
            box["v"] = obj
        return box["v"]

    src = [mha_pool() for _ in range(2)]
    dst = [mha_pool() for _ in range(2)]
    cfg = {"address": addr, "deadline_ms": 5000}
    savers = [KvferryConnector(src[r][0], model=MODEL, tp_rank=r, tp_size=2,
                               broadcast=broadcast, config={**cfg, "instance": "tp2-a"})
              for r in range(2)]
    loaders = [KvferryConnector(dst[r][0], model=MODEL, tp_rank=r, tp_size=2,
                                broadcast=broadcast, config={**cfg, "instance": "tp2-b"})
               for r in range(2)]
    toks = prompt(4, salt=3)
    for r in range(2):
        fill(src[r][0], seed=20 + r)
        sync()
        savers[r].start_store_kv("r", toks, slots(1, 4))
        wait_saves(savers[r])
        canary(dst[r][0], dst[r][1])
    box.clear()
    hits = [loaders[r].get_new_hit_length("q", toks, 0) for r in range(2)]
    if hits != [4 * PS] * 2:
        raise AssertionError(f"hits {hits}")
    for r in range(2):
        loaders[r].start_load_kv("q", slots(10, 4))
    if [loaders[r].wait_load("q") for r in range(2)] != [4 * PS] * 2:
        raise AssertionError("TP loads")
    for r in range(2):
        check(dst[r][0], dst[r][1], src[r][0], {10 + i: 1 + i for i in range(4)}, False, 24)
    if kvferry.EngineClient(addr).stats()["leases_live"] != 0:
        raise AssertionError("a lease outlived both ranks' loads")
    print("ok  mha tp=2: both ranks loaded their heads from rank 0's one lease")


class HostPool:
    """SGLang's MHATokenToKVPoolHost (page_first) as kvferry reads it: ``layout``,
    ``kv_buffer`` (2, tokens, layers, heads, dim) in host memory, ``page_size``. SGLang is not
    imported here; the CPU tests run its own class."""

    def __init__(self, pages=24, layers=4, heads=8, dim=128, dtype=torch.bfloat16):
        from kvferry.torch import memfd_empty

        self.layout, self.page_size, self.size = "page_first", PS, pages * PS
        self.kv_buffer = memfd_empty((2, pages * PS, layers, heads, dim), dtype, "hicache")

    def available_size(self):
        return self.size

    def page(self, p):
        return self.kv_buffer[:, p * PS:(p + 1) * PS].contiguous().view(torch.uint8)


def hicache_case(addr):
    """KvferryStorage's logic (StorageSide) against the node: A's host pages saved, B's
    loaded into other host pages; on a CUDA node the host pool is a client memfd the node
    registers as pinned host memory."""
    from kvferry.sglang.config import parse_config
    from kvferry.sglang.storage import StorageSide

    t0 = time.monotonic()
    a_pool, b_pool = HostPool(), HostPool()
    cfg = {"address": addr, "deadline_ms": 5000}
    a = StorageSide(parse_config({**cfg, "instance": "hc-a"}), model=MODEL)
    b = StorageSide(parse_config({**cfg, "instance": "hc-b"}), model=MODEL)
    a.register(a_pool)
    b.register(b_pool)
    g = torch.Generator().manual_seed(7)
    raw = a_pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    b_pool.kv_buffer.view(torch.uint8).fill_(CANARY)
    keys = [f"hc-{i}" for i in range(6)]
    if not all(a.set(keys, torch.arange(2 * PS, 8 * PS))):
        raise AssertionError("hicache: save failed")
    if b.exists(keys) != 6:
        raise AssertionError(f"hicache: {b.exists(keys)} of 6 pages held")
    if not all(b.get(keys, torch.arange(10 * PS, 16 * PS))):
        raise AssertionError("hicache: load failed")
    for i in range(6):
        if not torch.equal(b_pool.page(10 + i), a_pool.page(2 + i)):
            raise AssertionError(f"hicache: page {i} differs")
    for p in range(b_pool.size // PS):
        if not 10 <= p < 16 and not bool((b_pool.page(p) == CANARY).all()):
            raise AssertionError(f"hicache: host page {p} was written")
    if kvferry.EngineClient(addr).stats()["leases_live"] != 0:
        raise AssertionError("hicache: a lease was left")
    a.close()
    b.close()
    print(f"ok hicache-page-first: 6 host pages byte for byte ({time.monotonic() - t0:.2f} s)")


def hicache_tp2_case(addr):
    """Two HiCache TP ranks (StorageSide, as KvferryStorage runs them): rank 0 asks the node,
    rank 1 takes its lease through a store the ranks share (torch.distributed's HashStore
    here, the process group's TCPStore in SGLang), each loads its own heads."""
    import threading

    from kvferry.sglang.config import parse_config
    from kvferry.sglang.storage import StorageSide

    store = torch.distributed.HashStore()
    cfg = {"address": addr, "deadline_ms": 5000}
    src, dst = [HostPool() for _ in range(2)], [HostPool() for _ in range(2)]
    savers = [StorageSide(parse_config({**cfg, "instance": "hc2-a"}), model=MODEL, tp_rank=r,
                          tp_size=2) for r in range(2)]
    loaders = [StorageSide(parse_config({**cfg, "instance": "hc2-b"}), model=MODEL,
                           tp_rank=r, tp_size=2, store=store) for r in range(2)]
    keys = [f"hc2-{i}" for i in range(4)]
    for r in range(2):
        savers[r].register(src[r])
        loaders[r].register(dst[r])
        g = torch.Generator().manual_seed(40 + r)
        raw = src[r].kv_buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        dst[r].kv_buffer.view(torch.uint8).fill_(CANARY)
        if not all(savers[r].set(keys, torch.arange(1 * PS, 5 * PS))):
            raise AssertionError(f"hicache tp=2: rank {r} save failed")
    got = {}

    def get(r):
        got[r] = loaders[r].get(keys, torch.arange(8 * PS, 12 * PS))

    t = threading.Thread(target=get, args=(1,))  # rank 1 first: it waits for rank 0's lease
    t.start()
    get(0)
    t.join(30)
    if got != {0: [True] * 4, 1: [True] * 4}:
        raise AssertionError(f"hicache tp=2: loads {got}")
    if loaders[1].rank.counters["queries"] != 0:
        raise AssertionError("hicache tp=2: rank 1 asked the node itself")
    for r in range(2):
        for i in range(4):
            if not torch.equal(dst[r].page(8 + i), src[r].page(1 + i)):
                raise AssertionError(f"hicache tp=2: rank {r} page {i} differs")
        for p in range(dst[r].size // PS):
            if not 8 <= p < 12 and not bool((dst[r].page(p) == CANARY).all()):
                raise AssertionError(f"hicache tp=2: rank {r} host page {p} was written")
    if kvferry.EngineClient(addr).stats()["leases_live"] != 0:
        raise AssertionError("hicache tp=2: a lease outlived both ranks' loads")
    for side in savers + loaders:
        side.close()
    print("ok  hicache tp=2: both ranks loaded their heads from rank 0's one lease")


def main() -> int:
    if DEV == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        node = Node(Path(tmp), device="cuda" if DEV == "cuda" else "host",
                    pool="2GiB" if DEV == "cuda" else "256MiB", slot="8MiB")
        try:
            one_case(node.addr, "mha-nhd", lambda: mha_pool())
            one_case(node.addr, "mha-hnd", lambda: mha_pool(hnd=True), hnd=True)
            one_case(node.addr, "mla", lambda: mla_pool())
            one_case(node.addr, "mha-fp16-small", lambda: mha_pool(layers=2, heads=2, dim=64,
                                                                   dtype=torch.float16))
            tp2_case(node.addr)
            hicache_case(node.addr)
            hicache_tp2_case(node.addr)
        finally:
            node.kill()
    print("all SGLang GPU cases passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
