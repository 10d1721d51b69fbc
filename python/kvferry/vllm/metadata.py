"""What the scheduler-side connector hands its workers each step (plain data: no vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple

__all__ = ["BOARD_SLOTS", "EARLY_SLOTS", "LoadSpec", "SaveSpec", "StepMetadata"]

#: Slots of each rank's completion board.
BOARD_SLOTS = 256
#: The board's last slots, kept for loads the scheduler starts (load_start "scheduler"):
#: at most this many per step; the worker's own loads take the others.
EARLY_SLOTS = 8


@dataclass
class LoadSpec:
    """Every rank loads ``lease`` (its own share of it) into ``dest_blocks``: one block per
    leased block, in prefix order. ``lease`` None: the lease was lost between the query and
    the allocation; every destination is reported as a load error at once."""

    req_id: str
    lease: Optional[str]
    dest_blocks: List[int]
    #: Tokens this load brings (for the stats).
    tokens: int
    #: True: vLLM runs this step's forward on the blocks (load_mode "sync").
    sync: bool = False
    #: Started by the scheduler already (load_start "scheduler"): (board slot, board tag,
    #: load id) on rank 0; the worker watches it instead of starting it.
    early: Optional[Tuple[int, int, int]] = None


@dataclass
class SaveSpec:
    """Every rank copies its part of ``block_ids`` into the node's host blocks ``hashes``."""

    req_id: str
    hashes: List[bytes]
    block_ids: List[int]
    #: The node tenant the blocks go to (the request's LoRA adapter); None: the model's own.
    tenant: Optional[str] = None


@dataclass
class StepMetadata:
    loads: List[LoadSpec] = field(default_factory=list)
    saves: List[SaveSpec] = field(default_factory=list)
    #: Requests preempted this step: their blocks are freed, so their saves must finish
    #: before the forward can overwrite them.
    preempted: Set[str] = field(default_factory=set)
    #: No tokens are scheduled this step: vLLM runs no forward, only the connector's hooks.
    #: Nothing of any request waits on such a step, so the workers may start its loads on
    #: vLLM's own thread and wait (``idle_wait_ms``) for a running load to end.
    idle: bool = False
