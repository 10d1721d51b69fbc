"""kvferry.torch: memfd-backed CPU tensors, and torch KV in every layout registered and
loaded byte for byte. CUDA tensors (by IPC handle, against a node on CUDA) where a GPU is."""

from __future__ import annotations

import gc
import os

import pytest

torch = pytest.importorskip("torch", reason="kvferry.torch needs PyTorch in this Python")

import kvferry  # noqa: E402
import kvferry.torch as kt  # noqa: E402
from kvferry import memfd  # noqa: E402
from kvpattern import HostKv, block_hash, layout_shape, rank_block, scattered  # noqa: E402
from test_client import settle  # noqa: E402

DTYPES = {
    "fp8": getattr(torch, "float8_e4m3fn", torch.uint8),
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


def test_memfd_empty_is_a_memfd_tensor():
    t = kt.memfd_empty((3, 5, 64), torch.bfloat16, name="t")
    assert (t.shape, t.dtype, t.device.type) == ((3, 5, 64), torch.bfloat16, "cpu")
    assert t.is_contiguous()
    assert bool((t == 0).all())
    buf, offset = memfd.lookup(t.data_ptr(), t.numel() * t.element_size())
    assert offset == 0 and buf.length >= 3 * 5 * 64 * 2
    fd = buf.fd
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvferry-t")
    # A view keeps the memory; when every view is gone, the fd is closed.
    view = t[1]
    del t, buf
    gc.collect()
    assert memfd.lookup(view.data_ptr(), 64) is not None
    del view
    gc.collect()
    assert not os.path.exists(f"/proc/self/fd/{fd}") or not os.readlink(
        f"/proc/self/fd/{fd}").startswith("/memfd:kvferry-t")
    with pytest.raises(ValueError):
        kt.memfd_empty((0, 4), torch.float16)


def alloc_layout(layout, dtype, layers=3, num_blocks=12):
    shape = layout_shape(layout, layers, num_blocks, 2, 2, 32)
    if layout == "cross_layer":
        return kt.memfd_empty(shape, dtype)
    return [kt.memfd_empty(shape, dtype, name=f"layer{i}") for i in range(layers)]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "mla", "cross_layer"])
def test_torch_layouts_load_byte_for_byte(client, layout, dtype):
    before = client.stats()
    tensors = alloc_layout(layout, DTYPES[dtype])
    kv = HostKv.of(tensors, layout)
    instance = f"py-torch-{layout}-{dtype}"
    with client.open_session() as session:
        ns, desc = kt.register_kv(client, instance, instance, tensors, layout)
        session.bind(instance)
        assert ns.startswith(f"{instance}/")
        assert desc.segment_bytes == kv.seg_bytes
        blocks = [4, 8, 15, 16]
        client.put_blocks(instance, 0, [
            (block_hash(b), rank_block(b, 0, kv.layers, kv.segments, kv.seg_bytes))
            for b in blocks
        ])
        q = client.query(instance, [block_hash(b) for b in blocks])
        dests = scattered(len(blocks), kv.num_blocks)
        done = client.wait_load(client.load(q["lease"], instance, 0, dests), 10)
        assert done["ok"], done
        kv.verify(zip(dests, blocks))
    settle(client, before)


def test_torch_tensors_that_do_not_fit_are_refused(client):
    before = client.stats()
    shape = (2, 8, 4, 2, 16)
    good = kt.memfd_empty(shape, torch.float16)
    with pytest.raises(kvferry.LayoutError, match="layer 1: a CPU tensor must live in a memfd"):
        kt.register_kv(client, "py-refused", "m", [good, torch.zeros(shape, dtype=torch.float16)],
                       "flash_attn")
    strided = kt.memfd_empty((2, 8, 4, 16, 2), torch.float16).transpose(3, 4)
    with pytest.raises(kvferry.LayoutError, match="layer 2: .*not contiguous"):
        kt.register_kv(client, "py-refused", "m", [good, kt.memfd_empty(shape, torch.float16),
                                                   strided], "flash_attn")
    with pytest.raises(kvferry.LayoutError, match="layer 1: device meta"):
        kt.describe_layout([good, torch.empty(shape, dtype=torch.float16, device="meta")],
                           "flash_attn")
    with pytest.raises(kvferry.LayoutError, match="layer 1: dtype"):
        kt.describe_layout([good, kt.memfd_empty(shape, torch.bfloat16)], "flash_attn")
    after = client.stats()
    assert (after["instances"], after["memory_handles"]) == (
        before["instances"], before["memory_handles"])


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA tensors need a CUDA GPU (the GPU machine)"
)


@pytest.fixture(scope="module")
def cuda_node(tmp_path_factory):
    from conftest import NodeProc

    n = NodeProc(tmp_path_factory.mktemp("cuda-node"), name="py-cuda", device="cuda")
    yield n
    n.stop()


@needs_cuda
@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "mla", "cross_layer"])
def test_cuda_layouts_by_ipc_handle(cuda_node, layout):
    """One CUDA allocation per layer (as vLLM allocates), registered by IPC handle."""
    client = kvferry.EngineClient(cuda_node.addr, deadline_s=30)
    layers, num_blocks = 3, 12
    shape = layout_shape(layout, layers, num_blocks, 2, 2, 32)
    canary = 0xA5
    if layout == "cross_layer":
        tensors = torch.full(shape, canary, dtype=torch.uint8, device="cuda")
    else:
        tensors = [torch.full(shape, canary, dtype=torch.uint8, device="cuda")
                   for _ in range(layers)]
    desc = kt.describe_layout(tensors, layout)
    instance = f"py-cuda-{layout}"
    with client.open_session() as session:
        kt.register_kv(client, instance, instance, tensors, layout)
        session.bind(instance)
        blocks = [1, 2, 3]
        seg = desc.segment_bytes
        client.put_blocks(instance, 0, [
            (block_hash(b), rank_block(b, 0, layers, desc.segments, seg)) for b in blocks
        ])
        q = client.query(instance, [block_hash(b) for b in blocks])
        dests = [11, 0, 6]
        done = client.wait_load(client.load(q["lease"], instance, 0, dests), 30)
        assert done["ok"], done
        torch.cuda.synchronize()
        # Expected bytes of every distinct tensor: canary, with the pattern at each plane.
        distinct = desc.tensors
        images = {id(t): bytearray([canary]) * (t.numel() * t.element_size()) for t in distinct}
        from kvpattern import segment_pattern

        for dest, block in zip(dests, blocks):
            for l, p in enumerate(desc.layers):
                planes = [(p.k, p.k_offset)] + ([(p.v, p.v_offset)] if p.v is not None else [])
                for s, (t, off) in enumerate(planes):
                    at = off + dest * desc.block_stride
                    images[id(t)][at: at + seg] = segment_pattern(seg, block, 0, l, s)
        for t in distinct:
            got = bytes(t.view(torch.uint8).flatten().cpu().numpy().tobytes())
            assert got == bytes(images[id(t)]), f"{layout}: bytes differ"
