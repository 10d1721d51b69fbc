"""kvferry.sglang.KvferryStorage, SGLang's HiCache storage backend, driven with SGLang's
own classes on CPU: its host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) over
its device pools, in every ``--hicache-mem-layout`` kvferry describes, made by SGLang's
``StorageBackendFactory`` from a ``HiCacheStorageConfig`` as ``--hicache-storage-backend
dynamic`` makes it, named by page keys made as SGLang's ``get_hash_str`` makes them, and
called as its cache controller calls it (``register_mem_pool_host``, ``batch_exists``,
``batch_set_v1``, ``batch_get_v1`` with host indices from the pool's ``alloc``), against a
real ``kvferry node``. Pages saved by one engine and loaded into another engine's fresh pool equal the
originals byte for byte; pages not loaded keep their canary.

Run with the interpreter of ``scripts/sglang-env`` (SGLang + pytest).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import time

import pytest

from sglang_support import CANARY, Node, free_port, page_bytes, sglang_or_skip

memory_pool = sglang_or_skip()
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

import kvferry  # noqa: E402
from kvferry.layout import LayoutError  # noqa: E402
from kvferry.sglang import ConfigError  # noqa: E402

PS = 16  # SGLang's page size here (64 by default; small pages keep the pools small)
MODEL = "Qwen/Qwen3-0.6B"


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path, pool="32MiB", slot="64KiB")
    yield n
    n.kill()


def device_pool(kind: str):
    if kind == "mha":
        return memory_pool.MHATokenToKVPool(
            size=256, page_size=PS, dtype=torch.float16, head_num=2, head_dim=16,
            layer_num=3, device="cpu", enable_memory_saver=False,
        )
    return memory_pool.MLATokenToKVPool(
        size=256, page_size=PS, dtype=torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=32,
        layer_num=2, device="cpu", enable_memory_saver=False,
    )


def host_pool(kind: str, layout: str):
    cls = MHATokenToKVPoolHost if kind == "mha" else MLATokenToKVPoolHost
    dev = device_pool(kind)
    if "buffer_info" not in inspect.signature(cls.__init__).parameters:  # 0.5.16
        return cls(dev, 2.0, 0, PS, layout, False, "cpu")
    # 0.5.23: built from the device pool's buffer description, as HiCache builds it.
    extra = {"target_layer_num": dev.layer_num} if kind == "mla" else {}
    return cls(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PS, layout, False, "cpu",
               device_capacity_tokens=dev.size, start_layer=dev.start_layer,
               end_layer=dev.end_layer, **extra)


def storage(addr: str, pool, *, instance: str, tp_rank=0, tp_size=1, mla=False,
            metrics=False, store=None, **extra):
    cfg = {"backend_name": "kvferry", "module_path": "kvferry.sglang",
           "class_name": "KvferryStorage", "interface_v1": 1, "address": addr,
           "instance": instance, "deadline_ms": 2000, "retry_ms": 100}
    cfg.update(extra)
    sc = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=pool.layout == "page_first", model_name=MODEL, extra_config=cfg,
    )
    # SGLang's factory hands its keyword arguments to the backend (its own server finds the
    # store of its process group instead).
    kwargs = {"store": store} if store is not None else {}
    backend = StorageBackendFactory.create_backend("dynamic", sc, pool, **kwargs)
    # What HiCacheController.attach_storage_backend does right after creating it.
    backend.register_mem_pool_host(pool)
    return backend


def get_hash_str(token_ids, prior_hash=None, page_size=PS):
    """Page keys as SGLang's cache controller makes them (``get_hash_str``: SHA-256 hex of
    each page's token ids chained from the previous page's digest). SGLang's own builds a
    C++ extension at first use (a compiler and OpenSSL headers), which this machine lacks."""
    prev = bytes.fromhex(prior_hash) if prior_hash else b""
    out = []
    for i in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.sha256(prev)
        for t in token_ids[i:i + page_size]:
            h.update(int(t).to_bytes(4, "little", signed=False))
        prev = h.digest()
        out.append(h.hexdigest())
    return out


def tokens(n_pages: int, salt: int = 0):
    return [(7 * i + 11 * salt) % 30000 + 1 for i in range(n_pages * PS)]


def fill(pool, host_indices, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for i in range(0, len(host_indices), PS):
        page = pool.get_data_page(int(host_indices[i]), flat=False)
        raw = page.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def canary(pool) -> None:
    pool.kv_buffer.view(torch.uint8).fill_(CANARY)


def pages(pool, host_indices):
    return [page_bytes(torch, pool.get_data_page(int(host_indices[i])))
            for i in range(0, len(host_indices), PS)]


LAYOUTS = [("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_first_direct"),
           ("mha", "page_head"), ("mla", "layer_first"), ("mla", "page_first"),
           ("mla", "page_first_direct")]


@pytest.mark.parametrize("kind,layout", LAYOUTS)
def test_pages_saved_by_one_engine_load_into_another_byte_for_byte(node, kind, layout):
    mla = kind == "mla"
    a_pool, b_pool = host_pool(kind, layout), host_pool(kind, layout)
    a = storage(node.addr, a_pool, instance="engine-a", mla=mla)
    b = storage(node.addr, b_pool, instance="engine-b", mla=mla)
    keys = get_hash_str(tokens(5), page_size=PS)
    assert len(keys) == 5
    a_idx = a_pool.alloc(5 * PS)
    fill(a_pool, a_idx, seed=1)
    assert a.batch_set_v1(keys, a_idx) == [True] * 5
    assert b.batch_exists(keys) == 5

    canary(b_pool)
    b_pool.alloc(3 * PS)  # B's pages land elsewhere than A's
    b_idx = b_pool.alloc(5 * PS)
    got = b.batch_get_v1(keys, b_idx)
    assert got == [True] * 5
    assert pages(b_pool, b_idx) == pages(a_pool, a_idx)
    # Every other page of B's pool still holds the canary.
    loaded = {int(b_idx[i]) // PS for i in range(0, len(b_idx), PS)}
    want = bytes([CANARY]) * len(page_bytes(torch, b_pool.get_data_page(0)))
    for p in range(b_pool.page_num):
        if p not in loaded and (p + 1) * PS <= b_pool.size:
            assert page_bytes(torch, b_pool.get_data_page(p * PS)) == want, f"page {p}"
    stats = b.counters()
    assert stats["loaded_blocks"] == 5 and stats["node_failures"] == 0


def test_batch_exists_answers_the_leading_hit_count(node):
    pool = host_pool("mha", "layer_first")
    s = storage(node.addr, pool, instance="engine-a")
    keys = get_hash_str(tokens(6), page_size=PS)
    idx = pool.alloc(4 * PS)
    fill(pool, idx, seed=2)
    assert s.batch_set_v1(keys[:4], idx) == [True] * 4
    assert s.batch_exists(keys) == 4
    # Page 2 of another prompt differs: its chained keys from page 2 on are unknown.
    other = get_hash_str(tokens(2) + tokens(4, salt=1), page_size=PS)
    assert other[:2] == keys[:2] and other[2] != keys[2]
    assert s.batch_exists(other) == 2
    assert s.batch_exists([]) == 0
    # A get of more keys than held lands the held prefix and says so.
    dst = pool.alloc(6 * PS)
    got = s.batch_get_v1(keys, dst)
    assert isinstance(got, list) and got == [True] * 4 + [False] * 2
    assert pages(pool, dst)[:4] == pages(pool, idx)
    assert node.proc.poll() is None
    assert kvferry.EngineClient(node.addr).stats()["leases_live"] == 0


def test_layouts_and_models_never_share_pages(node):
    keys = get_hash_str(tokens(3), page_size=PS)
    lf = host_pool("mha", "layer_first")
    s = storage(node.addr, lf, instance="engine-lf")
    idx = lf.alloc(3 * PS)
    fill(lf, idx, seed=3)
    assert s.batch_set_v1(keys, idx) == [True] * 3
    # Same keys, same model, a layout with another byte order inside a page.
    pf = storage(node.addr, host_pool("mha", "page_head"), instance="engine-ph")
    assert pf.batch_exists(keys) == 0
    # Same layout, another model.
    other = storage(node.addr, host_pool("mha", "layer_first"), instance="engine-m2",
                    model="another/model")
    assert other.batch_exists(keys) == 0
    # page_first_direct keeps each layer's K and V of a page as layer_first does: shared.
    pfd_pool = host_pool("mha", "page_first_direct")
    pfd = storage(node.addr, pfd_pool, instance="engine-pfd")
    assert pfd.batch_exists(keys) == 3


def test_tp_ranks_of_one_engine_complete_a_page_together(node):
    """MHA TP ranks hold their heads of one page: a page is there once both saved."""
    r0_pool, r1_pool = host_pool("mha", "layer_first"), host_pool("mha", "layer_first")
    r0 = storage(node.addr, r0_pool, instance="tp-engine", tp_rank=0, tp_size=2)
    r1 = storage(node.addr, r1_pool, instance="tp-engine", tp_rank=1, tp_size=2)
    keys = get_hash_str(tokens(2), page_size=PS)
    i0, i1 = r0_pool.alloc(2 * PS), r1_pool.alloc(2 * PS)
    fill(r0_pool, i0, seed=4)
    fill(r1_pool, i1, seed=5)
    assert r0.batch_set_v1(keys, i0) == [True, True]
    assert r0.batch_exists(keys) == 0  # rank 1's heads are missing
    assert r1.batch_set_v1(keys, i1) == [True, True]
    assert r0.batch_exists(keys) == 2 and r1.batch_exists(keys) == 2
    d0, d1 = r0_pool.alloc(2 * PS), r1_pool.alloc(2 * PS)
    assert r0.batch_get_v1(keys, d0) == [True, True]
    assert r1.batch_get_v1(keys, d1) == [True, True]
    assert pages(r0_pool, d0) == pages(r0_pool, i0)
    assert pages(r1_pool, d1) == pages(r1_pool, i1)
    assert pages(r0_pool, d0) != pages(r1_pool, d1)


def test_tp_ranks_loads_share_rank_0s_lease(node):
    """HiCache calls batch_get_v1 on each rank's own thread: rank 0 asks the node, the other
    rank takes its lease through the store the ranks share, waiting for it where it comes
    first; a rank that skips a batch, comes late or waits in vain misses, nothing more."""
    from datetime import timedelta
    import threading

    store = torch.distributed.HashStore()
    store.set_timeout(timedelta(seconds=5))
    src = [host_pool("mha", "layer_first") for _ in range(2)]
    savers = [storage(node.addr, src[r], instance="tp-save", tp_rank=r, tp_size=2)
              for r in range(2)]
    keys = get_hash_str(tokens(3), page_size=PS)
    s_idx = [src[r].alloc(3 * PS) for r in range(2)]
    for r in range(2):
        fill(src[r], s_idx[r], seed=20 + r)
        assert savers[r].batch_set_v1(keys, s_idx[r]) == [True] * 3
    want = [pages(src[r], s_idx[r]) for r in range(2)]
    assert want[0] != want[1]

    dst = [host_pool("mha", "layer_first") for _ in range(2)]
    ranks = [storage(node.addr, dst[r], instance="tp-load", tp_rank=r, tp_size=2,
                     store=store, load_timeout_ms=500, share_wait_ms=400) for r in range(2)]
    client = kvferry.EngineClient(node.addr)
    for p in dst:
        canary(p)
    blank = bytes([CANARY]) * len(want[0][0])

    def get(r, idx, out):
        out[r] = ranks[r].batch_get_v1(keys, idx)

    # Rank 1 first: it waits for rank 0's lease and asks the node nothing.
    d_idx = [dst[r].alloc(3 * PS) for r in range(2)]
    queries = ranks[1].counters()["queries"]
    out = {}
    t = threading.Thread(target=get, args=(1, d_idx[1], out))
    t.start()
    time.sleep(0.1)
    assert t.is_alive() and client.stats()["leases_live"] == 0
    get(0, d_idx[0], out)
    t.join(5)
    assert out == {0: [True] * 3, 1: [True] * 3}
    assert [pages(dst[r], d_idx[r]) for r in range(2)] == want
    assert ranks[1].counters()["queries"] == queries
    assert client.stats()["leases_live"] == 0  # both consumed it

    # Rank 1 skipped a batch (an earlier one of its request failed): it takes the lease
    # rank 0 took after, for the same pages.
    e_idx = [dst[r].alloc(3 * PS) for r in range(2)]
    assert ranks[0].batch_get_v1(keys, e_idx[0]) == [True] * 3
    assert ranks[1].batch_get_v1(keys, e_idx[1]) == [True] * 3
    assert [pages(dst[r], e_idx[r]) for r in range(2)] == want
    assert client.stats()["leases_live"] == 0

    # Rank 1 never comes: rank 0 releases the lease once load_timeout_ms passed.
    f_idx = [dst[r].alloc(3 * PS) for r in range(2)]
    assert ranks[0].batch_get_v1(keys, f_idx[0]) == [True] * 3
    assert client.stats()["leases_live"] == 1
    time.sleep(0.6)
    assert ranks[0].batch_exists(keys) == 3
    assert client.stats()["leases_live"] == 0
    # ... and if it comes after all, its load is refused: a miss, nothing written.
    failures = ranks[1].counters()["load_failures"]
    assert ranks[1].batch_get_v1(keys, f_idx[1]) == [False] * 3
    assert ranks[1].counters()["load_failures"] == failures + 1
    assert pages(dst[1], f_idx[1]) == [blank] * 3

    # Rank 0 never answers: rank 1 waits share_wait_ms, then misses.
    t0 = time.monotonic()
    assert ranks[1].batch_get_v1(keys, f_idx[1]) == [False] * 3
    assert 0.35 < time.monotonic() - t0 < 3
    assert ranks[1].counters()["share_failures"] == 1
    assert pages(dst[1], f_idx[1]) == [blank] * 3

    # Afterwards the ranks load together again; nothing is left on the node.
    out = {}
    t = threading.Thread(target=get, args=(1, f_idx[1], out))
    t.start()
    get(0, f_idx[0], out)
    t.join(5)
    assert out == {0: [True] * 3, 1: [True] * 3}
    assert [pages(dst[r], f_idx[r]) for r in range(2)] == want
    stats = client.stats()
    assert stats["leases_live"] == 0 and stats["transfers_in_flight"] == 0
    assert node.proc.poll() is None


def test_a_batch_whose_store_slot_another_batch_took_misses_never_takes_its_lease():
    """The store holds one key per slot: where two batches' digests share one, a rank past
    0 waiting for the first sees only the second's answer, and misses."""
    from kvferry.sglang.share import StoreExchange, digest_of

    store = torch.distributed.HashStore()
    rank0 = StoreExchange(store, "kvferry/x", wait_s=0.2, slots=1)
    rank1 = StoreExchange(store, "kvferry/x", wait_s=0.2, slots=1)
    x, y = digest_of([b"x" * 32]), digest_of([b"y" * 32])
    assert rank0.exchange(x, ("lease-x", 2)) == ("lease-x", 2)
    assert rank0.exchange(y, ("lease-y", 3)) == ("lease-y", 3)
    with pytest.raises(TimeoutError):
        rank1.exchange(x, None)
    assert rank1.exchange(y, None) == ("lease-y", 3)
    # Taken already: the rank waits for rank 0's next answer for the batch.
    with pytest.raises(TimeoutError):
        rank1.exchange(y, None)
    rank0.exchange(y, (None, 0))  # rank 0 missed this time: so does rank 1, at once
    assert rank1.exchange(y, None) == (None, 0)


