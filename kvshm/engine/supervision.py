"""Per-rank supervision records and the statistics snapshot of an :class:`Runtime`.

:class:`RankWatch` is the hang rule's state for one rank. A rank is *stalled* while it
has Transfers outstanding and has completed none since the last progress mark; the
stall clock counts wall time for a worker that runs on its own (spawned or standalone)
and, for an embedded worker, only the time between two looks at which its heartbeat had
advanced -- an embedded worker does nothing while its host engine is not calling it, and
that is not a hang.
"""

from __future__ import annotations

import os
import select
from dataclasses import asdict, dataclass

from kvshm.config import EngineConfig
from kvshm.offload.manager import OffloadManager
from kvshm.offload.pool import BlockPool
from kvshm.ipc.protocol import Hello
from kvshm.ipc.sched_channel import SchedulerChannel
from kvshm.stats import EngineStats, LatencyWindow, RankStats

__all__ = ["CoreCounters", "RankWatch", "build_stats"]


@dataclass
class CoreCounters:
    """Engine-level counters (the manager keeps its own); monotonic."""

    store_jobs: int = 0
    load_jobs: int = 0
    lookups_not_ready: int = 0
    ranks_failed: int = 0
    hangs: int = 0
    protocol_errors: int = 0
    refused: int = 0
    done_errors: int = 0  # Dones whose handling raised (their jobs were failed)


class RankWatch:
    """What the scheduler tracks of one rank (see the module docstring)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pid = 0
        self.embedded = False
        self.alive = True
        self.fenced = False  # proven unable to touch a block (process exited / EOF)
        self.exitcode: int | None = None
        self.why = ""
        self.acks = 0
        self.failed_acks = 0
        self.latency = LatencyWindow()
        self._chan: SchedulerChannel | None = None
        self._stall_s = 0.0
        self._last_look: float | None = None
        self._last_beat = -1
        self._pidfd: int | None = None

    def hello(self, pid: int, hello: Hello | None) -> None:
        """The rank said Hello (an embedded worker brings its layout). Its process is
        watched through a pidfd from here on (opened while its connection is open, so
        the pid cannot have been reused yet): the proof that fences it if it exits."""
        self.pid = pid
        self.embedded = hello is not None and hello.layout is not None
        if pid > 0 and self._pidfd is None:
            try:
                self._pidfd = os.pidfd_open(pid)
            except OSError:  # another pid namespace, or gone already: no proof from it
                self._pidfd = None

    def process_exited(self) -> bool:
        """True once the rank's process is known to have exited (its pidfd is readable)."""
        if self._pidfd is None:
            return False
        poller = select.poll()  # not select(): fds >= 1024 are common in a busy server
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        """Release the pidfd (idempotent)."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def ready(self, chan: SchedulerChannel) -> None:
        """The rank got Ready; ``chan`` is its channel."""
        self._chan = chan

    def posted(self, now: float) -> None:
        """A Transfer went to this rank: start the stall clock if it was idle."""
        if self._last_look is None:
            self._last_look = now

    def acked(self, now: float, ok: bool, latency_s: float | None) -> None:
        """A Done arrived: progress, so the stall clock restarts."""
        self.acks += 1
        self.failed_acks += not ok
        if latency_s is not None:
            self.latency.add(latency_s)
        self._stall_s = 0.0
        self._last_look = now

    def died(self, exitcode: int | None, why: str) -> None:
        """Declared dead (never revived)."""
        self.alive = False
        self.exitcode = exitcode
        self.why = why

    def stalled_for(self, now: float) -> float:
        """Seconds of stall counted so far (0 while nothing is outstanding)."""
        chan = self._chan
        if chan is None or chan.closed or chan.outstanding == 0:
            self._stall_s, self._last_look = 0.0, None
            return 0.0
        if self._last_look is None:
            self._last_look = now
        elapsed, self._last_look = now - self._last_look, now
        if self.embedded:
            beat = chan.rings.heartbeat if not chan.closed else self._last_beat
            advanced, self._last_beat = beat != self._last_beat, beat
            if not advanced:
                return self._stall_s
        self._stall_s += elapsed
        return self._stall_s

    def snapshot(self) -> RankStats:
        """The rank's statistics record."""
        chan = self._chan
        return RankStats(rank=self.rank, pid=self.pid, connected=chan is not None,
                         alive=self.alive, fenced=self.fenced, embedded=self.embedded,
                         acks=self.acks,
                         failed_acks=self.failed_acks,
                         ack_latency_us=self.latency.summary_us(),
                         channel=chan.statistics().as_dict() if chan is not None else {})


def build_stats(config: EngineConfig, state: str, manager: OffloadManager | None,
                cpu: BlockPool | None, bytes_per_block: int, watch: dict[int, RankWatch],
                counters: CoreCounters) -> EngineStats:
    """One :class:`EngineStats` snapshot; ``bytes_per_block`` sums every rank's shard."""
    merged: dict[str, int] = dict(asdict(counters))
    stored = loaded = pins = jobs = q_gpu = q_cpu = 0
    if manager is not None:
        q_gpu, q_cpu = manager.quarantined_blocks()
        merged.update(manager.counters.as_dict())
        stored = manager.counters.stored_blocks * bytes_per_block
        loaded = manager.counters.loaded_blocks * bytes_per_block
        pins, jobs = manager.pins_held(), manager.num_jobs_in_flight
    return EngineStats(
        name=config.name, state=state, world_size=config.world_size,
        num_cpu_blocks=cpu.num_blocks if cpu is not None else 0,
        cpu_blocks_cached=cpu.num_hashes if cpu is not None else 0,
        pins_held=pins, jobs_in_flight=jobs, stored_bytes=stored, loaded_bytes=loaded,
        quarantined_gpu_blocks=q_gpu, quarantined_cpu_blocks=q_cpu,
        counters=merged, ranks=[w.snapshot() for w in watch.values()])
