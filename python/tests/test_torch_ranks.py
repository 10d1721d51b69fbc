"""Torch KV in every engine layout, TP 1 and TP 2 ranks in one process, saved and loaded
through a node byte for byte.

On CPU the tensors are memfd-backed (``kvferry.torch.memfd_empty``) and the node's device is
the host; with ``--device cuda`` (or ``KVFERRY_TEST_DEVICE=cuda``) they are CUDA tensors, one
allocation per layer, registered by CUDA IPC handle with a node on CUDA device 0 — that half
needs a CUDA GPU and runs on the GPU machine (see the README's GPU section).

Each case: random bytes in the source blocks of every rank, saved (a block is complete once
every rank saved it), one query, each rank loads its share of the one lease into scattered
destination blocks; then every byte of every tensor equals the snapshot taken before the
load with the destinations replaced by their sources (the canary everywhere else).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="the torch helpers need PyTorch")

import kvferry  # noqa: E402
import kvferry.torch as kt  # noqa: E402
from conftest import NodeProc  # noqa: E402

DEVICE = os.environ.get("KVFERRY_TEST_DEVICE", "cpu")
CANARY = 0xA5

# layout -> (dim of the block index, tensor shape for `layers`, `blocks`)
SHAPES = {
    "flash_attn": (1, lambda L, n: (2, n, 4, 2, 32)),
    "flashinfer": (0, lambda L, n: (n, 2, 4, 2, 32)),
    "mla": (0, lambda L, n: (n, 4, 64)),
    "cross_layer": (0, lambda L, n: (n, L, 2, 4, 2, 32)),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": getattr(torch, "float8_e4m3fn", None)}


@pytest.fixture(scope="module")
def device_node(tmp_path_factory):
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("KVFERRY_TEST_DEVICE=cuda needs a CUDA GPU (run on the GPU machine)")
    n = NodeProc(tmp_path_factory.mktemp("torch-node"), name="torch-node",
                 device="cuda" if DEVICE == "cuda" else "host")
    yield n
    n.stop()


def alloc(shape, dtype):
    if DEVICE == "cuda":
        # One allocation per tensor, as the caching allocator gives a large tensor its own.
        return torch.empty(shape, dtype=dtype, device="cuda:0")
    return kt.memfd_empty(shape, dtype)


def as_bytes(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp32"])
@pytest.mark.parametrize("layout", list(SHAPES))
def test_ranks_save_and_load_every_layout(device_node, layout, dtype, tp):
    if DTYPES[dtype] is None:
        pytest.skip("this torch has no float8_e4m3fn")
    c = kvferry.EngineClient(device_node.addr, deadline_s=20.0)
    layers, nb = 3, 24
    dim, shape_of = SHAPES[layout]
    instance = f"t-{layout}-{dtype}-{tp}"
    ranks = []
    for rank in range(tp):
        if layout == "cross_layer":
            tensors = alloc(shape_of(layers, nb), DTYPES[dtype])
            planes = [tensors]
        else:
            planes = [alloc(shape_of(layers, nb), DTYPES[dtype]) for _ in range(layers)]
            tensors = planes
        for p in planes:
            as_bytes(p).fill_(CANARY)
        kt.register_kv(c, instance, f"m-{layout}", tensors, layout, rank=rank, tp_size=tp,
                       device=0, dtype_name=dtype)
        ranks.append(planes)
    with c.open_session([instance]):
        src, dst = [0, 1, 2, 3], [17, 5, 22, 9]
        gen = torch.Generator(device=ranks[0][0].device).manual_seed(7)
        for planes in ranks:
            for p in planes:
                b = as_bytes(p).narrow(dim, 0, len(src))
                b.copy_(torch.randint(0, 255, b.shape, dtype=torch.uint8, device=b.device,
                                      generator=gen))
        hashes = [f"{instance}-{i}".encode() for i in src]
        for rank in range(tp):
            saved = c.save(instance, rank, hashes, src)
            assert saved["written"] == len(src), saved
        snap = [[as_bytes(p).clone() for p in planes] for planes in ranks]
        q = c.query(instance, hashes)
        assert q["local_blocks"] == len(src), q
        loads = [c.load(q["lease"], instance, rank, dst) for rank in range(tp)]
        for rank, lid in enumerate(loads):
            done = c.wait_load(lid, 20.0)
            assert done["ok"], done
            assert done["blocks"] == len(src)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        s_idx = torch.tensor(src, device=snap[0][0].device)
        d_idx = torch.tensor(dst, device=snap[0][0].device)
        for rank, planes in enumerate(ranks):
            for n, p in enumerate(planes):
                want = snap[rank][n].index_copy(dim, d_idx, snap[rank][n].index_select(dim, s_idx))
                got = as_bytes(p)
                if not torch.equal(got, want):
                    bad = (got != want).nonzero()[0].tolist()
                    pytest.fail(f"rank {rank} tensor {n}: byte at {bad} differs from the expected")