def test_a_timed_out_load_ends_its_lease_not_its_transfer(tmp_path):
    """What a timed-out batch_get_v1 leaves on the node. The pages live on node B; A leases
    them (B pins them) and B stalls (SIGSTOP) before A's load reads them. The backend gives
    up at load_timeout_ms and releases the lease: A's lease gauge is back to zero at once.
    The node has no call that ends a running load, so its transfer runs on: to B's answer
    (the bytes then land in pages SGLang has been told are misses), or until the node's
    completion timeout (5 s) fails it while B stays stopped. Either way every gauge is back
    to zero afterwards and the next load is byte-exact."""
    import signal

    from nodeproc import cluster_node

    ports = {"na": free_port(), "nb": free_port()}
    nb = cluster_node(tmp_path, "nb", ports, pool="32MiB", slot="64KiB")
    na = cluster_node(tmp_path, "na", ports, pool="32MiB", slot="64KiB")
    try:
        # Two prompts' pages (a load of B's pages leaves a copy in A's RAM).
        keys, keys2 = (get_hash_str(tokens(3, salt=k), page_size=PS) for k in (9, 10))
        src = host_pool("mha", "layer_first")
        owner = storage(nb.addr, src, instance="owner")
        s_idx, s_idx2 = src.alloc(3 * PS), src.alloc(3 * PS)
        fill(src, s_idx, seed=30)
        fill(src, s_idx2, seed=31)
        assert owner.batch_set_v1(keys, s_idx) == [True] * 3
        assert owner.batch_set_v1(keys2, s_idx2) == [True] * 3
        want, want2 = pages(src, s_idx), pages(src, s_idx2)

        dst = host_pool("mha", "layer_first")
        s = storage(na.addr, dst, instance="eng", load_timeout_ms=500, retry_ms=50)
        canary(dst)
        blank = bytes([CANARY]) * len(want[0])
        client = kvferry.EngineClient(na.addr)
        real_load = s.side.rank.load

        def load_after_pausing_b(lease, dest):
            nb.pause()  # A holds the lease (B pinned the pages); B stops answering
            return real_load(lease, dest)

        def settle(want_zero=("leases_live", "transfers_in_flight"), within=15.0):
            end = time.monotonic() + within
            while True:
                st = client.stats()
                if all(st[k] == 0 for k in want_zero) or time.monotonic() > end:
                    return st
                time.sleep(0.05)

        # 1. B answers after A gave up: the transfer lands, later.
        s.side.rank.load = load_after_pausing_b
        idx = dst.alloc(3 * PS)
        t0 = time.monotonic()
        assert s.batch_get_v1(keys, idx) == [False] * 3
        assert time.monotonic() - t0 < 3
        st = client.stats()
        assert st["leases_live"] == 0, "the timed-out load's lease is released"
        assert st["transfers_in_flight"] == 1, "...but its transfer still runs"
        assert pages(dst, idx) == [blank] * 3
        nb.stop_signal(signal.SIGCONT)
        st = settle()
        assert st["leases_live"] == 0 and st["transfers_in_flight"] == 0, st
        assert pages(dst, idx) == want, "the transfer landed after the client gave up"

        # 2. B stays stopped: the node's completion timeout ends the transfer, unwritten.
        canary(dst)
        t0 = time.monotonic()
        assert s.batch_get_v1(keys2, idx) == [False] * 3
        assert time.monotonic() - t0 < 3
        assert client.stats()["leases_live"] == 0
        st = settle(within=20.0)
        assert st["leases_live"] == 0 and st["transfers_in_flight"] == 0, st
        assert pages(dst, idx) == [blank] * 3
        nb.stop_signal(signal.SIGCONT)

        # The next load (B answering) is byte-exact and leaves nothing behind.
        s.side.rank.load = real_load
        end = time.monotonic() + 15
        while (got := s.batch_get_v1(keys2, idx)) != [True] * 3:
            assert time.monotonic() < end, f"no load after B resumed: {got}"
            time.sleep(0.2)
        assert pages(dst, idx) == want2
        st = settle()
        assert st["leases_live"] == 0 and st["transfers_in_flight"] == 0, st
    finally:
        nb.stop_signal(signal.SIGCONT)
        na.kill()
        nb.kill()


