"""The toy model across engines over a remote tier: ``tools.bench_remote`` parts (b), (c).

:func:`remote_parts` runs both on the same engines: engine A's process, engine B and the
engine without a remote tier start together; the TTFT part runs on B, then the server is
killed while B and the other engine serve lookups.

Cross-engine time to first token. Engine A -- its own process (spawned), a fresh
:class:`~kvshm.engine.Engine` with 2 SPAWN workers (the toy model's TP=2 shards) and the
remote tier -- serves ``count`` prompts of ``length`` random tokens (one reply token
each) on a :class:`~kvshm.demo.server.ToyServer`, steps until every stored block is
published (write-through PUT acked by both ranks, readiness keys SET), and exits. Engine
B -- this process, a fresh engine with an empty CPU tier, the same model (seed 0) and
fingerprint (:data:`MODEL_ID`) -- then serves, alternately, each of A's prompts (the
lookup misses B's CPU tier, queries the readiness index and answers "ask again"; a step
plans the GET of the present prefix into B's CPU tier; the next lookup is a CPU hit,
loaded like any) and a prompt of the same length no engine has seen (the index answers
0: recompute). TTFT is :attr:`~kvshm.demo.server.TurnResult.ttft_s`: from the request's
arrival at the server to its first token's logits, the "ask again" wait, the GET and the
load included. Phases per hit: the query (until the step that planned the GET), the GET
job (until the lookup answered), the load. The hit arm's logits are compared with A's
for the same prompt (B computes only the tail, with other chunk boundaries: equal to
float tolerance, reported as the largest difference).

Lookups while the server is down. Two engines side by side on the toy layout, B (with
the remote tier; a fresh one when the TTFT part did not run) and one without, both
driven by the same event loop like a scheduler's waiting queue: about every millisecond,
per engine, a step (nothing scheduled), ``arrivals`` new requests of ``length`` tokens'
worth of random block hashes (no hit anywhere), and a lookup call for every waiting
request; a request that answered is finished and leaves the queue (one that answered
None is asked again at the next round). The server is SIGKILLed ``up_s`` after the
start; every lookup call made in the ``down_s`` after that is timed (``perf_counter``
around ``Engine.lookup``), and so is every request that waited then (its first call
until the call that answered). Reported: p50 / p99 / max of both engines' calls, the
added p99 (remote minus none, same loop, same moments), and the longest wait against the
remote book's answer timeout. The harness records into flat arrays and ``gc.freeze()`` s
the heap before it starts (as vLLM does after start-up), so that its own garbage does
not lengthen the calls it times (a full collection of an unfrozen heap took 150-300 ms
here).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import multiprocessing
import random
import statistics
import time
from array import array
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final

import torch
import uvloop

from kvshm.config import EngineConfig
from kvshm.demo.model import ToyModel
from kvshm.demo.server import ToyServer, TurnResult
from kvshm.engine import SPAWN, Engine
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote import RemoteBook
from kvshm.shm import shared_tensor
from kvshm.types import RequestView, StepInput

__all__ = ["ANSWER_TIMEOUT_S", "MODEL_ID", "EngineAProcess", "prompts", "remote_parts",
           "toy_engine"]

#: The model id both engines put in the layout fingerprint (the model and its seed).
MODEL_ID: Final = "kvshm-demo-toy-seed0-float32"
#: How long the remote book lets a request wait for the index's answer.
ANSWER_TIMEOUT_S: Final[float] = float(
    inspect.signature(RemoteBook.__init__).parameters["answer_timeout_s"].default)


def prompts(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random tokens (no two share a first block)."""
    rnd = random.Random(seed)
    return [[rnd.randrange(vocab) for _ in range(length)] for _ in range(count)]


@asynccontextmanager
async def toy_engine(model: ToyModel, url: str | None, gpu_blocks: int,
                     cpu_blocks: int) -> AsyncIterator[tuple[Engine, ToyServer]]:
    """A fresh engine (2 SPAWN workers, the toy model's shards) and a server over it."""
    gpu = BlockPool(gpu_blocks)
    shards = model.make_kv_shards(gpu_blocks, shared_tensor)
    cfg = EngineConfig(block_size=model.config.block_size, tp=model.config.tp_shards,
                       num_cpu_blocks=cpu_blocks, remote_url=url, model_id=MODEL_ID)
    async with Engine.launch(cfg, workers=SPAWN, gpu_blocks=gpu,
                             device_caches=[[s] for s in shards]) as eng:
        yield eng, ToyServer(model, shards, gpu, eng, 0)


