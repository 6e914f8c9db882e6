"""One arm of :mod:`tools.bench_e2e`: an in-process vLLM engine in its own process,
driven one request at a time over a pipe.

Each arm process outlives the workloads: per workload the driver sends ``start`` (an
engine for an :class:`ArmSpec`), then ``req`` once per request of the workload (in the
same order on every arm), then ``stop``; ``exit`` ends the process. One process per
arm is what lets the driver interleave the arms request by request: two in-process
engines cannot share a process once one has a connector (the worker-side connector is
process-global). The engine setup is :mod:`tools.bench_vllm`'s (``make_llm``, ``one``),
the connector shims are :mod:`tools.bench_vllm_chat`'s and :mod:`tools.simplecpu_shim`.

Kinds (:class:`ArmKind`): ``none`` (no connector), ``kvshm`` (kvshm's connector, the
order ``eviction`` or kvshm's configured default), ``vllm`` (vLLM's
``SimpleCPUOffloadConnector`` through the shim), ``oracle`` (kvshm's connector whose CPU
tier evicts in Belady's order from ``uses``: :mod:`tools.oracle_pool`; benchmark-only).
With ``record`` a kvshm-based arm records, per request index, the block hashes its
first CPU-tier lookup asked for (after the engine's own device hit, up to the
one-token cap): the access sequence the oracle is replayed from and checked against.

Each reply is ``("ok", value)`` or ``("error", traceback text)``; the process's stdout
and stderr (vLLM's logs) go to the log file the driver names.
"""

from __future__ import annotations

import argparse
import enum
import gc
import os
import statistics
import sys
import time
import traceback
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tools.bench_vllm import BLOCK, SPECIALS, make_llm, one, tokens
from tools.bench_vllm_chat import SIMPLE_CPU, count_accepted, cpu_pool_built_by
from tools.oracle_pool import NextUse, oracle_pool

__all__ = ["ArmKind", "ArmSpec", "ReqResult", "serve"]

KVSHM = ("KvshmConnector", "kvshm.integrations.vllm")


class ArmKind(enum.Enum):
    """What serves the arm's CPU tier (module docstring)."""

    NONE = "none"
    KVSHM = "kvshm"
    VLLM = "vllm"
    ORACLE = "oracle"


@dataclass(frozen=True)
class ArmSpec:
    """One engine: its kind, CPU-tier blocks (0 for ``none``), kvshm's order (None:
    kvshm's default), whether to record lookups. The oracle's uses (hash -> ascending
    request indices) come in a ``uses`` message after ``start``."""

    kind: ArmKind
    num_cpu_blocks: int = 0
    eviction: str | None = None
    record: bool = False
    #: more ``kv_connector_extra_config`` items of a kvshm arm (e.g. a disk tier)
    extra: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class ReqResult:
    """One request on one arm: TTFT (vLLM's ``first_token_latency``), the arm
    process's CPU seconds (every thread: the engine, kvshm's service and copies) from
    the request's submission until its first token, seconds until the engine was idle
    again (stores included), CPU-tier tokens loaded, the first output token."""

    ttft: float
    cpu: float
    elapsed: float
    hit_tokens: int
    token: int
    steps: int = 0
    """Engine steps until the first token (``generate``: a one-token request)."""
    idle_steps: int = 0
    """... of which scheduled no token (a load in flight: ``WAITING_FOR_REMOTE_KVS``)."""
    hooks: tuple[tuple[str, float], ...] = ()
    """Seconds in each connector hook until the first token (``s.`` scheduler side,
    ``w.`` worker side), where any."""


