"""TEMPORARY stand-in for workers.worker.Worker (embedded API) until it lands.

Real parts only: rendezvous client, ring segment, WorkerChannel, host pool, CPU copy
engine. Same API as agreed: attach / begin_step / submit_loads / submit_stores / poll /
close. Delete once workers/worker.py exists.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from kvshm.channel import WorkerChannel
from kvshm.errors import PeerDied, TransportError, WouldBlock
from kvshm.layout import KVLayout
from kvshm.protocol import PROTOCOL_VERSION, Direction, Done, Hello, Transfer
from kvshm.rendezvous_client import RendezvousClient
from kvshm.ring import RingPair, segment_size
from kvshm.shm import map_segment
from workers.copy_engine import CopyJob
from workers.cpu_copy import CpuCopyEngine
from workers.host_pool import HostPool


class Worker:
    def __init__(self, name: str, rank: int, world_size: int, layout: KVLayout,
                 fault: Any) -> None:
        self.name, self.rank, self.world_size = name, rank, world_size
        self.layout = layout
        self.fault = fault
        self.client: RendezvousClient | None = None
        self.chan: WorkerChannel | None = None
        self.engine: CpuCopyEngine | None = None
        self.queued: list[Transfer] = []
        self.step = -1
        self.detached = False
        self._seg: Any = None

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int,
               regions: Sequence[torch.Tensor] | None, *, kv_outer: bool = False,
               fault: Any = None) -> Worker:
        assert regions is not None
        return cls(name, rank, world_size, KVLayout.from_tensors(regions, kv_outer=kv_outer),
                   fault)

    def begin_step(self, step: int, flush_ids: Sequence[int] = ()) -> None:
        self.step = step
        if self.detached:
            return
        if self.client is None:
            client = RendezvousClient(self.name)
            try:
                client.connect_nowait()
            except (PeerDied, WouldBlock):
                client.close()
                return
            client.send_hello(Hello(PROTOCOL_VERSION, self.rank, self.world_size, os.getpid(),
                                    self.layout.to_spec()))
            self.client = client
            return
        if self.chan is None:
            got = self.client.poll_ready()
            if got is None:
                return
            ready, fds = got
            ring_fd, host_fd, cmd_efd, done_efd = fds[:4]
            self._seg = map_segment(ring_fd, segment_size(ready.cmd_capacity,
                                                          ready.done_capacity))
            rings = RingPair.attach(self._seg.buf)
            self.chan = WorkerChannel(self.rank, rings, cmd_efd, done_efd, None, spin_us=0)
            host = HostPool.from_fd(host_fd, ready, pin=False)
            self.engine = CpuCopyEngine(self.rank, self.layout, host, fault=self.fault)
        self._pull()

    def _pull(self) -> None:
        assert self.chan is not None
        try:
            msgs = self.chan.receive_nowait()
        except TransportError:
            self.detached = True
            return
        for m in msgs:
            if isinstance(m, Transfer):
                self.queued.append(m)

    def _submit(self, step: int, direction: Direction) -> None:
        if self.engine is None:
            return
        self._pull()
        keep = []
        for t in self.queued:
            if t.step <= step and t.direction == direction:
                self.engine.submit(CopyJob.from_transfer(t))
            else:
                keep.append(t)
        self.queued = keep

    def submit_loads(self, step: int, after: Any = None) -> None:
        self._submit(step, Direction.LOAD)

    def submit_stores(self, step: int, after: Any = None) -> None:
        self._submit(step, Direction.STORE)

    def poll(self) -> list[Done]:
        if self.engine is None or self.chan is None:
            return []
        dones = self.engine.poll()
        if dones and not self.detached:
            try:
                self.chan.send_many(dones)
            except TransportError:
                self.detached = True
        return dones

    def statistics(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.chan is not None:
            self.chan.close()
        if self.client is not None:
            self.client.close()
