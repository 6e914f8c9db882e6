"""The records the vLLM scheduler side hands out: :class:`StepMeta`, which every worker
rank receives each step, and :class:`SchedulerCounters`, in the side's statistics.

Plain dataclasses with no kvshm engine import, so the worker side
(:mod:`~kvshm.integrations.vllm.worker`) reads the step metadata without loading the
scheduler side. ``KvshmMetadata`` (:mod:`~kvshm.integrations.vllm.connector`) is
:class:`StepMeta` as vLLM's ``KVConnectorMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SchedulerCounters", "StepMeta", "WorkerCounters"]


@dataclass
class StepMeta:
    """What one step tells every worker rank (pickled to worker processes).

    ``load_jobs``: every load job not yet acked by every rank -> its request ids (a rank
    reports them finished when it sees the job's ``Done``, ok or not). ``load_dsts``:
    load jobs planned this step -> their destination GPU block ids (a rank that sees
    such a job fail reports these as load errors). ``failed_loads``: loads that failed
    on the scheduler side and reach no worker -> destination ids (every rank reports
    them in the step it receives them). ``flush``: job ids to finish before compute.
    ``sync_reqs``: requests whose load this step planned (or failed) and which vLLM
    computes in this same step (a synchronous load, ``ConnectorConfig.sync_loads``):
    each rank has their load jobs finished before the forward (``start_load_kv``) and
    never reports them in ``finished_recving`` (vLLM asserts a request it runs is not
    there); a failure reaches vLLM as block ids only.
    """

    step: int
    load_jobs: dict[int, tuple[str, ...]] = field(default_factory=dict)
    load_dsts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    failed_loads: dict[str, tuple[int, ...]] = field(default_factory=dict)
    flush: tuple[int, ...] = ()
    sync_reqs: tuple[str, ...] = ()


@dataclass
class SchedulerCounters:
    """The connector's own counters (the engine keeps its own); monotonic."""

    lookups: int = 0
    lookups_skipped: int = 0  # skip_reading_prefix_cache (e.g. prompt logprobs)
    lookups_asked_again: int = 0
    lookups_answered_after_pump: int = 0  # "ask again" turned into an answer by a pump
    lookups_waited: int = 0  # lookups that waited for a posted disk read (its own or earlier)
    lookups_answered_after_wait: int = 0  # ... and were answered within the wait
    lookup_waits_timed_out: int = 0  # ... and were not (asked again)
    lookup_waits_ended_for_step: int = 0  # ... ended (or never slept): a fetch awaits a plan
    lookup_hit_tokens: int = 0
    lookups_sync: int = 0  # hits answered as synchronous loads (no load step of their own)
    sync_loads_unplanned: int = 0  # ... accepted but not planned: failed (recomputed)
    loads_ok: int = 0
    loaded_tokens: int = 0  # tokens of successful loads (a hit offered again is not counted)
    loads_failed: int = 0
    requests_announced_late: int = 0
    requests_preempted: int = 0
    requests_resumed: int = 0
    requests_unknown: int = 0
    requests_unchanged: int = 0  # running requests a step passed over (nothing changed)
    lookups_after_failed_load: int = 0  # answered 0: that request recomputes instead
    lookups_after_refusal: int = 0  # answered 0: kvshm refused one of that request's calls
    lookups_before_ready: int = 0  # asked again: a lower tier's engine, its ranks connecting
    requests_refused: int = 0  # calls kvshm refused (InvalidRequest): that request goes without
    steps: int = 0
    stats_writes_failed: int = 0  # live rewrites of stats_path that raised OSError


@dataclass
class WorkerCounters:
    """This rank's connector counters; monotonic."""

    steps: int = 0
    loads_done: int = 0
    loads_failed: int = 0
    scheduler_failed_loads: int = 0
    error_blocks: int = 0
    dones_unknown: int = 0
    loads_orphaned: int = 0  # the Worker detached before their Done: reported failed
    failed_requests: int = 0  # reported as failed_recving (several KV groups)
    load_waits: int = 0  # get_finished waited for this rank's loads (CPU device)
    load_waits_timed_out: int = 0  # ... and some were still running at the deadline
    sync_load_waits: int = 0  # start_load_kv waited for a step's synchronous loads
    sync_loads_late: int = 0  # ... a job not started by the deadline: cancelled, failed
    sync_loads_slow: int = 0  # ... a job still copying at a deadline: waited for
