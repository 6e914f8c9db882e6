"""Rank supervision: each rank's :class:`RankWatch`, and the verdict, the fence and the
hang check over all of them (:class:`Supervisor`).

A rank is declared dead -- the *verdict*, once per rank -- on lifeline EOF, pidfd exit
(spawned), a broken ring, or a hang. A rank is *stalled* while it has Transfers
outstanding and has made no progress since the last progress mark: no Transfer's Done
arrived and its copy progress stamp (``RingPair.last_progress_ns``: the CPU copy engine
stamps it every few thousand ``memmove`` calls of a long copy) did not move. The
stall clock counts wall time for a worker that runs on its own (spawned or standalone)
and, for an embedded worker, only the time between two looks at which its heartbeat had
advanced -- an embedded worker does nothing while its host engine is not calling it, and
that is not a hang. A rank stalled for ``hang_timeout_s`` is hung. (A job of 100,000
blocks over 80 layers took 10 s and more on an oversubscribed machine: before the stamp
counted, a rank copying all along was declared hung, a hostile probe.)

**A block that a rank may still touch is never handed out again until that rank is
fenced.** Declared dead is not fenced. The verdict sets the rank's revocation word (so
a rank that resumes starts nothing and publishes nothing) and fails its jobs, but their
pins stay (quarantined, ``quarantined_*_blocks`` in the statistics) until a proof that
nothing of the rank runs any more: its process exited (spawned ranks are SIGKILLed at
the verdict and watched by pidfd; every rank's process by a pidfd opened at its Hello)
or its lifeline closed -- kvshm's worker closes its socket only once none of its copies
runs (``Worker.close`` waits for them; a detached or revoked worker keeps the socket
until they finish). A rank that stays hung gives neither: for an embedded rank inside a
live host process its quarantine then lasts for the engine's life.

Ordering, per rank: the verdict comes before the fence (a fence that arrives first --
the process exited -- brings its verdict with it, in that order); each happens at most
once; a spawned rank is killed only after its verdict's consequences ran.
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Callable

from kvshm.engine.snapshot import CoreCounters
from kvshm.ipc.protocol import Hello
from kvshm.ipc.ring_pair import RevokeReason
from kvshm.ipc.sched_channel import SchedulerChannel
from kvshm.stats import LatencyWindow, RankStats

__all__ = ["RankWatch", "Supervisor"]


class RankWatch:
    """What the scheduler tracks of one rank (see the module docstring)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pid = 0
        self.embedded = False
        self.alive = True
        self.fenced = False  # proven unable to touch a block (process exited / EOF)
        self.detached = False  # left at the engine's close: not a failure
        self.exitcode: int | None = None
        self.why = ""
        self.acks = 0
        self.failed_acks = 0
        self.latency = LatencyWindow()
        self._chan: SchedulerChannel | None = None
        self._stall_s = 0.0
        self._last_look: float | None = None
        self._last_beat = -1
        self._last_progress = 0
        self._pidfd: int | None = None
        self.killable = False  # offered fence_by_kill in its Hello, and a pidfd holds it

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
        self.killable = (hello is not None and hello.fence_by_kill and pid != os.getpid()
                         and self._pidfd is not None)

    def kill(self) -> bool:
        """SIGKILL the rank's process through its pidfd (never a reused pid); True when
        the signal went (its exit, seen by :meth:`process_exited`, then fences it)."""
        if self._pidfd is None:
            return False
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        except OSError:  # gone already (its exit fences it), or not ours to signal
            return False
        return True

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
        stamp = chan.rings.last_progress_ns
        if stamp != self._last_progress:  # a long copy went on: progress
            self._last_progress = stamp
            self._stall_s = 0.0
            return 0.0
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
                         detached=self.detached, why=self.why,
                         acks=self.acks,
                         failed_acks=self.failed_acks,
                         ack_latency_us=self.latency.summary_us(),
                         ack_latency_hist=self.latency.histogram(),
                         channel=chan.statistics().as_dict() if chan is not None else {})


