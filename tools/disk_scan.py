"""Part ``scan`` of :mod:`tools.bench_disk`: the warm restart's header scan, cold.

A restart indexes its slab from the slot headers (:func:`kvshm.disk.scan`) before any
rank gets its Ready. The headers are one page every slot stride, so on a file not in the
page cache each read waits for the device unless reads are kept in flight ahead of the
parse (``ahead``, :data:`kvshm.disk.slab.SCAN_AHEAD`).

The part writes one slab of ``slots`` slots of ``row`` bytes (every slot a block, random
payloads) under ``directory``, flushes it, then for each run and each arm (``none``:
``ahead=0``, one read at a time; ``ahead``: the shipped window) drops the file's pages
from the page cache (``POSIX_FADV_DONTNEED``: no root needed for clean pages of one's own
file), times a scan, and times a second one on the now cached headers (``warm``). Every
scan must find every slot (else the part raises). The arms alternate within a run.

JSON (``summary["scan"]``): ``{"slots", "row_bytes", "file_bytes", "runs", "tmpfs", "ahead",
"cold_s": {"none": [min, med, max], "ahead": [...]}, "warm_s": {...}, "cold_speedup":
[min, med, max], "us_per_slot_cold": {"none": med, "ahead": med}}``.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from kvshm.disk import SlabFile, SlabSpec, scan
from kvshm.disk.slab import SCAN_AHEAD

#: Slots each write call covers while the slab is built.
_WRITE_GROUP = 16


def _spread(xs: list[float]) -> list[float]:
    """min / median / max."""
    return [min(xs), statistics.median(xs), max(xs)]


def _build(path: str, spec: SlabSpec) -> None:
    """Every slot of a new slab at ``path`` written (random payload, hash = slot + 1),
    then flushed to the device."""
    row = memoryview(bytearray(os.urandom(spec.row_bytes)))
    s = SlabFile.open(path, spec, direct=False)
    try:
        for lo in range(0, spec.slots, _WRITE_GROUP):
            slots = list(range(lo, min(spec.slots, lo + _WRITE_GROUP)))
            s.write_many(slots, [[row]] * len(slots),
                         [(i + 1).to_bytes(32, "little") for i in slots])
    finally:
        s.close()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _on_tmpfs(directory: str) -> bool:
    """Whether ``directory`` is on tmpfs (the mount table's longest matching mount
    point)."""
    real, best, kind = os.path.realpath(directory), "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (real == parts[1] or real.startswith(
                        parts[1].rstrip("/") + "/")) and len(parts[1]) >= len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        return False
    return kind == "tmpfs"


def _drop_cache(path: str) -> None:
    """Drop the file's clean pages from the page cache (on tmpfs there is nothing to
    drop: :func:`run` says so)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed_scan(path: str, spec: SlabSpec, ahead: int) -> float:
    """Seconds one scan took; RuntimeError unless it found every slot."""
    t = time.perf_counter()
    found = scan(path, spec, ahead=ahead)
    dt = time.perf_counter() - t
    if len(found) != spec.slots:
        raise RuntimeError(f"scan(ahead={ahead}) found {len(found)} of {spec.slots} slots")
    return dt


def run(directory: str, slots: int, row: int, runs: int) -> dict[str, Any]:
    """The part (module docstring); the slab is removed afterwards. On tmpfs its pages
    cannot be dropped (every scan is warm): the JSON says ``"tmpfs": true`` and the table
    says the figures mean nothing there."""
    tmpfs = _on_tmpfs(directory)
    spec = SlabSpec("bench-disk-scan", 0, 1, slots, row)
    path = os.path.join(directory, f"bench-scan-{os.getpid()}.slab")
    arms = {"none": 0, "ahead": SCAN_AHEAD}
    cold: dict[str, list[float]] = {a: [] for a in arms}
    warm: dict[str, list[float]] = {a: [] for a in arms}
    try:
        _build(path, spec)
        for i in range(runs):
            order = list(arms) if i % 2 == 0 else list(reversed(arms))
            for arm in order:
                _drop_cache(path)
                cold[arm].append(_timed_scan(path, spec, arms[arm]))
                warm[arm].append(_timed_scan(path, spec, arms[arm]))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    speedup = [n / a for n, a in zip(cold["none"], cold["ahead"], strict=True)]
    out = {"slots": slots, "row_bytes": row, "file_bytes": spec.file_bytes, "runs": runs,
           "tmpfs": tmpfs,
           "ahead": SCAN_AHEAD, "cold_s": {a: _spread(v) for a, v in cold.items()},
           "warm_s": {a: _spread(v) for a, v in warm.items()},
           "cold_speedup": _spread(speedup),
           "us_per_slot_cold": {a: statistics.median(v) / slots * 1e6
                                for a, v in cold.items()}}
    _print(out)
    return out


def _print(out: dict[str, Any]) -> None:
    """The part's table on stdout."""
    print(f"warm-restart scan: {out['slots']} slots of {out['row_bytes'] // 1024} KiB "
          f"({out['file_bytes'] / 2**30:.2f} GiB), {out['runs']} runs, min / median / max")
    for arm in ("none", "ahead"):
        c, w = out["cold_s"][arm], out["warm_s"][arm]
        print(f"  {arm:>5}: cold {c[0]:.3f} / {c[1]:.3f} / {c[2]:.3f} s "
              f"({out['us_per_slot_cold'][arm]:.1f} us a slot), warm {w[1]:.3f} s")
    if out["tmpfs"]:
        print("  (the slab is on tmpfs: nothing to drop from the page cache, every scan "
              "was warm; pass --dir on a disk)")
    s = out["cold_speedup"]
    print(f"  cold speedup with {out['ahead']} ahead: {s[0]:.2f} / {s[1]:.2f} / {s[2]:.2f}x")
