"""What an engine says about its start: the refusals it saw, the start-timeout error, and
the INFO lines of its lifecycle (logger ``kvshm.engine``).

Every start path -- ``Engine.launch`` (SPAWN and ATTACH) and
``SyncClient.wait_ready`` -- that runs out of time raises :class:`StartTimeout` (a
:class:`~kvshm.errors.KvshmError` and a ``TimeoutError``) whose text says how many ranks
said Hello, which never did, the command to run for them and every refusal the
rendezvous recorded (a worker started with the wrong ``--tp`` is refused there, and the
engine's log and the error say why, not only the worker).

:class:`Refusals` keeps the last :data:`KEEP` refusal reasons (bounded: a client that
retries forever cannot grow it) and logs them at WARNING as they happen, one line per
kind of refusal per :data:`~kvshm.ratelog.INTERVAL_S` (a flood of rogue connections
must not fill a pipe nobody drains and block the scheduler in ``write(2)``; the next
line of a kind says how many were not logged).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Final

from kvshm.config import EngineConfig
from kvshm.errors import KvshmError
from kvshm.ratelog import RateLimitedLog
from kvshm.stats import EngineStats

__all__ = ["KEEP", "Refusals", "StartTimeout", "log", "log_closed", "log_opened",
           "log_ready", "ranges", "start_timeout_error", "workers_command"]

#: The lifecycle logger of every engine (INFO: name, READY, FAILED, shutdown;
#: WARNING: refusals; DEBUG: per-request lines).
log: Final = logging.getLogger("kvshm.engine")

#: Refusal reasons kept for the start-timeout error (the oldest go first).
KEEP: Final = 8


class StartTimeout(KvshmError, TimeoutError):
    """The engine's ranks did not all connect in time. ``connected``: the ranks that said
    Hello; ``missing``: the others; ``refusals``: the reasons of the connections refused
    meanwhile (oldest first)."""

    def __init__(self, message: str, *, connected: tuple[int, ...], missing: tuple[int, ...],
                 refusals: tuple[str, ...]) -> None:
        super().__init__(message)
        self.connected = connected
        self.missing = missing
        self.refusals = refusals


class Refusals:
    """The refusal reasons one engine's rendezvous reported (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._reasons: deque[str] = deque(maxlen=KEEP)
        self.log = RateLimitedLog(log)

    def record(self, reason: str, kind: str = "refused") -> None:
        """Keep ``reason`` and log it (WARNING; rate-limited per ``kind``, the
        rendezvous counter it was counted under)."""
        self._reasons.append(reason)
        self.log.warning(kind, "kvshm engine %r: %s", self._name, reason)

    def reasons(self) -> tuple[str, ...]:
        """The kept reasons, oldest first."""
        return tuple(self._reasons)


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def workers_command(config: EngineConfig) -> str:
    """The ``kvshm-workers`` line that serves this engine's ranks."""
    pp = f" --pp {config.pp}" if config.pp > 1 else ""
    return f"kvshm-workers --name {config.name} --tp {config.tp}{pp}"


def start_timeout_error(config: EngineConfig, connected: set[int], refusals: Refusals,
                        timeout_s: float) -> StartTimeout:
    """The error of a start that ran out of ``timeout_s`` (see the module docstring)."""
    ws = config.world_size
    missing = [r for r in range(ws) if r not in connected]
    reasons = refusals.reasons()
    text = (f"kvshm engine {config.name!r}: {len(connected)} of {ws} ranks connected "
            f"(said Hello) within {timeout_s:g}s; missing rank(s) {ranges(missing)}. "
            f"Standalone workers: run `{workers_command(config)}`; embedded ones attach "
            "from the serving engine's worker processes.")
    if reasons:
        text += f" Refused meanwhile ({len(reasons)} kept): " + "; ".join(reasons)
    return StartTimeout(text, connected=tuple(sorted(connected)), missing=tuple(missing),
                        refusals=reasons)


def log_opened(config: EngineConfig) -> None:
    """INFO, once per engine: its name, its ranks and how to query it."""
    log.info("kvshm engine %r: waiting for %d rank(s); query it with "
             "`kvshm stats --name %s`", config.name, config.world_size, config.name)


def log_ready(config: EngineConfig, num_cpu_blocks: int, bytes_per_block: int) -> None:
    """INFO, once: READY with the CPU tier's size."""
    log.info("kvshm engine %r READY: %d rank(s), CPU tier %d blocks x %d bytes = "
             "%.3g GiB; `kvshm stats --name %s`", config.name, config.world_size,
             num_cpu_blocks, bytes_per_block, num_cpu_blocks * bytes_per_block / 2**30,
             config.name)


def log_closed(stats: EngineStats) -> None:
    """INFO, once: the engine shut down, with what it held and how many ranks failed or
    left (said Goodbye: their host closed them first) while it ran."""
    log.info("kvshm engine %r shut down: %d CPU block(s) cached, %d rank(s) failed, %d "
             "left", stats.name, stats.cpu_blocks_cached,
             stats.counters.get("ranks_failed", 0), stats.counters.get("ranks_left", 0))
