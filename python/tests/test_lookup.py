"""EngineClient.lookup against a real node: the longest prefix per node, and its bound."""

from __future__ import annotations

import pytest

import kvferry
from kvpattern import HostKv, block_hash, rank_block


def test_lookup_answers_the_prefix_this_node_holds(client, node):
    kv = HostKv.allocate("flash_attn", layers=3)
    ns = kv.register(client, "py-lookup", model="lookup-model")
    client.put_blocks("py-lookup", 0, [
        (block_hash(b), rank_block(b, 0, kv.layers, kv.segments, kv.seg_bytes))
        for b in range(1000, 1005)
    ])
    hashes = [block_hash(b) for b in range(1000, 1010)]
    assert client.lookup(ns, hashes) == [("py-node", 5)]
    # A prefix it does not hold: no node answers; the lookup leased nothing.
    assert client.lookup(ns, [block_hash(1)] + hashes) == []
    assert client.lookup(ns, []) == []
    assert client.stats()["leases_live"] == 0


def test_a_lookup_over_the_limit_is_refused_naming_it(client):
    limit = client.capabilities()["max_lookup_hashes"]
    assert limit == 65536
    # The advertised limit is the one enforced: at it, answered; one more, refused.
    assert client.lookup("m/bf16/f", [block_hash(i) for i in range(limit)]) == []
    with pytest.raises(kvferry.ResourceExhausted) as e:
        client.lookup("m/bf16/f", [block_hash(i) for i in range(limit + 1)])
    assert "65536" in str(e.value) and "max_lookup_hashes" in str(e.value)
    with pytest.raises(kvferry.ResourceExhausted):
        client.lookup("m/bf16/f", [block_hash(i) for i in range(100_000)])
    with pytest.raises(kvferry.InvalidArgument) as e:
        client.lookup("not-a-namespace", [block_hash(1)])
    assert "namespace" in str(e.value)
    assert client.health() is True
