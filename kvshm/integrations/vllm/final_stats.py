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
   if that happened at most :data:`DETACH_WINDOW_S` before the shutdown and no hook ran
   since (the workers closing ahead of the scheduler); an older loss, or one vLLM served
   on after (a hook ran: the snapshot holds that moment's loads in flight and their
   pins), is reported as the engine ended.

Its ``state`` is replaced by the state after ``close`` (``closed``), its ``connector``
counters by the final ones, and ``teardown`` says which snapshot it is and which ranks
had already detached (nothing is hidden: a rank lost before the window shows as lost).

While the engine serves, the file is rewritten with each statistics report (at most once
a second while busy, once when it goes idle: :mod:`~kvshm.integrations.vllm.reports`),
``teardown.snapshot`` = ``live`` (:func:`live_statistics`): vLLM's default
``shutdown_timeout`` of 0 SIGKILLs the engine core before the connector's shutdown can
write it, and the file then holds the last report's statistics instead of nothing.

The final-statistics line (:data:`FINAL_LINE`, :func:`final_line`): one INFO line per
engine with the counters an operator reads first, logged once (:class:`FinalLines`, one
per process, remembers what it logged):

* by the scheduler side's shutdown, from the statistics the file gets, when its reports
  did not reach vLLM's stat loggers or reached them in this same process;
* else by vLLM's front end (the API server) when its process exits, from the sums of
  the reports it received: vLLM's default ``shutdown_timeout`` of 0 SIGKILLs the engine
  core right after asking it to stop, so only the front end, the process that kills,
  is sure to log anything after that.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["DETACH_WINDOW_S", "FINAL_COUNTERS", "FINAL_GAUGES", "FINAL_LINE", "FINAL_LINES",
           "FinalLines", "SnapshotSource", "final_line", "final_statistics",
           "live_statistics", "write_json"]

log = logging.getLogger("kvshm.vllm")

#: How long before the connector's shutdown a rank may detach and still count as part
#: of vLLM's shutdown (vLLM's multi-process Worker takes ~5 s to exit).
DETACH_WINDOW_S: Final = 60.0


class SnapshotSource(enum.Enum):
    """Which statistics the file carries (``teardown.snapshot``)."""

    BEFORE_CLOSE = "before_close"  # rule 1
    ON_SHUTDOWN = "on_shutdown"  # rule 2
    BEFORE_WORKERS_DETACHED = "before_workers_detached"  # rule 3
    AFTER_CLOSE = "after_close"  # no READY snapshot applies: the engine as it ended
    LIVE = "live"  # written while serving; a file still saying so: no clean close


#: The final-statistics line's format (``log.info(FINAL_LINE, name, source, values)``).
FINAL_LINE: Final = "kvshm: engine %r final statistics (%s): %s"
#: The families the line shows, in this order (:mod:`kvshm.series` names).
FINAL_COUNTERS: Final = ("kvshm_hit_tokens", "kvshm_lookups", "kvshm_loaded_blocks",
                         "kvshm_loaded_bytes", "kvshm_stored_blocks", "kvshm_stored_bytes",
                         "kvshm_loads_failed", "kvshm_jobs_failed", "kvshm_ranks_failed")
FINAL_GAUGES: Final = ("kvshm_cpu_blocks_cached", "kvshm_num_cpu_blocks",
                       "kvshm_pins_held", "kvshm_jobs_in_flight")


def final_line(counters: dict[str, int], gauges: dict[str, float]) -> str:
    """The values of the final-statistics line: ``hit_tokens=256 lookups=3 ...``
    (family names without ``kvshm_``; a family missing from both dicts is left out)."""
    parts = [f"{k[6:]}={counters[k]}" for k in FINAL_COUNTERS if k in counters]
    parts += [f"{k[6:]}={int(gauges[k])}" for k in FINAL_GAUGES if k in gauges]
    return " ".join(parts)


def _detached_ranks(stats: dict[str, Any]) -> list[int]:
    """The ranks that left at the engine's close or said Goodbye (``detached``), not
    those a verdict failed while it served (an observability probe: a rank failed 2 s
    before the shutdown was listed as detached, in the live file too)."""
    return [int(r["rank"]) for r in stats.get("ranks", ()) if r.get("detached", False)]


