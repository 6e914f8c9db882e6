"""JobOutcomes alone (kvshm.offload.outcomes): acks, completion, reset and rank death
over a real job table, real CPU and GPU ``BlockPool``s and the real load and store books,
without an ``OffloadManager``. Each test builds its jobs the way the manager's parts do
(pins taken, store marks set) and checks what an outcome releases, indexes and reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvshm.offload.counters import ManagerCounters
from kvshm.offload.groups import GroupSet
from kvshm.offload.jobs import JobTable, LoadPart, StoreJob
from kvshm.offload.loads import LoadBook
from kvshm.offload.outcomes import JobOutcomes
from kvshm.offload.pool import BlockPool
from kvshm.offload.stores import StorePlanner
from kvshm.types import KVGroup, LoadFailure

BS = 4


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


@dataclass
class Parts:
    """The outcomes and the parts they act on; ``dropped``: the causes ``drop_hits``
    was called with."""

    world_size: int = 1
    dropped: list[LoadFailure] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counters = ManagerCounters()
        self.cpu = BlockPool(8)
        self.gpu = BlockPool(8)
        self.jobs = JobTable(self.world_size, self.counters)
        self.loads = LoadBook(self.cpu, self.gpu, self.counters)
        self.stores = StorePlanner(self.cpu, self.gpu, GroupSet((KVGroup.full(),), BS), BS,
                                   self.counters, 16, self.loads.dst.counts)
        self.out = JobOutcomes(self.jobs, self.cpu, self.loads, self.stores, None,
                               self.counters, self.dropped.append)

    def store(self, n: int) -> StoreJob:
        """A store job of ``n`` fresh GPU -> fresh CPU blocks, pinned and marked."""
        gpu, cpu = self.gpu.allocate(n), self.cpu.allocate(n)
        keys = [key(g) for g in gpu]
        self.stores.marks.gpu.update(gpu)
        self.stores.marks.keys.update(keys)
        return self.jobs.new_store(1, gpu, cpu, groups=[0] * n, keys=keys, n_eager=n)

    def load(self, req_id: str, n: int) -> int:
        """A load job of ``n`` CPU -> GPU blocks for ``req_id``; its id."""
        part = LoadPart(req_id, self.cpu.allocate(n), self.gpu.allocate(n), (), n * BS)
        self.loads.enqueue(part)
        t = self.loads.plan(1, self.jobs)
        assert t is not None
        return t.job_id

    def pinned(self) -> tuple[int, int]:
        return self.cpu.num_pinned, self.gpu.num_pinned


def test_a_store_completes_only_once_every_rank_acked_then_indexes_and_unpins() -> None:
    p = Parts(world_size=2)
    job = p.store(2)
    p.out.on_done(job.job_id, 0, True)
    assert p.pinned() == (2, 2) and p.cpu.num_hashes == 0
    p.out.on_done(job.job_id, 1, True)
    assert p.pinned() == (0, 0)
    assert [p.cpu.get_cached(k) for k in job.keys] == job.cpu_ids
    assert not p.jobs.jobs and not p.stores.marks.keys


def test_a_failed_store_releases_its_pins_without_indexing() -> None:
    p = Parts()
    job = p.store(2)
    p.out.on_done(job.job_id, 0, False)
    assert p.pinned() == (0, 0) and p.cpu.num_hashes == 0
    assert p.counters.jobs_failed == 1


def test_unknown_and_repeated_acks_are_counted_and_ignored() -> None:
    p = Parts(world_size=2)
    job = p.store(1)
    p.out.on_done(999, 0, True)
    p.out.on_done(job.job_id, 0, True)
    p.out.on_done(job.job_id, 0, True)
    assert p.counters.acks_unknown == 1 and p.counters.acks_duplicate == 1
    assert job.job_id in p.jobs.jobs


def test_a_failed_load_is_reported_at_its_first_failed_ack_and_keeps_its_pins() -> None:
    p = Parts(world_size=2)
    job_id = p.load("r", 2)
    p.out.on_done(job_id, 0, False)
    (res,) = p.loads.take_results()
    assert not res.ok and res.cause is LoadFailure.WORKER_FAILED
    assert p.pinned() == (2, 2)  # pins outlive failure
    p.out.on_done(job_id, 1, True)
    assert p.loads.take_results() == [] and p.pinned() == (0, 0)


def test_reset_abandons_in_flight_jobs_and_counts_them_down_to_zero() -> None:
    p = Parts()
    store, load = p.store(1), p.load("r", 1)
    assert p.out.reset() is False
    assert p.dropped == [LoadFailure.RESET]
    assert p.out.abandoned == 2 and p.counters.jobs_abandoned == 2
    assert p.counters.jobs_failed == 0  # abandoned jobs are not failed jobs
    assert p.loads.take_results() == []  # the load's rank may still copy: not yet
    p.out.on_done(store.job_id, 0, True)
    assert p.out.abandoned == 1 and p.cpu.num_hashes == 0  # an abandoned store indexes nothing
    p.out.on_done(load, 0, True)
    (res,) = p.loads.take_results()  # its job done: RESET, even though the copy went well
    assert not res.ok and res.cause is LoadFailure.RESET
    assert p.out.abandoned == 0 and p.out.reset() is True and p.pinned() == (0, 0)


def test_a_reset_is_done_once_its_abandoned_jobs_are_not_those_planned_since() -> None:
    """The Engine's reset polled ``reset()`` until True; once store 1 (abandoned) was
    done, a step planned store 2, and the next poll abandoned store 2 as well -- under
    steady traffic the reset never ended. ``reset_done`` is the poll: True once the
    abandoned jobs are done, with store 2 in flight and not abandoned (it indexes its
    block when acked)."""
    p = Parts()
    first = p.store(1)
    assert p.out.reset() is False and p.out.abandoned == 1
    p.out.on_done(first.job_id, 0, True)
    second = p.store(1)  # the next step's store, after the reset's jobs are done
    assert p.out.reset_done() is True
    assert p.out.abandoned == 0 and not second.abandoned and p.counters.jobs_abandoned == 1
    p.out.on_done(second.job_id, 0, True)
    assert p.cpu.num_hashes == 1 and p.pinned() == (0, 0)


def test_reset_drops_the_cpu_index() -> None:
    p = Parts()
    job = p.store(1)
    p.out.on_done(job.job_id, 0, True)
    assert p.cpu.num_hashes == 1
    assert p.out.reset() is True
    assert p.cpu.num_hashes == 0


def test_rank_death_fails_every_job_and_quarantines_the_dead_ranks_blocks_until_fenced() -> None:
    p = Parts(world_size=2)
    job = p.store(2)
    p.out.on_done(job.job_id, 0, True)
    p.out.rank_failed(1)
    assert p.out.failed and p.dropped == [LoadFailure.RANK_DIED]
    assert p.out.quarantined_blocks() == (2, 2) and p.pinned() == (2, 2)
    assert not p.out.has_pending_work()  # nothing will move a quarantined job
    assert p.out.reset() is True  # the engine is failed: reset waits for nothing
    p.out.rank_fenced(1)
    assert p.out.quarantined_blocks() == (0, 0) and p.pinned() == (0, 0)
    assert p.cpu.num_hashes == 0  # a store completed after a rank died indexes nothing


def test_rank_death_is_decided_once() -> None:
    p = Parts(world_size=2)
    p.load("r", 1)
    p.out.rank_failed(0)
    p.out.rank_failed(1)
    assert p.dropped == [LoadFailure.RANK_DIED]
    assert p.counters.jobs_failed == 1
    (res,) = p.loads.take_results()
    assert res.cause is LoadFailure.RANK_DIED


def test_a_tail_that_two_groups_place_in_one_gpu_block_is_not_queued() -> None:
    """The hazard (the hand-off's partial last block, ``pin_tail``): two full-attention
    groups whose tables both end in GPU 2 at position 2 (bad input no check refuses
    across groups). Both groups' candidates were queued for one store job, which then
    listed GPU 2 twice and failed its completion's internal check before releasing
    anything (the job's pins leaked). Now such a tail is not handed off: nothing is
    queued, marked or pinned."""
    from kvshm.offload.side_stores import pin_tail

    parts = Parts()
    stores = StorePlanner(parts.cpu, parts.gpu, GroupSet((KVGroup.full(), KVGroup.full()), BS),
                          BS, parts.counters, 16, parts.loads.dst.counts)
    gpu = parts.gpu.allocate(5)                                # 0, 1, 2, 3, 4
    assert pin_tail(stores, [[0, 1, 2], [3, 4, 2]], 2, key(99)) is None
    assert stores.finished.items == [] and not stores.marks.gpu and not stores.marks.keys
    assert [parts.gpu.ref_cnt(b) for b in gpu] == [1, 1, 1, 1, 1]
    keys = pin_tail(stores, [[0, 1, 2], [3, 4, 1]], 2, key(99))   # distinct: both queued
    assert keys is not None and len(keys) == 2
    assert [c.gpu_id for c in stores.finished.items] == [2, 1]


def test_a_close_releases_the_pins_of_the_ranks_proven_stopped_and_keeps_the_rest() -> None:
    """The engine closes with a store (both ranks out) and a load (rank 0 acked, rank 1
    out) in flight. ``close([])`` fails both jobs (ENGINE_CLOSED, not counted as a
    failure) and plans nothing more, but no rank has proven it stopped: every pin stays
    and the load is not reported -- rank 1 may still copy into its GPU blocks.
    ``close([1])`` (rank 1 reaped): the load completes, is reported and releases its
    pins; the store still waits for rank 0. ``close([0, 1])``: nothing is pinned."""
    p = Parts(world_size=2)
    store, load = p.store(2), p.load("r", 1)
    p.out.on_done(load, 0, True)
    assert p.pinned() == (3, 3)
    p.out.close([])
    assert p.out.failed and p.pinned() == (3, 3) and p.counters.jobs_failed == 0
    assert p.loads.take_results() == []  # rank 1 may still copy into its blocks
    assert p.dropped == [LoadFailure.ENGINE_CLOSED]
    p.out.close([1])
    (res,) = p.loads.take_results()
    assert not res.ok and res.cause is LoadFailure.ENGINE_CLOSED
    assert p.pinned() == (2, 2) and list(p.jobs.jobs) == [store.job_id]
    p.out.close([0, 1])
    assert p.pinned() == (0, 0) and not p.jobs.jobs and p.cpu.num_hashes == 0
    assert p.loads.take_results() == []  # reported once


def test_a_reset_reports_an_abandoned_load_only_once_no_rank_may_copy_it() -> None:
    """Two ranks, a load in flight, ``reset()``. Rank 0's ack used to report RESET at once
    (the reset had marked the job failed) while rank 1 still copied the bytes from
    before the reset into the request's blocks (a review). Now nothing is reported until
    rank 1 acks too. With rank 1 declared dead instead (hung: revoked, not fenced), the
    result comes once every live rank acked: a dead rank's late copy is the quarantine's
    accepted risk, and waiting for its fence could wait for ever."""
    p = Parts(world_size=2)
    load = p.load("r", 1)
    assert p.out.reset() is False
    p.out.on_done(load, 0, True)
    assert p.loads.take_results() == []
    p.out.on_done(load, 1, True)
    (res,) = p.loads.take_results()
    assert (res.req_id, res.ok, res.cause) == ("r", False, LoadFailure.RESET)

    q = Parts(world_size=2)
    load = q.load("s", 1)
    assert q.out.reset() is False
    q.out.rank_failed(1)
    assert q.loads.take_results() == []  # rank 0 still copies
    q.out.on_done(load, 0, True)
    (res,) = q.loads.take_results()
    assert (res.req_id, res.ok, res.cause) == ("s", False, LoadFailure.RESET)
    assert q.pinned() == (1, 1)  # quarantined until rank 1 is fenced
    q.out.rank_fenced(1)
    assert q.pinned() == (0, 0) and q.loads.take_results() == []