class Supervisor:
    """Every rank's :class:`RankWatch`, and the verdict, fence and hang rules over them.

    What a verdict and a fence mean for the rest of the engine is the runtime's:
    ``on_verdict(rank, exitcode, revoke)`` runs once per rank, right after its watch is
    marked dead (and before a spawned rank is killed); ``on_fence(rank)`` runs once per
    rank, right after its watch is marked fenced. Runs on the runtime's one thread.
    """

    def __init__(self, world_size: int, hang_timeout_s: float, counters: CoreCounters, *,
                 spawned: bool, on_verdict: Callable[[int, int | None, RevokeReason], None],
                 on_fence: Callable[[int], None]) -> None:
        self.watch: dict[int, RankWatch] = {r: RankWatch(r) for r in range(world_size)}
        self._hang_timeout_s = hang_timeout_s
        self._counters = counters
        self._spawned = spawned
        self._on_verdict = on_verdict
        self._on_fence = on_fence
        self._kill: Callable[[int], None] | None = None

    def set_killer(self, kill: Callable[[int], None]) -> None:
        """``kill(rank)``: SIGKILL a rank this engine spawned (SPAWN mode); its pidfd then
        reports the exit, which fences the rank (:meth:`rank_died` with ``fenced``)."""
        self._kill = kill

    def rank_died(self, rank: int, exitcode: int | None, *, why: str, fenced: bool,
                  revoke: RevokeReason) -> None:
        """``rank`` is gone or must be treated so: the verdict (once), then maybe the
        fence (once). ``fenced``: this news proves the rank stopped -- its process exited
        or it closed its lifeline itself. A spawned rank not fenced by this news is
        SIGKILLed at the verdict, so its fence follows in milliseconds; a rank that
        stays hung in a live process (embedded, or standalone that kvshm may not
        signal) stays quarantined."""
        watch = self.watch[rank]
        if watch.alive:
            watch.died(exitcode, why)
            self._counters.ranks_failed += 1
            self._on_verdict(rank, exitcode, revoke)
            if not fenced:
                self._fence_by_kill(rank, watch)
        if fenced and not watch.fenced:
            watch.fenced = True
            self._on_fence(rank)

    def _fence_by_kill(self, rank: int, watch: RankWatch) -> None:
        """After a verdict that is no fence: SIGKILL a rank whose process may be killed
        -- one this engine spawned, or one that offered it (``Hello.fence_by_kill``: a
        ``kvshm-workers`` rank, whose process runs nothing but copies) -- so that its
        fence follows in milliseconds. Before, a hung ``kvshm-workers`` rank stayed
        unfenced, and the request whose load it held recomputed into blocks the rank
        could still write when it woke (its own blocks: the quarantine keeps them from
        other requests only)."""
        if self._spawned and self._kill is not None:
            self._kill(rank)
        elif watch.killable and watch.kill():
            self._counters.ranks_killed_to_fence += 1

    def rank_left(self, rank: int, why: str) -> None:
        """``rank``'s worker said Goodbye, then closed its lifeline: its host closed it (a
        shutdown under way). Not a failure -- ``ranks_left`` moves, ``ranks_failed`` does
        not, the watch is marked detached -- but its unacked jobs end as at a verdict
        (``on_verdict`` with ``RevokeReason.LEFT``), and its EOF is the fence."""
        watch = self.watch[rank]
        if watch.alive:
            watch.died(None, f"left: {why}")
            watch.detached = True
            self._counters.ranks_left += 1
            self._on_verdict(rank, None, RevokeReason.LEFT)
        if not watch.fenced:
            watch.fenced = True
            self._on_fence(rank)

    def detach_all(self, why: str) -> None:
        """The engine began closing: every rank still alive detaches (``why``); a loss
        seen from here on is no verdict and no failure (the runtime ignores it)."""
        for watch in self.watch.values():
            if watch.alive and not watch.detached:
                watch.detached, watch.why = True, why

    def check_hangs(self, now: float) -> None:
        """The verdict for every live rank stalled for ``hang_timeout_s`` (rank order)."""
        for rank, watch in self.watch.items():
            if watch.alive and watch.stalled_for(now) >= self._hang_timeout_s:
                self._counters.hangs += 1
                self.rank_died(rank, None, why=f"hung: no job completed for "
                               f"{self._hang_timeout_s}s with jobs pending", fenced=False,
                               revoke=RevokeReason.HUNG)

    def fence_exited(self) -> None:
        """The fence of every quarantined rank whose process has exited since."""
        for rank, watch in self.watch.items():
            if not watch.alive and not watch.fenced and watch.process_exited():
                self.rank_died(rank, None, why="process exited", fenced=True,
                               revoke=RevokeReason.DIED)

    def snapshots(self) -> list[RankStats]:
        """Every rank's statistics record, in rank order."""
        return [w.snapshot() for w in self.watch.values()]

    def close(self) -> None:
        """Release every watch's pidfd (idempotent)."""
        for watch in self.watch.values():
            watch.close()
