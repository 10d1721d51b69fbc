"""One TP rank of the two-rank radix cache test (``test_sglang_radix.py`` starts two of
these, as SGLang starts one scheduler process per TP rank).

Each process is rank ``RANK`` of two engines (``tp-a``, which computes and saves, and
``tp-b``, which loads), joined to the other rank by a gloo process group, with the
broadcast and agreement the plugin builds over SGLang's TP group
(``kvferry.sglang.plugin._tp_helpers``). Both ranks make the same cache calls in the same
order, as the scheduler's ranks do. Every page is checked byte for byte against what this
rank's ``tp-a`` computed, every other slot against its canary. The last line of stdout is a
JSON object with the SHA-256 of the pages this rank loaded (the test checks that the two
ranks loaded different bytes: each its own heads).

Usage: ``sglang_tp_rank.py RANK INIT_FILE NODE_ADDR``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    rank, init, addr = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    import kvferry
    from kvferry.sglang import plugin
    from test_sglang_radix import CANARY, PS, SIZE, Engine, prompt

    broadcast, agree = plugin._tp_helpers(dist.group.WORLD, 2)
    kw = dict(tp_rank=rank, tp_size=2, broadcast=broadcast, agree=agree)
    a, b = Engine(addr, "tp-a", **kw), Engine(addr, "tp-b", **kw)
    client = kvferry.EngineClient(addr)

    def check(req, a_slots, pages):
        got = b.prefix(req)
        assert len(got) == pages * PS, f"rank {rank}: prefix {len(got)}, want {pages * PS}"
        out = {}
        for i in range(pages):
            bp, ap = int(got[i * PS]) // PS, int(a_slots[i * PS]) // PS
            assert b.page(bp) == a.page(ap), f"rank {rank}: page {i}"
            out[bp] = b.page(bp)
        return out

    # tp-a computes 3 pages on both ranks (each its own heads) and saves them.
    toks = prompt(3)
    ra = a.match("a1", toks)
    assert len(a.prefix(ra)) == 0
    a_slots = a.prefill(ra, seed=40 + rank)
    a.finish(ra)
    a.saves_ended()
    dist.barrier()  # every rank's heads saved: the node's blocks are whole

    b.canary()
    loaded = check(b.match("b1", toks), a_slots, 3)
    want = [bytes([CANARY]) * len(x) for x in b.page(0)]
    for p in range(SIZE // PS + 1):
        if p not in loaded:
            assert b.page(p) == want, f"rank {rank}: page {p} was written"
    # Rank 0 asked the node; rank 1 took its lease and asked nothing.
    assert b.conn.counters["queries"] == (1 if rank == 0 else 0), b.conn.counters
    assert b.conn.counters["loaded_blocks"] == 3
    digest = hashlib.sha256(b"".join(x for p in sorted(loaded) for x in loaded[p])).hexdigest()
    dist.barrier()
    if rank == 0:
        assert client.stats()["leases_live"] == 0

    # Rank 1's load lands 2 of 4 pages: both ranks insert the 2 (their trees stay the same)
    # and free the slots of the rest.
    toks2 = prompt(4, salt=5)
    ra2 = a.match("a2", toks2)
    a2_slots = a.prefill(ra2, seed=50 + rank)
    a.finish(ra2)
    a.saves_ended()
    dist.barrier()
    real_wait = b.conn.wait_load
    if rank == 1:
        b.conn.wait_load = lambda rid, timeout_s=None: min(real_wait(rid, timeout_s), 2 * PS)
    free = b.alloc.available_size()
    check(b.match("b2", toks2), a2_slots, 2)
    assert b.alloc.available_size() == free - 2 * PS, "slots of pages not inserted are freed"
    b.conn.wait_load = real_wait
    # The next match loads the other 2 on both ranks.
    check(b.match("b3", toks2), a2_slots, 4)
    dist.barrier()
    if rank == 0:
        stats = client.stats()
        assert stats["leases_live"] == 0 and stats["transfers_in_flight"] == 0, stats
    dist.barrier()
    print(json.dumps({"rank": rank, "pages": digest}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
