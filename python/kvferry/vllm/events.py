"""kvferry's tiers in vLLM's own KV event stream: what this engine saved to the node is
reported as ``BlockStored`` (``medium="CPU"`` for the node's RAM, ``"DISK"`` for its SSD)
once the node says it holds it, and ``BlockRemoved`` when the node drops it from a tier, with
vLLM's block hashes, so a router that reads the engine's events sees kvferry's copies under
the engine's own identity.

The scheduler side calls :meth:`EngineEvents.saving` for each block it hands to the workers
to save (it knows vLLM's hash and kvferry's key of it) and :meth:`EngineEvents.take` once a
step (from vLLM's ``take_events``). ``take`` reads what the node published since the last
step from a SUB socket on the node's ``[events] publish`` endpoint, without blocking, and
turns the events about blocks it knows into vLLM's classes. Blocks other engines saved are
not this engine's to report and are skipped. Nothing on the data path waits for this: the
socket is read only here, at most :data:`MAX_MESSAGES_PER_STEP` messages a step.

Nothing here imports vLLM: the event classes come in as arguments (``compat.event_classes``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

__all__ = ["BlockInfo", "EngineEvents", "NodeStream", "decode_node_batch"]

log = logging.getLogger("kvferry.vllm")

#: Node messages read per step at most (the rest wait in the socket for the next step).
MAX_MESSAGES_PER_STEP = 4096
#: Blocks remembered (kvferry key -> vLLM's view of it), least recently saved dropped first.
MAX_TRACKED_BLOCKS = 262_144


@dataclass(frozen=True)
class BlockInfo:
    """vLLM's view of one block this engine saved."""

    block_hash: Any  # vLLM's external block hash (bytes, or int where vLLM publishes ints)
    parent_block_hash: Any
    token_ids: Tuple[int, ...]
    block_size: int
    lora_id: Optional[int]
    lora_name: Optional[str]


def decode_node_batch(payload: bytes, decode: Callable[[bytes], Any]) -> List[Tuple[str, str, List[bytes]]]:
    """A node's ``KVEventBatch`` as ``(type, medium, hashes)`` per event, in either of the
    node's layouts (``[events] layout``: maps, or arrays with the tag first).
    ``AllBlocksCleared`` (the node started) comes as ``("AllBlocksCleared", "", [])``."""
    batch = decode(payload)
    out: List[Tuple[str, str, List[bytes]]] = []
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        return out
    for e in batch[1] or ():
        if isinstance(e, dict):
            kind, hashes, medium = e.get("type"), e.get("block_hashes"), e.get("medium")
        elif isinstance(e, (list, tuple)) and e:
            kind = e[0]
            hashes = e[1] if len(e) > 1 else None
            medium = e[6] if kind == "BlockStored" and len(e) > 6 else (
                e[2] if kind == "BlockRemoved" and len(e) > 2 else None)
        else:
            continue
        if kind in ("BlockStored", "BlockRemoved") and isinstance(hashes, list):
            out.append((kind, medium or "CPU", [bytes(h) for h in hashes]))
        elif kind == "AllBlocksCleared":
            out.append((kind, "", []))
    return out


