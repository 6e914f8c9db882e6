"""``OffloadManager.check_invariants``: an O(everything) cross-check for tests.

Kept apart from the manager so the hot module stays small. It reads the manager's
parts, not the manager: the manager hands them over as :class:`Parts` (the pools, the
phase-A hits, the :class:`~kvshm.offload.jobs.JobTable`, the
:class:`~kvshm.offload.loads.LoadBook`, the :class:`~kvshm.offload.stores.StorePlanner`
and two scalars), so this module never imports :mod:`kvshm.offload.manager`.

Checked:

* both pools' own invariants (free / cached-evictable / pinned, queue links, index);
* every CPU pin is recorded by exactly one hit, queued load or job (exact equality);
  every GPU pin the manager records is held (the engine holds its own refs besides);
* a CPU block being written by a store carries no hash (never satisfies a lookup);
* in-flight marks == the GPU ids and keys of store jobs plus queued finish-time stores,
  each GPU id and key at most once;
* "being loaded" counts == queued loads plus load jobs not yet reported; load
  destination marks == queued loads plus load jobs not yet complete;
* jobs wait for a non-empty set of live ranks; the abandoned count matches; the load
  jobs in flight are exactly the load book's;
* after a rank failure nothing is pinned by lookups, queued loads or finish stores.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from kvshm.offload.hits import Hit
from kvshm.offload.jobs import JobTable, LoadJob, RemoteJob, StoreJob
from kvshm.offload.loads import LoadBook
from kvshm.offload.pool import BlockPool
from kvshm.offload.stores import StorePlanner
from kvshm.types import GpuBlocks

__all__ = ["Parts", "check_parts", "recorded_pins"]


@dataclass(frozen=True, slots=True)
class Parts:
    """The manager's parts as they are at the check. ``failed``: a rank was declared
    dead; ``abandoned``: the manager's count of abandoned jobs in flight."""

    cpu: BlockPool
    gpu: GpuBlocks
    world_size: int
    hits: Mapping[str, Hit]
    jobs: JobTable
    loads: LoadBook
    stores: StorePlanner
    failed: bool
    abandoned: int
    remote_pins: tuple[int, ...] = ()


def _fail(msg: str) -> None:
    raise AssertionError(msg)


def check_parts(p: Parts) -> None:
    p.cpu.check_invariants()
    gpu_check = getattr(p.gpu, "check_invariants", None)
    if callable(gpu_check):
        gpu_check()
    _check_pins(p)
    _check_marks(p)
    _check_jobs(p)


def recorded_pins(p: Parts) -> tuple[Counter[int], Counter[int]]:
    """(CPU, GPU) pins per block id as the records say: phase-A hits, queued loads,
    jobs, queued finish-time stores."""
    cpu: Counter[int] = Counter()
    gpu: Counter[int] = Counter()
    for hit in p.hits.values():
        cpu.update(hit.pinned)
    for part in p.loads.queue.values():
        cpu.update(part.cpu_ids)
        gpu.update(part.gpu_ids)
    for job in p.jobs.jobs.values():
        cpu.update(job.cpu_ids)
        gpu.update(job.gpu_ids)
    gpu.update(c.gpu_id for c in p.stores.finished.items)
    cpu.update(p.remote_pins)
    return cpu, gpu


def _check_pins(p: Parts) -> None:
    cpu_rec, gpu_rec = recorded_pins(p)
    for b in range(p.cpu.num_blocks):
        if p.cpu.ref_cnt(b) != cpu_rec.get(b, 0):
            _fail(f"CPU block {b}: ref {p.cpu.ref_cnt(b)}, recorded pins {cpu_rec.get(b, 0)}")
    ref_cnt = getattr(p.gpu, "ref_cnt", None)
    if callable(ref_cnt):
        for b, n in gpu_rec.items():
            if ref_cnt(b) < n:
                _fail(f"GPU block {b}: ref {ref_cnt(b)} < recorded pins {n}")
    for rid, hit in p.hits.items():
        if hit.cause is not None and hit.pinned:
            _fail(f"tombstone hit of {rid} still records pins")
    if p.failed and (any(h.cause is None for h in p.hits.values()) or p.loads.queue
                     or p.stores.finished.items or p.remote_pins):
        _fail("a failed manager still holds lookup pins, queued loads or finish stores")


