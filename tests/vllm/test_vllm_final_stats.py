"""The statistics file's rules (issue 14, point 4; issue 28): the READY snapshot from
before the teardown, with the final state, and a ``teardown`` record that hides
nothing; while serving, the live snapshot, whose write never fails vLLM's step."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.logger", reason="vLLM is not installed (see tools/vllm_install.sh)")

from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.final_stats import (
    SnapshotSource,
    final_statistics,
    live_statistics,
    write_json,
)
from kvshm.integrations.vllm.scheduler import SchedulerSide
from kvshm.types import KVGroup, StoreMode


def _stats(state: str, cached: int, alive: list[bool], failed: int,
           detached: list[bool] | None = None) -> dict[str, Any]:
    """``alive[i]``: rank i not dead; ``detached[i]``: it left at the close (default:
    every dead rank of a closed engine, none of a serving one)."""
    if detached is None:
        detached = [not a and state == "closed" for a in alive]
    return {"name": "e", "state": state, "cpu_blocks_cached": cached,
            "counters": {"ranks_failed": failed},
            "ranks": [{"rank": i, "alive": a, "detached": d}
                      for i, (a, d) in enumerate(zip(alive, detached, strict=True))],
            "connector": {"steps": 3 if state == "ready" else 9}}


def test_the_ready_snapshot_wins_with_the_final_state_and_counters() -> None:
    ready = _stats("ready", 5, [True, True], 0)
    closed = _stats("closed", 0, [False, False], 2)
    out = final_statistics(ready, SnapshotSource.BEFORE_WORKERS_DETACHED, closed)
    assert out["state"] == "closed"
    assert out["cpu_blocks_cached"] == 5 and out["counters"] == {"ranks_failed": 0}
    assert [r["alive"] for r in out["ranks"]] == [True, True]
    assert out["connector"] == {"steps": 9}
    assert out["teardown"] == {"snapshot": "before_workers_detached",
                               "ranks_detached": [0, 1]}


def test_without_a_ready_snapshot_the_end_is_reported_as_it_is() -> None:
    """Rank 1 failed while serving (a verdict: dead, not detached), rank 0 left at the
    close: only rank 0 is listed (both were, before an observability probe)."""
    failed = _stats("closed", 0, [False, False], 1, detached=[True, False])
    out = final_statistics(None, SnapshotSource.AFTER_CLOSE, failed)
    assert out["counters"] == {"ranks_failed": 1} and out["cpu_blocks_cached"] == 0
    assert out["teardown"] == {"snapshot": "after_close", "ranks_detached": [0]}


def test_a_rank_already_lost_in_the_snapshot_is_not_listed_as_detached() -> None:
    snap = _stats("ready", 2, [True, False], 1)
    out = final_statistics(snap, SnapshotSource.ON_SHUTDOWN,
                           _stats("closed", 0, [False, False], 1, detached=[True, False]))
    assert out["counters"] == {"ranks_failed": 1}
    assert out["teardown"] == {"snapshot": "on_shutdown", "ranks_detached": [0]}


def test_the_live_file_is_the_snapshot_as_it_is_marked_live() -> None:
    """While the engine serves, the file holds the last report's snapshot as it is
    (a SIGKILLed engine core leaves it so): state ready, ``teardown.snapshot`` live. A
    rank a verdict failed is no detached one (it was listed, before an observability
    probe: nothing had shut down)."""
    snap = _stats("ready", 4, [True, False], 1)
    out = live_statistics(snap)
    assert out["state"] == "ready" and out["cpu_blocks_cached"] == 4
    assert out["teardown"] == {"snapshot": "live", "ranks_detached": []}
    assert "teardown" not in snap


def test_a_final_write_that_fails_is_logged_not_raised_into_vllms_shutdown(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The final write runs inside vLLM's ``Scheduler.shutdown``, which has more to do
    after the connector (its other connectors, the distributed environment): a
    stats_path in a missing folder used to raise OSError out of it. Now it is counted
    and warned about, and the side is closed. The closing line says the file was not
    written (it named the path as where the statistics went: a hostile probe)."""
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

    cfg = ConnectorConfig(f"unit-final-{os.getpid()}", 1, 1, 16, (KVGroup.full(),),
                          StoreMode.EAGER, None, 64, str(tmp_path / "missing" / "s.json"),
                          30.0, 0.2, 0)
    side = SchedulerSide(cfg)
    side.bind(VllmBlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16))
    with caplog.at_level(logging.INFO, logger="kvshm.vllm"):
        side.shutdown()
    assert side.life.closed and side.counters.stats_writes_failed == 1
    assert any("final statistics" in r.getMessage() for r in caplog.records)
    [closed] = [r.getMessage() for r in caplog.records if "closed (statistics" in r.getMessage()]
    assert "(statistics: not written to " in closed and "s.json" in closed