def test_a_node_down_costs_hits_never_an_exception(caplog):
    caplog.set_level(logging.WARNING, logger="kvferry.sglang")
    pool = host_pool("mha", "layer_first")
    t0 = time.monotonic()
    s = storage(f"127.0.0.1:{free_port()}", pool, instance="engine-down",
                deadline_ms=300, connect_timeout_ms=300)
    keys = get_hash_str(tokens(3), page_size=PS)
    idx = pool.alloc(3 * PS)
    assert s.batch_exists(keys) == 0
    got = s.batch_get_v1(keys, idx)
    assert got == [False] * 3 and isinstance(got, list)
    assert s.batch_set_v1(keys, idx) == [False] * 3
    assert time.monotonic() - t0 < 10
    assert s.counters()["node_failures"] >= 1
    assert any("127.0.0.1" in r.getMessage() for r in caplog.records)


def test_a_restarted_node_is_registered_with_again(tmp_path):
    n = Node(tmp_path, pool="32MiB", slot="64KiB")
    try:
        pool = host_pool("mha", "layer_first")
        s = storage(n.addr, pool, instance="engine-r", deadline_ms=500)
        keys = get_hash_str(tokens(2), page_size=PS)
        idx = pool.alloc(2 * PS)
        fill(pool, idx, seed=6)
        assert s.batch_set_v1(keys, idx) == [True, True]
        n.kill()
        assert s.batch_exists(keys) == 0
        assert s.batch_get_v1(keys, pool.alloc(2 * PS)) == [False, False]
        n.start()
        time.sleep(1.0)  # past the link's back-off
        assert s.batch_exists(keys) == 0  # the restarted node holds nothing
        end = time.monotonic() + 10
        while s.batch_set_v1(keys, idx) != [True, True]:
            assert time.monotonic() < end, "saving to the restarted node never worked"
            time.sleep(0.2)
        assert s.batch_exists(keys) == 2
        dst = pool.alloc(2 * PS)
        assert s.batch_get_v1(keys, dst) == [True, True]
        assert pages(pool, dst) == pages(pool, idx)
        assert s.counters()["registrations"] >= 2
    finally:
        n.kill()