class NodeStream:
    """A non-blocking SUB on the node's publisher (pyzmq). ``poll`` returns what arrived,
    at most ``limit`` messages, and counts sequence gaps (messages the socket dropped
    while this engine was slow)."""

    def __init__(self, endpoint: str, zmq_module: Any = None):
        if zmq_module is None:
            import zmq as zmq_module  # vLLM depends on pyzmq
        self._zmq = zmq_module
        self._ctx = zmq_module.Context.instance()
        self._sock = self._ctx.socket(zmq_module.SUB)
        self._sock.setsockopt(zmq_module.LINGER, 0)
        self._sock.setsockopt(zmq_module.RCVHWM, 100_000)
        self._sock.setsockopt(zmq_module.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._next: Optional[int] = None
        self.gaps = 0

    def poll(self, limit: int = MAX_MESSAGES_PER_STEP) -> List[bytes]:
        out: List[bytes] = []
        for _ in range(limit):
            try:
                frames = self._sock.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                break
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            seq = int.from_bytes(frames[1], "big")
            if self._next is not None and seq > self._next:
                self.gaps += seq - self._next
            self._next = seq + 1
            out.append(frames[2])
        return out

    def close(self) -> None:
        self._sock.close(linger=0)


class EngineEvents:
    """Blocks this engine saved, and the vLLM events the node's stream makes of them.

    ``stored(**fields)`` and ``removed(**fields)`` build vLLM's ``BlockStored`` and
    ``BlockRemoved`` (given only the fields the installed class has); ``stream`` has
    ``poll() -> [payload]``; ``decode`` is msgpack's."""

    def __init__(
        self,
        stream: Any,
        decode: Callable[[bytes], Any],
        stored: Callable[..., Any],
        removed: Callable[..., Any],
        *,
        max_tracked: int = MAX_TRACKED_BLOCKS,
    ):
        self._stream = stream
        self._decode = decode
        self._stored = stored
        self._removed = removed
        self._max = max_tracked
        self._known: "OrderedDict[bytes, BlockInfo]" = OrderedDict()
        # The media each block was reported stored in: what a router was told, and so all
        # that a node's clear has to take back.
        self._reported: Dict[bytes, Set[str]] = {}
        self.skipped = 0  # node events about blocks this engine did not save

    def saving(self, kv_hash: bytes, info: BlockInfo) -> None:
        self._known[kv_hash] = info
        self._known.move_to_end(kv_hash)
        while len(self._known) > self._max:
            gone, _ = self._known.popitem(last=False)
            self._reported.pop(gone, None)

    def take(self) -> List[Any]:
        out: List[Any] = []
        for payload in self._stream.poll():
            try:
                events = decode_node_batch(payload, self._decode)
            except Exception:  # noqa: BLE001  (a message this version cannot read)
                continue
            for kind, medium, hashes in events:
                if kind == "AllBlocksCleared":
                    # The node restarted: nothing this engine saved is in its tiers any more
                    # (what its disk still holds is stored again after this). Not vLLM's
                    # AllBlocksCleared, which would clear the engine's own GPU blocks too.
                    out.extend(self._cleared())
                    continue
                infos = [(h, self._known.get(h)) for h in hashes]
                mine = [(h, i) for h, i in infos if i is not None]
                self.skipped += len(infos) - len(mine)
                if kind == "BlockStored":
                    for h, _ in mine:
                        self._reported.setdefault(h, set()).add(medium)
                    out.extend(self._stored_events(mine, medium))
                elif mine:
                    for h, _ in mine:
                        self._reported.get(h, set()).discard(medium)
                    out.append(self._removed(
                        block_hashes=[i.block_hash for _, i in mine], medium=medium))
        return out

    def _cleared(self) -> List[Any]:
        # Only what was reported stored is taken back: a block saved to a node that had only
        # just started reaches the stream after the node's clear, which must not remove it.
        out = []
        for m in ("CPU", "DISK"):
            hashes = [i.block_hash for h, i in self._known.items()
                      if m in self._reported.get(h, ())]
            if hashes:
                out.append(self._removed(block_hashes=hashes, medium=m))
        self._reported.clear()
        return out

    def _stored_events(self, mine: Sequence[Tuple[bytes, BlockInfo]], medium: str) -> Iterable[Any]:
        # One event per block, as vLLM's own block pool reports them: each has its parent,
        # tokens and LoRA of its own.
        for _, i in mine:
            yield self._stored(
                block_hashes=[i.block_hash],
                parent_block_hash=i.parent_block_hash,
                token_ids=list(i.token_ids),
                block_size=i.block_size,
                lora_id=i.lora_id,
                medium=medium,
                lora_name=i.lora_name,
            )

    def close(self) -> None:
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()


def only_fields(cls: Any) -> Callable[..., Any]:
    """A constructor of ``cls`` that passes only the fields ``cls`` has (vLLM releases add
    fields to their event classes)."""
    names = set(getattr(cls, "__struct_fields__", ()) or ())

    def make(**kw: Any) -> Any:
        return cls(**{k: v for k, v in kw.items() if not names or k in names})

    return make


def block_infos(request: Any, indices: Sequence[int], block_size: int,
                convert: Callable[[Any], Any]) -> Dict[int, BlockInfo]:
    """vLLM's view of ``request``'s blocks at ``indices`` (vLLM's ``request.block_hashes``;
    blocks vLLM has not hashed are left out)."""
    vh = list(getattr(request, "block_hashes", None) or ())
    tokens = request.all_token_ids
    lora = getattr(request, "lora_request", None)
    lora_id = getattr(lora, "adapter_id", None) if lora is not None else None
    lora_name = getattr(lora, "lora_name", None) if lora is not None else None
    out: Dict[int, BlockInfo] = {}
    for i in indices:
        if i >= len(vh):
            continue
        out[i] = BlockInfo(
            block_hash=convert(vh[i]),
            parent_block_hash=convert(vh[i - 1]) if i > 0 else None,
            token_ids=tuple(tokens[i * block_size:(i + 1) * block_size]),
            block_size=block_size,
            lora_id=lora_id,
            lora_name=lora_name,
        )
    return out
