"""A synchronous test scheduler side for the worker tests: rendezvous + provision + channels.

Real parts only: :class:`RendezvousServer` on an abstract socket, :func:`provision` (real
unlinked segments and eventfds), one :class:`SchedulerChannel` per rank. Nothing here
waits except :meth:`Sched.wait_for` / :meth:`Sched.collect`, which poll with short sleeps
and a deadline (callers pass a ``tick`` to drive in-process workers meanwhile).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import torch

from kvshm.engine.provision import Provisioned, provision
from kvshm.errors import WorkerDied
from kvshm.ipc.protocol import CmdMsg, Direction, Done, Hello, Ready, Transfer, pack_ids
from kvshm.ipc.rendezvous import RendezvousServer
from kvshm.ipc.rendezvous_events import EventKind, RendezvousEvent
from kvshm.ipc.sched_channel import SchedulerChannel


def unique_name() -> str:
    return f"wtest-{os.getpid()}-{uuid.uuid4().hex[:10]}"


def transfer(step: int, job: int, direction: Direction, src: Sequence[int],
             dst: Sequence[int]) -> Transfer:
    return Transfer(step, job, direction, pack_ids(src), pack_ids(dst))


def rank_lost_error(ev: RendezvousEvent) -> WorkerDied:
    """A RANK_LOST event as the typed error the engine raises for it."""
    assert ev.kind is EventKind.RANK_LOST
    return WorkerDied(ev.rank, None, ev.reason)


class Sched:
    """Scheduler side for ``world`` ranks; ``device_caches`` for standalone workers."""

    def __init__(self, world: int, *, device_caches: Sequence[Sequence[torch.Tensor]] | None = None,
                 num_cpu_blocks: int = 512, capacity: int | None = None) -> None:
        self.name = unique_name()
        self.world = world
        self._caches = device_caches
        self._cpu = num_cpu_blocks
        self._capacity = capacity
        self.prov: Provisioned | None = None
        self.chans: dict[int, SchedulerChannel] = {}
        self.events: list[RendezvousEvent] = []
        self.dones: dict[int, list[Done]] = {r: [] for r in range(world)}
        self.server = RendezvousServer(self.name, world, make_ready=self._make_ready,
                                       stats=dict)

    def _make_ready(self, hellos: Mapping[int, Hello]) -> dict[int, tuple[Ready, list[int]]]:
        self.prov = provision(hellos, world_size=self.world, device_caches=self._caches,
                              num_cpu_blocks=self._cpu, cpu_bytes_per_rank=None,
                              capacity=self._capacity)
        return self.prov.ready_plan()

    def service(self) -> list[RendezvousEvent]:
        """Rendezvous work, then every Done that arrived (kept in ``self.dones``)."""
        evs = self.server.service()
        self.events += evs
        for ev in evs:
            if ev.kind in (EventKind.ALL_READY, EventKind.READY_FAILED) and self.prov:
                self.prov.close_sent_fds()
            if ev.kind is EventKind.ALL_READY:
                assert self.prov is not None
                self.chans = {r: res.make_channel() for r, res in self.prov.ranks.items()}
        for rank, chan in self.chans.items():
            if not chan.closed:
                self.dones[rank] += chan.receive_nowait()
        return evs

    def ready(self) -> bool:
        return any(e.kind is EventKind.ALL_READY for e in self.events)

    def lost(self) -> list[RendezvousEvent]:
        return [e for e in self.events if e.kind is EventKind.RANK_LOST]

    def post(self, *msgs: CmdMsg, ranks: Sequence[int] | None = None) -> None:
        for rank in range(self.world) if ranks is None else ranks:
            for msg in msgs:
                self.chans[rank].post(msg)

    def wait_for(self, cond: Callable[[], bool], timeout: float = 20.0,
                 tick: Callable[[], object] | None = None, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while True:
            if tick is not None:
                tick()
            self.service()
            if cond():
                return
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.002)

    def collect(self, job_ids: Sequence[int], timeout: float = 20.0,
                tick: Callable[[], object] | None = None) -> dict[int, dict[int, Done]]:
        """rank -> job -> Done for ``job_ids`` from every rank (waits for all of them)."""
        want = set(job_ids)

        def have() -> bool:
            return all(want <= {d.job_id for d in self.dones[r]} for r in range(self.world))

        self.wait_for(have, timeout, tick, f"Dones of jobs {sorted(want)}")
        return {r: {d.job_id: d for d in ds if d.job_id in want} for r, ds in self.dones.items()}

    def close(self) -> None:
        for chan in self.chans.values():
            chan.close()
        if self.prov is not None:
            self.prov.close()
        self.server.close()


def live_children() -> set[int]:
    """This process's live (not yet reaped, not zombie) child processes."""
    me, out = str(os.getpid()), set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            out.add(int(pid))
    return out
