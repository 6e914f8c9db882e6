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

Kvshm's service thread runs in the step's untimed gaps; its CPU time is charged to
kvshm as the hook ``service`` (:mod:`tools.vs_vllm_rig`), and neither contender's
timed hook can be interrupted by it.

Decode traces, at 1k / 4k / 16k running requests; per step 16 requests finish and 16
arrive (a 4-block prompt: half fresh, half the prompt of a request that finished at
least two steps earlier, whose GPU copy the harness drops from vLLM's prefix cache, so
that it is a CPU-tier hit), and some running requests grow a block (16 new tokens, one
new GPU block), round robin:

* ``realistic``: ``running / block_size`` of them, the requests a real decode step
  (one token each) carries across a block boundary: 62 at 1k, 250 at 4k, 1,000 at 16k;
* ``old``: 64 at every size (the trace of the earlier rounds).

Two phases of each: ``all`` (the SchedulerOutput lists every running request, one
token each, as a decode step does; requests that do not grow keep their token counts,
which isolates the listing cost) and ``changed`` (only the requests that grew, arrived
or were loaded). Each (size, trace) is run ``--runs`` times (3) over a fresh rig; a
run's figure is the median over its timed steps; printed: the ratio's min / median /
max over the runs, the median µs of both, and where the step goes, per hook (median µs
per step over every run's timed steps; kvshm's ``lookup`` includes
``on_new_request``), and the service thread's pumps and mean CPU µs per timed step.

