"""``python -m tools.bench_disk --part e2e --part restart --quick --json`` runs end to end
against the installed vLLM (engine processes per arm, a minute or two on 2 cores: marked
slow): its last line carries part (b)'s rows (the CPU tier alone, with a disk tier, and
unbounded; the disk arm wrote blocks) and part (c)'s (a warm engine indexed the seed's
slab at start, a cold one did not). No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_ends_with_both_parts(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "tools.bench_disk", "--part", "e2e", "--part",
                          "restart", "--quick", "--offload-workloads", "chat", "--dir",
                          str(tmp_path), "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    summary: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(summary) == {"e2e", "restart"}
    chat = summary["e2e"]["workloads"]["chat"]
    assert set(chat["arms"]) == {"cpu", "disk", "unbounded"}
    assert chat["arms"]["disk"]["disk"]["written_blocks"] > 0
    assert chat["mean_ratio"] > 0 and isinstance(chat["met"], bool)
    restart = summary["restart"]
    assert restart["arms"]["warm"]["disk"]["warm_slots"] > 0
    assert restart["arms"]["cold"]["disk"]["warm_slots"] == 0
    assert restart["first_turn_ratio"] >= 0 and isinstance(restart["met"], bool)
    assert restart["seed_serves"] == "answers"
    assert not list(tmp_path.glob("disk_e2e_*"))  # the slabs went with the run


def test_the_restart_seed_leaves_each_answer_behind_within_the_length_limit() -> None:
    """The restart's seed is sent what a generating server computes: a turn's prompt and
    its answer (the next turn of the conversation starts with both), cut to the
    workload's longest prompt (the engines' length limit is built from it); with
    ``prompts``, the prompt alone."""
    from tools.chat_trace import Turn
    from tools.disk_e2e import seed_tokens

    turn = Turn("r0", 0, 0, prompt=(1, 2, 3), answer=(4, 5, 6, 7))
    assert seed_tokens(turn, "answers", {"max_prompt_tokens": 100}) == [1, 2, 3, 4, 5, 6, 7]
    assert seed_tokens(turn, "answers", {"max_prompt_tokens": 5}) == [1, 2, 3, 4, 5]
    assert seed_tokens(turn, "prompts", {"max_prompt_tokens": 100}) == [1, 2, 3]


def test_part_b_runs_at_the_e2e_benchmarks_scales_and_part_c_at_its_own() -> None:
    """Part (b)'s workloads default to ``tools.bench_e2e.BENCH_SCALES`` (the e2e
    benchmark's own sizes), ``--scale NAME=FRACTION`` overrides one, and part (c) keeps
    ``SCALES``' chat whatever ``--scale`` says; ``--quick`` makes both tiny."""
    import argparse

    from tools.bench_e2e import BENCH_SCALES, QUICK_SCALE, SCALES
    from tools.disk_e2e import add_arguments, finish_args, restart_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = finish_args(ap.parse_args([]))
    assert args.scale == {"chat": BENCH_SCALES["chat"], "agentic": BENCH_SCALES["agentic"]}
    assert restart_args(args).scale == {"chat": SCALES["chat"]}
    args = finish_args(ap.parse_args(["--scale", "chat=0.3"]))
    assert args.scale["chat"] == 0.3 and args.scale["agentic"] == BENCH_SCALES["agentic"]
    assert restart_args(args).scale == {"chat": SCALES["chat"]}
    args = finish_args(ap.parse_args(["--quick"]))
    assert set(args.scale.values()) == {QUICK_SCALE}
    assert restart_args(args).scale == {"chat": QUICK_SCALE}
    with pytest.raises(SystemExit):
        ap.parse_args(["--scale", "chat"])