def final_statistics(snapshot: dict[str, Any] | None, source: SnapshotSource,
                     after_close: dict[str, Any]) -> dict[str, Any]:
    """The file's content: ``snapshot`` (from ``source``) with the final state and
    connector counters of ``after_close``; ``after_close`` itself when there is none."""
    if snapshot is None:
        out = dict(after_close)
        out["teardown"] = {"snapshot": SnapshotSource.AFTER_CLOSE.value,
                           "ranks_detached": _detached_ranks(after_close)}
        return out
    out = dict(snapshot)
    out["state"] = after_close["state"]
    if "connector" in after_close:
        out["connector"] = after_close["connector"]
    gone = [r for r in _detached_ranks(after_close) if r not in _detached_ranks(snapshot)]
    out["teardown"] = {"snapshot": source.value, "ranks_detached": gone}
    return out


@dataclass
class _Seen:
    """What this process's front end received from one engine: counter sums, latest
    gauges, when; whether its line was logged here."""

    counters: dict[str, int] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    last: float = 0.0
    logged: bool = False


class FinalLines:
    """This process's final-statistics lines (:data:`FINAL_LINES`; module docstring):
    the front end's view of each engine (:meth:`observe`), the scheduler side's line at
    its close (:meth:`at_close`), and the front end's lines at exit (:meth:`at_exit`,
    registered by :meth:`arm`). A line is logged once per engine and process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, _Seen] = {}
        self._armed = False

    def arm(self) -> None:
        """Register :meth:`at_exit` to run when the process exits (once)."""
        with self._lock:
            if not self._armed:
                self._armed = True
                atexit.register(self.at_exit)

    def observe(self, name: str, data: dict[str, Any]) -> None:
        """Add one report (:mod:`~kvshm.integrations.vllm.reports`) of engine ``name``."""
        with self._lock:
            seen = self._seen.setdefault(name, _Seen())
            for key, n in (data.get("counters") or {}).items():
                seen.counters[key] = seen.counters.get(key, 0) + int(n)
            seen.gauges.update(data.get("gauges") or {})
            seen.last = time.monotonic()

    def at_close(self, name: str, stats: dict[str, Any], shipped: bool) -> bool:
        """The scheduler side closed engine ``name`` with final statistics ``stats``:
        log its line unless its reports were ``shipped`` to a front end in another
        process (which logs it). True when it was logged here."""
        from kvshm.series import scalars

        with self._lock:
            seen = self._seen.get(name)
            if shipped and seen is None:
                return False
            self._seen.setdefault(name, _Seen()).logged = True
        counters, gauges = scalars(stats)
        log.info(FINAL_LINE, name, "at its close", final_line(counters, gauges))
        return True

    def at_exit(self) -> None:
        """Log the line of every engine this front end saw and did not log yet."""
        with self._lock:
            todo = [(n, s) for n, s in self._seen.items() if not s.logged]
            for _, seen in todo:
                seen.logged = True
        now = time.monotonic()
        for name, seen in todo:
            log.info(FINAL_LINE, name, f"vLLM's front end at its exit; the engine's last "
                     f"report came {now - seen.last:.1f} s before",
                     final_line(seen.counters, seen.gauges))


#: This process's final-statistics lines.
FINAL_LINES: Final = FinalLines()


def live_statistics(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The file's content while the engine serves: ``snapshot`` as it is, marked
    ``teardown.snapshot`` = ``live`` (replaced by :func:`final_statistics` at a clean
    close)."""
    out = dict(snapshot)
    out["teardown"] = {"snapshot": SnapshotSource.LIVE.value,
                       "ranks_detached": _detached_ranks(snapshot)}
    return out


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it); the
    temporary file is removed when the dump or the rename fails (a ``stats_path`` that
    is a directory left one behind), and the error raised.

    The temporary file is made with ``mkstemp`` in ``path``'s directory as given (a new
    file of a random name, ``O_EXCL``: never an existing file or a link), with the mode
    a plain create would give it (0666 less the umask, where the filesystem keeps
    modes). It was ``<path>.tmp<pid>``, opened with ``open(.., "w")``: a local user who
    could write to ``path``'s directory planted a link under that predictable name, and
    the engine -- root, say -- emptied the file it pointed to and wrote its statistics
    there, at every report (a hostile probe). The directory is not normalised (a review:
    ``dir/link/../s.json`` put the temporary file elsewhere than the rename's target,
    EXDEV at every write)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(path) or ".")
    try:
        with contextlib.suppress(OSError):  # a filesystem without modes keeps its own
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            fd = -1  # the file object owns it now
            json.dump(data, f, indent=1, sort_keys=True, default=str)
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it: a race
    with other threads); 022 where /proc does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
