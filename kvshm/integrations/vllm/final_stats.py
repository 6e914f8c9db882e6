"""What the scheduler side writes to ``stats_path`` when vLLM shuts it down.

vLLM stops its workers before it shuts the scheduler's connector down
(``EngineCore.shutdown``: the executor first, then the scheduler), so by the time
``SchedulerSide.shutdown`` runs the workers have usually closed their lifelines. Read
after that EOF and after ``close``, the statistics would describe the teardown (every
rank dead, the CPU index dropped, the engine FAILED) rather than the engine that served.

The rule: the file carries the last snapshot taken while the engine was READY with
every rank attached, as close to the shutdown as possible, in this order of preference:

1. taken in ``shutdown`` before ``close``, when the engine is still READY there (nothing
   was torn down yet: the in-flight work was drained first);
2. taken in ``shutdown`` before any pump, when the engine was READY on entry;
3. the one the service thread took just before the pump that saw the engine leave READY,
   if that happened at most :data:`DETACH_WINDOW_S` before the shutdown (the workers
   closing ahead of the scheduler); an older loss is a failure and is reported as one.

Its ``state`` is replaced by the state after ``close`` (``closed``), its ``connector``
counters by the final ones, and ``teardown`` says which snapshot it is and which ranks
had already detached (nothing is hidden: a rank lost before the window shows as lost).
"""

from __future__ import annotations

import enum
import json
import os
from typing import Any, Final

__all__ = ["DETACH_WINDOW_S", "SnapshotSource", "final_statistics", "write_json"]

#: How long before the connector's shutdown a rank may detach and still count as part
#: of vLLM's shutdown (vLLM's multi-process Worker takes ~5 s to exit).
DETACH_WINDOW_S: Final = 60.0


class SnapshotSource(enum.Enum):
    """Which statistics the file carries (``teardown.snapshot``)."""

    BEFORE_CLOSE = "before_close"  # rule 1
    ON_SHUTDOWN = "on_shutdown"  # rule 2
    BEFORE_WORKERS_DETACHED = "before_workers_detached"  # rule 3
    AFTER_CLOSE = "after_close"  # no READY snapshot applies: the engine as it ended


def _dead_ranks(stats: dict[str, Any]) -> list[int]:
    return [int(r["rank"]) for r in stats.get("ranks", ()) if not r.get("alive", True)]


def final_statistics(snapshot: dict[str, Any] | None, source: SnapshotSource,
                     after_close: dict[str, Any]) -> dict[str, Any]:
    """The file's content: ``snapshot`` (from ``source``) with the final state and
    connector counters of ``after_close``; ``after_close`` itself when there is none."""
    if snapshot is None:
        out = dict(after_close)
        out["teardown"] = {"snapshot": SnapshotSource.AFTER_CLOSE.value,
                           "ranks_detached": _dead_ranks(after_close)}
        return out
    out = dict(snapshot)
    out["state"] = after_close["state"]
    if "connector" in after_close:
        out["connector"] = after_close["connector"]
    gone = [r for r in _dead_ranks(after_close) if r not in _dead_ranks(snapshot)]
    out["teardown"] = {"snapshot": source.value, "ranks_detached": gone}
    return out


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True, default=str)
    os.replace(tmp, path)
