"""An embedded worker's remote jobs (workers.link + workers.remote_mover) on a real Valkey:
the mover's own thread publishes each job's Done on the ``done`` ring the moment the job
ends, without waking the publisher thread or waiting for the host's next call.

The scheduler side is the worker rig's (real rendezvous, real rings); the worker is a
real embedded :class:`~workers.worker.Worker` (vLLM's kind: it runs only inside its
host's hooks) whose Ready names the server."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import msgspec
import torch
from worker_rig import Sched

from kvshm.ipc.protocol import Hello, Ready, Remote, RemoteOp, RemoteSetup, pack_ids
from kvshm.remote.server import ValkeyServer

FP = "test-publish.bs4"
NB = 32
ROW = 4096


class RemoteSched(Sched):
    """The worker rig's scheduler side, each Ready naming the remote tier at ``url``."""

    def __init__(self, world: int, url: str, **kw: object) -> None:
        self._url = url
        super().__init__(world, **kw)  # type: ignore[arg-type]

    def _make_ready(self, hellos: Mapping[int, Hello]) -> dict[int, tuple[Ready, list[int]]]:
        setup = RemoteSetup(self._url, FP)
        return {r: (msgspec.structs.replace(ready, remote=setup), fds)
                for r, (ready, fds) in super()._make_ready(hellos).items()}


def _job(job_id: int, op: RemoteOp, rows: list[int], hashes: list[bytes]) -> Remote:
    return Remote(job_id, op, pack_ids(rows), b"".join(hashes), len(hashes[0]))


def test_the_mover_thread_publishes_its_done_with_no_publisher_and_no_host_call(
        valkey: ValkeyServer) -> None:
    """The attack on latency: in a busy vLLM process every thread hop of a hand-off's
    GET waits up to the switch interval for the GIL. Here the publisher thread is
    stopped (as if it were never scheduled) and the host never calls the worker once a
    job is taken off the ring: a PUT's and then a GET's Done still reach the scheduler,
    published by the mover's own thread (counted ``published_on_mover``), the GET's only
    after its rows hold the bytes. Without the mover's hook both Dones wait in its
    outbox for ever."""
    from workers.worker import Phase, Worker

    sched = RemoteSched(1, valkey.url, num_cpu_blocks=NB)
    region = torch.zeros((NB, ROW), dtype=torch.uint8)
    worker = Worker.attach(sched.name, 0, 1, [region])
    try:
        sched.wait_for(lambda: worker.phase is Phase.READY, tick=worker.service, what="READY")
        worker._stop_publisher()  # the publisher never runs: only the mover may publish
        assert worker._session is not None and worker._session.remote is not None
        rows = worker._session.host.regions[0]
        rows[0:4].copy_(torch.randint(0, 256, (4, ROW), dtype=torch.uint8))
        want = rows[0:4].clone()
        hs = [hashlib.sha256(bytes([k])).digest() for k in range(4)]
        taken = worker.statistics()["counters"].get("jobs_submitted", 0)
        sched.post(_job(1, RemoteOp.PUT, [0, 1, 2, 3], hs))
        sched.wait_for(lambda: worker.statistics()["counters"].get("jobs_submitted", 0)
                       > taken, tick=worker.service, what="the PUT taken off the ring")
        assert sched.collect([1], timeout=10)[0][1].ok  # no worker call in between
        sched.post(_job(2, RemoteOp.GET, [10, 11, 12, 13], hs))
        sched.wait_for(lambda: worker.statistics()["counters"].get("jobs_submitted", 0)
                       > taken + 1, tick=worker.service, what="the GET taken off the ring")
        assert sched.collect([2], timeout=10)[0][2].ok
        assert torch.equal(rows[10:14], want)
        counts = worker._session.remote.counts
        assert counts["published_on_mover"] == 2 and counts["finish_hook_errors"] == 0
    finally:
        worker.close()
        sched.close()
