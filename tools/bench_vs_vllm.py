"""kvshm's vLLM adapter against vLLM's own CPU offload connector, side by side (needs vLLM).

``python -m tools.bench_vs_vllm [--json] [--quick]``

Both scheduler sides run in lockstep on ONE real vLLM ``KVCacheManager`` with real
``Request`` objects and real ``SchedulerOutput``s: vLLM 0.32's
``SimpleCPUOffloadScheduler`` (eager mode; its worker is simulated: every store and load
of a step completes before the next one) and kvshm's adapter
(:class:`~kvshm.integrations.vllm.scheduler.SchedulerSide`, called with what
``KvshmConnector``'s hooks pass, over a real ``SyncClient`` whose one rank is an
embedded ``Worker`` in this process: the shared-memory post of every transfer is
included; the worker's own copying is not timed). Per step, in vLLM's order: load and
store completions (``update_connector_output``), finished requests
(``request_finished_all_groups``), arrivals (``get_num_new_matched_tokens``,
``update_state_after_alloc``), ``build_connector_meta``. A contender's step time is the
sum of its hooks' times; which contender goes first alternates every step.

Decode trace, at 1k / 4k / 16k running requests: per step 64 running requests grow a
block (16 new tokens, one new GPU block), 16 finish, 16 arrive (a 4-block prompt: half
fresh, half the prompt of a request that finished at least two steps earlier, whose GPU
copy the harness drops from vLLM's prefix cache, so that it is a CPU-tier hit). Two
phases: ``all`` (the SchedulerOutput lists every running request, one token each, as a
decode step does; requests that do not grow keep their token counts, which isolates the
listing cost) and ``changed`` (only the requests that grew, arrived or were loaded).

Same work: every lookup must answer the same hit for both, and the stored blocks, loaded
blocks and hit tokens must be equal over the run; otherwise the tool exits 1 naming the
difference.

Chat trace (hit rate): multi-turn conversations whose prompts extend the previous turn
(:mod:`tools.chat_trace` when present, else a local generator), one request at a time,
the CPU tier at half the trace's distinct blocks for both, the GPU prefix cache dropped
after each request (so hits come from the CPU tier). ``hit_fraction`` = CPU-tier hit
tokens / the hit tokens an unbounded CPU tier gives on the same trace; ``belady`` is the
offline optimum at the same capacity.

Last line with ``--json``: ``{"step_ratio_all": {"1000": ..}, "step_ratio_changed":
{..}, "hit_fraction": {"kvshm": .., "vllm": .., "belady": ..}}`` (ratio = vLLM µs /
kvshm µs, medians over the timed steps).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import deque
from typing import Any

from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.request import Request

from tools import chat_trace as ct
from tools.vs_vllm_rig import BS, Rig, SameWorkError

SIZES = (1000, 4000, 16000)
QUICK_SIZES = (200, 400)
GROW, FINISH, ARRIVE = 64, 16, 16
PROMPT = 4 * BS  # a 4-block prompt
WHO = ("kvshm", "vllm")


def _order(step: int) -> tuple[str, str]:
    return WHO if step % 2 == 0 else (WHO[1], WHO[0])


class Decode:
    """The decode trace over one :class:`Rig` (see the module docstring)."""

    def __init__(self, n: int, steps: int, seed: int = 0) -> None:
        self.rnd = random.Random(seed)
        # GPU: every running request's blocks plus each step's net growth, with slack;
        # CPU: everything the trace stores (no eviction: both must do the same work)
        grow = steps * (GROW + ARRIVE * (PROMPT // BS + 1))
        self.rig = Rig(gpu_blocks=n * (PROMPT // BS + 2) + grow + 4096,
                       cpu_blocks=n * (PROMPT // BS + 2) + grow + 4096)
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []  # loads in flight
        self.ready: list[Request] = []  # loaded: scheduled next step
        self.gone: deque[tuple[int, list[int], list[int]]] = deque()  # finished, GPU ids
        self.repeatable: list[list[int]] = []  # prompts whose GPU copy was dropped
        self.ids = iter(range(1 << 60))
        self.step = 0
        self.cursor = 0
        self.samples: dict[str, list[dict[str, float]]] = {"all": [], "changed": []}
        self._start(n)

    def _prompt(self) -> list[int]:
        return [self.rnd.randrange(50000) for _ in range(PROMPT)]

    def _start(self, n: int) -> None:
        """``n`` fresh requests, prefilled in batches, then one step that lists all
        (their prompt blocks are stored): untimed."""
        rig = self.rig
        for lo in range(0, n, 2048):
            new: list[NewRequestData] = []
            for _ in range(min(2048, n - lo)):
                r = rig.request(f"r{next(self.ids)}", self._prompt())
                local, ext = rig.lookup(r, WHO)
                rig.admit(r, local, ext, WHO)
                new.append(NewRequestData.from_request(r, rig.kvm.get_block_ids(r.request_id)))
                self.running[r.request_id] = r
            rig.complete(WHO)
            rig.build(rig.output(new, [], set(), {d.req_id: PROMPT for d in new}), WHO)
            for d in new:
                self.running[d.req_id].num_computed_tokens = PROMPT
        rig.complete(WHO)
        cached: list[tuple[Request, Any]] = [(r, None) for r in self.running.values()]
        rig.build(rig.output([], cached, set(), {r.request_id: 1 for r, _ in cached}), WHO)
        rig.take_clock()

    def run(self, phase: str, steps: int, timed: bool) -> None:
        for _ in range(steps):
            self._one(phase)
            clock = self.rig.take_clock()
            if timed:
                self.samples[phase].append(clock)

    def _one(self, phase: str) -> None:
        rig, order = self.rig, _order(self.step)
        self.step += 1
        rig.complete(order)
        finished: set[str] = set()
        for rid in list(self.running)[:FINISH]:
            r = self.running.pop(rid)
            ids = rig.kvm.get_block_ids(rid)[0]
            rig.finish(r, order)
            finished.add(rid)
            self.gone.append((self.step, ids, r.prompt_token_ids or []))
        self._drop_old_gpu_copies()
        new: list[NewRequestData] = []
        sched: dict[str, int] = {}
        for r in self.ready:  # loaded last step: scheduled now, like vLLM does
            rig.kvm.cache_blocks(r, r.num_computed_tokens)
            n_new = r.num_tokens - r.num_computed_tokens
            got = rig.kvm.allocate_slots(r, n_new)
            assert got is not None
            new.append(NewRequestData.from_request(r, rig.kvm.get_block_ids(r.request_id)))
            sched[r.request_id] = n_new
            self.running[r.request_id] = r
        self.ready = []
        grown = self._grow(sched)
        for _ in range(ARRIVE):
            prompt = (self.repeatable.pop(self.rnd.randrange(len(self.repeatable)))
                      if self.repeatable and self.rnd.random() < 0.5 else self._prompt())
            r = rig.request(f"r{next(self.ids)}", prompt)
            local, ext = rig.lookup(r, order)
            rig.admit(r, local, ext, order)
            if ext:
                self.waiting.append(r)
                continue
            new.append(NewRequestData.from_request(r, rig.kvm.get_block_ids(r.request_id)))
            sched[r.request_id] = r.num_tokens - local
            self.running[r.request_id] = r
        listed = self.running if phase == "all" else grown
        cached = [(self.running[rid], grown.get(rid)) for rid in listed
                  if rid not in sched or rid in grown]
        for r, _ in cached:
            sched.setdefault(r.request_id, 1)
        loaded = rig.build(rig.output(new, cached, finished, sched), order)
        for d in new:
            r = self.running[d.req_id]
            r.num_computed_tokens = r.num_tokens
        for rid in grown:
            self.running[rid].num_computed_tokens += BS
        self.ready = [r for r in self.waiting if r.request_id in loaded]
        self.waiting = [r for r in self.waiting if r.request_id not in loaded]

    def _grow(self, sched: dict[str, int]) -> dict[str, Any]:
        """64 running requests, round robin, get one block of new tokens."""
        rig, out = self.rig, {}
        rids = list(self.running)
        for _ in range(GROW):
            self.cursor = (self.cursor + 1) % len(rids)
            rid = rids[self.cursor]
            if rid in sched or rid in out:
                continue
            r = self.running[rid]
            r.append_output_token_ids([self.rnd.randrange(50000) for _ in range(BS)])
            got = rig.kvm.allocate_slots(r, BS)
            assert got is not None, "GPU pool exhausted"
            out[rid] = got.get_block_ids()
            sched[rid] = BS
        return out

    def _drop_old_gpu_copies(self) -> None:
        """Requests finished two steps ago or more: their blocks leave vLLM's prefix
        cache (GPU pressure), so their prompts become CPU-tier hits."""
        while self.gone and self.gone[0][0] <= self.step - 2:
            _, ids, prompt = self.gone.popleft()
            blocks = self.rig.pool.blocks
            self.rig.pool.evict_blocks({b for b in ids if blocks[b].ref_cnt == 0})
            self.repeatable.append(prompt)


def _median_us(samples: list[dict[str, float]], who: str) -> float:
    return statistics.median(s[who] for s in samples) * 1e6


def decode_section(sizes: tuple[int, ...], warmup: int, steps: int
                   ) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, Any]]:
    """Per size and phase: median µs per step of each contender; the work done."""
    out: dict[str, dict[str, dict[str, float]]] = {"all": {}, "changed": {}}
    work: dict[str, Any] = {}
    for n in sizes:
        tr = Decode(n, 2 * (warmup + steps))
        try:
            for phase in ("all", "changed"):
                tr.run(phase, warmup, timed=False)
                tr.run(phase, steps, timed=True)
                s = tr.samples[phase]
                out[phase][str(n)] = {w: round(_median_us(s, w), 1) for w in WHO}
            tr.rig.complete(WHO)  # the last step's completions
            tr.rig.kvshm_totals()
            work[str(n)] = tr.rig.work
            _same_work(tr.rig.work, f"decode {n}")
        finally:
            tr.rig.close()
    return out, work


def _same_work(work: dict[str, dict[str, int]], what: str) -> None:
    if work["kvshm"] != work["vllm"]:
        raise SameWorkError(f"{what}: kvshm did {work['kvshm']}, vLLM {work['vllm']}")


# ---- the chat trace (hit rate) ---------------------------------------------------------

CHAT_GPU_BLOCKS = 256  # the GPU pool tools.chat_trace's limits assume


def _chat_pass(trace: list[ct.Turn], capacity: int, who: str) -> int:
    """CPU-tier hit tokens of ``who`` alone on ``trace``, one request at a time through
    vLLM's KVCacheManager with a 256-block GPU pool (its prefix cache serves what it
    still holds); each request's stores complete before the next one arrives."""
    rig = Rig(gpu_blocks=CHAT_GPU_BLOCKS, cpu_blocks=capacity)
    order = (who,)
    try:
        for t in trace:
            r = rig.request(t.req_id, list(t.prompt))
            local, ext = rig.lookup(r, order)
            rig.admit(r, local, ext, order)
            if ext:
                loaded = rig.build(rig.output([], [], set(), {}), order)
                assert r.request_id in loaded, "a chat load did not finish"
                rig.complete(order)
                rig.kvm.cache_blocks(r, r.num_computed_tokens)
                assert rig.kvm.allocate_slots(r, r.num_tokens - r.num_computed_tokens)
            new = NewRequestData.from_request(r, rig.kvm.get_block_ids(r.request_id))
            rig.build(rig.output([new], [], set(), {r.request_id: r.num_tokens -
                                                    r.num_computed_tokens}), order)
            rig.complete(order)
            r.num_computed_tokens = r.num_tokens
            r.append_output_token_ids(list(t.answer))
            assert rig.kvm.allocate_slots(r, len(t.answer)), "GPU pool exhausted"
            r.num_computed_tokens = r.num_tokens
            rig.finish(r, order)
            rig.build(rig.output([], [], {r.request_id}, {}), order)
            rig.complete(order)
        return rig.work[who]["hit_tokens"]
    finally:
        rig.close()