def _sizes(model: ToyModel, count: int, length: int) -> tuple[int, int]:
    """(GPU blocks, CPU blocks): one request at a time on the GPU; every prompt twice
    (hit and miss arms) in the CPU tier."""
    per = -(-(length + 1) // model.config.block_size)
    return 2 * per + 8, 2 * count * per + 64


# ---------------------------------------------------------------------------- engine A


async def _store(url: str, seed: int, count: int, length: int,
                 timeout_s: float) -> dict[str, Any]:
    model = ToyModel()
    gpu_blocks, cpu_blocks = _sizes(model, count, length)
    async with toy_engine(model, url, gpu_blocks, cpu_blocks) as (eng, server):
        logits = []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts(seed, count, length, model.config.vocab_size)):
            res = await server.serve(f"a{i}", p, 1)
            logits.append(res.logits.tolist())
        serve_s = time.perf_counter() - t0
        deadline = time.monotonic() + timeout_s
        while True:  # until every stored block's readiness key is SET
            await server.drain()
            st = eng.statistics()
            stored, rem = st.counters.get("stored_blocks", 0), st.remote
            if stored and rem.get("published_blocks", 0) >= stored and rem.get(
                    "index_published", 0) >= rem["published_blocks"]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine A: blocks not published within {timeout_s} s: "
                                   f"stored {stored}, remote {rem}")
            await asyncio.sleep(0.005)
        return {"logits": logits, "serve_s": serve_s, "stored_blocks": stored,
                "published_blocks": rem["published_blocks"],
                "put_bytes": rem.get("put_bytes", 0)}


def _engine_a_main(url: str, seed: int, count: int, length: int, timeout_s: float,
                   out: Any) -> None:
    """Engine A's process: store the prompts, put the result (or the error) on ``out``."""
    torch.set_num_threads(1)
    try:
        out.put(uvloop.run(_store(url, seed, count, length, timeout_s)))
    except BaseException as exc:  # reported by the parent
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


