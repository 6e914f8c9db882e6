"""tools/bench_evict end to end on small workloads: the JSON line has every order's hit
and saved-compute fractions, both offline limits, the default's gap and share per row
and their summary; the direct replay of recorded accesses gives exactly the hits the
real manager gives. No timing is asserted; two rankings are, each by a wide margin when
this test was written (the quick chat_sync row at 0.5: LRU 0.38 < deepest 0.71 and
the oracle 0.87). ``--e2e`` replays tools.bench_e2e's requests: the same prompts, no
answer blocks, its 160-block device pool."""

from __future__ import annotations

import json

import pytest

from kvshm.config import DEFAULT_EVICTION
from kvshm.offload.evict_cost import ATTN_HALF_TOKENS
from tools.bench_evict import E2E_DEVICE_BLOCKS, ORDERS, bench_workload, e2e_workload, main
from tools.workloads import make

NAMES = {n for n, _, _ in ORDERS}


def test_bench_evict_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--json", "--workloads", "chat_sync", "scan",
                 "--fracs", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["default"] == DEFAULT_EVICTION.value and out["half"] == ATTN_HALF_TOKENS
    assert [w["name"] for w in out["workloads"]] == ["chat_sync", "scan"]
    rows = out["rows"]
    assert [(r["workload"], r["frac"]) for r in rows] == [("chat_sync", 0.5), ("scan", 0.5)]
    for r in rows:
        for key in ("hit_fraction", "saved_fraction"):
            assert set(r[key]) == NAMES | {"belady", "belady_cost"}
            assert all(0 <= f <= 1 for f in r[key].values())
        saved = r["saved_fraction"]
        others = [n for n in NAMES if n != out["default"]]
        best = max(others, key=lambda n: saved[n])
        assert r["best_fixed"] == best
        assert r["default_gap"] == pytest.approx(saved[best] - saved[out["default"]], abs=2e-4)
        assert r["default_share"] == pytest.approx(saved[out["default"]] / saved[r["oracle"]],
                                                   abs=2e-3)
        assert saved[r["oracle"]] >= max(saved[n] for n in NAMES)
    sync = rows[0]["saved_fraction"]
    assert sync["lru"] < sync["deepest"] < sync[rows[0]["oracle"]]
    s = out["summary"]
    assert s["rows"] == 2 and 0 < s["default_share_mean"] <= 1
    assert s["max_gap"] == max(r["default_gap"] for r in rows)


def test_the_direct_replay_gives_the_managers_hits() -> None:
    wl = make("agentic", 0, scale=0.1)
    kw = {"fracs": [0.3], "orders": sorted(NAMES), "half": float(ATTN_HALF_TOKENS)}
    direct = bench_workload(wl, **kw)  # type: ignore[arg-type]
    managed = bench_workload(wl, manager=True, check_every=5, **kw)  # type: ignore[arg-type]
    assert [r["hit_fraction"] for r in direct] == [r["hit_fraction"] for r in managed]
    assert [r["saved_fraction"] for r in direct] == [r["saved_fraction"] for r in managed]


def test_e2e_replays_bench_e2es_prompts_with_its_device_pool(
        capsys: pytest.CaptureFixture[str]) -> None:
    from tools.bench_e2e import load, parse

    reqs, size = load("agentic", parse([]))
    wl = e2e_workload("agentic", 0)
    assert [r.prompt for r in wl.requests] == [r.prompt for r in reqs]
    assert all(r.answer == () and r.block_size == 32 for r in wl.requests)
    assert wl.params["scale"] == size["scale"] and len(wl.requests) == size["requests"]
    assert main(["--e2e", "--json", "--workloads", "agentic", "--fracs", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["e2e"] and [r["workload"] for r in out["rows"]] == ["agentic"]
    row = out["rows"][0]
    assert row["gpu_blocks"] == E2E_DEVICE_BLOCKS
    assert row["distinct"] == size["distinct_blocks"]
    assert row["capacity"] == int(size["distinct_blocks"] * 0.5)
