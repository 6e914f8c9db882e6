"""kvshm as the KV connector of a real vLLM engine (CPU, tiny random Llama).

The check that matters: a prompt, ``reset_prefix_cache()`` (vLLM's own cache is gone,
kvshm's CPU tier is not), the same prompt again -> vLLM reports the prefix cached and
the logprobs are *bitwise* equal to the cold run (a restore that is off by one bit, or
loads the wrong block, moves them). Then the same under pressure (80-block device pool,
8 concurrent requests, several rounds), through the disk tier (a CPU tier too small to
keep the prompt), in lazy mode, in bfloat16, with a copy failure
injected on a load under vLLM's default failure policy, which kvshm turns into
"recompute" (vLLM must recompute those blocks: no token counted as cached, the output
still exact), and with the engine core and worker in their own processes.

Each engine is module-scoped and shared by the tests that need its configuration; its
teardown checks the statistics file written at shutdown (zero pins, nothing in flight),
/dev/shm, and that no process is left (``_run_llm`` in conftest).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed (see tools/vllm_install.sh)",
)

from vllm import SamplingParams
from vllm.distributed.kv_transfer import get_kv_transfer_group

from kvshm.integrations.vllm import engine_name
from kvshm.integrations.vllm.connector import KvshmConnector

MODULE = "kvshm.integrations.vllm"
CONNECTOR = "KvshmConnector"
LLMFactory = Callable[..., AbstractContextManager[Any]]
Drain = Callable[[Any], int]

BLOCK = 32
PROMPT_TOKENS = 100  # 3 full blocks + 4 tokens
MAX_TOKENS = 8
CPU_BYTES = 64 << 20
FP32_BLOCK_BYTES = 2 * 2 * BLOCK * 64 * 4  # 2 layers x 2 KV heads x 32 tokens x (K|V) fp32
SMALL_POOL = 80 * FP32_BLOCK_BYTES


def _kvshm_connector() -> KvshmConnector:
    """This (in-process) engine's connector, as kvshm's class (vLLM types it as the base)."""
    conn = get_kv_transfer_group()
    assert isinstance(conn, KvshmConnector)
    return conn


def _params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=3)


def _prompt(n: int, start: int = 0) -> str:
    return " ".join(f"w{(start + i) % 508}" for i in range(n))


def _signature(out: Any) -> tuple[list[int], list[dict[int, float]]]:
    """Token ids and top-3 logprobs of a request's output (compared bitwise)."""
    comp = out.outputs[0]
    lps = [{tok: lp.logprob for tok, lp in pos.items()} for pos in comp.logprobs]
    return list(comp.token_ids), lps


def _shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "kvshm" in n.lower()}


