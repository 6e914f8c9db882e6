"""The vLLM adapter's worker side never reports a load job twice (no vLLM needed: the
worker side is plain kvshm code fed StepMeta records)."""

from __future__ import annotations

from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.records import StepMeta
from kvshm.integrations.vllm.worker import WorkerSide
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
    done: set[str] = set()
    side._on_done(7, False, done)
    assert done == {"r"}
    side.bind(StepMeta(2, load_jobs={7: ("r",)}))
    assert 7 not in side._job_reqs
    again: set[str] = set()
    for job in list(side._job_reqs):  # what finished_loads does for a gone worker
        side._on_done(job, False, again)
    assert again == set()
    side.bind(StepMeta(3))
    assert side._reported == set()
