"""``python -m tools.bench_vs_vllm --quick --json`` runs end to end against the installed
vLLM: its last line has the issue's shape (``step_ratio_all`` / ``step_ratio_changed``
per size, ``hit_fraction`` of kvshm, vLLM and Belady), both contenders did the same work
on the decode trace, and a run where they do not is refused (exit 1, the difference
named). No timing is asserted."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("vllm.v1.simple_kv_offload.manager")

pytestmark = pytest.mark.vllm



def _check(lines: list[str]) -> None:
    """The last line's shape and the same-work line."""
    summary: dict[str, Any] = json.loads(lines[-1])
    assert set(summary) == {"step_ratio_all", "step_ratio_changed", "hit_fraction"}
    for key in ("step_ratio_all", "step_ratio_changed"):
        assert set(summary[key]) == {"200", "400"}
        assert all(v > 0 for v in summary[key].values())
    assert set(summary["hit_fraction"]) == {"kvshm", "vllm", "belady"}
    assert all(0 < v <= 1 for v in summary["hit_fraction"].values())
    work = json.loads(next(ln for ln in lines if ln.startswith("same work"))
                      .split(": ", 1)[1])
    for n in ("200", "400"):
        assert work[n]["kvshm"] == work[n]["vllm"]
        assert work[n]["kvshm"]["stored"] > 0 and work[n]["kvshm"]["hit_tokens"] > 0
        assert work[n]["kvshm"]["loaded"] > 0


def test_quick_run_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    from tools import bench_vs_vllm

    assert bench_vs_vllm.main(["--quick", "--json", "--steps", "3", "--warmup", "1"]) == 0
    _check(capsys.readouterr().out.strip().splitlines())


def test_different_work_is_refused(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """kvshm answering every lookup with a miss: the first CPU hit vLLM finds differs."""
    from kvshm.integrations.vllm.scheduler import SchedulerSide
    from tools import bench_vs_vllm

    monkeypatch.setattr(SchedulerSide, "lookup", lambda self, r, n: (0, False))
    assert bench_vs_vllm.main(["--quick", "--steps", "2", "--warmup", "0"]) == 1
    err = capsys.readouterr().err
    assert "did different work" in err and "CPU hits" in err
