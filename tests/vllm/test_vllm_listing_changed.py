"""The vLLM adapter's per-step listing is O(changed) (issue 15, part 2), and its GPU block
hashes are cached.

* A running request is listed when something kvshm reads changed: new block ids, or its
  computed tokens reaching the next block boundary past its confirmed tokens; otherwise
  it is passed over (``requests_unchanged``) without reading its ``Request``.
* A preempted request loses its next look (it is listed in full when it resumes); a
  finished one is forgotten.
* ``VllmGpuBlocks.block_hashes`` hands back the same tuple while the block keeps its
  hash object, and a new one once vLLM re-hashes the block.

No vLLM engine: duck-typed SchedulerOutputs (the listing's own test in
``test_vllm_connector_api`` covers every kind of request), vLLM's real ``BlockPool``.
"""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import pytest

from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.scheduler import SchedulerSide
from kvshm.types import KVGroup, ScheduledRequest, StoreMode

pytest.importorskip("vllm.v1.core.block_pool")

pytestmark = pytest.mark.vllm

BS = 16


def _side() -> SchedulerSide:
    return SchedulerSide(ConnectorConfig("unit", 1, 1, BS, (KVGroup.full(),), StoreMode.EAGER,
                                         None, 64, None, 30.0, 5.0, 0))


def _so(*cached: tuple[str, Any, int], new: tuple[Any, ...] = (),
        preempted: set[str] | None = None) -> Any:
    return NS(scheduled_new_reqs=list(new), preempted_req_ids=preempted or set(),
              kv_connector_block_state=None,
              scheduled_cached_reqs=NS(req_ids=[c[0] for c in cached], resumed_req_ids=set(),
                                       new_block_ids=[c[1] for c in cached],
                                       num_computed_tokens=[c[2] for c in cached]))


def _req(side: SchedulerSide, rid: str, computed: int, placeholders: int = 0) -> Any:
    r = NS(request_id=rid, block_hashes=[], num_tokens=computed + 1,
           num_computed_tokens=computed, num_output_placeholders=placeholders,
           kv_transfer_params=None)
    side.on_new_request(r)
    return r


def _ids(out: list[ScheduledRequest]) -> list[str]:
    return [r.req_id for r in out]


def test_a_running_request_is_listed_only_when_something_it_carries_changed() -> None:
    side = _side()
    a, b = _req(side, "a", 20), _req(side, "b", 40, placeholders=1)
    out, _ = side._listing(_so(new=(NS(req_id="a", block_ids=([1, 2],), num_computed_tokens=20),
                                    NS(req_id="b", block_ids=([3, 4, 5],),
                                       num_computed_tokens=40))))
    assert _ids(out) == ["a", "b"]
    # decode steps: a at 21..31 and b at 41..47 stay inside their confirmed block
    for step in range(1, 8):
        a.num_computed_tokens, b.num_computed_tokens = 20 + step, 40 + step
        out, _ = side._listing(_so(("a", None, a.num_computed_tokens),
                                   ("b", None, b.num_computed_tokens)))
        assert out == []
    assert side.counters.requests_unchanged == 14
    # new block ids: listed at once, with them
    a.num_computed_tokens = 28
    out, _ = side._listing(_so(("a", ([6],), 28), ("b", None, 47)))
    assert out == [ScheduledRequest("a", [], 21, ((6,),), False, 28)]
    # b's computed tokens reach 48: listed, but one placeholder keeps 47 unconfirmed, so
    # it is listed again until the confirmed tokens cross too
    b.num_computed_tokens = 48
    out, _ = side._listing(_so(("b", None, 48)))
    assert _ids(out) == ["b"] and out[0].num_confirmed_tokens == 47
    b.num_computed_tokens = 49
    out, _ = side._listing(_so(("b", None, 49)))
    assert _ids(out) == ["b"] and out[0].num_confirmed_tokens == 48
    b.num_computed_tokens = 50
    assert side._listing(_so(("b", None, 50)))[0] == []      # next look: 64
    a.num_computed_tokens = 32
    out, _ = side._listing(_so(("a", None, 32)))
    assert _ids(out) == ["a"]                                  # 32: a's next block


