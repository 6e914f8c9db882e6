"""What one engine step's calls service, on both sides of the link (real rendezvous
socket, shared-memory rings, copy threads): the worker reads its lifeline (the
rendezvous socket) once a step, in ``begin_step``; ``SyncClient.poll`` and
``has_pending_work`` with ``rendezvous=False`` leave a READY engine's rendezvous to the
step's other pump, but never hold up the handshake; the CPU copy engine's notify fd
stays readable exactly while a finish is unreported, whichever call took its Done.

Why: each socket or eventfd read is a syscall, and a syscall in a process whose copy
threads run hands them the GIL; a busy vLLM engine then waits for it in every hook
(measured with ``tools.bench_e2e --dump``: 4 lifeline reads and 4 eventfd reads a step
on the worker side, 2-3 rendezvous reads on the scheduler side)."""

from __future__ import annotations

import select
import time

import torch
from engine_rig import GPU_BLOCKS, ROW, config
from test_cpu_copy import WAIT_S, collect, drained_by_polls, make_layout, rank_tensors
from test_worker import STORE, linked
from worker_rig import transfer

from kvshm.engine import EngineState, SyncClient
from kvshm.offload.pool import BlockPool
from kvshm.shm import shared_tensor
from workers.copy_engine import CopyJob, CpuFence
from workers.cpu_copy import CpuCopyEngine
from workers.host_pool import HostPool
from workers.worker import DetachReason, Phase, Worker


def test_the_step_reads_the_lifeline_in_begin_step_only() -> None:
    """The scheduler side goes away after ``begin_step``: the step's ``submit_*`` and
    ``poll`` do not read the socket (the worker stays READY and its store still runs
    and reports); the next ``begin_step`` reads the EOF and detaches (PEER_DIED)."""
    with linked(1, nb=64) as (sched, ws, _):
        w = ws[0]
        sched.post(transfer(1, 1, STORE, [0, 1], [0, 1]))
        w.begin_step(1)
        sched.close()
        w.submit_loads(1)
        w.submit_stores(1)
        got = w.wait([1], WAIT_S) + w.poll()
        assert [(d.job_id, d.ok) for d in got] == [(1, True)]
        assert w.phase is Phase.READY
        w.begin_step(2)
        assert (w.phase, w.detach_reason) == (Phase.DETACHED, DetachReason.PEER_DIED)


def _ready_pair() -> tuple[SyncClient, Worker]:
    """A one-rank SyncClient and its embedded Worker, READY through pumps that skip the
    rendezvous (``rendezvous=False`` services it while the handshake runs)."""
    cfg = config(tp=1)
    client = SyncClient(cfg, gpu_blocks=BlockPool(GPU_BLOCKS))
    kv = shared_tensor((GPU_BLOCKS, ROW), torch.uint8)
    worker = Worker.attach(cfg.name, 0, 1, [kv])
    deadline = time.monotonic() + 30
    while client.state is not EngineState.READY or worker.phase is not Phase.READY:
        assert time.monotonic() < deadline, "no READY in 30 s"
        worker.service()
        client.poll(rendezvous=False)
        time.sleep(0.002)
    return client, worker


def test_a_ready_client_reads_the_rendezvous_only_when_asked() -> None:
    """The rank closes (Goodbye, then EOF on its socket): polls and pending-work checks
    with ``rendezvous=False`` do not see it (the engine stays READY); the next plain
    ``poll`` reads it and the engine stops serving offload (the rank left)."""
    client, worker = _ready_pair()
    try:
        worker.close()
        for _ in range(5):
            client.poll(rendezvous=False)
            assert not client.has_pending_work(rendezvous=False)
            time.sleep(0.01)
        assert client.state is EngineState.READY
        deadline = time.monotonic() + 10
        while client.state is EngineState.READY:
            assert time.monotonic() < deadline, "the rank's departure was never read"
            client.poll()
            time.sleep(0.005)
        assert client.state is EngineState.STOPPED
    finally:
        worker.close()
        client.close()


def test_the_notify_fd_is_readable_exactly_while_a_finish_is_unreported() -> None:
    """``poll`` drains the fd only when a job finished since its last drain; a Done that
    ``wait`` took leaves the fd readable until the next ``poll`` drains it, and a poll
    that finds nothing new leaves an idle fd unreadable: a parked loop is woken by
    every finish and at most once more by a stale ring, never spins on one."""
    layout = make_layout(rank_tensors(0))
    host = HostPool.for_tests(layout, 16)
    try:
        with CpuCopyEngine(0, layout, host) as eng:
            fd = eng.notify_fd()
            eng.submit(CopyJob.from_ids(1, STORE, [0], [0]))
            assert [d.job_id for d in eng.wait([1], WAIT_S)] == [1]
            assert select.select([fd], [], [], WAIT_S)[0] == [fd]  # wait does not drain
            # the copy thread counts its ring just after writing it (and ``wait`` may
            # return before both): a poll after the count drains the fd
            assert drained_by_polls(eng, fd)
            assert eng.poll() == []
            gate = CpuFence()
            eng.submit(CopyJob.from_ids(2, STORE, [1], [1]), after=gate)
            assert eng.poll() == [] and select.select([fd], [], [], 0.02)[0] == []
            gate.set()
            assert select.select([fd], [], [], WAIT_S)[0] == [fd]
            assert [d.job_id for d in collect(eng, 1)] == [2]
            # the poll that took it may have run between the thread's ring and its
            # count (the fd then stays readable): the next poll drains it
            assert drained_by_polls(eng, fd)
    finally:
        host.close()

