"""A process that forks while it holds an engine (``tests/fork_proc.py``): the child can
neither use nor close its parent's engine, and the parent serves on, bit-exact, and
closes (``kvshm.engine.forks``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.process


def _run(tmp_path: Path, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parent's JSON line and the child's report."""
    child = tmp_path / "child.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(HERE / "fork_proc.py"), args[0], str(child),
                          *args[1:]], env=env, capture_output=True, text=True, timeout=90,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    parent = json.loads(out.stdout.strip().splitlines()[-1])
    return parent, json.loads(child.read_text())


def _refused_as_a_fork(seen: str) -> bool:
    return seen.startswith("StateError") and "is a fork of it" in seen


def test_a_forked_child_can_neither_use_nor_close_its_parents_sync_client(
        tmp_path: Path) -> None:
    """A hostile probe: a child forked from a process with a READY ``SyncClient`` (two
    ``kvshm-workers`` ranks) called ``close()``; it posted Shutdown on the cmd rings it
    shares with the parent, both ranks detached, and the parent lost its offload for
    good (``rank 0 lifeline lost``, ``ranks_failed`` 2). A step from the child moved the
    ring's head under the parent's feet (both ranks failed: "head 168 impossible for tail
    224"). Now the child's copy is disowned at the fork: each call raises StateError
    naming the owner, ``close()`` returns touching nothing; the parent stores and loads
    bit-exact afterwards, nothing failed, and its ranks exit 0 at its close."""
    parent, child = _run(tmp_path, "client", f"fork-{uuid.uuid4().hex[:8]}")
    assert _refused_as_a_fork(child["step"]) and _refused_as_a_fork(child["lookup"])
    assert child["statistics"][0] == "closed" and child["statistics"][1] < 1.0
    assert parent == {"before": True, "after": True, "state_after": "READY",
                      "closed": "CLOSED", "ranks_failed": 0, "ranks_left": 0,
                      "workers_rc": 0}


def test_a_child_forked_on_an_engines_loop_returns_from_aclose_and_the_parent_closes(
        tmp_path: Path) -> None:
    """A hostile probe: a child forked inside a SPAWN ``Engine``'s coroutine ran to its
    end -- ``async with`` closed the engine there, ``asyncio.run`` closed the child's copy
    of the loop, which took the self-pipe out of the epoll set parent and child share.
    The parent served on, then hung in ``aclose()`` for good: the ranks' reaping,
    finished on an executor thread, could no longer wake its loop. Now the child's
    ``aclose()`` returns at once (the engine is its parent's) after each call raised
    StateError, its copy of the loop gets an epoll instance of its own and its copied
    callbacks do nothing -- a review found the child's loop, on its way out, applying
    two of the parent's Dones from the shared ring (stores in flight at the fork) --
    and the parent serves bit-exact after the fork and closes."""
    parent, child = _run(tmp_path, "engine")
    assert _refused_as_a_fork(child["step"]) and _refused_as_a_fork(child["lookup"])
    # read from the child's copy at once (it hopped to the parent's loop, which never
    # ran there: 5 s, then a StateError that blamed a blocked loop)
    assert child["statistics"][0] == "closed" and child["statistics"][1] < 1.0
    assert child["close_s"] < 1.0
    assert child["applied_in_child"] == 0  # no Done of the parent's read by the child
    assert parent == {"before": True, "after": True, "state_after": "READY",
                      "closed": "CLOSED", "ranks_failed": 0, "ranks_left": 0}
