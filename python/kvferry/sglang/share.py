"""TP ranks of one engine share rank 0's lease: the one implementation, for the connector
(and the radix cache over it) and the HiCache storage backend.

An MHA model's TP ranks are the ranks of one node instance: a block is whole once every rank
saved its heads, and a query leases it for ``tp_size`` consumes. Rank 0 asks the node; the
other ranks take its answer ``(lease, blocks)`` instead of asking themselves; each rank loads
its share with its own load, and the last consume removes the lease. So the ranks load the
same blocks, pinned once, and the node answers one query instead of ``tp_size``. Only rank 0
releases (a lease its ranks will not load).

How rank 0's answer reaches the others depends on how SGLang makes the calls:

- :class:`BroadcastExchange`: the ranks make the same calls in the same order (the
  scheduler thread: ``match_prefix`` of the radix cache runs in lockstep on every rank), so
  the answer goes by a TP-group broadcast.
- :class:`StoreExchange`: the ranks do not (HiCache's prefetch I/O thread: a rank whose
  earlier batch failed, or whose request was cancelled between two batches, skips a
  ``batch_get_v1`` the others make; a collective there would hang them). Rank 0 writes its
  answer, under the digest of the batch's hashes, into the key-value store SGLang's ranks
  already share (torch.distributed's ``Store``); the other ranks wait for it, at most
  ``share_wait_ms``. A rank that waited in vain, or took a lease rank 0 has since released,
  misses (nothing is written where a load is refused). A lease can only name the blocks of
  its hashes, so whatever lease a rank takes under a digest lands the right bytes.
  Leases the other ranks may still load are released by rank 0 ``load_timeout_ms`` after
  its own load (the node removes a fully consumed lease itself; releasing it again is a
  harmless NOT_FOUND), so a rank that never comes keeps the blocks pinned that long, not
  for the node's lease TTL.

Nothing here imports SGLang or torch.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Deque, Optional, Sequence, Tuple

from .rank import RankKv

__all__ = ["BroadcastExchange", "LeaseShare", "StoreExchange"]

log = logging.getLogger("kvferry.sglang")

# (lease, blocks) as rank 0 answered it.
Answer = Tuple[Optional[str], int]


class BroadcastExchange:
    """Rank 0's answer to every rank through ``broadcast(obj) -> rank 0's obj`` (SGLang's TP
    group broadcast): for calls every rank makes in the same order."""

    #: Every rank calls for every query, even one with nothing to ask (the collective needs
    #: all of them).
    lockstep = True

    def __init__(self, broadcast: Callable[[Any], Any]):
        self._broadcast = broadcast

    def exchange(self, digest: bytes, answer: Optional[Answer]) -> Answer:
        lease, n = self._broadcast(answer if answer is not None else (None, 0))
        return lease, int(n)


class StoreExchange:
    """Rank 0's answer through ``store`` (a ``torch.distributed.Store``: ``set``, ``get``,
    ``check``), keyed by the digest of the hashes asked: for calls the ranks make in their
    own time. ``prefix`` names the instance; ``slots`` bounds the keys it ever writes (a
    digest's key is ``digest mod slots``: a batch whose slot another batch took since misses
    on the ranks past 0, it never takes the other batch's lease)."""

    lockstep = False

    def __init__(self, store: Any, prefix: str, *, wait_s: float, slots: int = 4096):
        self.store = store
        self.prefix = prefix
        self.wait_s = wait_s
        self.slots = slots
        self._nonce = 0
        # digest -> the nonce of rank 0's answer this rank last took (ranks past 0).
        self._taken: "OrderedDict[bytes, int]" = OrderedDict()

    def _key(self, digest: bytes) -> str:
        return f"{self.prefix}/{int.from_bytes(digest[:8], 'little') % self.slots}"

    def exchange(self, digest: bytes, answer: Optional[Answer]) -> Answer:
        key = self._key(digest)
        if answer is not None:  # rank 0
            self._nonce += 1
            lease, n = answer
            self.store.set(key, f"{digest.hex()}:{self._nonce}:{lease or ''}:{int(n)}")
            return answer
        end = time.monotonic() + self.wait_s
        while True:
            got = self._read(key, digest)
            if got is not None:
                nonce, lease, n = got
                self._taken[digest] = nonce
                self._taken.move_to_end(digest)
                while len(self._taken) > self.slots:
                    self._taken.popitem(last=False)
                return lease, n
            if time.monotonic() >= end:
                raise TimeoutError(f"rank 0's lease of this batch did not come in "
                                   f"{self.wait_s:.3f} s")
            time.sleep(0.001)

    def _read(self, key: str, digest: bytes) -> Optional[Tuple[int, Optional[str], int]]:
        """Rank 0's answer for ``digest`` under ``key`` that this rank has not taken yet."""
        # Keys are only ever overwritten, never deleted: get after check does not block.
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        text = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
        hexd, nonce_s, lease, n_s = text.split(":")
        if hexd != digest.hex():
            return None
        nonce = int(nonce_s)
        if self._taken.get(digest) == nonce:
            return None  # the one this rank loaded last time: rank 0 has not answered yet
        return nonce, lease or None, int(n_s)


class LeaseShare:
    """``rank``'s way to a lease: its own query where ``exchange`` is None (one rank, or KV
    every rank holds in full), else rank 0's, shared through ``exchange``."""

    def __init__(self, rank: RankKv, tp_rank: int, exchange: Optional[Any] = None):
        self.rank = rank
        self.tp_rank = tp_rank
        self.exchange = exchange
        # (when, lease) rank 0 releases once its other ranks had their time to load it.
        self._retired: Deque[Tuple[float, str]] = deque()

    @property
    def shared(self) -> bool:
        return self.exchange is not None

    @property
    def asks(self) -> bool:
        """Whether this rank asks the node (and releases)."""
        return self.exchange is None or self.tp_rank == 0

    def query(self, hashes: Sequence[bytes], tenant: Optional[str] = None) -> Answer:
        """(lease, blocks held) for ``hashes`` (of ``tenant``): rank 0's on every rank; (None,
        0) on a miss, a node failure, or an answer that did not reach this rank."""
        self._sweep()
        if self.exchange is None:
            return self.rank.query(hashes, tenant) if hashes else (None, 0)
        if not hashes and not self.exchange.lockstep:
            return None, 0
        answer = None
        if self.tp_rank == 0:
            answer = self.rank.query(hashes, tenant) if hashes else (None, 0)
        try:
            lease, n = self.exchange.exchange(digest_of(hashes), answer)
        except Exception as e:  # noqa: BLE001 - a miss on this rank, never a crash
            log.warning("kvferry: %s rank %d: sharing rank 0's lease failed (%s); no hit",
                        self.rank.instance, self.tp_rank, e)
            if answer is not None:
                self.rank.release(answer[0])
            self.rank.counters["share_failures"] += 1
            return None, 0
        if lease is None or n <= 0:
            return None, 0
        return lease, min(int(n), len(hashes))

    def release(self, lease: Optional[str]) -> None:
        """Releases ``lease`` now (none of the ranks loads it); rank 0's part."""
        if self.asks:
            self.rank.release(lease)

    def loaded(self, lease: Optional[str], grace_s: float) -> None:
        """This rank's load of ``lease`` ended. Without sharing the lease is released now;
        rank 0 of shared ones releases it ``grace_s`` later (the other ranks' loads consume
        it before that, or they are late and miss)."""
        if lease is None:
            return
        if self.exchange is None:
            self.rank.release(lease)
        elif self.tp_rank == 0:
            self._retired.append((time.monotonic() + grace_s, lease))
        self._sweep()

    def sweep(self) -> None:
        """Releases the leases whose grace passed (every query and load does too)."""
        self._sweep()

    def _sweep(self, everything: bool = False) -> None:
        now = time.monotonic()
        while self._retired and (everything or self._retired[0][0] <= now):
            self.rank.release(self._retired.popleft()[1])

    def pending(self) -> int:
        """Leases rank 0 still holds for its other ranks."""
        return len(self._retired)

    def close(self) -> None:
        self._sweep(everything=True)


def digest_of(hashes: Sequence[bytes]) -> bytes:
    """What names one batch of hashes between the ranks."""
    h = hashlib.sha256()
    for x in hashes:
        h.update(len(x).to_bytes(1, "little"))
        h.update(x)
    return h.digest()
