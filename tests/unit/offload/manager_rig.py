"""The manager test rig shared by tests/unit/offload: the real ``OffloadManager`` over
two real ``BlockPool``s (the CPU tier and a toy engine's GPU pool), with tiny pools so
block ids, ref counts and jobs can be asserted exactly.

The test plays the engine: it allocates GPU blocks (:meth:`Rig.alloc`), hashes a block
once its KV is computed (:meth:`Rig.hash`), lists requests in ``StepInput``\\ s
(:meth:`Rig.step`, numbered 1, 2, ...) and acks jobs (:meth:`Rig.ack`);
``check_invariants()`` runs after every rig call that changes the manager.
:func:`manager_state` snapshots everything a call could change, for "refused whole,
nothing changed" checks.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from kvshm.config import Eviction
from kvshm.hashing import chain_hashes
from kvshm.ipc.protocol import Transfer, unpack_ids
from kvshm.offload.counters import DeclineReason
from kvshm.offload.jobs import LoadJob, RemoteJob, StoreJob
from kvshm.offload.manager import OffloadManager
from kvshm.offload.pool import BlockPool
from kvshm.types import KVGroup, RequestView, ScheduledRequest, StepInput, StepPlan, StoreMode

BS = 4
REMOTE = {"do_remote_decode": True}


class Rig:
    """The manager, both pools and a step counter."""

    def __init__(self, *, cpu: int = 8, gpu: int = 16, world_size: int = 1,
                 groups: Sequence[KVGroup] = (KVGroup.full(),),
                 mode: StoreMode = StoreMode.EAGER, lazy_window: int = 256,
                 eviction: Eviction = Eviction.LRU) -> None:
        self.cpu = BlockPool(cpu, eviction=eviction)
        self.gpu = BlockPool(gpu)
        self.m = OffloadManager(self.cpu, self.gpu, block_size=BS, groups=groups,
                                world_size=world_size, mode=mode, lazy_window=lazy_window)
        self.ngroups = len(groups)
        self.n = 0

    def step(self, *reqs: ScheduledRequest, allocated: Sequence[int] = ()) -> StepPlan:
        self.n += 1
        plan = self.m.build_step(StepInput(self.n, reqs, (), frozenset(allocated)))
        self.m.check_invariants()
        return plan

    def ack(self, t: Transfer | None, *, ranks: Sequence[int] = (0,), ok: bool = True) -> None:
        assert t is not None
        for r in ranks:
            self.m.on_done(t.job_id, r, ok)
            self.m.check_invariants()

    def alloc(self, n: int, hashes: Sequence[bytes] = ()) -> list[int]:
        """Engine allocation; ``hashes`` marks the first blocks as computed."""
        ids = self.gpu.allocate(n)
        self.hash(ids, hashes)
        return ids

    def hash(self, ids: Sequence[int], hashes: Sequence[bytes]) -> None:
        for b, h in zip(ids, hashes):
            self.gpu.add_hashes(b, [h])

    def seed_cpu(self, *hashes: bytes) -> list[int]:
        """Put blocks into the CPU tier as if stored long ago (cached, ref 0)."""
        ids = self.cpu.allocate(len(hashes))
        for b, h in zip(ids, hashes):
            self.cpu.add_hashes(b, [h])
        self.cpu.free(reversed(ids))
        return ids


class Req:
    """An engine-side request: tokens and their chained block hashes."""

    def __init__(self, rid: str, n_tokens: int, *, base: int = 0,
                 params: dict[str, Any] | None = None) -> None:
        self.rid = rid
        self.toks = list(range(base, base + n_tokens))
        self.h = chain_hashes(self.toks, BS)
        self.params = params

    def view(self) -> RequestView:
        return RequestView(self.rid, self.h, len(self.toks), self.params)

    def sched(self, *new_ids: Sequence[int], confirmed: int, new: bool = False,
              preempted: bool = False) -> ScheduledRequest:
        return ScheduledRequest(self.rid, self.h, len(self.toks),
                                tuple(tuple(ids) for ids in new_ids), new, confirmed,
                                preempted, self.params)


def hashes(n_tokens: int, base: int = 0) -> list[bytes]:
    """The chained block hashes of tokens ``base, base + 1, ...``."""
    return chain_hashes(list(range(base, base + n_tokens)), BS)


def ids(data: bytes) -> list[int]:
    return unpack_ids(data)


def pairs(t: Transfer | None) -> tuple[list[int], list[int]]:
    assert t is not None
    return ids(t.src_ids), ids(t.dst_ids)


def refs(pool: BlockPool, block_ids: Sequence[int]) -> list[int]:
    return [pool.ref_cnt(b) for b in block_ids]


def declined(m: OffloadManager, reason: DeclineReason) -> int:
    return m.counters.declined[reason]


# ---- the snapshot ------------------------------------------------------------------------


def pool_state(pool: Any) -> tuple[Any, ...]:
    """Ref counts, the free queue from its LRU end, and every block's hashes."""
    n = pool.num_blocks
    return (tuple(pool.ref_cnt(b) for b in range(n)), tuple(pool.iter_free_from_lru()),
            tuple(pool.block_hashes(b) for b in range(n)))


def _job_state(j: StoreJob | LoadJob | RemoteJob) -> tuple[Any, ...]:
    ack = (j.step, list(j.gpu_ids), list(j.cpu_ids), set(j.waiting), j.failed, j.cause,
           j.abandoned)
    if isinstance(j, StoreJob):
        return ("store", *ack, list(j.groups), list(j.keys), j.n_eager)
    if isinstance(j, RemoteJob):
        return ("remote", *ack, j.put, list(j.keys), list(j.depths), j.req_id, j.keep)
    return ("load", *ack, [(p.req_id, list(p.cpu_ids), list(p.gpu_ids)) for p in j.parts],
            j.reported)


def manager_state(m: OffloadManager) -> dict[str, Any]:
    """Everything a call could change, as plain comparable values (counters without
    ``invalid_calls``, which a refusal bumps)."""
    jobs, loads, stores, track = m._jobs, m._loads, m._stores, m._track
    counters = m.counters.as_dict()
    del counters["invalid_calls"]
    return {
        "cpu": pool_state(m.cpu),
        "gpu": pool_state(m.gpu),
        "hits": {rid: (h.start, h.end, copy.deepcopy(h.cpu), list(h.pinned), tuple(h.hashes),
                       h.cause) for rid, h in m._hits.items()},
        "load_queue": {rid: (p.req_id, list(p.cpu_ids), list(p.gpu_ids), p.failed_ids,
                             p.num_tokens) for rid, p in loads.queue.items()},
        "loading_cpu": dict(loads.loading_cpu.counts),
        "load_job_reqs": dict(loads.job_reqs),
        "results": list(loads.results),
        "failed_loads": dict(loads.failed),
        "failed": m.outcomes.failed,
        "abandoned": m.outcomes.abandoned,
        "jobs": {jid: _job_state(j) for jid, j in jobs.jobs.items()},
        "revoked": set(jobs.revoked),
        "dead": set(jobs.dead),
        "next_job_id": jobs._next_id,
        "inflight_gpu": set(stores.marks.gpu),
        "inflight_keys": set(stores.marks.keys),
        "load_dst": dict(loads.dst.counts),
        "finish_queue": list(stores.finished.items),
        "reqs": {rid: ([list(t) for t in st.tables], st.cursor, tuple(st.hashes), st.start,
                       st.remote, st.tracked) for rid, st in track.reqs.items()},
        "watch": dict(track.watch),
        "counters": counters,
    }
