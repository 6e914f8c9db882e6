"""tools/prefill_cost.py: the line through chunk timings recovers the per-token model's
``a`` and ``b`` (and so ``half``), a fit whose timings do not grow with position still
reports (``half`` null), and the toy backend runs end to end (its output's shape only:
no claim on timings a loaded machine decides)."""

from __future__ import annotations

import json

import pytest

from tools.prefill_cost import fit, main, summary


def test_the_fit_recovers_a_and_b_from_exact_chunk_times() -> None:
    a, b, chunk = 3e-6, 3e-10, 512
    starts = [0, 2048, 4096, 8192]
    secs = [chunk * a + b * chunk * (s + (chunk - 1) / 2) for s in starts]
    f = fit(starts, secs, chunk)
    assert f.a == pytest.approx(a) and f.b == pytest.approx(b)
    assert f.half == pytest.approx(10_000) and f.worst_residual < 1e-9


@pytest.mark.parametrize("seconds", [[2e-3, 2e-3, 2e-3], [3e-3, 2e-3, 1e-3]])
def test_timings_that_do_not_grow_with_position_report_no_half(seconds: list[float]) -> None:
    """What a loaded machine can measure for short chunks: flat or falling times. The
    report says so (half null) instead of failing (round(inf) raised OverflowError)."""
    out = summary("toy", fit([0, 64, 128], seconds, 16))
    assert out["half"] is None and out["seconds"] == seconds
    json.dumps(out)


def test_the_toy_backend_reports_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backend", "toy", "--chunk", "16", "--starts", "0", "64", "128",
                 "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["chunk"] == 16 and out["starts"] == [0, 64, 128]
    assert len(out["seconds"]) == 3 and all(t >= 0 for t in out["seconds"])
    assert out["half"] is None or isinstance(out["half"], int)
