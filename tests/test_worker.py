"""workers.worker.Worker (embedded API, and standalone in-process) against a real scheduler
side: rendezvous socket, provisioned shared-memory rings and host pools, eventfds."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import pytest
import torch
from worker_rig import Sched, rank_lost_error, transfer, unique_name

from kvshm.errors import ConfigError, PeerDied, ProtocolError
from kvshm.ipc.protocol import (
    Direction,
    DiskSetup,
    Done,
    Flush,
    Ready,
    Shutdown,
    Transfer,
    pack_ids,
)
from kvshm.ipc.rendezvous_events import EventKind
from kvshm.shm import shared_tensor
from workers.copy_engine import CpuFence
from workers.cpu_copy import FaultInjection
from workers.worker import DetachReason, Phase, Worker

NB = 256  # device blocks per rank
STORE, LOAD = Direction.STORE, Direction.LOAD
KV_OUTER = [True, False]  # the layout of shard()


def shard(rank: int, nb: int = NB) -> list[torch.Tensor]:
    """A K/V-outer fp16 tensor (2 regions) plus a plain uint8 one: 3 regions per rank."""
    g = torch.Generator().manual_seed(100 + rank)
    kv = torch.empty((2, nb, 4, 32), dtype=torch.float16)
    kv.view(torch.uint8).copy_(torch.randint(0, 256, kv.view(torch.uint8).shape,
                                             dtype=torch.uint8, generator=g))
    extra = torch.randint(0, 256, (nb, 48), dtype=torch.uint8, generator=g)
    return [kv, extra]


@contextlib.contextmanager
def linked(world: int, *, nb: int = NB, capacity: int | None = None, device: str = "cpu",
           **kw: object) -> Iterator[tuple[Sched, list[Worker], list[list[torch.Tensor]]]]:
    """``world`` embedded workers in this process, READY against a fresh scheduler side;
    with ``device="cuda"`` the shards live on the GPU (CUDA copy engine, pinned pool)."""
    sched = Sched(world, capacity=capacity)
    shards = [[t.to(device) for t in shard(r, nb)] for r in range(world)]
    workers: list[Worker] = []
    try:
        workers = [Worker.attach(sched.name, r, world, shards[r], kv_outer=KV_OUTER,
                                 **kw) for r in range(world)]  # type: ignore[arg-type]

        def tick() -> None:
            for w in workers:
                w.service()

        sched.wait_for(lambda: all(w.phase is Phase.READY for w in workers), tick=tick,
                       what="READY")
        yield sched, workers, shards
    finally:
        for w in workers:
            w.close()
        sched.close()


def run_step(workers: Sequence[Worker], step: int) -> None:
    for w in workers:
        w.begin_step(step)
        w.submit_loads(step)
        w.submit_stores(step)


class Local:
    """Collects each worker's poll() results (the connector's view)."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.workers = workers
        self.dones: list[list[Done]] = [[] for _ in workers]

    def __call__(self) -> None:
        for i, w in enumerate(self.workers):
            self.dones[i] += w.poll()

    def ids(self, i: int) -> list[int]:
        return [d.job_id for d in self.dones[i]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_store_then_load_round_trip_two_ranks_byte_exact(device: str) -> None:
    """256 blocks per rank go to random CPU rows (4 jobs), the device caches are wiped,
    then come back into a random permutation of device blocks: every byte of both
    ranks' different shards matches, and both sides saw every Done exactly once. On
    CUDA the same path runs the CUDA copy engine against the cudaHostRegister'ed pool."""
    g = torch.Generator().manual_seed(7)
    cpu_ids = torch.randperm(512, generator=g)[:NB].tolist()
    perm = torch.randperm(NB, generator=g).tolist()
    with linked(2, device=device) as (sched, ws, shards):
        orig = [[t.clone() for t in s] for s in shards]
        assert not torch.equal(orig[0][1], orig[1][1])  # the ranks hold different shards
        assert not torch.equal(orig[0][0].view(torch.uint8), orig[1][0].view(torch.uint8))
        local = Local(ws)
        for j in range(4):
            sl = slice(64 * j, 64 * (j + 1))
            sched.post(transfer(1, j, STORE, range(NB)[sl], cpu_ids[sl]))
        run_step(ws, 1)
        sched.collect(range(4), tick=local)
        for s in shards:
            for t in s:
                t.zero_()
        for j in range(4):
            sl = slice(64 * j, 64 * (j + 1))
            sched.post(transfer(2, 10 + j, LOAD, cpu_ids[sl], perm[sl]))
        run_step(ws, 2)
        got = sched.collect(range(10, 14), tick=local)
        assert all(d.ok for per_rank in got.values() for d in per_rank.values())
        for r in range(2):
            kv, extra = shards[r]
            assert torch.equal(kv[:, perm].view(torch.uint8), orig[r][0].view(torch.uint8))
            assert torch.equal(extra[perm], orig[r][1])
            assert sorted(local.ids(r)) == [0, 1, 2, 3, 10, 11, 12, 13]
            assert sorted(d.job_id for d in sched.dones[r]) == sorted(local.ids(r))
            st = ws[r].statistics()
            assert st["counters"]["jobs_ok"] == 8 and st["counters"]["dones_sent"] == 8
            assert st["copy"]["pairs_copied"] == 2 * NB
            assert st["copy"]["bytes_copied"] == 2 * NB * (2 * 256 + 48)


def test_job_of_next_step_is_not_run_during_this_step() -> None:
    """A load of step 2 already in the ring stays queued through all of step 1 (even a
    premature submit_loads(2)); it runs once step 2 begins."""
    with linked(1, nb=64) as (sched, ws, shards):
        w, extra = ws[0], shards[0][1]
        before = extra[5].clone()
        assert before.any()
        sched.post(transfer(2, 1, LOAD, [0], [5]))  # the host pool starts zero-filled
        run_step(ws, 1)
        w.submit_loads(2)
        time.sleep(0.05)
        assert w.poll() == []
        assert torch.equal(extra[5], before)
        st = w.statistics()
        assert st["queued"] == 1 and st["counters"]["submits_before_begin"] == 1
        assert w.queued_steps() == [2]
        run_step(ws, 2)
        sched.collect([1], tick=w.poll)
        assert not extra[5].any()


def test_attach_and_begin_step_never_block() -> None:
    """No scheduler at all, then one that never answers: every call returns at once."""
    w = Worker.attach(unique_name(), 0, 1, shard(0, 16), kv_outer=KV_OUTER)
    t0 = time.monotonic()
    for step in range(50):
        run_step([w], step)
        assert w.poll() == []
    assert time.monotonic() - t0 < 1.0  # ~1 ms expected; 1 s is very loose
    assert w.phase is Phase.NEW
    assert w.statistics()["counters"]["submits_not_ready"] == 100
    w.close()

    sched = Sched(1)
    try:
        w = Worker.attach(sched.name, 0, 1, shard(0, 16), kv_outer=KV_OUTER)
        t0 = time.monotonic()
        for step in range(50):
            run_step([w], step)
            w.poll()
        assert time.monotonic() - t0 < 1.0
        assert w.phase is Phase.CONNECTING  # Hello is out, Ready is not
        sched.service()
        w.begin_step(50)
        assert w.phase is Phase.READY
    finally:
        w.close()
        sched.close()


def test_lifeline_eof_fails_queued_jobs_and_detaches() -> None:
    """The scheduler vanishes: no exception reaches the host; jobs never run fail
    locally; a copy already submitted reports normally once its fence is set."""
    with linked(1, nb=64) as (sched, ws, _):
        w = ws[0]
        sched.post(transfer(1, 1, STORE, [0, 1], [0, 1]), transfer(5, 2, LOAD, [0], [3]),
                   transfer(5, 3, STORE, [4], [4]))
        fence = CpuFence()
        w.begin_step(1)
        w.submit_stores(1, after=fence)
        sched.close()
        w.begin_step(2)  # must not raise
        assert w.phase is Phase.DETACHED and w.detach_reason is DetachReason.PEER_DIED
        assert isinstance(w.last_error, PeerDied)
        failed = w.poll()
        assert sorted(d.job_id for d in failed) == [2, 3]
        assert not any(d.ok for d in failed) and "detached" in failed[0].error
        fence.set()
        got: list[Done] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = w.poll()
            time.sleep(0.002)
        assert got == [Done(1, 0, True)]
        w.submit_loads(5)
        assert w.poll() == []
        c = w.statistics()["counters"]
        assert c["jobs_failed_unrun"] == 2 and c["detached_peer_died"] == 1
        assert c["submits_detached"] == 1


def test_protocol_error_detaches_and_scheduler_sees_eof() -> None:
    with linked(1, nb=64) as (sched, ws, _):
        w = ws[0]
        sched.post(transfer(3, 1, STORE, [0], [0]))
        ring = sched.chans[0].rings.cmd
        assert ring.stage(b"\xc1\xc1")  # 0xc1 is never valid msgpack
        ring.publish()
        w.begin_step(1)
        assert w.detach_reason is DetachReason.PROTOCOL_ERROR
        assert isinstance(w.last_error, ProtocolError)
        assert [d.job_id for d in w.poll()] == [1]
        sched.wait_for(lambda: bool(sched.lost()), what="RANK_LOST")
        err = rank_lost_error(sched.lost()[0])
        assert err.rank == 0 and isinstance(err, PeerDied)


def test_a_second_bad_record_during_the_redrain_loses_no_good_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hazard "a second undecodable record races the re-drain": the cmd ring holds
    Transfer 1 and a bad record; the drain raises ProtocolError and keeps Transfer 1
    back. The worker re-drains before detaching (to fail the good records locally),
    but meanwhile the scheduler published Transfer 2 and a second bad record: that
    re-drain raises too, and the worker used to ignore it and detach -- closing the
    channel dropped Transfers 1 and 2 unfailed (no local Done). Now it takes what the
    channel kept back: both fail locally, in order."""
    with linked(1, nb=64) as (sched, ws, _):
        w = ws[0]
        ring = sched.chans[0].rings.cmd
        sched.post(transfer(3, 1, STORE, [0], [0]))
        assert ring.stage(b"\xc1\xc1")  # 0xc1 is never valid msgpack
        ring.publish()
        assert w._session is not None and w._session.channel is not None
        chan = w._session.channel
        real = chan.receive_nowait
        calls: list[int] = []

        def racing() -> list[Any]:
            calls.append(1)
            if len(calls) == 2:  # the re-drain: the scheduler wrote meanwhile
                sched.post(transfer(3, 2, STORE, [1], [1]))
                assert ring.stage(b"\xc1")
                ring.publish()
            return real()

        monkeypatch.setattr(chan, "receive_nowait", racing)
        w.begin_step(1)
        assert len(calls) >= 2
        assert w.detach_reason is DetachReason.PROTOCOL_ERROR
        failed = w.poll()
        assert [d.job_id for d in failed] == [1, 2]
        assert not any(d.ok for d in failed)


def test_a_ready_that_fails_unexpectedly_detaches_the_rank_and_leaks_nothing(
        tmp_path: object) -> None:
    """Hazard "a setup that fails with an unexpected error": the Ready names a disk
    tier whose path holds a NUL byte, so opening the slab raises ValueError -- not a
    kvshm error nor an OSError -- after the copy engine was built. It used to escape
    ``Worker.service()`` into the host, leave the copy engine's thread running, and
    leave the rank CONNECTING for good (its Ready consumed, no heartbeat: the
    scheduler never declared it hung). Now the rank detaches (SETUP_FAILED, the error
    named), the scheduler sees the link close (RANK_LOST), and no thread is left. The
    rank also says why before it closes (SetupFailed): the RANK_LOST reason -- the
    engine's FAILED line -- names the cause, where it said only "lifeline lost" and the
    cause was on the rank's stderr alone (a hostile probe: an address-space limit)."""
    class BadDisk(Sched):
        def _make_ready(self, hellos: Any) -> dict[int, tuple[Ready, list[int]]]:
            plan = super()._make_ready(hellos)
            return {r: (msgspec.structs.replace(rd, disk=DiskSetup(f"{tmp_path}/s\0x", 8,
                                                                  "fp")), fds)
                    for r, (rd, fds) in plan.items()}

    sched = BadDisk(1)
    before = {t.name for t in threading.enumerate()}
    w = Worker.attach(sched.name, 0, 1, shard(0), kv_outer=KV_OUTER)
    try:
        sched.wait_for(lambda: w.phase is Phase.DETACHED, tick=w.service, what="DETACHED")
        assert w.detach_reason is DetachReason.SETUP_FAILED
        assert isinstance(w.last_error, ConfigError) and "ValueError" in str(w.last_error)
        sched.wait_for(lambda: bool(sched.lost()), what="RANK_LOST")
        (lost,) = sched.lost()
        assert "the rank could not set up: ValueError" in lost.reason, lost.reason
        assert [t.name for t in threading.enumerate() if t.name not in before] == []
    finally:
        w.close()
        sched.close()


def test_a_publisher_that_cannot_start_detaches_the_rank_and_leaks_nothing(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same hazard one step later: the Ready names a good disk tier, the session
    opens, and then the thread that publishes the movers' Dones cannot start (a thread
    limit: ``RuntimeError("can't start new thread")``). That ran outside the setup's
    guard: the error escaped ``Worker.service()`` into the host, the rank stayed READY
    with no publisher, and the duplicate of the command doorbell it had made leaked.
    Now the rank detaches (SETUP_FAILED), nothing is raised, no fd or thread is left."""
    import os

    import workers.link as link

    class Failing(link.MoverPublisher):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any, **kw: Any) -> None:
            raise RuntimeError("can't start new thread")
    monkeypatch.setattr(link, "MoverPublisher", Failing)

    class WithDisk(Sched):
        def _make_ready(self, hellos: Any) -> dict[int, tuple[Ready, list[int]]]:
            plan = super()._make_ready(hellos)
            return {r: (msgspec.structs.replace(rd, disk=DiskSetup(f"{tmp_path}/r{r}.slab",
                                                                  16, "fp", True)), fds)
                    for r, (rd, fds) in plan.items()}

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    gc.collect()  # an earlier test's garbage closing its fds meanwhile reads as fewer
    sched = WithDisk(1)
    before, fd0 = {t.name for t in threading.enumerate()}, fds()
    w = Worker.attach(sched.name, 0, 1, shard(0), kv_outer=KV_OUTER)
    try:
        sched.wait_for(lambda: w.phase is Phase.DETACHED, tick=w.service, what="DETACHED")
        assert w.detach_reason is DetachReason.SETUP_FAILED
        assert "the mover publisher could not start" in str(w.last_error)
        sched.wait_for(lambda: bool(sched.lost()), what="RANK_LOST")
    finally:
        w.close()
        sched.close()
    assert [t.name for t in threading.enumerate() if t.name not in before] == []
    gc.collect()
    assert fds() <= fd0


def test_shutdown_sends_a_done_for_every_job_it_fails_before_detaching() -> None:
    """Exactly one Done per job per rank, also at Shutdown: 400 stores queued for a step
    that never begins, then Shutdown, on a small done ring. The rank fails them all
    ("shut down before its step began"), sends what fits -- and used to detach at once,
    dropping the rest of its outbox (336 jobs got no Done; the scheduler saw the link
    close with them pending). Now it stays draining until every failure is sent."""
    n = 400
    with linked(1, nb=64, capacity=4096) as (sched, ws, _):
        w = ws[0]
        sched.post(*[transfer(9, j, STORE, [j % 64], [j]) for j in range(n)], Shutdown())
        w.begin_step(1)

        def tick() -> None:
            sched.chans[0].flush_overflow()
            w.poll()
        sched.wait_for(lambda: w.phase is Phase.DETACHED, tick=tick, what="DETACHED")
        sched.wait_for(lambda: bool(sched.lost()), what="RANK_LOST")
        got = [d.job_id for d in sched.dones[0]]
        assert sorted(got) == list(range(n))                     # each exactly once
        assert not any(d.ok for d in sched.dones[0])
        counters = w.statistics()["counters"]
        assert counters["dones_unsent"] == 0 and w.detach_reason is DetachReason.SHUTDOWN


def test_dones_a_close_leaves_unsent_are_counted() -> None:
    """Every declined outcome is counted: 300 stores done on a rank whose done ring the
    scheduler does not drain leave Dones in its outbox; closing the rank dropped them
    with no counter moving (a detach counts them ``dones_unsent``). Now a close counts
    them the same way."""
    with linked(1, nb=64, capacity=4096) as (sched, ws, _):
        w = ws[0]
        sched.post(*[transfer(1, j, STORE, [j % 64], [j]) for j in range(300)])
        done = 0
        deadline = time.monotonic() + 20
        while done < 300:  # (not sched.wait_for: it would read the done ring)
            assert time.monotonic() < deadline, done
            run_step(ws, 1)
            done += len(w.poll())
            sched.chans[0].flush_overflow()
            time.sleep(0.001)
        outbox = w.statistics()["outbox"]
        assert outbox > 0
        w.close()
        assert w.statistics()["counters"]["dones_unsent"] == outbox


def _host_pool_maps() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f
                if "host_pool" in line and len(line.split(None, 5)) == 6}


def test_a_closed_worker_keeps_no_host_pool_mapped() -> None:
    """Nothing leaked after close: an embedding host that keeps its (closed) Worker
    object kept the rank's whole CPU tier mapped -- the copy engine's region tuple held
    the host pool's tensors until the Worker was garbage-collected. Now the engine
    drops them once its threads are joined."""
    before = _host_pool_maps()
    kept: list[Worker] = []
    with linked(1, nb=64) as (sched, ws, _):
        sched.post(transfer(1, 1, STORE, [0], [0]))
        run_step(ws, 1)
        sched.collect([1], tick=ws[0].poll)
        assert _host_pool_maps() - before
        kept.append(ws[0])
    gc.collect()
    assert kept[0].phase is Phase.CLOSED
    assert _host_pool_maps() - before == set()


def test_a_load_cancelled_before_it_started_is_never_copied() -> None:
    """The vLLM side gives up on a synchronous load that has not reached the rank (its
    Transfer queued behind a full command ring) and lets vLLM recompute its blocks: the
    load must then never run, or it would write blocks vLLM computed (and may have
    handed to another request). ``cancel_unstarted`` names the jobs not started; when
    their Transfer is taken they fail unrun and the destination stays as computed."""
    with linked(1) as (sched, ws, shards):
        w = ws[0]
        sched.post(transfer(1, 1, LOAD, [0], [0]))
        run_step(ws, 1)
        assert [d.job_id for d in sched.collect([1], tick=w.poll)[0].values()] == [1]
        assert w.cancel_unstarted([2]) == {2}                  # not arrived yet
        def block5() -> list[torch.Tensor]:
            return [(t[:, 5] if outer else t[5]).contiguous().clone().view(torch.uint8)
                    for t, outer in zip(shards[0], KV_OUTER)]
        dst = block5()
        sched.post(transfer(2, 2, LOAD, [1], [5]))
        run_step(ws, 2)
        done = sched.collect([2], tick=w.poll)[0][2]
        assert not done.ok and "cancelled before it started" in done.error
        assert all(torch.equal(a, b) for a, b in zip(block5(), dst))
        assert w.statistics()["counters"]["jobs_cancelled_unrun"] == 1


def test_a_ragged_flush_drops_none_of_the_jobs_beside_it() -> None:
    """A message is never dropped because its neighbour was bad: one batch carries
    store 1, a Flush whose id list is 3 bytes (not a whole id), then store 2. The bad
    Flush detaches the rank (PROTOCOL_ERROR); both stores fail locally, each exactly
    once -- store 2 used to be neither queued nor failed (no Done ever)."""
    with linked(1) as (sched, ws, _):
        w = ws[0]
        sched.post(transfer(0, 1, STORE, [1], [1]), Flush(0, b"\x01\x02\x03"),
                   transfer(0, 2, STORE, [2], [2]))
        w.begin_step(0)
        got: list[Done] = []
        sched.wait_for(lambda: len(got) >= 2, tick=lambda: got.extend(w.poll()),
                       what="both stores failed")
        assert w.detach_reason is DetachReason.PROTOCOL_ERROR
        assert sorted(d.job_id for d in got) == [1, 2] and not any(d.ok for d in got)
        assert w.poll() == []
        assert w.statistics()["counters"]["jobs_failed_unrun"] == 2


def test_shutdown_finishes_running_work_then_detaches() -> None:
    """Shutdown while a store waits for its fence: DRAINING until it is done (its Done
    is sent), jobs of never-begun steps fail, then the link closes (RANK_LOST)."""
    with linked(1, nb=64) as (sched, ws, _):
        w = ws[0]
        sched.post(transfer(1, 1, STORE, [0], [0]), transfer(9, 2, STORE, [1], [1]), Shutdown())
        fence = CpuFence()
        w.begin_step(1)
        w.submit_stores(1, after=fence)
        assert w.poll() == []
        assert w.phase is Phase.DRAINING
        fence.set()
        local = Local(ws)
        got = sched.collect([1, 2], tick=local)[0]
        assert got[1].ok and not got[2].ok and "before its step began" in got[2].error
        assert sorted(local.ids(0)) == [1, 2]
        assert w.phase is Phase.DETACHED and w.detach_reason is DetachReason.SHUTDOWN
        sched.wait_for(lambda: bool(sched.lost()), what="RANK_LOST")


def test_flush_finishes_jobs_before_the_step() -> None:
    """Flush(2, [1, 3]) from the ring and flush_ids=[4]: begin_step returns only once those
    jobs finished (their Dones are in the very next poll); a fence that never comes is
    bounded by flush_timeout_s and counted. The timeout (2 s) is far above the 50 ms
    timers, so a slow timer on a loaded machine still counts as a wait, not a timeout."""
    with linked(1, nb=64, flush_timeout_s=2.0) as (sched, ws, _):
        w = ws[0]
        sched.post(transfer(1, 1, STORE, [0], [0]), transfer(1, 2, STORE, [1], [1]),
                   transfer(1, 3, STORE, [2], [2]), Flush(2, pack_ids([1, 3])))
        fences = [CpuFence(), CpuFence(), CpuFence()]
        w.begin_step(1)
        for f in fences:
            w.submit_stores(1, after=f)  # the first call submits all three, after fences[0]
        threading.Timer(0.05, fences[0].set).start()
        w.begin_step(2)
        assert {1, 3} <= {d.job_id for d in w.poll()}  # job 2 was not flushed
        assert w.statistics()["counters"]["flush_waits"] == 1
        sched.post(transfer(3, 4, STORE, [3], [3]), transfer(3, 5, STORE, [4], [4]))
        f4 = CpuFence()
        w.begin_step(3)
        w.submit_stores(3, after=f4)
        threading.Timer(0.05, f4.set).start()
        w.begin_step(4, flush_ids=[4])
        assert 4 in {d.job_id for d in w.poll()}
        sched.post(transfer(5, 6, STORE, [5], [5]))
        never = CpuFence()
        w.begin_step(5)
        w.submit_stores(5, after=never)
        w.begin_step(6, flush_ids=[6])  # returns after ~2 s, no exception
        assert w.statistics()["counters"]["flush_timeouts"] == 1
        never.set()
        sched.collect([1, 2, 3, 4, 5, 6], tick=w.poll)


def test_wait_returns_each_done_once() -> None:
    with linked(1, nb=64) as (sched, ws, _):
        w = ws[0]
        sched.post(transfer(1, 1, STORE, [0], [0]), transfer(1, 2, STORE, [1], [1]))
        run_step(ws, 1)
        got = w.wait([1, 2], timeout=10)
        assert sorted(d.job_id for d in got) == [1, 2] and all(d.ok for d in got)
        assert w.poll() == []
        sched.collect([1, 2])


def test_full_done_ring_keeps_dones_until_there_is_room() -> None:
    """400 Dones into a 4 KiB done ring the scheduler does not drain: the surplus waits
    in the worker's outbox (counted), nothing blocks, and all arrive once, in order."""
    with linked(1, nb=64, capacity=4096) as (sched, ws, _):
        w, chan = ws[0], sched.chans[0]
        sched.post(*[transfer(1, j, STORE, [j % 64], [j]) for j in range(400)])
        local: list[Done] = []
        deadline = time.monotonic() + 20
        while len(local) < 400:
            assert time.monotonic() < deadline
            run_step(ws, 1)
            local += w.poll()
            chan.flush_overflow()
            time.sleep(0.001)
        st = w.statistics()
        assert st["outbox"] > 0 and st["counters"]["done_ring_full"] >= 1
        sched.collect(range(400), tick=w.poll)
        assert [d.job_id for d in sched.dones[0]] == list(range(400))
        assert [d.job_id for d in local] == list(range(400))


def test_failures_are_dones_and_counted() -> None:
    """Injected copy failure, ragged ids, an out-of-range id: each a Done(ok=False) on
    both sides; later jobs still run; the heartbeat moves on every host call."""
    with linked(1, nb=64, fault=FaultInjection(fail_job_ids=frozenset({7}))) as (sched, ws, _):
        w = ws[0]
        beats = sched.chans[0].rings.heartbeat
        sched.post(transfer(1, 7, STORE, [0], [0]),
                   Transfer(1, 8, STORE, b"\x01\x02\x03", pack_ids([0])),
                   transfer(1, 9, STORE, [0], [999_999]), transfer(1, 10, STORE, [1], [1]))
        run_step(ws, 1)
        got = sched.collect([7, 8, 9, 10], tick=w.poll)[0]
        assert [got[j].ok for j in (7, 8, 9, 10)] == [False, False, False, True]
        assert "injected" in got[7].error and "ProtocolError" in got[8].error
        assert "out of range" in got[9].error
        assert sched.chans[0].rings.heartbeat > beats + 3
        w.begin_step(0)
        c = w.statistics()["counters"]
        assert c["bad_transfers"] == 1 and c["jobs_failed"] == 3 and c["steps_regressed"] == 1


def test_standalone_in_process_maps_device_caches_from_ready() -> None:
    """regions=None: the layout comes from Ready.device_caches (shared_tensor memory the
    scheduler holds); a store then load round trip is byte-exact through that memory."""
    cache = shared_tensor((32, 2, 64), torch.float32)
    cache.copy_(torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(3)))
    orig = cache.clone()
    sched = Sched(1, device_caches=[[cache]], num_cpu_blocks=64)
    w = Worker.attach(sched.name, 0, 1, None)
    try:
        sched.wait_for(lambda: w.phase is Phase.READY, tick=w.service, what="READY")
        sched.post(transfer(1, 1, STORE, range(32), range(32, 64)))
        run_step([w], 1)
        sched.collect([1], tick=w.poll)
        cache.zero_()
        sched.post(transfer(2, 2, LOAD, range(32, 64), list(reversed(range(32)))))
        run_step([w], 2)
        sched.collect([2], tick=w.poll)
        assert torch.equal(cache, orig.flip(0))
    finally:
        w.close()
        sched.close()