class EngineAProcess:
    """Engine A in a spawned process: :meth:`start` returns at once, :meth:`result`
    waits for it to exit (0) and returns what it stored."""

    def __init__(self, url: str, seed: int, count: int, length: int,
                 timeout_s: float = 120.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._out = ctx.SimpleQueue()
        self._timeout = timeout_s
        self._proc = ctx.Process(target=_engine_a_main, name="kvshm-bench-engine-a",
                                 args=(url, seed, count, length, timeout_s, self._out))

    def start(self) -> EngineAProcess:
        self._proc.start()
        return self

    def close(self) -> None:
        """Kill it if it still runs (an error elsewhere); idempotent."""
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def result(self) -> dict[str, Any]:
        proc = self._proc
        proc.join(self._timeout + 60)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise RuntimeError("engine A's process did not finish")
        result: dict[str, Any] = (self._out.get() if not self._out.empty()
                                  else {"error": "no result"})
        if proc.exitcode != 0 or "error" in result:
            raise RuntimeError(f"engine A's process exited with {proc.exitcode}: "
                               f"{result.get('error')}")
        return result


# ---------------------------------------------------------------------------- engine B


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else 0.0


async def _ttft(eng: Engine, server: ToyServer, model: ToyModel, seed: int, count: int,
               length: int, engine_a: EngineAProcess) -> dict[str, Any]:
    vocab, bs = model.config.vocab_size, model.config.block_size
    hits: list[TurnResult] = []
    misses: list[TurnResult] = []
    # B started while A served (its CPU tier is empty); A is gone when B serves
    a = await asyncio.get_running_loop().run_in_executor(None, engine_a.result)
    fresh = prompts(seed + 7919, count, length, vocab)
    for i, p in enumerate(prompts(seed, count, length, vocab)):
        hits.append(await server.serve(f"hit{i}", p, 1))
        misses.append(await server.serve(f"miss{i}", fresh[i], 1))
    await server.drain()
    rem = eng.statistics().remote
    diff = max(float((r.logits - torch.tensor(x)).abs().max())
               for r, x in zip(hits, a["logits"]))
    return {
        "ttft_hit_ms": _median_ms([r.ttft_s for r in hits]),
        "ttft_miss_ms": _median_ms([r.ttft_s for r in misses]),
        "hit_tokens": [r.cpu_hit_tokens for r in hits],
        "expected_hit_tokens": (length - 1) // bs * bs,
        "miss_hit_tokens": sum(r.cpu_hit_tokens for r in misses),
        "load_failures": sum(r.load_failed for r in hits),
        "phases_hit_ms": {
            "query": _median_ms([r.query_s for r in hits]),
            "get": _median_ms([r.lookup_s - r.query_s for r in hits]),
            "lookup": _median_ms([r.lookup_s for r in hits]),
            "load": _median_ms([r.load_s for r in hits]),
            "compute": _median_ms([r.ttft_s - r.lookup_s - r.load_s for r in hits])},
        "phases_miss_ms": {
            "lookup": _median_ms([r.lookup_s for r in misses]),
            "compute": _median_ms([r.ttft_s - r.lookup_s - r.load_s for r in misses])},
        "per_hit_ms": [{"ttft": round(r.ttft_s * 1e3, 1), "query": round(r.query_s * 1e3, 1),
                        "get": round((r.lookup_s - r.query_s) * 1e3, 1),
                        "load": round(r.load_s * 1e3, 1)} for r in hits],
        "logits_max_abs_diff_vs_a": diff,
        "remote": {k: rem.get(k) for k in ("queries", "query_hits", "query_misses",
                                           "get_jobs", "get_failed_jobs", "hit_blocks",
                                           "hit_bytes", "index_errors")},
        "engine_a": {k: v for k, v in a.items() if k != "logits"},
        "ratio": (statistics.median(r.ttft_s for r in misses)
                  / statistics.median(r.ttft_s for r in hits)),
    }


# ---------------------------------------------------------------------------- server down


class _Lookups:
    """One engine's requests, served like a scheduler's waiting queue: every lookup
    call's seconds and every request's wait."""

    def __init__(self, eng: Engine, blocks: int, bs: int, seed: int) -> None:
        self.eng, self.blocks, self.bs = eng, blocks, bs
        self.rnd = random.Random(seed)
        self.n = 0
        # (when it started, seconds) of every call; (arrival, seconds until answered) of
        # every request: flat arrays, no object per entry (less for the GC to walk)
        self.call_t, self.call_s = array("d"), array("d")
        self.wait_t, self.wait_s = array("d"), array("d")

    async def run(self, stop: asyncio.Event, arrivals: int) -> None:
        """Until ``stop``, about every millisecond: step the engine (nothing scheduled),
        let ``arrivals`` new requests (random block hashes: no hit anywhere) join the
        waiting ones, call lookup on each waiting request, finish those answered."""
        waiting: dict[str, tuple[RequestView, float]] = {}
        step = 0
        while not stop.is_set():
            step += 1
            self.eng.step(StepInput(step, []))
            for _ in range(arrivals):
                self.n += 1
                hashes = [self.rnd.randbytes(32) for _ in range(self.blocks)]
                view = RequestView(f"r{self.n}", hashes, self.blocks * self.bs)
                waiting[view.req_id] = (view, time.perf_counter())
            for rid, (view, arrival) in list(waiting.items()):
                t0 = time.perf_counter()
                hit = self.eng.lookup(view, 0)
                t1 = time.perf_counter()
                self.call_t.append(t0)
                self.call_s.append(t1 - t0)
                if hit is not None:
                    del waiting[rid]
                    self.wait_t.append(arrival)
                    self.wait_s.append(t1 - arrival)
                    self.eng.finished(rid, 0, [[]])
            await asyncio.sleep(0.001)
        now = time.perf_counter()  # still waiting at the end: waited at least this long
        for _, arrival in waiting.values():
            self.wait_t.append(arrival)
            self.wait_s.append(now - arrival)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _summary(values_s: list[float]) -> dict[str, float]:
    us = [v * 1e6 for v in values_s]
    return {"count": len(us), "p50_us": round(_pct(us, 0.5), 1),
            "p99_us": round(_pct(us, 0.99), 1), "max_us": round(max(us, default=0.0), 1)}


@asynccontextmanager
async def _engines(model: ToyModel, specs: list[tuple[str | None, int, int]],
                   ) -> AsyncIterator[list[tuple[Engine, ToyServer]]]:
    """Toy engines for ``specs`` (remote URL or None, GPU blocks, CPU blocks), launched
    at once, each with a server over it; all closed at the end."""
    launches, made = [], []
    for url, gpu_blocks, cpu_blocks in specs:
        gpu = BlockPool(gpu_blocks)
        shards = model.make_kv_shards(gpu_blocks, shared_tensor)
        cfg = EngineConfig(block_size=model.config.block_size, tp=model.config.tp_shards,
                           num_cpu_blocks=cpu_blocks, remote_url=url, model_id=MODEL_ID)
        launches.append(Engine.launch(cfg, workers=SPAWN, gpu_blocks=gpu,
                                      device_caches=[[s] for s in shards]))
        made.append((gpu, shards))
    got = await asyncio.gather(*(_go(x) for x in launches), return_exceptions=True)
    engines = [e for e in got if isinstance(e, Engine)]
    try:
        for e in got:
            if isinstance(e, BaseException):
                raise e
        yield [(e, ToyServer(model, shards, gpu, e, 0))
               for e, (gpu, shards) in zip(engines, made)]
    finally:
        await asyncio.gather(*(e.aclose() for e in engines))


async def _go(launch: Any) -> Engine:
    engine: Engine = await launch
    return engine


async def _down(with_remote: Engine, without: Engine, kill: Callable[[], None], bs: int,
                length: int, up_s: float, down_s: float, arrivals: int) -> dict[str, Any]:
    blocks = length // bs
    arms = [_Lookups(with_remote, blocks, bs, 1), _Lookups(without, blocks, bs, 2)]
    stop = asyncio.Event()
    gc.collect()
    gc.freeze()  # what a server does after start-up (vLLM does): cheap full collections
    tasks = [asyncio.create_task(arm.run(stop, arrivals)) for arm in arms]
    killed_at = 0.0
    try:
        await asyncio.sleep(up_s)
        kill()  # SIGKILL while both engines serve lookups
        killed_at = time.perf_counter()
        await asyncio.sleep(down_s)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        gc.unfreeze()
    rem = with_remote.statistics().remote
    r_calls = [s for t, s in zip(arms[0].call_t, arms[0].call_s) if t >= killed_at]
    n_calls = [s for t, s in zip(arms[1].call_t, arms[1].call_s) if t >= killed_at]
    r_waits = [s for t, s in zip(arms[0].wait_t, arms[0].wait_s)
               if t + s >= killed_at]  # waited while down
    remote, none = _summary(r_calls), _summary(n_calls)
    return {
        "remote_down": remote, "no_remote": none,
        "added_p99_ms": round((remote["p99_us"] - none["p99_us"]) / 1e3, 4),
        "requests_down": len(r_waits),
        "max_wait_ms": round(max(r_waits, default=0.0) * 1e3, 2),
        "answer_timeout_ms": ANSWER_TIMEOUT_S * 1e3,
        "remote": {k: rem.get(k) for k in ("queries", "query_misses", "query_timeouts",
                                           "skipped_unhealthy", "index_errors",
                                           "index_timeouts", "index_rejected",
                                           "index_breaker_state", "index_breaker_opens")},
    }


async def _remote_parts(url: str, kill: Callable[[], None], ttft: bool, down: bool,
                        kw: dict[str, Any]) -> dict[str, Any]:
    seed, count, length = kw["seed"], kw["count"], kw["length"]
    engine_a = EngineAProcess(url, seed, count, length).start() if ttft else None
    try:
        model = ToyModel()
        gpu_blocks, cpu_blocks = _sizes(model, count, length) if ttft else (8, 64)
        specs: list[tuple[str | None, int, int]] = [(url, gpu_blocks, cpu_blocks)]
        if down:
            specs.append((None, 8, 64))
        out: dict[str, Any] = {}
        async with _engines(model, specs) as got:
            (b, server) = got[0]
            if engine_a is not None:
                out["ttft"] = await _ttft(b, server, model, seed, count, length, engine_a)
            if down:
                out["down"] = await _down(b, got[1][0], kill, model.config.block_size,
                                          kw["down_length"],
                                          kw["up_s"], kw["down_s"], kw["arrivals"])
        return out
    finally:
        if engine_a is not None:
            engine_a.close()


def remote_parts(url: str, kill: Callable[[], None], *, ttft: bool = True,
                 down: bool = True, seed: int = 0, count: int = 6, length: int = 2048,
                 down_length: int = 1024, up_s: float = 0.5, down_s: float = 3.0,
                 arrivals: int = 2) -> dict[str, Any]:
    """Engine A's process, engine B and (``down``) the engine without a remote tier
    start together; then (``ttft``) the cross-engine TTFT runs on B, then (``down``) the
    server is SIGKILLed (``kill``) while B and the other engine serve lookups. Returns
    ``{"ttft": ..., "down": ...}`` (what ran; see the module docstring)."""
    torch.set_num_threads(1)
    kw = {"seed": seed, "count": count, "length": length, "down_length": down_length,
          "up_s": up_s, "down_s": down_s, "arrivals": arrivals}
    return uvloop.run(_remote_parts(url, kill, ttft, down, kw))
