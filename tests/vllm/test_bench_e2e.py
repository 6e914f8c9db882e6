"""``python -m tools.bench_e2e --quick --json`` runs end to end against the installed
vLLM (nine engine processes, four workloads, minutes on 2 cores: marked slow): its last
line has issue 29's shape (per workload a ``half`` and a ``quarter`` row with each
arm's ceiling share and the ratios to vLLM's connector, the targets at half), the
seeds and sizes to repeat it, and every kvshm-based arm saw the lookups the recording
pass saw; ``--dump`` writes each request's TTFT, hits, engine steps and connector hook
times per arm. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.simple_kv_offload.manager")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"capacity_blocks", "vllm_cpu_blocks", "ceiling_share", "vllm_ceiling_share",
            "oracle_ceiling_share", "mean_ratio_vs_vllm", "p50_ratio_vs_vllm",
            "p90_ratio_vs_vllm", "ratio_interval", "unbounded_ratio_vs_vllm",
            "cpu_ceiling_share", "cpu_mean_ratio_vs_vllm",
            "hit_fraction", "arms", "access_mismatches", "answer_mismatches"}
ARM_KEYS = {"mean_ms", "p50_ms", "p90_ms", "cpu_mean_ms", "cpu_p50_ms", "wall_s", "tok_s",
            "req_s", "hit_tokens", "stored_blocks"}


def _check_row(row: dict[str, Any], half: bool) -> None:
    assert set(row) == ROW_KEYS | ({"targets"} if half else set())
    assert set(row["arms"]) == {"none", "unbounded", "vllm", "kvshm", "oracle"}
    for arm in row["arms"].values():
        assert set(arm) == ARM_KEYS
        assert 0 < arm["p50_ms"] <= arm["p90_ms"] and arm["mean_ms"] > 0
        assert arm["tok_s"] > 0 and arm["hit_tokens"] >= 0 and arm["cpu_mean_ms"] > 0
    assert row["arms"]["none"]["hit_tokens"] == 0
    assert row["arms"]["none"]["stored_blocks"] is None is row["arms"]["vllm"]["stored_blocks"]
    assert row["arms"]["kvshm"]["stored_blocks"] >= 0
    assert row["vllm_cpu_blocks"] == row["capacity_blocks"] > 0
    assert row["mean_ratio_vs_vllm"] > 0 and row["p50_ratio_vs_vllm"] > 0
    lo, hi = row["ratio_interval"]["mean"]  # the paired bootstrap brackets the mean ratio
    assert 0 < lo <= row["mean_ratio_vs_vllm"] + 0.001 and row["mean_ratio_vs_vllm"] <= hi + 0.001
    lo, hi = row["ratio_interval"]["p50"]  # (a median of a few requests may not be inside)
    assert 0 < lo <= hi
    assert row["unbounded_ratio_vs_vllm"]["mean"] > 0 < row["unbounded_ratio_vs_vllm"]["p50"]
    assert set(row["hit_fraction"]) == {"vllm", "kvshm", "oracle"}
    assert set(row["cpu_ceiling_share"]) == {"vllm", "kvshm", "oracle"}
    assert set(row["access_mismatches"]) == {"kvshm", "oracle"}
    if half:
        assert set(row["targets"]) == {"ceiling_share", "mean_ratio_vs_vllm",
                                       "p50_ratio_vs_vllm"}
        for t in row["targets"].values():
            assert set(t) == {"want", "got", "met"} and isinstance(t["met"], bool)


def test_quick_run_ends_with_the_issue_json_shape(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    dump = tmp_path / "dump"
    out = subprocess.run([sys.executable, "-m", "tools.bench_e2e", "--quick", "--json",
                          "--logs", str(tmp_path), "--dump", str(dump)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1500, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    summary: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"workloads", "targets_met", "sizes", "layout", "seed", "eviction",
            "args"} <= set(summary)
    names = {"chat", "rag", "agentic", "scan"}
    assert set(summary["workloads"]) == names == set(summary["sizes"])
    for name, rows in summary["workloads"].items():
        assert set(rows) == {"half", "quarter"}
        _check_row(rows["half"], half=True)
        _check_row(rows["quarter"], half=False)
        assert rows["quarter"]["capacity_blocks"] < rows["half"]["capacity_blocks"]
        size = summary["sizes"][name]
        assert size["seed"] == 0 and size["requests"] > 0 and size["distinct_blocks"] > 0
        # the same unbounded arm serves both rows
        assert rows["half"]["arms"]["unbounded"] == rows["quarter"]["arms"]["unbounded"]
    assert summary["layout"]["ttft_1024_ms"] > summary["layout"]["ttft_16_ms"] > 0
    assert isinstance(summary["targets_met"], bool)
    for name in names:
        _check_dump(json.loads((dump / f"{name}.json").read_text()),
                    summary["sizes"][name]["requests"])


def _check_dump(d: dict[str, Any], n: int) -> None:
    """Every arm, every request: a step or more to the first token (no fewer than the
    steps that scheduled nothing), hook seconds only where a connector is."""
    assert d["columns"] == ["ttft", "cpu", "elapsed", "hit_tokens", "steps", "idle_steps",
                            "hooks", "token"]
    assert len(d["arms"]) == 8 and len(d["prompt_tokens"]) == n
    for arm, reqs in d["arms"].items():
        assert len(reqs) == n
        for ttft, _, _, hits, steps, idle, hooks, token in reqs:
            assert ttft > 0 and steps >= 1 + idle and hits >= 0 and isinstance(token, int)
            assert bool(hooks) == (arm != "none"), (arm, hooks)
            assert all(v >= 0 for v in hooks.values())
        if arm.startswith("kvshm"):
            assert any("s.build_connector_meta" in r[6] for r in reqs)
