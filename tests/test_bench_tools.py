"""Every benchmark under tools/ (except bench_vllm, which needs vLLM and minutes, and
bench_vs_vllm, which tests/vllm/test_bench_vs_vllm.py runs) runs end to end with tiny
parameters and ends with the JSON line the README and the issues name, so a benchmark
cannot rot unnoticed. No timing is asserted: only shape and sanity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

CASES: dict[str, tuple[list[str], set[str]]] = {
    "bench_manager": (["--steps", "3", "--warmup", "1", "--clock", "cpu"],
                      {"us_per_step", "us_per_unchanged_request"}),
    "bench_copy": (["--reps", "1", "--no-index"], {"cpu_ratio_block", "cpu_ratio_frag", "cuda"}),
    "bench_ipc": (["--n", "200", "--m", "2000", "--warmup", "20", "--rounds", "1"],
                  {"rtt_us", "events_per_s", "cmd_doorbells_per_100"}),
    "bench_acks": (["--requests", "20", "--blocks", "2", "--row", "4096", "--inflight", "4"],
                   {"ack_p50_ms", "ack_p99_ms", "ack_p999_ms", "ack_max_ms",
                    "max_stall_gap_ms", "jobs", "wall_s"}),
    "bench_disk": (["--part", "slab", "--part", "scan", "--scan-slots", "40", "--sizes",
                    "128K,256K", "--total-mib", "2", "--runs", "2", "--threads", "2",
                    "--no-vllm"], {"slab", "scan"}),
}


def _run(tool: str, args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", f"tools.{tool}", *args, "--json"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    summary: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return summary


@pytest.mark.parametrize("tool", sorted(CASES))
def test_benchmark_runs_and_ends_with_its_json_line(tool: str) -> None:
    args, keys = CASES[tool]
    summary = _run(tool, args)
    assert set(summary) == keys
    if tool == "bench_manager":
        assert set(summary["us_per_step"]) == {"1000", "4000", "16000"}
        assert all(v > 0 for v in summary["us_per_step"].values())
    elif tool == "bench_copy":
        assert summary["cpu_ratio_block"] > 0 and summary["cpu_ratio_frag"] > 0
    elif tool == "bench_disk":
        _check_bench_disk(summary["slab"], vllm=False)
        scan = summary["scan"]
        assert scan["slots"] == 40 and scan["runs"] == 2
        assert all(0 < lo <= med <= hi for lo, med, hi in scan["cold_s"].values())
    elif tool == "bench_acks":
        # a store and a load a request; requests stepping together may share a job
        assert 20 <= summary["jobs"] <= 40
        assert 0 < summary["ack_p50_ms"] <= summary["ack_max_ms"]
    else:
        assert set(summary["rtt_us"]) == {f"{c}_{m}" for c in ("kvshm", "zmq", "mp")
                                          for m in ("cold", "hot")}
        assert all(v > 0 for v in summary["events_per_s"].values())


def _check_bench_disk(slab: dict[str, Any], *, vllm: bool) -> None:
    assert set(slab) >= {"128KiB", "256KiB", "targets", "threads", "vllm_o_direct"}
    for size in ("128KiB", "256KiB"):
        for op in ("write", "read"):
            row = slab[size][op]
            assert 0 < row["slab"][0] <= row["slab"][1] <= row["slab"][2]
            assert row["raw"][0] > 0 and row["slab_vs_raw"][1] > 0
            assert (row["vllm"] is not None) is vllm
        assert slab[size]["bounce"] == 0  # page-aligned host rows: zero-copy O_DIRECT
    assert len(slab["targets"]) == (8 if vllm else 4)


@pytest.mark.vllm
def test_bench_disk_measures_vllms_fs_tier_too() -> None:
    """Part (a) with vLLM's own fs tier calls on the same blocks (8 s of vLLM import)."""
    pytest.importorskip("vllm.v1.kv_offload.tiering.fs.io")
    summary = _run("bench_disk", ["--part", "slab", "--sizes", "128K,256K", "--total-mib",
                                  "2", "--runs", "1", "--threads", "1"])
    _check_bench_disk(summary["slab"], vllm=True)
    assert isinstance(summary["slab"]["vllm_o_direct"], bool)  # its own O_DIRECT probe
