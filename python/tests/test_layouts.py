"""The KV layouts engines allocate, registered from memfd-backed arrays and loaded byte for
byte; tensors that do not fit are refused naming the layer, with nothing registered."""

from __future__ import annotations

import numpy as np
import pytest

import kvferry
from kvferry import memfd
from kvferry.layout import describe_layout
from kvpattern import GUARD, HostKv, block_hash, rank_block, scattered

from test_client import settle


class CountingClient:
    """Forwards to a client, counting the memfds sent."""

    def __init__(self, inner):
        self.inner = inner
        self.memfds = 0

    def send_memfd(self, *a):
        self.memfds += 1
        return self.inner.send_memfd(*a)

    def register(self, *a, **kw):
        return self.inner.register(*a, **kw)


# cross_layer is one tensor: one memfd either way.
LAYOUT_CASES = [
    pytest.param(layout, one, id=f"{layout}-{'one-memfd' if one else 'memfd-per-tensor'}")
    for layout in ["flash_attn", "flashinfer", "mla", "cross_layer"]
    for one in ([False] if layout == "cross_layer" else [False, True])
]


@pytest.mark.parametrize("itemsize", [1, 2, 4], ids=["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("layout,one_memfd", LAYOUT_CASES)
def test_layout_loads_byte_for_byte(client, layout, itemsize, one_memfd):
    before = client.stats()
    instance = f"py-{layout}-{itemsize}-{int(one_memfd)}"
    kv = HostKv.allocate(layout, layers=3, num_blocks=12, block_size=2, heads=2,
                         head_dim=32, itemsize=itemsize, one_memfd=one_memfd)
    seg = 2 * 32 * itemsize * (1 if layout == "mla" else 2)
    assert kv.seg_bytes == seg
    expect_stride = {"flash_attn": seg, "flashinfer": 2 * seg, "mla": seg,
                     "cross_layer": 3 * 2 * seg}[layout]
    assert kv.layout.block_stride == expect_stride
    counting = CountingClient(client)
    with client.open_session() as session:
        # A model of its own: blocks of other parametrisations do not hit.
        kv.register(counting, instance, model=instance)
        session.bind(instance)
        # One memfd sent per memfd, whatever the number of tensors in it.
        assert counting.memfds == len(kv.buffers)
        blocks = [7, 3, 11, 20, 5]
        client.put_blocks(instance, 0, [
            (block_hash(b), rank_block(b, 0, kv.layers, kv.segments, kv.seg_bytes))
            for b in blocks
        ])
        q = client.query(instance, [block_hash(b) for b in blocks])
        assert q["local_blocks"] == len(blocks)
        dests = scattered(len(blocks), kv.num_blocks)
        done = client.wait_load(client.load(q["lease"], instance, 0, dests), 10)
        assert done["ok"], done
        kv.verify(zip(dests, blocks))
        # And back: save what the engine computed into other blocks, load it elsewhere.
        kv.reset()
        kv.write_block(0, 500)
        kv.write_block(1, 501)
        saved = client.save(instance, 0, [block_hash(500), block_hash(501)], [0, 1])
        assert saved["written"] == 2
        q = client.query(instance, [block_hash(500), block_hash(501)])
        done = client.wait_load(client.load(q["lease"], instance, 0, [10, 6]), 10)
        assert done["ok"], done
        kv.verify([(0, 500), (1, 501), (10, 500), (6, 501)])
    settle(client, before)


def memfd_array(shape, dtype=np.float16, offset=GUARD):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = memfd.allocate(offset + n + GUARD)
    return np.frombuffer(buf.mmap, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)


FA = (2, 8, 4, 2, 16)


def refused(client, tensors, layout, match):
    """describe + register must raise LayoutError matching ``match``; nothing registered."""
    before = client.stats()
    with pytest.raises(kvferry.LayoutError, match=match) as e:
        kvferry.register_kv(client, "py-refused", "m", tensors, layout)
    assert isinstance(e.value, kvferry.InvalidArgument) and isinstance(e.value, ValueError)
    after = client.stats()
    assert after["instances"] == before["instances"]
    assert after["memory_handles"] == before["memory_handles"]
    return e.value


def test_non_contiguous_is_refused(client):
    good = memfd_array(FA)
    strided = memfd_array((2, 8, 4, 16, 2)).transpose(0, 1, 2, 4, 3)
    err = refused(client, [good, strided], "flash_attn", "layer 1: .*not contiguous")
    assert err.layer == 1


def test_mismatched_shapes_dtypes_are_refused(client):
    refused(client, [memfd_array(FA), memfd_array(FA), memfd_array((2, 9, 4, 2, 16))],
            "flash_attn", "layer 2: shape")
    refused(client, [memfd_array(FA), memfd_array(FA, dtype=np.float32)], "flash_attn",
            "layer 1: dtype")


def test_overlapping_tensors_are_refused(client):
    buf = memfd.allocate(1 << 20)
    n = int(np.prod(FA))
    a = np.frombuffer(buf.mmap, dtype=np.float16, count=n, offset=0).reshape(FA)
    b = np.frombuffer(buf.mmap, dtype=np.float16, count=n, offset=2048).reshape(FA)
    refused(client, [a, b], "flash_attn", "layer 1: .*overlaps layer 0")


def test_wrong_shapes_for_the_layout_are_refused(client):
    refused(client, [memfd_array((3, 8, 4, 2, 16))], "flash_attn", "layer 0: shape")
    refused(client, [memfd_array((8, 3, 4, 2, 16))], "flashinfer", "layer 0: shape")
    refused(client, [memfd_array((8,))], "mla", "layer 0: shape")
    refused(client, memfd_array((8, 2, 3, 4, 2, 16)), "cross_layer", "shape")
    refused(client, [memfd_array(FA)], "page_first", "layout 'page_first'")


def test_segments_must_be_a_multiple_of_64_bytes(client):
    # 1 x 3 x 8 x 2 bytes = 48 per segment.
    refused(client, [memfd_array((2, 8, 1, 3, 8))], "flash_attn", "multiple of 64")


def test_plain_host_memory_is_refused_naming_the_layer(client):
    plain = np.zeros(FA, dtype=np.float16)
    refused(client, [memfd_array(FA), plain], "flash_attn", "layer 1: a CPU tensor must live in a memfd")


def test_planes_outside_their_tensor_are_refused(client):
    kv = describe_layout([memfd_array(FA)], "flash_attn")
    before = client.stats()
    with pytest.raises(kvferry.LayoutError, match="layer 0: the V plane"):
        kvferry.register_tensors(
            client, "py-refused", "m", "f16", rank=0, tp_size=1, device=0,
            **{**kv.register_kwargs(), "num_blocks": kv.num_blocks + 1},
        )
    assert client.stats()["memory_handles"] == before["memory_handles"]


def test_describe_layout_numbers():
    fa = describe_layout([memfd_array(FA)] * 1, "flash_attn")
    seg = 4 * 2 * 16 * 2
    assert (fa.segments, fa.segment_bytes, fa.block_stride, fa.num_blocks) == (2, seg, seg, 8)
    assert (fa.layers[0].k_offset, fa.layers[0].v_offset) == (0, 8 * seg)
    cl = describe_layout(memfd_array((8, 5, 2, 4, 2, 16)), "cross_layer")
    assert cl.kind == "cross_layer" and len(cl.layers) == 5
    assert cl.block_stride == 5 * 2 * seg
    assert [(p.k_offset, p.v_offset) for p in cl.layers][2] == (4 * seg, 5 * seg)
