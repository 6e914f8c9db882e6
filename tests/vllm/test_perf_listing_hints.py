"""The listing's mirror of the last step's next looks (issue 15, "O(changed) per
step": the batch boundary test where vLLM kept its order, the positional walk
elsewhere) changes nothing: over random steps -- finishes, arrivals, growth, decode
progress, reorders, preemptions and resumptions, every request or only some listed -- a
listing with the mirror answers exactly what one that always asks ``next_look`` answers
(the requests listed, their fields, the counters, the next looks); and a steady decode
step takes the batch test.

Duck-typed SchedulerOutputs; no vLLM import."""

from __future__ import annotations

import random
from types import SimpleNamespace as NS
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.listing import Listing
from kvshm.integrations.vllm.records import SchedulerCounters
from kvshm.types import KVGroup, StoreMode, no_new_blocks

BS = 4


def _listing(requests: dict[str, Any], mirror: bool = True) -> Listing:
    cfg = ConnectorConfig("unit", 1, 1, BS, (KVGroup.full(),), StoreMode.EAGER, None, 64,
                          None, 30.0, 5.0, 0)
    return Listing(cfg, requests, set(), SchedulerCounters(), no_new_blocks(1), mirror=mirror)


class _World:
    """Running requests in vLLM's order; ids are made once, so ``is`` holds across
    steps as it does for vLLM's request ids."""

    def __init__(self, rnd: random.Random) -> None:
        self.rnd = rnd
        self.requests: dict[str, Any] = {}
        self.running: list[str] = []
        self.preempted: list[str] = []
        self.next_id = 0
        self.next_block = 1

    def new_request(self) -> Any:
        rid = f"req-{self.next_id}"
        self.next_id += 1
        computed = self.rnd.randrange(0, 3 * BS)
        r = NS(request_id=rid, block_hashes=[], num_tokens=computed + 1,
               num_computed_tokens=computed, num_output_placeholders=self.rnd.choice([0, 0, 1]),
               kv_transfer_params=None)
        self.requests[rid] = r
        return r

    def blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out


def _so(new: list[Any], cached: list[tuple[str, Any]], resumed: set[str],
        preempted: set[str], requests: dict[str, Any]) -> Any:
    return NS(scheduled_new_reqs=new, preempted_req_ids=preempted,
              kv_connector_block_state=None,
              scheduled_cached_reqs=NS(
                  req_ids=[rid for rid, _ in cached], resumed_req_ids=resumed,
                  new_block_ids=[nb for _, nb in cached],
                  num_computed_tokens=[requests[rid].num_computed_tokens for rid, _ in cached]))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 1 << 30), steps=st.integers(1, 25))
def test_hints_answer_what_next_look_answers(seed: int, steps: int) -> None:
    rnd = random.Random(seed)
    w = _World(rnd)
    hinted, plain = _listing(w.requests), _listing(w.requests, mirror=False)
    for _ in range(steps):
        for rid in rnd.sample(w.running, min(len(w.running), rnd.randrange(0, 3))):
            w.running.remove(rid)  # finished: vLLM calls request_finished
            hinted.forget(rid)
            plain.forget(rid)
        new = []
        for _ in range(rnd.randrange(0, 4)):
            r = w.new_request()
            new.append(NS(req_id=r.request_id, block_ids=(w.blocks(2),),
                          num_computed_tokens=r.num_computed_tokens))
        preempted = set(rnd.sample(w.running, min(len(w.running), rnd.choice([0, 0, 0, 1]))))
        w.running = [rid for rid in w.running if rid not in preempted]
        resumed = set(rnd.sample(w.preempted, min(len(w.preempted), rnd.randrange(0, 2))))
        w.preempted = [rid for rid in w.preempted if rid not in resumed] + sorted(preempted)
        if rnd.random() < 0.1:
            rnd.shuffle(w.running)
        cached: list[tuple[str, Any]] = []
        listed = w.running if rnd.random() < 0.7 else [
            rid for rid in w.running if rnd.random() < 0.5]
        for rid in listed:
            r = w.requests[rid]
            r.num_computed_tokens += rnd.choice([0, 1, 1, 2, BS])
            r.num_tokens = max(r.num_tokens, r.num_computed_tokens + 1)
            cached.append((rid, (w.blocks(1),) if rnd.random() < 0.2 else None))
        for rid in sorted(resumed):
            cached.append((rid, (w.blocks(3),)))
        w.running.extend(sorted(resumed))
        w.running.extend(nr.req_id for nr in new)
        so = _so(new, cached, resumed, preempted, w.requests)
        assert hinted.build(so) == plain.build(so)
        assert hinted.next_look == plain.next_look
        assert vars(hinted._counters) == vars(plain._counters)
        assert hinted._announced == plain._announced


def test_a_steady_decode_step_takes_the_batch_test() -> None:
    """Finishes, arrivals and growth keep vLLM's order: after the first listing every
    step's ids match the mirror, and only the flagged requests are visited."""
    rnd = random.Random(7)
    w = _World(rnd)
    lst = _listing(w.requests)
    batch = []
    orig = lst._aligned

    def spy(*args: Any) -> bool:
        batch.append(orig(*args))
        return batch[-1]

    lst._aligned = spy  # type: ignore[method-assign,assignment]
    new: list[Any] = []
    for _ in range(6):
        for rid in w.running[:2]:
            w.running.remove(rid)
            lst.forget(rid)
        w.running.extend(nr.req_id for nr in new)  # last step's new requests run now
        cached = []
        for rid in w.running:
            r = w.requests[rid]
            r.num_computed_tokens += 1
            r.num_tokens = r.num_computed_tokens + 1
            cached.append((rid, (w.blocks(1),) if rnd.random() < 0.2 else None))
        new = []
        for _ in range(3):
            r = w.new_request()
            new.append(NS(req_id=r.request_id, block_ids=(w.blocks(2),),
                          num_computed_tokens=r.num_computed_tokens))
        lst.build(_so(new, cached, set(), set(), w.requests))
    assert batch[1:] == [True] * 5, batch
