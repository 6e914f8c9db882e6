"""``python -m tools.bench_pd --quick --json`` runs end to end (two engines, four worker
processes, a real Valkey): the decode side's logits equal the prefill side's bit for
bit, and the last line carries the issue's keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_pd_quick_is_bit_exact_and_reports_its_keys(valkey: object) -> None:
    del valkey  # only for the fixture's skip where the remote extra is missing
    out = subprocess.run([sys.executable, "-m", "tools.bench_pd", "--quick", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"pd_ttft_ratio", "publish_ms_p50", "bytes_per_request"} <= set(last)
    assert last["bit_exact"] is True and last["decode_pd_consumed"] == 2
    # 15 full blocks and the tail (the last block's first 15 tokens) x 2 shards, put by
    # the prefill side and got by the decode side (kvshm's counters)
    assert last["bytes_per_request"] == last["decode_bytes_per_request"] == 16 * 2 * 128 * 1024
