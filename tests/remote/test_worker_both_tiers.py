"""A worker rank with both lower tiers (a real Valkey and a real slab file): the order in
which the rank hands a step's Disk and Remote jobs to its two movers.

The scheduler posts the WRITE of a block a GET's allocation evicted (its write-down)
before the GET into the same row; on the rank, the remote mover's GET asks the disk
mover's row fence, which sees only the WRITEs submitted so far. So the link must submit
the Disk jobs it took before the Remote ones: the other way round, the remote mover's
thread may start the GET before the WRITE is registered, and the WRITE then stores the
GET's bytes under the victim's hash -- a later READ is a clean HIT with another block's
KV. (Found in review: the link ran Remote first.)
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from pathlib import Path

import msgspec
import torch
from worker_rig import Sched

from kvshm.ipc.protocol import (
    Disk,
    DiskOp,
    DiskSetup,
    Hello,
    Ready,
    Remote,
    RemoteOp,
    RemoteSetup,
    pack_ids,
)
from kvshm.remote.server import ValkeyServer
from workers.worker import Phase, Worker

FP = "both-tiers.bs4"
NB = 32
ROW = 4096


class BothTiers(Sched):
    """The worker rig's scheduler whose Ready names a disk tier and a remote tier."""

    def __init__(self, url: str, disk: DiskSetup) -> None:
        self._url, self._disk = url, disk
        super().__init__(1, num_cpu_blocks=NB)

    def _make_ready(self, hellos: Mapping[int, Hello]) -> dict[int, tuple[Ready, list[int]]]:
        remote = RemoteSetup(self._url, FP)
        return {r: (msgspec.structs.replace(ready, remote=remote, disk=self._disk), fds)
                for r, (ready, fds) in super()._make_ready(hellos).items()}


def _remote(job_id: int, op: RemoteOp, rows: list[int], h: bytes) -> Remote:
    return Remote(job_id, op, pack_ids(rows), h, len(h))


def _disk(job_id: int, op: DiskOp, rows: list[int], slots: list[int], h: bytes) -> Disk:
    return Disk(job_id, op, pack_ids(rows), pack_ids(slots), h, len(h))


def _rank(tmp_path: Path, valkey: ValkeyServer) -> tuple[BothTiers, Worker]:
    """One embedded rank, READY, its mover publisher stopped (so that the two jobs of
    one post are taken in one host call, as one ring batch is)."""
    sched = BothTiers(valkey.url, DiskSetup(str(tmp_path / "r0.slab"), 16, FP, True))
    worker = Worker.attach(sched.name, 0, 1, [torch.zeros((NB, ROW), dtype=torch.uint8)])
    sched.wait_for(lambda: worker.phase is Phase.READY, tick=worker.service, what="READY")
    worker._stop_publisher()
    return sched, worker


def test_the_victims_write_is_registered_before_the_get_that_reuses_its_row(
        tmp_path: Path, valkey: ValkeyServer) -> None:
    """Row 0 holds block V; X is on the server (PUT from row 3). The scheduler posts, as
    for a GET whose allocation evicted V: WRITE row 0 -> slot 5 (V's write-down), then
    GET X into row 0. The host thread is made to lose the CPU for 0.3 s at the start of
    the disk mover's submit (a GIL switch in a busy process, made long): the remote
    mover must not have the GET yet. Both jobs end ok, row 0 holds X, and slot 5 read
    back into row 2 holds V's bytes -- not X's (run Remote before Disk in the link and
    it holds X's, a HIT: the failure this test was written for). The movers got the
    jobs in the order posted."""
    sched, worker = _rank(tmp_path, valkey)
    try:
        s = worker._session
        assert s is not None and s.remote is not None and s.disk is not None
        rows = s.host.regions[0]
        rows[0:4].copy_(torch.randint(0, 256, (4, ROW), dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(5)))
        v_bytes, x_bytes = rows[0].clone(), rows[3].clone()
        hx, hv = hashlib.sha256(b"x").digest(), hashlib.sha256(b"v").digest()
        sched.post(_remote(1, RemoteOp.PUT, [3], hx))
        assert sched.collect([1], timeout=10, tick=worker.service)[0][1].ok
        order: list[str] = []
        disk_submit, remote_submit = s.disk.submit, s.remote.submit

        def late_disk(job: Disk) -> None:
            order.append("disk")
            time.sleep(0.3)
            disk_submit(job)

        def remote(job: Remote) -> None:
            order.append("remote")
            remote_submit(job)
        s.disk.submit = late_disk  # type: ignore[method-assign]
        s.remote.submit = remote  # type: ignore[method-assign]
        sched.post(_disk(2, DiskOp.WRITE, [0], [5], hv), _remote(3, RemoteOp.GET, [0], hx))
        done = sched.collect([2, 3], timeout=10, tick=worker.service)[0]
        assert done[2].ok and done[3].ok and order == ["disk", "remote"]
        assert torch.equal(rows[0], x_bytes)
        s.disk.submit = disk_submit  # type: ignore[method-assign]
        sched.post(_disk(4, DiskOp.READ, [2], [5], hv))
        assert sched.collect([4], timeout=10, tick=worker.service)[0][4].ok
        assert torch.equal(rows[2], v_bytes), "slot 5 holds the GET's bytes under V's hash"
    finally:
        worker.close()
        sched.close()