def test_wait_for_work_polls_the_copies_of_an_engine_without_a_completion_fd() -> None:
    """The CUDA copy engine has no fd that wakes poll() when a copy ends (its events are
    polled): with a job in flight, a standalone loop's ``wait_for_work(1.0)`` parks at
    most COPY_POLL_S, so a finished CUDA copy is reported within ~1 ms, not after the
    1 s park. Simulated on the CPU engine by hiding its fd; the copy waits on a fence."""
    from workers.worker import COPY_POLL_S

    cache = shared_tensor((32, 64), torch.uint8)
    sched = Sched(1, device_caches=[[cache]], num_cpu_blocks=64)
    w = Worker.attach(sched.name, 0, 1, None)
    fence = CpuFence()
    try:
        sched.wait_for(lambda: w.phase is Phase.READY, tick=w.service, what="READY")
        session = w._session
        assert session is not None and session.notify_fd is not None
        session.notify_fd = None  # what a CUDA session looks like
        sched.post(transfer(1, 1, STORE, range(4), range(4)))
        sched.wait_for(lambda: bool(w.queued_steps()), tick=w.service, what="queued")
        w.begin_step(1)
        w.submit_stores(1, after=fence)
        assert w.statistics()["inflight"] == 1
        t0 = time.monotonic()
        w.wait_for_work(1.0)
        assert time.monotonic() - t0 < 0.9  # the 1 s park would be >= 1.0
        assert COPY_POLL_S <= 0.001
        fence.set()
        sched.collect([1], tick=w.poll)
    finally:
        fence.set()
        w.close()
        sched.close()


