"""The vLLM scheduler side's lifecycle alone (kvshm.integrations.vllm.side_lifecycle):
bind, the idle-time service thread, reports, shutdown and the statistics file, over a
real vLLM ``BlockPool`` and a real kvshm client (no worker ranks: the engine stays
STARTING, which the service thread still pumps), without a ``SchedulerSide``."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.block_pool", reason="vLLM is not installed "
                    "(see tools/vllm_install.sh)")

from vllm.v1.core.block_pool import BlockPool

from kvshm.errors import ConfigError, StateError
from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.records import SchedulerCounters
from kvshm.integrations.vllm.service import HookGuard
from kvshm.integrations.vllm.side_lifecycle import PUMP_SETTLE_EVENTS, SideLifecycle
from kvshm.types import KVGroup, StoreMode

BS = 16


class Absorbed:
    """The side's ``absorb``: records each call and whether the guard was held."""

    def __init__(self, guard: HookGuard) -> None:
        self.guard = guard
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, results: Sequence[Any]) -> None:
        held = self.guard.lock._is_owned()  # type: ignore[attr-defined]
        self.calls.append((len(results), held))


def _life(tmp_path: Path, requests: dict[str, Any] | None = None
          ) -> tuple[SideLifecycle, Absorbed]:
    cfg = ConnectorConfig(f"life{os.getpid()}{time.monotonic_ns() % 10**6}", 1, 1, BS,
                          (KVGroup.full(),), StoreMode.EAGER, None, 64,
                          str(tmp_path / "stats.json"), 30.0, 0.2, 0)
    guard = HookGuard()
    absorbed = Absorbed(guard)
    life = SideLifecycle(cfg, guard, SchedulerCounters(), requests or {}, absorbed)
    return life, absorbed


@pytest.fixture
def bound(tmp_path: Path) -> Iterator[tuple[SideLifecycle, Absorbed]]:
    life, absorbed = _life(tmp_path)
    life.bind(BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS))
    try:
        yield life, absorbed
    finally:
        life.shutdown()


def test_before_bind_the_client_is_refused_and_shutdown_writes_nothing(
        tmp_path: Path) -> None:
    life, absorbed = _life(tmp_path)
    assert not life.bound and life.bound_client is None and life.service_thread is None
    with pytest.raises(StateError, match="no GPU block pool bound"):
        life.client  # noqa: B018
    assert life.report() is None
    life.shutdown()
    life.shutdown()
    assert life.closed and not (tmp_path / "stats.json").exists()
    assert absorbed.calls == []


def test_bind_refuses_a_pool_that_hashes_another_block_size(tmp_path: Path) -> None:
    life, _ = _life(tmp_path)
    with pytest.raises(ConfigError, match="blocks of 32 tokens"):
        life.bind(BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=32))
    assert not life.bound


def test_bind_twice_is_refused(bound: tuple[SideLifecycle, Absorbed]) -> None:
    life, _ = bound
    with pytest.raises(StateError, match="twice"):
        life.bind(BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS))


def test_the_service_thread_absorbs_results_under_the_lock_while_idle(
        bound: tuple[SideLifecycle, Absorbed]) -> None:
    life, absorbed = bound
    deadline = time.monotonic() + 10
    while not absorbed.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert absorbed.calls and all(held for _, held in absorbed.calls)
    service = life.service_thread
    assert service is not None and service.alive and service.errors == 0


def test_a_statistics_read_is_not_taken_for_a_hook(
        bound: tuple[SideLifecycle, Absorbed]) -> None:
    """The idle pump re-takes its READY snapshot when a hook left the guard since the
    last one (``guard.last_exit``). ``statistics()`` went through the guard, so the
    pump's own snapshot stamped ``last_exit`` and the next pump took another: about 50
    snapshots a second on an idle engine, 0.3 ms of CPU each under the hooks' lock. A
    read holds the lock without stamping now."""
    life, _ = bound
    before = life.guard.last_exit
    time.sleep(0.01)
    assert "connector" in life.statistics()
    assert life.guard.last_exit == before


def test_the_service_thread_settles_the_eviction_order_under_the_lock_while_idle(
        bound: tuple[SideLifecycle, Absorbed]) -> None:
    """Each idle pump ends with the client's ``settle`` (the adaptive order's simulations,
    deferred off the hooks), under the hooks' lock -- and bounded: at most
    ``PUMP_SETTLE_EVENTS`` events a pump, never the whole log (a hook waits on the lock
    for as long as the pump settles: the TTFT spikes ``PUMP_SETTLE_EVENTS`` documents)."""
    life, _ = bound
    client = life.bound_client
    assert client is not None
    settles: list[tuple[bool, int]] = []
    real = client.settle

    def recorded(limit: int = 0) -> bool:
        settles.append((life.guard.lock._is_owned(), limit))  # type: ignore[attr-defined]
        return real(limit)

    client.settle = recorded  # type: ignore[method-assign]
    deadline = time.monotonic() + 10
    while len(settles) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(settles) >= 2 and all(held for held, _ in settles)
    assert {limit for _, limit in settles} == {PUMP_SETTLE_EVENTS} and PUMP_SETTLE_EVENTS > 0


def test_an_idle_side_reports_once_and_rewrites_the_stats_file(
        bound: tuple[SideLifecycle, Absorbed]) -> None:
    life, _ = bound
    assert life.report() is not None
    assert life.report() is None  # idle: once, until it goes busy again
    written = json.loads(Path(str(life.cfg.stats_path)).read_text())
    assert written["teardown"]["snapshot"] == "live"


def test_a_busy_side_reports_at_most_once_a_period(tmp_path: Path) -> None:
    life, _ = _life(tmp_path, {"r": object()})
    life.bind(BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS))
    try:
        assert life.report() is not None
        assert life.report() is None
    finally:
        life.shutdown()


def test_shutdown_stops_the_thread_closes_the_client_and_writes_the_file_once(
        bound: tuple[SideLifecycle, Absorbed]) -> None:
    life, _ = bound
    life.counters.steps = 7
    life.shutdown()
    service = life.service_thread
    assert service is not None and not service.alive
    assert life.closed and life.report() is None
    path = Path(str(life.cfg.stats_path))
    stats = json.loads(path.read_text())
    assert stats["state"] == "closed" and stats["connector"]["steps"] == 7
    mtime = path.stat().st_mtime_ns
    life.shutdown()  # a second call does nothing
    assert path.stat().st_mtime_ns == mtime