def _check_marks(p: Parts) -> None:
    plan, book = p.stores, p.loads
    gpu_ids: list[int] = []
    keys: list[bytes] = []
    loading: Counter[int] = Counter()
    dst: Counter[int] = Counter()
    for job in p.jobs.jobs.values():
        if isinstance(job, RemoteJob):
            for c in job.cpu_ids:
                if not job.put and p.cpu.block_hashes(c):
                    _fail(f"CPU block {c} is being fetched but carries hashes")
        elif isinstance(job, StoreJob):
            gpu_ids.extend(job.gpu_ids)
            keys.extend(job.keys)
            for c in job.cpu_ids:
                if p.cpu.block_hashes(c):
                    _fail(f"CPU block {c} is being written but carries hashes")
        else:
            dst.update(job.gpu_ids)
            if not job.reported:
                for part in job.parts:
                    loading.update(part.cpu_ids)
    for cand in plan.finished.items:
        gpu_ids.append(cand.gpu_id)
        keys.append(cand.key)
    for part in book.queue.values():
        loading.update(part.cpu_ids)
        dst.update(part.gpu_ids)
    if len(set(gpu_ids)) != len(gpu_ids) or len(set(keys)) != len(keys):
        _fail("a GPU block or a key is being stored twice")
    if set(gpu_ids) != plan.marks.gpu:
        _fail(f"in-flight GPU ids {sorted(plan.marks.gpu)} != jobs' {sorted(gpu_ids)}")
    if set(keys) != plan.marks.keys:
        _fail("in-flight keys differ from the store jobs' keys")
    if loading != Counter(book.loading_cpu.counts):
        _fail(f"being-loaded CPU counts {dict(book.loading_cpu.counts)} != expected "
              f"{dict(loading)}")
    if dst != Counter(book.dst.counts):
        _fail(f"load destination counts {dict(book.dst.counts)} != expected {dict(dst)}")


def _check_jobs(p: Parts) -> None:
    jobs = p.jobs
    live = set(range(p.world_size)) - jobs.dead
    if jobs.revoked & jobs.dead:
        _fail(f"ranks {sorted(jobs.revoked & jobs.dead)} both revoked and fenced")
    abandoned = 0
    for jid, job in jobs.jobs.items():
        if not job.waiting or not job.waiting <= live:
            _fail(f"job {jid} waits for {sorted(job.waiting)}, live ranks {sorted(live)}")
        if not job.failed and not jobs.revoked.isdisjoint(job.waiting):
            _fail(f"job {jid} waits for a revoked rank but is not failed")
        if isinstance(job, RemoteJob):
            if job.gpu_ids or len(job.keys) != len(job.cpu_ids):
                _fail(f"remote job {jid}: {len(job.gpu_ids)} GPU ids, {len(job.keys)} keys "
                      f"for {len(job.cpu_ids)} CPU ids")
        elif len(job.gpu_ids) != len(job.cpu_ids):
            _fail(f"job {jid} pairs {len(job.gpu_ids)} GPU ids with {len(job.cpu_ids)} CPU ids")
        abandoned += job.abandoned
        if job.abandoned and not job.failed:
            _fail(f"abandoned job {jid} is not marked failed")
    if abandoned != p.abandoned:
        _fail(f"{abandoned} abandoned jobs in flight, manager counts {p.abandoned}")
    loads = {j for j, job in jobs.jobs.items() if isinstance(job, LoadJob)}
    if loads != set(p.loads.job_reqs):
        _fail(f"load jobs {sorted(loads)} != reported load_jobs {sorted(p.loads.job_reqs)}")
