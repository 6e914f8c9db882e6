"""tools/bench_evict runs end to end on a small capacity-bound chat trace, through the
real manager, and ends with the JSON line the README and issue 15 name. No timing is
asserted; the ranking LRU < depth_aged <= Belady is (it holds on this trace by a wide
margin: 0.11 / 0.30 / 0.67 when this test was written)."""

from __future__ import annotations

import json

import pytest

from tools.bench_evict import main


def test_bench_evict_small_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--conversations", "16", "--turns", "4", "--think", "16",
                 "--cpu-frac", "0.3", "--check-every", "7", "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    out = json.loads(last)
    frac = out["hit_fraction"]
    assert set(frac) == {"lru", "lru_refresh", "deepest", "slru", "s3fifo", "depth_aged",
                         "depth_aged+refresh", "belady"}
    assert out["kvshm"] == frac["depth_aged"]
    assert all(0 <= f <= 1 for f in frac.values())
    assert frac["lru"] < frac["depth_aged"] <= frac["belady"]
