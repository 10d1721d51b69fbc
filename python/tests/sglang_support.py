"""What the SGLang tests share: SGLang's own pool classes built on CPU, pages filled with a
pattern of (engine, page, position) and compared byte for byte."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nodeproc import Node, free_port  # noqa: E402,F401

CANARY = 0x5A


def sglang_or_skip():
    """SGLang's memory pool modules, or a skip saying why (run the SGLang tests with the
    interpreter of ``scripts/sglang-env``)."""
    return pytest.importorskip(
        "sglang.srt.mem_cache.memory_pool",
        reason="SGLang is not installed in this interpreter (see scripts/sglang-env)",
    )


def fill_pages(torch, pages_of, seed: int) -> None:
    """Writes a distinct pattern into every page tensor of ``pages_of`` (a list of views)."""
    g = torch.Generator().manual_seed(seed)
    for view in pages_of:
        raw = view.view(torch.uint8) if view.dtype != torch.uint8 else view
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def page_bytes(torch, t) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()
