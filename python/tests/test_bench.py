"""`python -m kvferry.bench` on CPU (memfd KV, host node): small, but the whole path — node
start, registration in both layouts, save, query, load, byte checks, the raw baseline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the benchmark needs PyTorch")

from conftest import kvferry_bin  # noqa: E402


def test_bench_runs_and_verifies_on_cpu():
    out = subprocess.run(
        [sys.executable, "-m", "kvferry.bench", "--device", "cpu", "--blocks", "1,3",
         "--layers", "3", "--segment-kib", "1", "--iters", "2", "--json",
         "--kvferry-bin", str(kvferry_bin())],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["verified"] is True
    assert set(r["layouts"]) == {"per_layer", "cross_layer"}
    for rows in r["layouts"].values():
        assert [row["blocks"] for row in rows] == [1, 3]
        for row in rows:
            assert row["verified"] is True
            assert row["bytes"] == row["blocks"] * 3 * 2 * 1024
            assert row["load_ms"] > 0 and row["raw_ms"] > 0 and row["load_vs_raw"] > 0


def test_bench_refuses_bad_arguments():
    out = subprocess.run(
        [sys.executable, "-m", "kvferry.bench", "--layouts", "page_first"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and "unknown layout" in out.stderr


def test_bench_finish_times_the_workers_path_beside_the_board_on_cpu():
    out = subprocess.run(
        [sys.executable, "-m", "kvferry.bench", "finish", "--device", "cpu", "--blocks", "1,3",
         "--layers", "3", "--segment-kib", "2", "--iters", "2", "--json",
         "--kvferry-bin", str(kvferry_bin())],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["verified"] is True
    assert set(r["layouts"]) == {"per-layer", "cross-layer"}
    for rows in r["layouts"].values():
        assert [row["blocks"] for row in rows] == [1, 3]
        for row in rows:
            assert row["verified"] is True
            assert row["bytes"] == row["blocks"] * 3 * 2048
            # Successes reported from the board: not one PollLoad.
            assert row["poll_load_calls"] == 0, row
            for m in ("async", "sync"):
                assert row[f"{m}_ms"] > 0 and row[f"{m}_over_board"] > 0