def chat_section(quick: bool) -> tuple[dict[str, float], dict[str, Any]]:
    """Hit fractions of both contenders and of Belady on :func:`tools.chat_trace.chat_trace`
    (quick: 16 conversations x 3 turns), the CPU tier at half its distinct blocks."""
    trace = ct.chat_trace(16, 3) if quick else ct.chat_trace(64, 6)
    capacity = max(1, ct.distinct_blocks(trace) // 2)
    acc = ct.gpu_accesses(trace, CHAT_GPU_BLOCKS)
    unbounded = ct.unbounded_hit_tokens(acc, BS)
    frac = {w: round(ct.hit_fraction(_chat_pass(trace, capacity, w), unbounded), 3)
            for w in WHO}
    frac["belady"] = round(ct.hit_fraction(ct.belady_hit_tokens(acc, capacity, BS),
                                           unbounded), 3)
    info = {"requests": len(trace), "cpu_blocks": capacity, "gpu_blocks": CHAT_GPU_BLOCKS,
            "unbounded_hit_tokens": unbounded}
    return frac, info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="end with the one-line JSON summary")
    ap.add_argument("--quick", action="store_true", help="small sizes, few steps")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per phase")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per phase")
    args = ap.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    steps = args.steps or (6 if args.quick else 40)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 8)
    try:
        times, work = decode_section(sizes, warmup, steps)
        frac, info = chat_section(args.quick)
    except SameWorkError as exc:
        print(f"bench_vs_vllm: the contenders did different work: {exc}", file=sys.stderr)
        return 1
    ratios: dict[str, dict[str, float]] = {}
    print(f"{'running':>8} {'phase':>8} {'kvshm us':>10} {'vLLM us':>10} {'ratio':>6}")
    for phase in ("all", "changed"):
        ratios[phase] = {}
        for n, t in times[phase].items():
            ratios[phase][n] = round(t["vllm"] / t["kvshm"], 2)
            print(f"{n:>8} {phase:>8} {t['kvshm']:>10.1f} {t['vllm']:>10.1f} "
                  f"{ratios[phase][n]:>6.2f}")
    print(f"same work per size (stored / loaded blocks, hit tokens): {json.dumps(work)}")
    print(f"chat trace ({json.dumps(info)}): hit fraction {json.dumps(frac)}")
    if args.json:
        print(json.dumps({"step_ratio_all": ratios["all"],
                          "step_ratio_changed": ratios["changed"], "hit_fraction": frac}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
