"""`kvshm demo` and the custom-server example, run the way a user runs them: as processes.

The demo's full trace takes minutes (it is the main job, measured in the README); here the
``--quick`` trace goes through the same path - toy model, 2 SPAWN workers, store/load
checksums, the replay-based logits check - and its JSON line must report exactness,
carry both arms' TTFT turn by turn, and the text must say what the "on" wall time
includes. One demo run serves every test of this module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _kvshm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "kvshm" in n.lower()}


class DemoRun(NamedTuple):
    """One ``kvshm demo --quick --json`` run: its text lines and its JSON summary."""

    text: list[str]
    summary: dict[str, Any]
    segments_before: set[str]


@pytest.fixture(scope="module")
def demo_run() -> DemoRun:
    before = _kvshm_segments()
    out = subprocess.run([sys.executable, "-m", "kvshm.cli", "demo", "--quick", "--json"],
                         capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    return DemoRun(lines[:-1], json.loads(lines[-1]), before)


def test_demo_quick_is_bit_exact_and_leaves_nothing(demo_run: DemoRun) -> None:
    summary = demo_run.summary
    assert summary["bit_exact"] is True
    assert summary["checksums_bad"] == 0 and summary["checksums_ok"] > 0
    assert summary["logit_checks"] > 0
    assert summary["logit_checks_equal"] == summary["logit_checks"]
    assert summary["hit_rate"] > 0 and summary["pins_at_end"] == 0
    assert summary["load_failures"] == 0
    assert _kvshm_segments() <= demo_run.segments_before


def test_demo_json_carries_ttft_per_turn_for_both_arms(demo_run: DemoRun) -> None:
    """One record per replayed request, in replay order (turn 1 of every conversation
    first), each with both arms' TTFT; per turn number the medians and the hit rate,
    consistent with the records and with the overall hit rate."""
    s = demo_run.summary
    per_turn = s["per_turn"]
    assert len(per_turn) == s["turns"] == 12  # --quick: 4 conversations x 3 turns
    assert [(r["conversation"], r["turn"]) for r in per_turn] == [
        (c, t) for t in (1, 2, 3) for c in range(4)]
    for r in per_turn:
        assert r["ttft_off_ms"] > 0 and r["ttft_on_ms"] > 0
        assert 0 <= r["cpu_hit_tokens"] < r["prompt_tokens"]
    assert all(r["cpu_hit_tokens"] == 0 for r in per_turn if r["turn"] == 1)
    by_turn = s["ttft_by_turn_ms"]
    for arm in ("off", "on"):
        assert by_turn[arm] == [statistics.median(r[f"ttft_{arm}_ms"] for r in per_turn
                                                  if r["turn"] == t) for t in (1, 2, 3)]
    assert s["hit_rate_by_turn"][0] == 0 and s["hit_rate_by_turn"][2] > 0
    hit = sum(r["cpu_hit_tokens"] for r in per_turn)
    assert hit / sum(r["prompt_tokens"] for r in per_turn) == pytest.approx(s["hit_rate"])
    assert s["workers"] == 2 and 0 < s["workers_start_s"] < s["wall_on_s"]
    assert 0 <= s["workers_stop_s"] < s["wall_on_s"]


def test_demo_text_says_the_on_wall_time_includes_starting_the_workers(
        demo_run: DemoRun) -> None:
    s = demo_run.summary
    wall = next(line for line in demo_run.text if line.startswith("wall time:"))
    assert wall == (f"wall time:             {s['wall_off_s']:.1f} s off, "
                    f"{s['wall_on_s']:.1f} s on; the on time includes starting the 2 worker "
                    f"processes ({s['workers_start_s']:.1f} s) and stopping them "
                    f"({s['workers_stop_s']:.1f} s)")
    by_turn = next(line for line in demo_run.text if line.startswith("TTFT by turn"))
    assert by_turn.startswith("TTFT by turn (median): turn 1 ")
    assert ", turn 3 " in by_turn and " -> " in by_turn


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed (pip install 'kvshm[plot]')")
def test_plot_draws_the_summary(demo_run: DemoRun, tmp_path: Path) -> None:
    """The picture ``--plot`` writes, drawn from the run's JSON summary: a PNG."""
    from kvshm.demo.plot import draw

    path = tmp_path / "demo.png"
    draw(demo_run.summary, str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_without_matplotlib_names_the_extra_before_running(tmp_path: Path) -> None:
    """matplotlib made unimportable in the child (``sys.modules`` entry None): the demo
    refuses at once, exit 2, naming ``pip install 'kvshm[plot]'``; nothing is replayed."""
    path = tmp_path / "demo.png"
    code = ("import sys; sys.modules['matplotlib'] = None; "
            "from kvshm.demo.driver import main; "
            f"sys.exit(main(['--quick', '--plot', {str(path)!r}]))")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("kvshm demo: --plot needs matplotlib, which is not "
                                 "installed (")
    assert out.stderr.rstrip().endswith("install it with: pip install 'kvshm[plot]'")
    assert out.stdout == "" and not path.exists()
    assert time.monotonic() - t0 < 60


def test_plot_into_a_missing_folder_is_refused_before_running(tmp_path: Path) -> None:
    """The hazard: ``--plot /no/such/dir/x.png`` was used only by the drawing after the
    whole replay (minutes), which then died with a traceback and no picture. Now the
    folder is checked first: exit 2, one line, nothing replayed."""
    path = tmp_path / "missing" / "demo.png"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvshm.demo", "--quick", "--plot", str(path)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"kvshm demo: --plot {path}: {path.parent} is not a folder this "
                          f"user can write to\n")
    assert time.monotonic() - t0 < 60


def test_ctrl_c_during_the_offload_off_pass_stops_the_demo_at_once() -> None:
    """Ctrl-C while the demo replays with offload off: the event loop cancels the demo's
    task, but that pass never suspended (no engine to step, no await that yields), so
    the cancel waited for its whole replay -- 20 s and more of the README's main
    command ignoring Ctrl-C. Now every compute chunk is a suspension point: the demo
    stops within seconds, says "interrupted" in one line (no traceback), exits 130 and
    leaves no segment or process behind."""
    before = _kvshm_segments()
    p = subprocess.Popen([sys.executable, "-m", "kvshm.cli", "demo"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        assert p.stdout is not None
        for line in p.stdout:  # the first progress line: the offload-off pass runs
            if "(offload off)" in line:
                break
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert time.monotonic() - t0 < 10, "Ctrl-C waited for the pass"
    assert p.returncode == 130, out[-2000:]
    assert "kvshm demo: interrupted" in out and "Traceback" not in out, out[-2000:]
    assert _kvshm_segments() <= before


def test_demo_module_offers_plot() -> None:
    out = subprocess.run([sys.executable, "-m", "kvshm.demo", "--help"], capture_output=True,
                         text=True, timeout=60, check=True)
    assert "--plot FILE.png" in out.stdout and "kvshm[plot]" in out.stdout


def test_custom_server_example_restores_the_stored_bytes() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_server.py")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    first = out.stdout.splitlines()[0]
    assert first == "hit 96 tokens, load ok=True, bytes identical=True", out.stdout