def test_standalone_without_device_caches_is_refused() -> None:
    sched = Sched(1)
    w = Worker.attach(sched.name, 0, 1, None)
    try:
        sched.wait_for(lambda: w.phase is Phase.DETACHED, tick=w.service, what="refusal")
        assert w.detach_reason is DetachReason.REFUSED
        assert any(e.kind is EventKind.READY_FAILED for e in sched.events)
        assert w.poll() == []
    finally:
        w.close()
        sched.close()


def test_attach_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        Worker.attach("x", 2, 2, shard(0, 4), kv_outer=KV_OUTER)
    with pytest.raises(ConfigError):
        Worker.attach("x", 0, 0, shard(0, 4), kv_outer=KV_OUTER)
    with pytest.raises(ConfigError):
        Worker.attach("x" * 200, 0, 1, shard(0, 4), kv_outer=KV_OUTER)
    with pytest.raises(ConfigError):
        Worker.attach("x", 0, 1, shard(0, 4))  # K/V-outer tensor read as blocks-first
    with pytest.raises(ConfigError):
        Worker.attach("x", 0, 1, [torch.empty(0)])
    w = Worker.attach("x", 0, 1, shard(0, 4), kv_outer=KV_OUTER)
    w.close()
    w.close()
    assert w.phase is Phase.CLOSED and w.poll() == []