def test_a_layout_kvferry_cannot_describe_is_refused_naming_it(node):
    pool = host_pool("mha", "layer_first")
    pool.layout = "page_first_kv_split"  # Ascend's split layout
    with pytest.raises(LayoutError, match="page_first_kv_split"):
        storage(node.addr, pool, instance="engine-bad")


def test_settings_are_checked_at_start(node):
    pool = host_pool("mha", "layer_first")
    with pytest.raises(ConfigError, match="adress"):
        storage(node.addr, pool, instance="engine-c", adress="x")
    with pytest.raises(ConfigError, match="interface_v1"):
        storage(node.addr, pool, instance="engine-c", interface_v1=0)


def test_the_host_pool_keeps_its_addresses_and_contents(node):
    """Registering puts a memfd under the pool: SGLang's tensors and pointers stay valid and
    what the pool held is still there."""
    pool = host_pool("mha", "layer_first")
    idx = pool.alloc(2 * PS)
    fill(pool, idx, seed=7)
    before, ptr = pages(pool, idx), pool.kv_buffer.data_ptr()
    k_ptrs = pool.k_data_ptrs.tolist()
    storage(node.addr, pool, instance="engine-keep")
    assert pool.kv_buffer.data_ptr() == ptr and pool.k_data_ptrs.tolist() == k_ptrs
    assert pages(pool, idx) == before
    # Writes through SGLang's views reach the memory the node maps.
    pool.kv_buffer.view(torch.uint8)[0, 0, 0].fill_(1)
    assert pool.kv_buffer.view(torch.uint8)[0, 0, 0].eq(1).all()


