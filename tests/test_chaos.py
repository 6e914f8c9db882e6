"""tools/chaos briefly: five fresh engines (SPAWN and ATTACH, tp=2), one fault each
(SIGKILL, SIGSTOP + resume after the verdict, a corrupt done record, rogue rendezvous
connections, invalid API calls), byte-pattern traffic verified on every load and on
every live block. The verdict is its JSON line: no wrong byte, no hang, no leaked pin,
nothing left in /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"engines", "faults", "survived", "wrong_bytes", "hangs", "leaked_pins",
        "shm_leftovers", "quarantined_blocks"}


def _chaos(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1"}
    return subprocess.run([sys.executable, "-m", "tools.chaos", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_quick_chaos_run_finds_no_corruption_hang_or_leak() -> None:
    out = _chaos("--quick", "--seed", "1", "--json", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(summary) == KEYS
    assert summary["engines"] == 5 and summary["faults"] == 5, out.stdout[-4000:]
    report = out.stdout[-6000:]  # the per-engine lines say which fault did what
    assert summary["wrong_bytes"] == 0, report
    assert summary["hangs"] == 0, report
    assert summary["leaked_pins"] == 0, report
    assert summary["shm_leftovers"] == 0, report


def test_bad_usage_exits_2() -> None:
    out = _chaos("--engines", "0", timeout=120)
    assert out.returncode == 2 and "--engines must be >= 1" in out.stderr
