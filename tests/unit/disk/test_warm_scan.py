"""The start's scan of the slabs on its own thread (``kvshm.engine.warm_scan``): what it
hands the scheduler, that it never leaves the tier warming, and that a close stops it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvshm.disk import PAGE, SlabFile, SlabSpec, scan
from kvshm.engine import warm_scan
from kvshm.engine.warm_scan import WarmScan, agree

FP = "test-model.bf16.bs16"
H_A, H_B = b"\xaa" * 32, b"\xbb" * 32


def _wait(ws: WarmScan, timeout: float = 10.0) -> warm_scan.ScanResult:
    deadline = time.monotonic() + timeout
    while True:
        got = ws.take()
        if got is not None:
            return got
        assert time.monotonic() < deadline, "the scan never ended"
        time.sleep(0.01)


def _slab(path: Path, rank: int, slots: dict[int, bytes]) -> tuple[str, SlabSpec]:
    spec = SlabSpec(FP, rank, 2, 10, PAGE)
    s = SlabFile.open(str(path), spec, direct=False)
    try:
        row = memoryview(bytearray([rank + 1]) * PAGE)
        for slot, h in slots.items():
            s.write(slot, [row], h)
    finally:
        s.close()
    return str(path), spec


def test_the_scan_hands_over_the_slots_every_rank_agrees_on_once(tmp_path: Path) -> None:
    """Rank 0 holds A in slot 2 and B in slot 7, rank 1 holds A in slot 2 and A in slot
    7 (a torn write): slot 2 is indexed in the result's slot table, slot 7 disagreed.
    ``take`` hands the result over once, then None."""
    ws = WarmScan([_slab(tmp_path / "r0.slab", 0, {2: H_A, 7: H_B}),
                   _slab(tmp_path / "r1.slab", 1, {2: H_A, 7: H_A})], 10)
    ws.start()
    got = _wait(ws)
    assert got.table is not None and (got.disagreed, got.errors) == (1, 0)
    table = got.table.slots  # indexed on the scan's thread: the scheduler swaps it in
    assert (table.num_blocks, table.num_hashes, table.num_pinned) == (10, 1, 0)
    assert list(table.block_hashes(2)) == [H_A] and got.table.left_out == 0
    assert got.seconds >= 0 and ws.take() is None
    assert agree([]) == ({}, 0)


def test_a_bug_in_the_scan_starts_the_tier_cold_never_warming_for_good(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Anything but an OSError raised on the scan's thread (a bug) is logged and the
    result is an empty index with every slab counted unreadable: the scheduler applies
    it and the disk tier writes again, instead of warming for the engine's life."""
    def boom(*args: Any, **kwargs: Any) -> dict[int, bytes]:
        raise ValueError("a bug")
    monkeypatch.setattr(warm_scan, "scan", boom)
    ws = WarmScan([("/nowhere/a", SlabSpec(FP, 0, 2, 10, PAGE)),
                   ("/nowhere/b", SlabSpec(FP, 1, 2, 10, PAGE))], 10)
    ws.start()
    got = _wait(ws)
    assert (got.table, got.disagreed, got.errors) == (None, 0, 2)
    assert "warm scan failed" in caplog.text


def test_a_close_stops_a_running_scan_and_drops_its_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine closes while its scan runs: ``close`` sets the scan's stop and waits
    for the thread (bounded); the result is never handed over."""
    started = threading.Event()

    def slow(path: str, spec: SlabSpec, *, stop: threading.Event) -> dict[int, bytes]:
        started.set()
        assert stop.wait(10), "close never stopped the scan"
        return {}
    monkeypatch.setattr(warm_scan, "scan", slow)
    ws = WarmScan([("/nowhere", SlabSpec(FP, 0, 1, 10, PAGE))], 10)
    ws.start()
    assert started.wait(10)
    t0 = time.monotonic()
    ws.close()
    assert time.monotonic() - t0 < 5 and not ws._thread.is_alive()
    assert ws.take() is None


def test_scan_ends_early_with_nothing_once_its_stop_is_set(tmp_path: Path) -> None:
    """``kvshm.disk.scan`` looks at its stop every ``SCAN_STOP_SLOTS`` slots, the first
    before slot 0: set, it returns ``{}`` (the result would be dropped anyway)."""
    path, spec = _slab(tmp_path / "r0.slab", 0, {2: H_A})
    stop = threading.Event()
    assert scan(path, spec, stop=stop) == {2: H_A}
    stop.set()
    assert scan(path, spec, stop=stop) == {}