def test_a_host_pool_the_node_cannot_map_is_refused_at_start(node):
    pool = host_pool("mha", "layer_first")
    # Memory from the allocator (private), not SGLang's shared mmap.
    pool.kv_buffer = torch.zeros(pool.kv_buffer.shape, dtype=pool.kv_buffer.dtype)
    with pytest.raises(LayoutError, match="page boundary|shared anonymous"):
        storage(node.addr, pool, instance="engine-private")
    import mmap

    from kvferry import memfd

    m = mmap.mmap(-1, 1 << 16, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.uint8)
    with pytest.raises(memfd.AdoptError, match="not as shared anonymous"):
        memfd.adopt(t.data_ptr(), t.numel(), t)
    with pytest.raises(memfd.AdoptError, match="page boundary"):
        memfd.adopt(t.data_ptr() + 8, 64, t)


def test_storage_metrics_are_what_sglangs_collector_takes(node):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = host_pool("mha", "layer_first")
    s = storage(node.addr, pool, instance="engine-metrics", metrics=True)
    keys = get_hash_str(tokens(3), page_size=PS)
    idx = pool.alloc(3 * PS)
    assert s.batch_set_v1(keys, idx) == [True] * 3
    assert s.batch_get_v1(keys, pool.alloc(3 * PS)) == [True] * 3
    m = s.get_stats()
    assert isinstance(m, StorageMetrics)  # SGLang's collector asserts exactly this
    assert m.prefetch_pgs == [3] and m.backup_pgs == [3]
    assert len(m.prefetch_bandwidth) == 1 and m.prefetch_bandwidth[0] > 0
    assert s.get_stats().prefetch_pgs == []  # since the last call
    # Without storage metrics SGLang never asks; None is what it would take.
    plain = storage(node.addr, host_pool("mha", "layer_first"), instance="engine-nm")
    assert plain.get_stats() is None
