"""``OffloadManager.check_invariants``: an O(everything) cross-check for tests.

Kept apart from the manager so the hot module stays small; it reads the manager's
private records on purpose (it is the manager's own consistency check).

Checked:

* both pools' own invariants (free / cached-evictable / pinned, queue links, index);
* every CPU pin is recorded by exactly one hit, queued load or job (exact equality);
  every GPU pin the manager records is held (the engine holds its own refs besides);
* a CPU block being written by a store carries no hash (never satisfies a lookup);
* in-flight marks == the GPU ids and keys of store jobs plus queued finish-time stores,
  each GPU id and key at most once;
* "being loaded" counts == queued loads plus load jobs not yet reported; load
  destination marks == queued loads plus load jobs not yet complete;
* jobs wait for a non-empty set of live ranks; the abandoned count matches;
* after a rank failure nothing is pinned by lookups, queued loads or finish stores.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvshm.offload.jobs import JobKind

if TYPE_CHECKING:
    from kvshm.offload.manager import OffloadManager

__all__ = ["check_manager", "recorded_pins"]


def _fail(msg: str) -> None:
    raise AssertionError(msg)


def check_manager(m: OffloadManager) -> None:
    m.cpu.check_invariants()
    gpu_check = getattr(m.gpu, "check_invariants", None)
    if callable(gpu_check):
        gpu_check()
    _check_pins(m)
    _check_marks(m)
    _check_jobs(m)


def recorded_pins(m: OffloadManager) -> tuple[Counter[int], Counter[int]]:
    """(CPU, GPU) pins per block id as the manager's records say: phase-A hits, queued
    loads, jobs, queued finish-time stores."""
    cpu: Counter[int] = Counter()
    gpu: Counter[int] = Counter()
    for hit in m._hits.values():
        cpu.update(hit.pinned)
    for part in m._load_queue.values():
        cpu.update(part.cpu_ids)
        gpu.update(part.gpu_ids)
    for job in m._jobs.jobs.values():
        cpu.update(job.cpu_ids)
        gpu.update(job.gpu_ids)
    gpu.update(c[0] for c in m._plan.finish_queue)
    return cpu, gpu


def _check_pins(m: OffloadManager) -> None:
    cpu_rec, gpu_rec = recorded_pins(m)
    for b in range(m.cpu.num_blocks):
        if m.cpu.ref_cnt(b) != cpu_rec.get(b, 0):
            _fail(f"CPU block {b}: ref {m.cpu.ref_cnt(b)}, recorded pins {cpu_rec.get(b, 0)}")
    ref_cnt = getattr(m.gpu, "ref_cnt", None)
    if callable(ref_cnt):
        for b, n in gpu_rec.items():
            if ref_cnt(b) < n:
                _fail(f"GPU block {b}: ref {ref_cnt(b)} < recorded pins {n}")
    for rid, hit in m._hits.items():
        if hit.cause is not None and hit.pinned:
            _fail(f"tombstone hit of {rid} still records pins")
    if m._failed and (any(h.cause is None for h in m._hits.values()) or m._load_queue
                      or m._plan.finish_queue):
        _fail("a failed manager still holds lookup pins, queued loads or finish stores")


def _check_marks(m: OffloadManager) -> None:
    plan = m._plan
    gpu_ids: list[int] = []
    keys: list[bytes] = []
    loading: Counter[int] = Counter()
    dst: Counter[int] = Counter()
    for job in m._jobs.jobs.values():
        if job.kind is JobKind.STORE:
            gpu_ids.extend(job.gpu_ids)
            keys.extend(job.keys)
            for c in job.cpu_ids:
                if m.cpu.block_hashes(c):
                    _fail(f"CPU block {c} is being written but carries hashes")
        else:
            dst.update(job.gpu_ids)
            if not job.reported:
                for part in job.parts:
                    loading.update(part.cpu_ids)
    for b, _g, key in plan.finish_queue:
        gpu_ids.append(b)
        keys.append(key)
    for part in m._load_queue.values():
        loading.update(part.cpu_ids)
        dst.update(part.gpu_ids)
    if len(set(gpu_ids)) != len(gpu_ids) or len(set(keys)) != len(keys):
        _fail("a GPU block or a key is being stored twice")
    if set(gpu_ids) != plan.inflight_gpu:
        _fail(f"in-flight GPU ids {sorted(plan.inflight_gpu)} != jobs' {sorted(gpu_ids)}")
    if set(keys) != plan.inflight_keys:
        _fail("in-flight keys differ from the store jobs' keys")
    if loading != Counter(m._loading_cpu):
        _fail(f"being-loaded CPU counts {m._loading_cpu} != expected {dict(loading)}")
    if dst != Counter(plan.load_dst):
        _fail(f"load destination counts {plan.load_dst} != expected {dict(dst)}")


def _check_jobs(m: OffloadManager) -> None:
    live = set(range(m.world_size)) - m._jobs.dead
    if m._jobs.revoked & m._jobs.dead:
        _fail(f"ranks {sorted(m._jobs.revoked & m._jobs.dead)} both revoked and fenced")
    abandoned = 0
    for jid, job in m._jobs.jobs.items():
        if not job.waiting or not job.waiting <= live:
            _fail(f"job {jid} waits for {sorted(job.waiting)}, live ranks {sorted(live)}")
        if not job.failed and not m._jobs.revoked.isdisjoint(job.waiting):
            _fail(f"job {jid} waits for a revoked rank but is not failed")
        if len(job.gpu_ids) != len(job.cpu_ids):
            _fail(f"job {jid} pairs {len(job.gpu_ids)} GPU ids with {len(job.cpu_ids)} CPU ids")
        abandoned += job.abandoned
        if job.abandoned and not job.failed:
            _fail(f"abandoned job {jid} is not marked failed")
    if abandoned != m._abandoned:
        _fail(f"{abandoned} abandoned jobs in flight, manager counts {m._abandoned}")
    loads = {j for j, job in m._jobs.jobs.items() if job.kind is JobKind.LOAD}
    if loads != set(m._load_job_reqs):
        _fail(f"load jobs {sorted(loads)} != reported load_jobs {sorted(m._load_job_reqs)}")