class _Arm:
    """The engine of one :class:`ArmSpec` (and the lookup recorder)."""

    current: _Arm | None = None  # the arm the class-level lookup hook reports to

    def __init__(self, folder: Path, ns: argparse.Namespace, spec: ArmSpec) -> None:
        self.spec = spec
        self.ns = ns
        self.clock = NextUse({})
        self.asks: dict[int, tuple[bytes, ...]] = {}
        self.waits: list[tuple[int, float]] = []  # per answer after "ask again"s
        self._nones, self._first_none = 0, 0.0
        self.req = -1  # no request yet (a warm-up's lookup may reach the hook too)
        self.stack = ExitStack()
        factory = oracle_pool(self.clock) if spec.kind is ArmKind.ORACLE else None
        self.stack.enter_context(cpu_pool_built_by(factory))
        extra: dict[str, Any] | None = None
        connector = KVSHM
        if spec.kind in (ArmKind.KVSHM, ArmKind.ORACLE):
            extra = {"num_cpu_blocks": spec.num_cpu_blocks, "mode": ns.mode}
            if spec.eviction is not None:
                extra["eviction"] = spec.eviction
            extra.update(spec.extra)
        elif spec.kind is ArmKind.VLLM:
            extra = {"cpu_bytes_to_use": spec.num_cpu_blocks * kv_bytes_per_block(ns)}
            connector = SIMPLE_CPU
        self.connected = extra is not None
        _Arm.current = self
        try:
            self.llm = make_llm(folder, ns, self.connected, extra=extra, connector=connector)
        except BaseException:
            self.stack.close()
            raise
        self.accepted = count_accepted(self.llm)
        self.probe = StepProbe(self.llm, self.connected)
        self.gen_cpu = 0.0
        generate = self.llm.generate

        def timed(*a: Any, **kw: Any) -> Any:  # one output token: it returns at the first
            c0 = time.process_time()
            self.probe.begin()
            try:
                return generate(*a, **kw)
            finally:
                self.gen_cpu = time.process_time() - c0
                self.probe.end()

        self.llm.generate = timed
        # warm-up (one-time costs): under one block, so nothing is stored
        self.clock.now = -2
        one(self.llm, tokens(BLOCK - 1, 17, ns.vocab - len(SPECIALS)), ns, self.connected)
        self.req = -1

    def on_lookup(self, hashes: tuple[bytes, ...]) -> None:
        """A CPU-tier lookup of the current request asked for ``hashes``."""
        if self.req >= 0:
            if self.spec.record:
                self.asks.setdefault(self.req, hashes)
            self.clock.now = self.req

    def on_answer(self, hit: int | None, t: float) -> None:
        """A lookup answered ``hit`` at ``t``: the "ask again" answers before an answer
        (a lower tier's read) and the wall time they took are kept per answer."""
        if hit is None:
            if not self._nones:
                self._first_none = t
            self._nones += 1
        elif self._nones:
            self.waits.append((self._nones, t - self._first_none))
            self._nones = 0

    def ask_again(self) -> dict[str, float]:
        """How the lookups that asked again ended: answers, "ask again" answers per
        answer (mean), wall ms from the first "ask again" to the answer (mean, p50, p90)."""
        if not self.waits:
            return {"answers": 0}
        ms = sorted(w * 1e3 for _, w in self.waits)
        return {"answers": len(ms),
                "asks_mean": round(statistics.fmean(n for n, _ in self.waits), 2),
                "wait_ms_mean": round(statistics.fmean(ms), 3),
                "wait_ms_p50": round(ms[len(ms) // 2], 3),
                "wait_ms_p90": round(ms[int(len(ms) * 0.9)], 3)}

    def request(self, i: int, prompt: list[int]) -> ReqResult:
        self.req = i
        self.clock.now = i - 1
        before = self.accepted[0]
        ttft, elapsed, answer = one(self.llm, prompt, self.ns, self.connected)
        self.clock.now = i
        pr = self.probe
        return ReqResult(ttft, self.gen_cpu, elapsed, self.accepted[0] - before,
                         answer[0] if answer else -1, pr.steps, pr.idle_steps,
                         tuple(sorted(pr.hooks.items())))

    def cpu_blocks(self) -> int:
        """The CPU-tier blocks the engine's connector actually has."""
        conn = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        if self.spec.kind is ArmKind.VLLM:
            return int(conn.scheduler_manager.num_cpu_blocks)
        if self.connected:
            return int(conn.scheduler_side.statistics()["num_cpu_blocks"])
        return 0

    def stop(self) -> dict[str, Any]:
        """Shut the engine down; kvshm's counters (loads must not have failed)."""
        out: dict[str, Any] = {"asks": self.asks, "num_cpu_blocks": self.cpu_blocks(),
                               "ask_again": self.ask_again()}
        conn = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        if self.connected and self.spec.kind is not ArmKind.VLLM:
            st = conn.scheduler_side.statistics()
            c = st["counters"]
            out.update(stored_blocks=int(c["stored_blocks"]),
                       loaded_blocks=int(c["loaded_blocks"]),
                       loads_failed=int(c["loads_failed"]), disk=st.get("disk") or {},
                       counters={k: v for k, v in c.items() if isinstance(v, int)})
            conn_c = st.get("connector") or {}
            out["lookup_waits"] = {k: conn_c.get(k, 0) for k in (
                "lookups_asked_again", "lookups_answered_after_pump", "lookups_waited",
                "lookups_answered_after_wait", "lookup_waits_timed_out")}
        try:
            self.llm.llm_engine.engine_core.shutdown(timeout=30)
        finally:
            del self.llm
            gc.collect()
            self.stack.close()
            _Arm.current = None
        return out


SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc",
                   "build_connector_meta", "update_connector_output",
                   "request_finished", "request_finished_all_groups",
                   "get_kv_connector_stats")
WORKER_HOOKS = ("bind_connector_metadata", "start_load_kv", "wait_for_save",
                "get_finished", "get_block_ids_with_load_errors",
                "clear_connector_metadata", "get_kv_connector_stats")


class StepProbe:
    """Counts an engine's steps (and those that scheduled no token) and times its
    connector's hooks while ``generate`` runs (between :meth:`begin` and :meth:`end`):
    where a request's time goes before its first token. Benchmark instrumentation:
    it wraps the in-process engine's ``step_fn``, ``schedule`` and the connectors'
    hook methods on their instances."""

    def __init__(self, llm: Any, connected: bool) -> None:
        self.on = False
        self.steps = 0
        self.idle_steps = 0
        self.hooks: dict[str, float] = {}
        core = llm.llm_engine.engine_core.engine_core
        step_fn, schedule = core.step_fn, core.scheduler.schedule

        def counted_step() -> Any:
            if self.on:
                self.steps += 1
            return step_fn()

        def counted_schedule(*a: Any, **kw: Any) -> Any:
            out = schedule(*a, **kw)
            if self.on and not out.total_num_scheduled_tokens:
                self.idle_steps += 1
            return out

        core.step_fn = counted_step
        core.scheduler.schedule = counted_schedule
        if connected:
            from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

            self._wrap(core.scheduler.connector, "s.", SCHEDULER_HOOKS)
            self._wrap(get_kv_transfer_group(), "w.", WORKER_HOOKS)

    def _wrap(self, obj: Any, prefix: str, names: tuple[str, ...]) -> None:
        for name in names:
            inner = getattr(obj, name, None)
            if inner is not None:
                setattr(obj, name, self._timed(prefix + name, inner))

    def _timed(self, key: str, inner: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            if not self.on:
                return inner(*a, **kw)
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.hooks[key] = self.hooks.get(key, 0.0) + time.perf_counter() - t0
        return timed

    def begin(self) -> None:
        self.on, self.steps, self.idle_steps, self.hooks = True, 0, 0, {}

    def end(self) -> None:
        self.on = False


def kv_bytes_per_block(ns: argparse.Namespace) -> int:
    """Bytes of one block's K and V over every layer (the layout of
    :func:`tools.bench_vllm.make_llm`: head dim 64)."""
    per_elem = 2 if ns.dtype == "bfloat16" else 4
    return int(2 * ns.layers * ns.kv_heads * 64 * BLOCK * per_elem)


def _hook_lookups() -> None:
    """Report every kvshm CPU-tier lookup to the current arm (class-level wrap of the
    manager's ``_lookup``, in this process only)."""
    from kvshm.offload.manager import OffloadManager

    inner = OffloadManager._lookup

    def recorded(self: OffloadManager, view: Any, num_local_tokens: int) -> int | None:
        arm = _Arm.current
        bs = self.block_size
        if arm is not None and num_local_tokens % bs == 0:
            s = num_local_tokens // bs
            n_max = max(0, (view.num_tokens - 1 - num_local_tokens) // bs)
            asked = tuple(view.hashes[s:s + n_max])  # vLLM's hashes are bytes
            t = time.perf_counter()
            result = inner(self, view, num_local_tokens)
            arm.on_lookup(asked)
            arm.on_answer(result, t)
            return result
        return inner(self, view, num_local_tokens)

    OffloadManager._lookup = recorded  # type: ignore[method-assign]


def probe(ns: argparse.Namespace, arm: _Arm, sizes: tuple[int, ...] = (16, 1024, 2048),
          reps: int = 3) -> dict[str, float]:
    """Median TTFT and CPU time (ms) of fresh prompts of each size that fits: how much of
    a request prefill is, on this layout."""

    out: dict[str, float] = {}
    for n in sizes:
        if n + 1 > ns.max_model_len:
            continue
        ttft, cpu = [], []
        for r in range(reps):
            prompt = tokens(n, 977 * r + 31 * n + 3, ns.vocab - len(SPECIALS))
            ttft.append(one(arm.llm, prompt, ns, arm.connected)[0])
            cpu.append(arm.gen_cpu)
        out[f"ttft_{n}_ms"] = round(statistics.median(ttft) * 1e3, 2)
        out[f"cpu_{n}_ms"] = round(statistics.median(cpu) * 1e3, 2)
    return out


def serve(conn: Connection, log_path: str) -> None:
    """The arm process's loop (module docstring)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _hook_lookups()
    arm: _Arm | None = None
    while True:
        msg = conn.recv()
        try:
            op = msg[0]
            value: Any = None
            if op == "start":
                t0 = time.perf_counter()
                arm = _Arm(Path(msg[1]), msg[2], msg[3])
                value = {"start_s": time.perf_counter() - t0,
                         "num_cpu_blocks": arm.cpu_blocks()}
            elif op == "req":
                assert arm is not None, "req before start"
                value = arm.request(msg[1], msg[2])
            elif op == "uses":  # the oracle's future, before its first request
                assert arm is not None, "uses before start"
                arm.clock.uses = msg[1]
            elif op == "probe":
                assert arm is not None, "probe before start"
                value = probe(arm.ns, arm)
            elif op == "stop":
                assert arm is not None, "stop before start"
                value, arm = arm.stop(), None
            elif op == "exit":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown op {op!r}")
            conn.send(("ok", value))
        except Exception:  # noqa: BLE001 - the driver gets the traceback and stops
            sys.stdout.flush()
            conn.send(("error", traceback.format_exc()))