The machine's other work makes absolute µs noisy; the ratios are what count: both
contenders run every step, interleaved, so load slows both (``--clock cpu`` times
hooks by this thread's CPU time instead of wall time). Once a rig is built, the
population so far is frozen out of the cyclic collector (``gc.freeze``), so that a
full collection does not rescan it inside whichever hook triggers it.

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
{..}, "hit_fraction": {"kvshm": .., "vllm": .., "belady": ..}, "realistic_ratio_all":
{..}, "realistic_ratio_changed": {..}, "ratio_range": {trace: {phase: {size: [min,
median, max]}}}, "step_us": {trace: {phase: {size: {"kvshm": .., "vllm": ..}}}},
"hook_us": {trace: {phase: {size: {contender: {hook: ..}}}}}, "service": {size:
{"pumps_per_step": .., "us_per_step": ..}}}`` (ratio = vLLM µs / kvshm µs: the median
over the runs of each run's ratio of medians; ``step_ratio_*`` are the old trace's,
``realistic_ratio_*`` the realistic trace's).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.request import Request

from tools import chat_trace as ct
from tools.vs_vllm_rig import BS, HOOKS, Rig, SameWorkError

SIZES = (1000, 4000, 16000)
QUICK_SIZES = (200, 400)
OLD_GROW, FINISH, ARRIVE = 64, 16, 16
PROMPT = 4 * BS  # a 4-block prompt
WHO = ("kvshm", "vllm")
TRACES = ("realistic", "old")
PHASES = ("all", "changed")
Clock = dict[str, dict[str, float]]


def grow_per_step(trace: str, n: int) -> int:
    """Running requests that grow a block per step: see the module docstring."""
    return max(1, n // BS) if trace == "realistic" else OLD_GROW


def _order(step: int) -> tuple[str, str]:
    return WHO if step % 2 == 0 else (WHO[1], WHO[0])


class Decode:
    """The decode trace over one :class:`Rig` (see the module docstring)."""

    def __init__(self, n: int, steps: int, grow: int = OLD_GROW, seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.rnd = random.Random(seed)
        self.grow = grow
        # GPU: every running request's blocks plus each step's net growth, with slack;
        # CPU: everything the trace stores (no eviction: both must do the same work)
        grow = steps * (grow + ARRIVE * (PROMPT // BS + 1))
        self.rig = Rig(gpu_blocks=n * (PROMPT // BS + 2) + grow + 4096,
                       cpu_blocks=n * (PROMPT // BS + 2) + grow + 4096, clock=clock)
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []  # loads in flight
        self.ready: list[Request] = []  # loaded: scheduled next step
        self.gone: deque[tuple[int, list[int], list[int]]] = deque()  # finished, GPU ids
        self.repeatable: list[list[int]] = []  # prompts whose GPU copy was dropped
        self.ids = iter(range(1 << 60))
        self.step = 0
        self.cursor = 0
        self.samples: dict[str, list[Clock]] = {p: [] for p in PHASES}
        self.pumps = 0  # service-thread pumps during timed steps
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
        # the population built so far (the running requests, both pools) leaves the
        # collector's generations: a full collection would otherwise rescan it inside
        # whichever hook (or service pump) happens to trigger it (up to 0.7 s at 16k);
        # :meth:`close` returns it
        gc.collect()
        gc.freeze()
        rig.take_clock()

    def close(self) -> None:
        self.rig.close()
        gc.unfreeze()

    def run(self, phase: str, steps: int, timed: bool) -> None:
        for _ in range(steps):
            pumps = self.rig.service_pumps()
            self._one(phase)
            clock = self.rig.take_clock()
            if timed:
                self.samples[phase].append(clock)
                self.pumps += self.rig.service_pumps() - pumps

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
        """``self.grow`` running requests, round robin, get one block of new tokens."""
        rig, out = self.rig, {}
        rids = list(self.running)
        for _ in range(self.grow):
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


def _total(c: dict[str, float]) -> float:
    return sum(c.values())


def _one_run(n: int, trace: str, warmup: int, steps: int, seed: int,
             phases: tuple[str, ...] = PHASES, clock: Callable[[], float] = time.perf_counter
             ) -> tuple[dict[str, list[Clock]], dict[str, Any], int]:
    """One rig, the phases of ``trace`` at ``n`` running: the timed steps' clocks per
    phase, the work done (checked equal), service-thread pumps in the timed steps."""
    tr = Decode(n, len(phases) * (warmup + steps), grow_per_step(trace, n), seed, clock)
    try:
        for phase in phases:
            tr.run(phase, warmup, timed=False)
            tr.run(phase, steps, timed=True)
        tr.rig.complete(WHO)  # the last step's completions
        tr.rig.kvshm_totals()
        _same_work(tr.rig.work, f"decode {n} ({trace})")
        return tr.samples, tr.rig.work, tr.pumps
    finally:
        tr.close()


class Result:
    """Every run of one (trace, size): per phase, each run's samples."""

    def __init__(self, phases: tuple[str, ...] = PHASES) -> None:
        self.phases = phases
        self.runs: dict[str, list[list[Clock]]] = {p: [] for p in phases}
        self.pumps = 0
        self.steps = 0

    def add(self, samples: dict[str, list[Clock]], pumps: int) -> None:
        for phase in self.phases:
            self.runs[phase].append(samples[phase])
            self.steps += len(samples[phase])
        self.pumps += pumps

    def medians(self, phase: str) -> list[dict[str, float]]:
        """Per run: each contender's median step (µs)."""
        return [{w: statistics.median(_total(c[w]) for c in run) * 1e6 for w in WHO}
                for run in self.runs[phase]]

    def ratios(self, phase: str) -> list[float]:
        """Per run: vLLM's median step / kvshm's."""
        return [m["vllm"] / m["kvshm"] for m in self.medians(phase)]

    def step_us(self, phase: str) -> dict[str, float]:
        """Each contender's median over the runs of its runs' median steps (µs)."""
        ms = self.medians(phase)
        return {w: round(statistics.median(m[w] for m in ms), 1) for w in WHO}

    def hooks(self, phase: str) -> dict[str, dict[str, float]]:
        """Median µs per step per hook, over every run's timed steps (medians: a step
        slowed by other work on the machine moves them little; they need not add up to
        the step's median)."""
        clocks = [c for run in self.runs[phase] for c in run]
        return {w: {h: round(statistics.median(c[w][h] for c in clocks) * 1e6, 1)
                    for h in HOOKS if w == "kvshm" or h != "service"} for w in WHO}

    def service(self) -> dict[str, float]:
        """kvshm's service thread per timed step: pumps and CPU µs."""
        clocks = [c for p in self.phases for run in self.runs[p] for c in run]
        return {"pumps_per_step": round(self.pumps / max(1, self.steps), 2),
                "us_per_step": round(statistics.fmean(c["kvshm"]["service"]
                                                      for c in clocks) * 1e6, 1)}


def decode_section(sizes: tuple[int, ...], warmup: int, steps: int, runs: int = 3,
                   traces: tuple[str, ...] = TRACES, phases: tuple[str, ...] = PHASES,
                   clock: Callable[[], float] = time.perf_counter
                   ) -> tuple[dict[str, dict[int, Result]], dict[str, Any]]:
    """Every (trace, size) ``runs`` times, the traces and sizes interleaved within a
    round (noise from other work on the machine spreads over all of them); the work of
    the last run of each (checked equal in every run)."""
    out = {t: {n: Result(phases) for n in sizes} for t in traces}
    work: dict[str, Any] = {}
    for r in range(runs):
        for n in sizes:
            for trace in traces:
                samples, w, pumps = _one_run(n, trace, warmup, steps, r, phases, clock)
                out[trace][n].add(samples, pumps)
                work.setdefault(trace, {})[str(n)] = w
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


def _range(xs: list[float]) -> list[float]:
    return [round(min(xs), 2), round(statistics.median(xs), 2), round(max(xs), 2)]


def _report(res: dict[str, dict[int, Result]]) -> dict[str, Any]:
    """Print the tables; the JSON summary's decode part."""
    summary: dict[str, Any] = {"ratio_range": {}, "step_us": {}, "hook_us": {},
                               "service": {}}
    print(f"{'trace':>9} {'running':>8} {'phase':>8} {'kvshm us':>10} {'vLLM us':>10} "
          f"{'ratio min/med/max':>20}")
    for trace, by_size in res.items():
        phases = next(iter(by_size.values())).phases
        for key in ("ratio_range", "step_us", "hook_us"):
            summary[key][trace] = {p: {} for p in phases}
        for phase in phases:
            for n, r in by_size.items():
                rng = _range(r.ratios(phase))
                us = r.step_us(phase)
                summary["ratio_range"][trace][phase][str(n)] = rng
                summary["step_us"][trace][phase][str(n)] = us
                summary["hook_us"][trace][phase][str(n)] = r.hooks(phase)
                print(f"{trace:>9} {n:>8} {phase:>8} {us['kvshm']:>10.1f} "
                      f"{us['vllm']:>10.1f} {rng[0]:>6.2f} {rng[1]:>6.2f} {rng[2]:>6.2f}")
    print("\nper hook, median us per step (kvshm / vLLM; kvshm's lookup includes "
          "on_new_request, its service is the service thread's CPU time):")
    print(f"{'trace':>9} {'running':>8} {'phase':>8} " +
          " ".join(f"{h:>17}" for h in HOOKS))
    for trace, by_size in res.items():
        for phase in summary["hook_us"][trace]:
            for n in by_size:
                hk = summary["hook_us"][trace][phase][str(n)]
                cells = [f"{hk['kvshm'][h]:>8.0f}/{hk['vllm'].get(h, 0.0):<8.0f}"
                         for h in HOOKS]
                print(f"{trace:>9} {n:>8} {phase:>8} " + " ".join(cells))
    for n in next(iter(res.values())):
        svc = [res[t][n].service() for t in res]
        summary["service"][str(n)] = {
            k: round(statistics.fmean(s[k] for s in svc), 2) for k in svc[0]}
    print(f"service thread, per timed step (charged to kvshm): "
          f"{json.dumps(summary['service'])}")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="end with the one-line JSON summary")
    ap.add_argument("--quick", action="store_true", help="small sizes, few steps")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per phase")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per phase")
    ap.add_argument("--runs", type=int, default=None, help="runs per size and trace (3)")
    ap.add_argument("--sizes", type=str, default=None,
                    help="comma-separated running counts (default 1000,4000,16000)")
    ap.add_argument("--traces", type=str, default=",".join(TRACES),
                    help="comma-separated traces: realistic, old")
    ap.add_argument("--phases", type=str, default=",".join(PHASES),
                    help="comma-separated phases: all, changed")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time hooks by wall time (default) or this thread's CPU time "
                         "(which other work on a loaded machine inflates less)")
    ap.add_argument("--no-chat", action="store_true", help="skip the chat trace")
    args = ap.parse_args(argv)
    sizes = (tuple(int(x) for x in args.sizes.split(",")) if args.sizes
             else QUICK_SIZES if args.quick else SIZES)
    traces = tuple(t for t in args.traces.split(",") if t)
    if not traces or set(traces) - set(TRACES):
        ap.error(f"--traces: one or more of {', '.join(TRACES)}")
    phases = tuple(p for p in args.phases.split(",") if p)
    if not phases or set(phases) - set(PHASES):
        ap.error(f"--phases: one or more of {', '.join(PHASES)}")
    steps = args.steps or (6 if args.quick else 40)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 8)
    runs = args.runs or (1 if args.quick else 3)
    try:
        clock = time.thread_time if args.clock == "cpu" else time.perf_counter
        res, work = decode_section(sizes, warmup, steps, runs, traces, phases, clock)
        frac, info = (({}, {}) if args.no_chat else chat_section(args.quick))
    except SameWorkError as exc:
        print(f"bench_vs_vllm: the contenders did different work: {exc}", file=sys.stderr)
        return 1
    summary = _report(res)
    print(f"same work per trace and size (stored / loaded blocks, hit tokens): "
          f"{json.dumps(work)}")
    if not args.no_chat:
        print(f"chat trace ({json.dumps(info)}): hit fraction {json.dumps(frac)}")
    if args.json:
        rr = summary["ratio_range"]
        med = {t: {p: {n: v[1] for n, v in by_n.items()} for p, by_n in rr[t].items()}
               for t in rr}
        out: dict[str, Any] = {}
        for trace, prefix in (("old", "step_ratio_"), ("realistic", "realistic_ratio_")):
            for phase, by_n in med.get(trace, {}).items():
                out[prefix + phase] = by_n
        out["hit_fraction"] = frac
        out.update(summary)
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
