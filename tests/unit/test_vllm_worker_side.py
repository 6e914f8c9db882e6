"""The vLLM adapter's worker side never reports a load job twice (no vLLM needed: the
worker side is plain kvshm code fed StepMeta records)."""

from __future__ import annotations

from typing import Any

from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.records import StepMeta
from kvshm.integrations.vllm.worker import WorkerSide
from kvshm.ipc.protocol import Done
from kvshm.types import KVGroup, StoreMode


def _side() -> WorkerSide:
    cfg = ConnectorConfig(name="t", tp=1, pp=1, block_size=16, groups=(KVGroup.full(),),
                          mode=StoreMode.EAGER, cpu_bytes_per_rank=None, num_cpu_blocks=8,
                          stats_path=None, hang_timeout_s=10.0, shutdown_timeout_s=5.0,
                          test_fail_loads=0)
    return WorkerSide(cfg)


def test_load_job_listed_after_its_done_is_not_reported_twice() -> None:
    """Job 7 (request r) is listed at step 1; this rank sees its Done; the scheduler
    still lists it at step 2 (another rank has not acked, or it waits quarantined for a
    revoked rank). Registering it again would report r finished a second time when the
    worker later goes away -- vLLM asserts on that. Once no longer listed, it is
    forgotten (the memory stays bounded)."""
    side = _side()
    side.bind(StepMeta(1, load_jobs={7: ("r",)}, load_dsts={7: (3, 4)}))
    assert side.reports.report([Done(7, 0, False)], gone=False) == {"r"}
    side.bind(StepMeta(2, load_jobs={7: ("r",)}))
    assert not side.reports.waiting
    # what finished_loads does for a gone worker: every unreported job fails -- none
    assert side.reports.report([], gone=True) == set()
    assert side.counters.loads_orphaned == 0
    side.bind(StepMeta(3))
    assert side.reports._reported == set()


class _SlowWorker:
    """A Worker at the seam the synchronous wait uses: job 7 has not reached the rank
    (cancellable), job 8 is copying and finishes only on the third wait."""

    def __init__(self) -> None:
        from workers.worker import Phase

        self.phase = Phase.READY
        self.waits: list[set[int]] = []
        self.cancelled: set[int] = set()

    def wait(self, job_ids: Any, timeout: float | None = None) -> list[Done]:
        self.waits.append(set(job_ids))
        if len(self.waits) == 3 and 8 in job_ids:
            return [Done(8, 0, True, "")]
        return []

    def cancel_unstarted(self, job_ids: Any) -> set[int]:
        self.cancelled = set(job_ids) & {7}
        return self.cancelled


def test_a_slow_synchronous_load_is_waited_for_and_an_unstarted_one_cancelled() -> None:
    """The hazard: a synchronous load not finished by ``hang_timeout_s`` was reported
    failed at once and the forward went on -- vLLM recomputed into its blocks (and, once
    the request ended, handed them out again) while the copy could still write them,
    and a Transfer still queued behind a full command ring could run later. Now job 7,
    not started, is cancelled (never copied) and reported failed; job 8, copying, is
    waited for until it ends (warned and counted each deadline) and reported ok."""
    side = _side()
    meta = StepMeta(1, load_jobs={7: ("a",), 8: ("b",)}, load_dsts={7: (1,), 8: (2,)},
                    sync_reqs=("a", "b"))
    worker = _SlowWorker()
    side._wait_sync(worker, meta)  # type: ignore[arg-type]
    assert worker.cancelled == {7}
    assert worker.waits == [{7, 8}, {8}, {8}]
    assert sorted((d.job_id, d.ok) for d in side.reports._early) == [(7, False), (8, True)]
    assert (side.counters.sync_loads_late, side.counters.sync_loads_slow) == (1, 2)
