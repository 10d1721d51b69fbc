"""kvferry.vllm.events without vLLM: node batches in both layouts, only this engine's blocks
reported, with vLLM's view of them, and a bounded memory of saved blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

msgspec = pytest.importorskip("msgspec")

from kvferry.vllm.events import BlockInfo, EngineEvents, block_infos, decode_node_batch  # noqa: E402


def batch(events, layout="map"):
    out = []
    for kind, medium, hashes in events:
        if layout == "map" and kind == "AllBlocksCleared":
            e = {"type": kind}
        elif layout == "map":
            e = {"type": kind, "block_hashes": hashes, "medium": medium}
            if kind == "BlockStored":
                e.update(parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                         lora_name=None)
        elif kind == "AllBlocksCleared":
            e = [kind]
        elif kind == "BlockStored":
            e = [kind, hashes, None, [], 0, None, medium, None]
        else:
            e = [kind, hashes, medium]
        out.append(e)
    return msgspec.msgpack.encode([1.0, out])


class Stream:
    def __init__(self):
        self.queue = []

    def poll(self):
        out, self.queue = self.queue, []
        return out


def book(max_tracked=100):
    s = Stream()
    made = lambda kind: (lambda **kw: (kind, kw))  # noqa: E731
    return s, EngineEvents(s, msgspec.msgpack.decode, made("stored"), made("removed"),
                           max_tracked=max_tracked)


def info(i):
    return BlockInfo(block_hash=1000 + i, parent_block_hash=(999 + i) if i else None,
                     token_ids=tuple(range(i * 4, i * 4 + 4)), block_size=4, lora_id=None,
                     lora_name=None)


@pytest.mark.parametrize("layout", ["map", "array"])
def test_both_layouts_decode(layout):
    got = decode_node_batch(batch([("BlockStored", "DISK", [b"a", b"b"]),
                                   ("BlockRemoved", "CPU", [b"c"])], layout),
                            msgspec.msgpack.decode)
    assert got == [("BlockStored", "DISK", [b"a", b"b"]), ("BlockRemoved", "CPU", [b"c"])]


def test_only_this_engines_blocks_with_vllms_view():
    s, b = book()
    b.saving(b"k0", info(0))
    b.saving(b"k1", info(1))
    s.queue.append(batch([("BlockStored", "CPU", [b"k0", b"other", b"k1"])]))
    s.queue.append(batch([("BlockRemoved", "CPU", [b"k1", b"other"])]))
    out = b.take()
    assert [k for k, _ in out] == ["stored", "stored", "removed"]
    assert out[0][1] == dict(block_hashes=[1000], parent_block_hash=None,
                             token_ids=[0, 1, 2, 3], block_size=4, lora_id=None,
                             medium="CPU", lora_name=None)
    assert out[1][1]["parent_block_hash"] == 1000
    assert out[2][1] == dict(block_hashes=[1001], medium="CPU")
    assert b.skipped == 2
    assert b.take() == []
    # A message that is not msgpack is skipped, not raised.
    s.queue.append(b"\xc1garbage")
    assert b.take() == []


def test_memory_of_saved_blocks_is_bounded():
    s, b = book(max_tracked=2)
    for i in range(3):
        b.saving(b"k%d" % i, info(i))
    s.queue.append(batch([("BlockRemoved", "CPU", [b"k0", b"k1", b"k2"])]))
    (removed,) = b.take()
    assert removed[1]["block_hashes"] == [1001, 1002], "the oldest was let go"


def test_block_infos_follow_vllms_hashes_tokens_and_lora():
    req = SimpleNamespace(block_hashes=[b"h0", b"h1"], all_token_ids=list(range(10)),
                          lora_request=SimpleNamespace(adapter_id=7, lora_name="ad"))
    got = block_infos(req, [1, 2], 4, lambda h: h.decode())
    assert list(got) == [1], "block 2 is not hashed by vLLM yet"
    assert got[1] == BlockInfo("h1", "h0", (4, 5, 6, 7), 4, 7, "ad")


@pytest.mark.parametrize("layout", ["map", "array"])
def test_a_node_restart_removes_this_engines_blocks_from_both_tiers(layout):
    s, b = book()
    b.saving(b"k0", info(0))
    b.saving(b"k1", info(1))
    s.queue.append(batch([("BlockStored", "CPU", [b"k0", b"k1"]),
                          ("BlockStored", "DISK", [b"k1"])], layout))
    assert [k for k, _ in b.take()] == ["stored"] * 3
    assert decode_node_batch(batch([("AllBlocksCleared", None, None)], layout),
                             msgspec.msgpack.decode) == [("AllBlocksCleared", "", [])]
    s.queue.append(batch([("AllBlocksCleared", None, None)], layout))
    # What the restarted node's disk still holds is stored again after the clear.
    s.queue.append(batch([("BlockStored", "DISK", [b"k1"])], layout))
    out = b.take()
    assert out[0] == ("removed", dict(block_hashes=[1000, 1001], medium="CPU"))
    assert out[1] == ("removed", dict(block_hashes=[1001], medium="DISK"))
    assert [k for k, _ in out[2:]] == ["stored"]
    assert out[2][1]["block_hashes"] == [1001] and out[2][1]["medium"] == "DISK"
    # Nothing saved yet: a clear reports nothing.
    _, empty = book()
    empty._stream.queue.append(batch([("AllBlocksCleared", None, None)], layout))
    assert empty.take() == []


@pytest.mark.parametrize("layout", ["map", "array"])
def test_a_clear_does_not_take_back_blocks_saved_before_it_was_sent(layout):
    # A node publishes its start's clear after a grace period: an engine may save to it
    # before then, and the clear reaches the stream before those blocks' BlockStored. Such a
    # block was never reported, so the clear must not report it removed (the suite once saw
    # exactly that on a loaded machine).
    s, b = book()
    b.saving(b"k0", info(0))
    s.queue.append(batch([("AllBlocksCleared", None, None)], layout))
    s.queue.append(batch([("BlockStored", "CPU", [b"k0"])], layout))
    out = b.take()
    assert [k for k, _ in out] == ["stored"]
    # A block reported removed is not taken back a second time by a later clear.
    s.queue.append(batch([("BlockRemoved", "CPU", [b"k0"])], layout))
    s.queue.append(batch([("AllBlocksCleared", None, None)], layout))
    assert b.take() == [("removed", dict(block_hashes=[1000], medium="CPU"))]
