"""``python -m tools.bench_vs_vllm --quick --json`` runs end to end against the installed
vLLM: its last line has the issue's shape (``step_ratio_all`` / ``step_ratio_changed``
per size for the old trace, ``realistic_ratio_*`` for the realistic one, min / median /
max per trace, phase and size, per-hook µs of both contenders with kvshm's service
thread as its own hook, ``hit_fraction`` of kvshm, vLLM and Belady), both contenders did
the same work on both decode traces, and a run where they do not is refused (exit 1,
the difference named). The rig (:mod:`tools.vs_vllm_rig`) charges the service thread's
CPU time to kvshm and times no hook while that thread could pump. No timing is
asserted."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("vllm.v1.simple_kv_offload.manager")

pytestmark = pytest.mark.vllm



SIZES = {"200", "400"}
HOOKS = {"update_output", "finished", "lookup", "allocated", "build"}


def _check(lines: list[str]) -> None:
    """The last line's shape and the same-work line."""
    summary: dict[str, Any] = json.loads(lines[-1])
    assert set(summary) == {"step_ratio_all", "step_ratio_changed", "hit_fraction",
                            "realistic_ratio_all", "realistic_ratio_changed",
                            "ratio_range", "step_us", "hook_us", "service"}
    for key in ("step_ratio_all", "step_ratio_changed", "realistic_ratio_all",
                "realistic_ratio_changed"):
        assert set(summary[key]) == SIZES
        assert all(v > 0 for v in summary[key].values())
    for trace, prefix in (("old", "step_ratio_"), ("realistic", "realistic_ratio_")):
        for phase in ("all", "changed"):
            by_n = summary["ratio_range"][trace][phase]
            assert set(by_n) == SIZES
            for n, (lo, med, hi) in by_n.items():
                assert 0 < lo <= med <= hi
                assert summary[prefix + phase][n] == med
                hooks = summary["hook_us"][trace][phase][n]
                assert set(hooks["kvshm"]) == HOOKS | {"service"}
                assert set(hooks["vllm"]) == HOOKS
                assert all(v >= 0 for w in hooks.values() for v in w.values())
                assert all(v > 0 for v in summary["step_us"][trace][phase][n].values())
    assert set(summary["service"]) == SIZES
    assert set(summary["hit_fraction"]) == {"kvshm", "vllm", "belady"}
    assert all(0 < v <= 1 for v in summary["hit_fraction"].values())
    work = json.loads(next(ln for ln in lines if ln.startswith("same work"))
                      .split(": ", 1)[1])
    assert set(work) == {"realistic", "old"}
    for by_n in work.values():
        for n in SIZES:
            assert by_n[n]["kvshm"] == by_n[n]["vllm"]
            assert by_n[n]["kvshm"]["stored"] > 0 and by_n[n]["kvshm"]["hit_tokens"] > 0
            assert by_n[n]["kvshm"]["loaded"] > 0


def test_quick_run_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    from tools import bench_vs_vllm

    assert bench_vs_vllm.main(["--quick", "--json", "--steps", "3", "--warmup", "1",
                               "--runs", "2"]) == 0
    _check(capsys.readouterr().out.strip().splitlines())


def test_service_thread_is_charged_to_kvshm_and_never_runs_inside_a_timed_hook() -> None:
    """An idle rig: the service thread pumps, and its CPU time lands on kvshm's clock
    as ``service``; during a timed hook of either contender it cannot take the hook
    lock (so it cannot pump there)."""
    import threading
    import time

    from tools.vs_vllm_rig import Rig

    rig = Rig(gpu_blocks=64, cpu_blocks=64)
    try:
        rig.take_clock()
        pumps = rig.service_pumps()
        deadline = time.monotonic() + 10
        while rig.service_pumps() < pumps + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rig.service_pumps() >= pumps + 3
        clock = rig.take_clock()
        assert clock["kvshm"]["service"] > 0
        assert clock["vllm"]["service"] == 0

        def try_lock() -> bool:
            """Whether another thread can take the hook lock now (as the service
            thread tries it)."""
            got: list[bool] = []

            def attempt() -> None:
                lock = rig.side.guard.lock
                got.append(lock.acquire(blocking=False))
                if got[0]:
                    lock.release()

            t = threading.Thread(target=attempt)
            t.start()
            t.join()
            return got[0]

        assert try_lock()  # idle: the thread could take it
        for who in ("kvshm", "vllm"):
            assert rig.timed(who, "build", try_lock) is False
        assert rig.take_clock()["vllm"]["build"] > 0
    finally:
        rig.close()


def test_different_work_is_refused(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """kvshm answering every lookup with a miss: the first CPU hit vLLM finds differs."""
    from kvshm.integrations.vllm.scheduler import SchedulerSide
    from tools import bench_vs_vllm

    monkeypatch.setattr(SchedulerSide, "lookup", lambda self, r, n: (0, False))
    assert bench_vs_vllm.main(["--quick", "--steps", "2", "--warmup", "0"]) == 1
    err = capsys.readouterr().err
    assert "did different work" in err and "CPU hits" in err