def test_a_live_write_that_fails_is_counted_and_logged_once_not_raised(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The live rewrite runs inside vLLM's step: a stats_path in a missing folder must
    not fail the step; it is counted and warned about once."""
    cfg = ConnectorConfig("unit", 1, 1, 16, (KVGroup.full(),), StoreMode.EAGER, None, 64,
                          str(tmp_path / "missing" / "s.json"), 30.0, 5.0, 0)
    side = SchedulerSide(cfg)
    with caplog.at_level(logging.WARNING, logger="kvshm.vllm"):
        side.life._write_live(str(cfg.stats_path), _stats("ready", 1, [True], 0))
        side.life._write_live(str(cfg.stats_path), _stats("ready", 1, [True], 0))
    assert side.counters.stats_writes_failed == 2
    assert [r.levelno for r in caplog.records if "stats_path" in r.getMessage()] == [
        logging.WARNING]


def test_a_stats_file_that_cannot_be_written_leaves_no_temporary_file(
        tmp_path: Path) -> None:
    """``stats_path`` naming a directory: the rename failed (logged), and the
    temporary file beside it stayed for good. It is removed now, and the error still
    raised to the caller (which logs it)."""
    target = tmp_path / "stats"
    target.mkdir()
    with pytest.raises(OSError):
        write_json(str(target), {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats"]
    write_json(str(tmp_path / "ok.json"), {"a": 1})
    assert json.loads((tmp_path / "ok.json").read_text()) == {"a": 1}


def test_a_link_planted_at_the_temporary_files_name_is_never_written_through(
        tmp_path: Path) -> None:
    """The hazard (a hostile probe): the statistics were written to ``<stats_path>.tmp
    <pid>`` -- a predictable name (the EngineCore's pid is public) opened with
    ``open(.., "w")``, which follows a link and truncates. A local user who could write
    to the directory planted a link there to a file of the engine's user, and each
    report emptied that file and wrote the statistics into it. Now the temporary file is
    a new one of a random name (``mkstemp``): the planted link and its target are left
    as they were, the statistics land in ``stats_path`` (mode 0666 less the umask: 0600
    under 077, a review), and nothing else is left beside it; a path through a link to a
    directory and ``..`` still works (a review: normalised, the temporary file went to
    another filesystem than the target)."""
    victim = tmp_path / "victim"
    victim.write_text("the engine user's own file\n")
    stats = tmp_path / "stats.json"
    planted = tmp_path / f"stats.json.tmp{os.getpid()}"
    planted.symlink_to(victim)
    old_mask = os.umask(0o077)
    try:
        write_json(str(stats), {"a": 1})
    finally:
        os.umask(old_mask)
    assert victim.read_text() == "the engine user's own file\n"
    assert json.loads(stats.read_text()) == {"a": 1}
    assert stats.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["victim", "stats.json", planted.name])
    other = tmp_path / "sub" / "deeper"
    other.mkdir(parents=True)
    (tmp_path / "link").symlink_to(other)
    write_json(str(tmp_path / "link" / ".." / "s.json"), {"b": 2})
    assert json.loads((tmp_path / "sub" / "s.json").read_text()) == {"b": 2}