def test_preempted_and_finished_requests_lose_their_next_look() -> None:
    side = _side()
    a = _req(side, "a", 16)
    side._listing(_so(new=(NS(req_id="a", block_ids=([1, 2],), num_computed_tokens=16),)))
    assert side._lister.next_look == {"a": 32}
    out, _ = side._listing(_so(preempted={"a"}))
    assert _ids(out) == ["a"] and out[0].preempted and "a" not in side._lister.next_look
    a.num_computed_tokens = 17
    out, _ = side._listing(_so(("a", None, 17)))             # no next look: listed
    assert _ids(out) == ["a"]
    side._forget("a")  # what ``finished`` and a finished id in the SchedulerOutput do
    assert side._lister.next_look == {} and "a" not in side._requests


def test_block_hashes_are_cached_until_vllm_rehashes_the_block() -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    from kvshm.integrations.vllm.blocks import VllmGpuBlocks

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=32)
    gpu = VllmGpuBlocks(pool)
    [blk] = pool.get_new_blocks(1)
    assert gpu.block_hashes(blk.block_id) == ()
    pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(b"a" * 32), 0), blk, 32)
    first = gpu.block_hashes(blk.block_id)
    assert first == (b"a" * 32,) and gpu.block_hashes(blk.block_id) is first
    pool.free_blocks([blk])
    pool.evict_blocks({blk.block_id})
    assert gpu.block_hashes(blk.block_id) == ()
    [again] = pool.get_new_blocks(1)
    while again.block_id != blk.block_id:  # take the same block back
        [again] = pool.get_new_blocks(1)
    pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(b"b" * 32), 0), again, 32)
    assert gpu.block_hashes(blk.block_id) == (b"b" * 32,)


def test_a_failed_engine_keeps_no_id_of_the_requests_that_end_after_it() -> None:
    """Hazard: once the engine is FAILED (a rank's verdict: vLLM serves on without
    offload) no listing runs again, and every request that ended still added its id to
    the listing's set of ids that left the running list -- which only a listing
    cleared. One entry per request for the life of the server (a soak probe: 100,000
    entries after 100k requests, ~128 B each). A step without a listing now lets that
    set and the mirror go."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from kvshm.engine.lifecycle import EngineState
    from kvshm.ipc.ring_pair import RevokeReason
    from tools.vs_vllm_rig import Rig

    def step(new: list[Any], cached: list[tuple[str, int]]) -> Any:
        cd = CachedRequestData(req_ids=[c[0] for c in cached], resumed_req_ids=set(),
                               new_token_ids=[[] for _ in cached], all_token_ids={},
                               new_block_ids=[None for _ in cached],
                               num_computed_tokens=[c[1] for c in cached],
                               num_output_tokens=[0 for _ in cached])
        return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cd,
                               num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                               scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                               finished_req_ids=set(), free_encoder_mm_hashes=[],
                               preempted_req_ids=set())

    rig = Rig(gpu_blocks=64, cpu_blocks=64)
    try:
        side = rig.side
        # READY: two running requests listed twice, so the mirror holds them
        running = [rig.request(f"run{i}", list(range(i, i + 20))) for i in range(2)]
        for r in running:
            side.on_new_request(r)
            side.lookup(r, 0)
            side.allocated(r, ([10 + len(side._requests)],), 0)
        side.build(step([NewRequestData.from_request(r, ([10],)) for r in running], []))
        side.build(step([], [(r.request_id, 20) for r in running]))
        assert side._lister._ids == ["run0", "run1"] and side._lister._gone == set()
        with side.guard:
            side.client._core.rank_died(0, None, why="test: a hang",
                                        revoke=RevokeReason.HUNG)
        assert side.client.state is EngineState.FAILED
        for i in range(300):
            r = rig.request(f"cmpl-{i:032x}-0", list(range(40)))
            side.on_new_request(r)
            side.lookup(r, 0)
            side.finished(r, ([],))
            if i % 10 == 9:  # vLLM steps on without offload
                side.build(step([], [(x.request_id, 20) for x in running]))
        # before: 300 ids kept (and the two-entry mirror, never to be read again)
        assert side._lister._gone == set() and side._lister._ids == []
        assert side._requests.keys() == {"run0", "run1"}
    finally:
        rig.close()