class Engine:
    """A module's engine, where its statistics file lands, and helpers."""

    def __init__(self, llm: Any, stats_path: Path, in_process: bool) -> None:
        self.llm = llm
        self.stats_path = stats_path
        self.in_process = in_process

    def generate(self, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[Any]:
        """Generate, then (in-process) run the steps vLLM still owes the connector:
        the finish notification and, while kvshm has stores in flight, empty steps."""
        outs: list[Any] = self.llm.generate(prompts, _params(max_tokens), use_tqdm=False)
        if self.in_process:
            _drain(self.llm)
        return outs

    def connector(self) -> Any:
        """The scheduler-side connector (in-process engines only)."""
        assert self.in_process
        return self.llm.llm_engine.engine_core.engine_core.scheduler.connector

    def stats(self) -> dict[str, Any]:
        """Live statistics (in-process engines only)."""
        stats: dict[str, Any] = self.connector().scheduler_side.statistics()
        return stats

    def reset_device_cache(self) -> None:
        assert self.llm.reset_prefix_cache(), "vLLM's prefix cache did not reset"


def _drain(llm: Any, max_steps: int = 500) -> None:
    core = llm.llm_engine.engine_core.engine_core
    steps = 0
    while core.scheduler.has_requests():
        assert steps < max_steps, "engine still has work after max_steps steps"
        _, executed = core.step_fn()
        core.post_step(model_executed=executed)
        steps += 1


def _engine(make_llm: LLMFactory, tmp: Path, *, multiprocess: bool = False,
            failed_jobs_ok: bool = False, cpu_bytes: int | None = CPU_BYTES,
            **kw: Any) -> Iterator[Engine]:
    """Build an engine, yield it, then check the final statistics and /dev/shm."""
    stats_path = tmp / "kvshm-stats.json"
    before = _shm_entries()
    with make_llm(CONNECTOR, module=MODULE, multiprocess=multiprocess, cpu_bytes=cpu_bytes,
                  stats_path=str(stats_path), **kw) as llm:
        expected = engine_name(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)
        yield Engine(llm, stats_path, not multiprocess)
    final = json.loads(stats_path.read_text())
    assert final["name"] == expected
    assert final["state"] == "closed", final["state"]
    assert final["pins_held"] == 0, final
    assert final["jobs_in_flight"] == 0, final
    assert final["counters"]["jobs_failed"] == 0 or failed_jobs_ok, final
    assert final["disk"].get("slots_pinned", 0) == 0, final["disk"]
    assert _shm_entries() - before == set()


def _watch_recomputes(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request ids vLLM's scheduler reschedules after a failed synchronous load
    (what its ``_handle_invalid_blocks`` returns: their tokens of this step are dropped
    and the failed blocks recomputed). A failed synchronous load was scheduled as cached
    (``num_cached_tokens`` counts the hit), so this is where the recompute shows."""
    sched = eng.llm.llm_engine.engine_core.engine_core.scheduler
    inner = sched._handle_invalid_blocks
    seen: list[str] = []

    def watched(*a: Any, **kw: Any) -> Any:
        out = inner(*a, **kw)
        seen.extend(sorted(out))
        return out

    monkeypatch.setattr(sched, "_handle_invalid_blocks", watched)
    return seen


def _first_token_steps(eng: Engine, prompt: str) -> tuple[Any, tuple[int, int]]:
    """Generate one token of ``prompt``: its output and the engine steps it took (and
    those of them that scheduled no token), counted on the in-process engine core."""
    core = eng.llm.llm_engine.engine_core.engine_core
    inner, schedule = core.step_fn, core.scheduler.schedule
    steps, idle = [0], [0]

    def counted() -> Any:
        steps[0] += 1
        return inner()

    def counted_schedule(*a: Any, **kw: Any) -> Any:
        out = schedule(*a, **kw)
        idle[0] += not out.total_num_scheduled_tokens
        return out

    core.step_fn, core.scheduler.schedule = counted, counted_schedule
    try:
        out = eng.llm.generate([prompt], _params(1), use_tqdm=False)[0]
    finally:
        core.step_fn, core.scheduler.schedule = inner, schedule
    _drain(eng.llm)
    return out, (steps[0], idle[0])


def _restore_round_trip(eng: Engine, start: int = 0) -> dict[str, Any]:
    """Cold prompt, device cache reset, same prompt: cached through kvshm, exact."""
    prompt = _prompt(PROMPT_TOKENS, start)
    cold = eng.generate([prompt])[0]
    assert not cold.num_cached_tokens
    eng.reset_device_cache()
    hot = eng.generate([prompt])[0]
    assert hot.num_cached_tokens == 3 * BLOCK, hot.num_cached_tokens
    assert _signature(hot) == _signature(cold)
    return {"cold": cold, "hot": hot}


# Engines are class-scoped: two in-process engines cannot coexist (vLLM keeps the
# worker-side connector in a process-global), and a class's engine is shut down as soon
# as its last test ends.


class TestFp32SmallPool:
    """float32, an 80-block device pool."""

    @pytest.fixture(scope="class")
    @classmethod
    def eng(cls, make_llm: LLMFactory,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
        yield from _engine(make_llm, tmp_path_factory.mktemp("fp32"), kv_cache_bytes=SMALL_POOL)

    def test_restore_is_bitwise_exact(self, eng: Engine) -> None:
        _restore_round_trip(eng)
        stats = eng.stats()
        assert stats["state"] == "ready"
        assert stats["counters"]["loaded_blocks"] == 3
        assert stats["connector"]["loads_ok"] == 1

    def test_concurrent_requests_rounds(self, eng: Engine) -> None:
        """8 requests sharing a prefix, 80 device blocks (they need ~100 together), 4
        rounds of 40 tokens each: vLLM preempts and resumes requests, every round is
        bit-exact, later rounds hit kvshm's CPU tier."""
        prefix = _prompt(160, 300)
        prompts = [f"{prefix} {_prompt(256 + 16 * i, 37 * i)}" for i in range(8)]
        before = eng.stats()["counters"]
        reference = [_signature(o) for o in eng.generate(prompts, 40)]
        for _ in range(3):
            outs = eng.generate(prompts, 40)
            assert [_signature(o) for o in outs] == reference
        stats = eng.stats()
        conn = stats["connector"]
        assert conn["requests_preempted"] > 0 and conn["requests_resumed"] > 0, conn
        assert conn["loaded_tokens"] > 0
        after = stats["counters"]
        assert after["lookup_hit_tokens"] > before.get("lookup_hit_tokens", 0)
        assert after["loaded_blocks"] > before.get("loaded_blocks", 0)
        assert after["loads_failed"] == before.get("loads_failed", 0)


    def test_a_cpu_hit_is_computed_in_the_step_that_loads_it(
            self, eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        """On a CPU device (one KV cache group) a hit is a synchronous load: the lookup
        answers ``(hit, False)``, vLLM schedules the prefill in the same step and calls
        ``start_load_kv`` before its forward, where the worker copies the load inline:
        one engine step to the first token, with a token scheduled in it -- as a cold
        request. Before, a hit was an asynchronous load: a step with no token
        scheduled (the load), then the prefill (two steps). Each copy is slowed to 20
        ms (timing control at the copy engine's seam): the forward must still read the
        loaded blocks (the logprobs are exact), and the request is never reported in
        ``finished_recving`` (vLLM asserts a running request is not)."""
        from workers.cpu_copy import CpuCopyEngine

        prompt = _prompt(PROMPT_TOKENS, 3331)
        cold = eng.generate([prompt])[0]
        eng.reset_device_cache()
        real = CpuCopyEngine._copy

        def slow(self: CpuCopyEngine, job: Any) -> int:
            time.sleep(0.02)
            return real(self, job)

        monkeypatch.setattr(CpuCopyEngine, "_copy", slow)
        before = eng.stats()["connector"]["lookups_sync"]
        hot, steps = _first_token_steps(eng, prompt)
        assert hot.num_cached_tokens == 3 * BLOCK
        toks, lps = _signature(cold)
        assert _signature(hot) == (toks[:1], lps[:1])
        assert steps == (1, 0), f"{steps} (steps, idle steps) to the first token"
        assert eng.stats()["connector"]["lookups_sync"] == before + 1
        wstats = _kvshm_connector().worker_side.counters
        assert wstats.sync_loads_late == 0 and wstats.sync_load_waits >= 1

    def test_requests_aborted_mid_flight_pin_nothing_and_the_rest_stay_exact(
            self, eng: Engine) -> None:
        """Clients that hang up: 12 requests over 4 shared 5-block prefixes that
        kvshm's CPU tier holds (computed once, device cache reset), submitted together;
        every third is aborted through vLLM's own ``abort_request`` at its first
        scheduled step -- its CPU hit pinned, its load done or in flight, its blocks
        stored or not. Every other request's tokens equal the cold reference bit for
        bit, and once the engine is idle kvshm holds no pin and no job (an aborted
        request's pins go with its ``request_finished``, as a finished one's)."""
        core = eng.llm.llm_engine
        prefixes = [_prompt(5 * BLOCK, 400 + 40 * i) for i in range(4)]
        prompts = [f"{prefixes[i % 4]} {_prompt(10 + i, 97 * i)}" for i in range(12)]
        reference = [_signature(o)[0] for o in eng.generate(prompts)]
        eng.reset_device_cache()
        before = eng.stats()["counters"]
        ids = [f"abort-{i}" for i in range(12)]
        for rid, p in zip(ids, prompts, strict=True):
            core.add_request(rid, p, _params())
        doomed, aborted = set(ids[::3]), set[str]()
        got: dict[str, list[int]] = {}
        for _ in range(200):
            if not core.has_unfinished_requests():
                break
            for out in core.step():
                if out.finished and out.request_id not in aborted:
                    got[out.request_id] = list(out.outputs[0].token_ids)
            running = [r.request_id for r in core.engine_core.engine_core.scheduler.running]
            now = sorted(rid for rid in doomed - aborted  # (vLLM suffixes its own ids)
                         if any(r == rid or r.startswith(rid + "-") for r in running))
            core.abort_request(now)
            aborted.update(now)
        _drain(eng.llm)
        assert aborted == doomed
        assert got == {rid: reference[i] for i, rid in enumerate(ids) if rid not in doomed}
        stats = eng.stats()
        assert (stats["pins_held"], stats["jobs_in_flight"]) == (0, 0), stats
        after = stats["counters"]
        assert after["loaded_blocks"] - before.get("loaded_blocks", 0) >= 4 * 5  # each prefix
        assert after["loads_failed"] == before.get("loads_failed", 0)

    def test_reset_connector_drops_the_cpu_tier(self, eng: Engine) -> None:
        """``reset_prefix_cache(reset_connector=True)`` empties kvshm's index too: the
        same prompt is then computed from scratch (and stored again)."""
        prompt = _prompt(PROMPT_TOKENS, 400)
        cold = eng.generate([prompt])[0]
        assert eng.llm.reset_prefix_cache(reset_connector=True)
        assert eng.stats()["cpu_blocks_cached"] == 0
        again = eng.generate([prompt])[0]
        assert not again.num_cached_tokens
        assert _signature(again) == _signature(cold)
        assert eng.stats()["cpu_blocks_cached"] >= 3


class TestHybridSlidingWindow:
    """Layer 0 attends over a 64-token window, layer 1 over everything: vLLM's hybrid
    allocator gives two KV cache groups, and kvshm (SupportsHMA) stores and loads both.
    The first load job fails (``test_fail_loads=1``): with several groups the failure
    must reach vLLM per request (``failed_recving``), never as block ids, on which vLLM
    0.32 raises and kills the engine core; the request is recomputed exactly."""

    @pytest.fixture(scope="class")
    @classmethod
    def eng(cls, make_hybrid_llm: LLMFactory,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
        yield from _engine(make_hybrid_llm, tmp_path_factory.mktemp("hybrid"),
                           failed_jobs_ok=True, test_fail_loads=1)

    def test_failed_load_is_recomputed_exactly(self, eng: Engine) -> None:
        groups = eng.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        assert [type(g.kv_cache_spec).__name__ for g in groups.kv_cache_groups] == [
            "SlidingWindowSpec", "FullAttentionSpec"]
        prompt = _prompt(PROMPT_TOKENS, 50)
        cold = eng.generate([prompt])[0]
        eng.reset_device_cache()
        hot = eng.generate([prompt])[0]
        assert hot.num_cached_tokens == 0  # the whole request recomputed
        assert _signature(hot) == _signature(cold)
        stats = eng.stats()
        assert stats["connector"]["loads_failed"] == 1 and stats["counters"]["jobs_failed"] == 1


class TestHybridSlidingWindowRestore:
    """The hybrid engine of the class above without its injected failure: the restore
    test used to live there and, run alone, took the failing first load itself (it
    passed only after the failure test had used it up). Its own engine, in its own
    class: two in-process vLLM engines cannot be alive at once."""

    @pytest.fixture(scope="class")
    @classmethod
    def eng(cls, make_hybrid_llm: LLMFactory,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
        yield from _engine(make_hybrid_llm, tmp_path_factory.mktemp("hybrid-restore"))

    def test_restore_of_both_groups_is_bitwise_exact(self, eng: Engine) -> None:
        """3 full-attention blocks and the 2 sliding-window blocks covering the window
        before the hit point are loaded (5 blocks), and the logprobs are exact."""
        _restore_round_trip(eng, start=200)
        assert eng.stats()["counters"]["loaded_blocks"] == 5


class TestBf16:
    @pytest.fixture(scope="class")
    @classmethod
    def eng(cls, make_llm: LLMFactory,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
        yield from _engine(make_llm, tmp_path_factory.mktemp("bf16"), dtype="bfloat16")

    def test_restore_is_bitwise_exact(self, eng: Engine) -> None:
        _restore_round_trip(eng, start=7)
        assert eng.stats()["counters"]["loaded_blocks"] == 3


class TestLazy:
    @pytest.fixture(scope="class")
    @classmethod
    def eng(cls, make_llm: LLMFactory,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
        yield from _engine(make_llm, tmp_path_factory.mktemp("lazy"), kv_cache_bytes=SMALL_POOL,
                           mode="lazy")

    def test_stores_freed_blocks_and_restores_exactly(self, eng: Engine) -> None:
        """Lazy mode stores nothing while the request runs; its blocks go out once freed
        near the eviction end of vLLM's free queue, and come back bit-exact."""
        _restore_round_trip(eng, start=50)
        counters = eng.stats()["counters"]
        assert counters["stored_blocks"] >= 3
        assert counters["loaded_blocks"] == 3


class TestLoadFailure:
    """vLLM's default kv_load_failure_policy ('fail', what the one-line config gets):
    kvshm sets 'recompute' before vLLM's scheduler reads it."""

    @pytest.fixture(scope="class")
    @classmethod
    def eng(cls, make_llm: LLMFactory,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
        yield from _engine(make_llm, tmp_path_factory.mktemp("faulty"), test_fail_loads=1,
                           failed_jobs_ok=True,
                           kv_overrides={"kv_load_failure_policy": "fail"})

    def test_failed_load_is_recomputed_exactly(self, eng: Engine,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
        """The first load's copy fails on the worker: vLLM recomputes the request (its
        failed blocks reported, the request rescheduled, not aborted) and the output is
        exact; the next restore loads normally."""
        scheduler = eng.llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.recompute_kv_load_failures is True
        prompt = _prompt(PROMPT_TOKENS, 90)
        cold = eng.generate([prompt])[0]
        eng.reset_device_cache()
        recomputed = _watch_recomputes(eng, monkeypatch)
        failed = eng.generate([prompt])[0]
        assert len(recomputed) == 1 and recomputed[0].startswith(failed.request_id)
        assert _signature(failed) == _signature(cold)
        stats = eng.stats()
        assert stats["counters"]["loads_failed"] == 1
        assert stats["counters"]["jobs_failed"] == 1
        assert stats["connector"]["loads_failed"] == 1
        # a synchronous load's request runs on: vLLM recomputes it without a new lookup
        assert stats["connector"]["lookups_after_failed_load"] == 0
        wstats = _kvshm_connector().worker_side.statistics()["connector"]
        assert wstats["loads_failed"] == 1
        assert wstats["error_blocks"] == 3
        eng.reset_device_cache()
        again = eng.generate([prompt])[0]
        assert again.num_cached_tokens == 3 * BLOCK
        assert _signature(again) == _signature(cold)


class TestWorkerGone:
    """The kvshm worker leaves with a load queued (closed before it submits the copy):
    no Done will ever come, so the worker side reports the load failed; the scheduler
    side sees its Goodbye and the lifeline close and goes STOPPED (a departure: its host
    closed it, no rank failed); vLLM recomputes and serves on without offload, exactly."""

    @pytest.fixture(scope="class")
    @classmethod
    def eng(cls, make_llm: LLMFactory,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
        yield from _engine(make_llm, tmp_path_factory.mktemp("gone"), failed_jobs_ok=True)

    def test_serving_goes_on_without_offload(self, eng: Engine,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
        prompt = _prompt(PROMPT_TOKENS, 250)
        cold = eng.generate([prompt])[0]
        eng.reset_device_cache()
        side = _kvshm_connector().worker_side
        start_loads = side.start_loads

        def close_then_start() -> None:
            assert side._worker is not None
            side._worker.close()
            # the scheduler side's service thread (it pumps after 20 ms without a
            # hook) sees the Goodbye first, as under load: it remembers its last READY
            # snapshot, taken with this load in flight (6 pins, 1 job)
            time.sleep(0.2)
            start_loads()

        monkeypatch.setattr(side, "start_loads", close_then_start)
        recomputed = _watch_recomputes(eng, monkeypatch)
        hot = eng.generate([prompt])[0]
        assert len(recomputed) == 1 and recomputed[0].startswith(hot.request_id)
        assert _signature(hot) == _signature(cold)
        assert side.statistics()["connector"]["loads_orphaned"] == 1
        stats = eng.stats()
        assert stats["state"] == "stopped"
        assert stats["counters"]["ranks_left"] == 1 and stats["counters"]["ranks_failed"] == 0
        assert stats["pins_held"] == 0 and stats["jobs_in_flight"] == 0
        eng.reset_device_cache()
        again = eng.generate([prompt])[0]  # no offload any more, still exact
        assert not again.num_cached_tokens
        assert _signature(again) == _signature(cold)


class TestSchedulerSideLoadFailure:
    """The worker is lost between a request's lookup (a CPU hit, pinned) and its block
    allocation: the load fails on the scheduler side and never reaches a worker. It
    travels in the metadata's ``failed_loads``; the worker side reports the request
    finished with its destination blocks invalid; vLLM recomputes, exactly."""

    @pytest.fixture(scope="class")
    @classmethod
    def eng(cls, make_llm: LLMFactory,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
        yield from _engine(make_llm, tmp_path_factory.mktemp("schedfail"),
                           failed_jobs_ok=True)

    def test_failed_before_any_worker_is_recomputed(self, eng: Engine,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
        prompt = _prompt(PROMPT_TOKENS, 330)
        cold = eng.generate([prompt])[0]
        eng.reset_device_cache()
        sched = eng.connector().scheduler_side
        worker_side = _kvshm_connector().worker_side
        allocated = sched.allocated

        def lose_worker_then_allocate(request: Any, block_ids: Any, n_ext: int) -> None:
            if n_ext:
                assert worker_side._worker is not None
                worker_side._worker.close()  # the scheduler sees Goodbye + EOF ...
                sched.client.poll()  # ... at its next call: STOPPED, the pin is void
            allocated(request, block_ids, n_ext)

        monkeypatch.setattr(sched, "allocated", lose_worker_then_allocate)
        recomputed = _watch_recomputes(eng, monkeypatch)
        hot = eng.generate([prompt])[0]
        assert len(recomputed) == 1 and recomputed[0].startswith(hot.request_id)
        assert _signature(hot) == _signature(cold)
        wstats = worker_side.statistics()["connector"]
        assert wstats["scheduler_failed_loads"] == 1 and wstats["error_blocks"] == 3
        stats = eng.stats()
        assert stats["state"] == "stopped" and stats["connector"]["loads_failed"] == 1
        assert stats["pins_held"] == 0


class TestMultiProcess:
    @pytest.fixture(scope="class")
    @classmethod
    def eng(cls, make_llm: LLMFactory,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
        yield from _engine(make_llm, tmp_path_factory.mktemp("mp"), multiprocess=True)

    def test_restore_is_bitwise_exact(self, eng: Engine) -> None:
        """Engine core and worker in their own processes: the metadata is pickled, the
        EngineCore keeps stepping while kvshm has stores in flight (has_pending_push_work),
        and the restore is exact."""
        prompt = _prompt(PROMPT_TOKENS, 120)
        cold = eng.generate([prompt])[0]
        deadline = time.monotonic() + 30
        while not eng.llm.reset_prefix_cache():  # False while kvshm pins finish-time stores
            assert time.monotonic() < deadline, "reset_prefix_cache never succeeded"
            time.sleep(0.05)
        hot = eng.generate([prompt])[0]
        assert hot.num_cached_tokens == 3 * BLOCK
        assert _signature(hot) == _signature(cold)


class TestDiskTier:
    """A CPU tier of 4 blocks and a disk tier: each prompt has 3 full blocks, so the next
    two prompts evict it from the CPU tier, and it is written to disk before it goes.
    A prompt, two others, ``reset_prefix_cache()`` (vLLM's cache is gone, and kvshm's
    CPU tier lost the prompt), the same prompt again: its first lookup posts the READ and
    waits for it or finds it done at its pump (no "ask again"), vLLM reports the prefix
    cached, the logprobs are bitwise equal. The disk hit, once read, is a CPU hit loaded
    synchronously: one engine step to the first token."""

    @pytest.fixture(scope="class")
    @classmethod
    def eng(cls, make_llm: LLMFactory,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
        tmp = tmp_path_factory.mktemp("disk")
        yield from _engine(make_llm, tmp, cpu_bytes=None, num_cpu_blocks=4,
                           disk_path=str(tmp), disk_bytes_per_rank=32 << 20)

    def test_a_prompt_evicted_to_disk_is_restored_bitwise_exact(self, eng: Engine) -> None:
        prompt = _prompt(PROMPT_TOKENS, 50)
        cold = eng.generate([prompt])[0]
        assert not cold.num_cached_tokens and eng.stats()["num_cpu_blocks"] == 4
        for start in (150, 250):
            eng.generate([_prompt(PROMPT_TOKENS, start)])
        disk: dict[str, Any] = eng.stats()["disk"]
        assert disk["written_blocks"] >= 3 and disk["io"] == "direct", disk
        eng.reset_device_cache()
        before = eng.stats()["connector"]
        hot = eng.generate([prompt])[0]
        assert hot.num_cached_tokens == 3 * BLOCK, hot.num_cached_tokens
        assert _signature(hot) == _signature(cold)
        stats = eng.stats()
        disk = stats["disk"]
        assert disk["hit_blocks"] >= 3 and disk["get_failed_jobs"] == 0, disk
        # the first lookup posted the READ, the worker started it on arrival, and the
        # lookup (the only request: nothing else to run) waited for it -- or found it
        # done at its one pump before waiting (a read of 3 slots may end that soon): a
        # hit at once either way, never "ask again"
        after = stats["connector"]
        assert after["lookups_asked_again"] == before["lookups_asked_again"], after
        answered = ("lookups_answered_after_wait", "lookups_answered_after_pump")
        assert sum(after[k] for k in answered) > sum(before[k] for k in answered), after

    def test_a_disk_hit_costs_no_engine_step_of_its_own(self, eng: Engine) -> None:
        """The lookup waits for its READ (the only request: nothing else could run),
        then answers the hit as a synchronous load (``(hit, False)``): the first token
        comes in the first engine step, which schedules the prefill -- as a cold
        request, where an asynchronous load cost a step with no token first (2 steps,
        1 idle)."""
        prompt = _prompt(PROMPT_TOKENS, 350)
        cold = eng.generate([prompt])[0]
        for start in (450, 550):
            eng.generate([_prompt(PROMPT_TOKENS, start)])
        eng.reset_device_cache()
        before = eng.stats()
        hot, steps = _first_token_steps(eng, prompt)
        after = eng.stats()
        assert after["disk"]["hit_blocks"] - before["disk"]["hit_blocks"] == 3, after["disk"]
        assert hot.num_cached_tokens == 3 * BLOCK
        toks, lps = _signature(cold)
        assert _signature(hot) == (toks[:1], lps[:1])
        assert steps == (1, 0), f"{steps} (steps, idle steps) to the first token"
        assert after["connector"]["lookups_sync"] == before["connector"]["lookups_sync"] + 1


@pytest.mark.slow
class TestTensorParallel2:
    """TP=2 on vLLM's CPU platform (gloo): two worker processes, one kvshm rank each
    (each stores and loads its own KV head); a job completes when both ranks acked."""

    @pytest.fixture(scope="class")
    @classmethod
    def eng(cls, make_llm: LLMFactory,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
        yield from _engine(make_llm, tmp_path_factory.mktemp("tp2"), multiprocess=True,
                           llm_overrides={"tensor_parallel_size": 2})

    def test_restore_is_bitwise_exact(self, eng: Engine) -> None:
        prompt = _prompt(PROMPT_TOKENS, 200)
        cold = eng.generate([prompt])[0]
        deadline = time.monotonic() + 30
        while not eng.llm.reset_prefix_cache():
            assert time.monotonic() < deadline, "reset_prefix_cache never succeeded"
            time.sleep(0.05)
        hot = eng.generate([prompt])[0]
        assert hot.num_cached_tokens == 3 * BLOCK
        assert _signature(hot) == _signature(cold)


def test_a_refused_build_leaves_no_worker_connector_for_the_next_engine(
        llm_factory: LLMFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a hostile probe (in-process mode, a notebook's): ``LLM()`` with a CPU
    budget that does not fit is refused at the scheduler side, after vLLM built this
    process's worker-side connector. That connector stayed in vLLM's process-global slot
    and the next ``LLM()`` -- the config fixed, or with no connector at all -- failed
    with "register_kv_caches called twice" until the process restarted. The refusal now
    empties the slot: the test harness's own clean-up (which papered over it) finds it
    empty."""
    import vllm.distributed.kv_transfer as kv_transfer

    from kvshm.errors import ConfigError

    at_cleanup: list[bool] = []
    real = kv_transfer.ensure_kv_transfer_shutdown

    def spy() -> None:
        at_cleanup.append(kv_transfer.has_kv_transfer_group())
        real()

    monkeypatch.setattr(kv_transfer, "ensure_kv_transfer_shutdown", spy)
    with pytest.raises(ConfigError, match="does not fit"), \
            llm_factory(CONNECTOR, module=MODULE, cpu_bytes=10**15):
        pass
    assert at_cleanup and at_cleanup[-1] is False


def test_a_restarted_engine_serves_its_first_request_from_its_disk_tier(
        make_llm: LLMFactory, tmp_path: Path) -> None:
    """Found by a hostile probe: an engine restarted over its disk tier (a name kept,
    ``write_through``) recomputed its first request although the slab held it. vLLM's
    worker connects at its first step, so the first lookup came before any rank had and
    answered 0 (``lookups_not_ready``) -- the very request a warm restart is for. With a
    lower tier the first lookups now ask again while the ranks connect (bounded): the
    restarted engine's first request gets its 3 blocks from disk, bitwise equal."""
    kw: dict[str, Any] = {"cpu_bytes": None, "num_cpu_blocks": 16, "disk_path": str(tmp_path),
                          "disk_bytes_per_rank": 32 << 20, "disk_mode": "write_through",
                          "name": f"warm-{os.getpid()}"}
    prompt = _prompt(PROMPT_TOKENS, 70)
    with make_llm(CONNECTOR, module=MODULE, **kw) as llm:
        first = Engine(llm, tmp_path / "unused", True)
        cold = first.generate([prompt])[0]
        assert not cold.num_cached_tokens
        assert first.stats()["disk"]["written_blocks"] >= 3
    with make_llm(CONNECTOR, module=MODULE, **kw) as llm:
        restarted = Engine(llm, tmp_path / "unused", True)
        hot = restarted.generate([prompt])[0]
        assert hot.num_cached_tokens == 3 * BLOCK, hot.num_cached_tokens
        assert _signature(hot) == _signature(cold)
        connector = restarted.stats()["connector"]
        assert connector["lookups_before_ready"] >= 1, connector
