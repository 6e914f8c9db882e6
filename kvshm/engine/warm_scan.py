"""The disk tier's warm scan, on a thread of its own: every rank's slab headers read at
start, and the slots every rank agrees on handed to the scheduler once it ends.

Why a thread: the scan reads one header a slot (4.5 - 9 us each on this project's
machines), so 8 ranks of a million slots took about a minute. It used to run on the
scheduler's loop before any Ready was sent: meanwhile no rank was ready, a serving
engine's start waited, and a hand-started rank's ``--connect-timeout`` ran out (a
probe at production scale). Now the engine is READY as soon as its ranks are, and its
disk tier *warms* (``DiskBook.warming``) until the scheduler applies the result.

Order (each step before the next):

1. :meth:`WarmScan.start`, once every rank's setup is made and before any Ready is sent.
   The workers open their slabs after Ready; an open re-initialises only a file of
   another spec, which :func:`~kvshm.disk.scan` refuses as well (``{}``), so the scan
   never reads a slot a worker re-initialises. While the tier warms its book writes
   nothing, so no slot changes under the scan either.
2. :meth:`WarmScan.take`, from the scheduler's thread (each step, pump, tick and
   lookup): None while the scan runs, then its :class:`ScanResult` once (None ever
   after). The result carries the slot table already indexed
   (:func:`~kvshm.offload.disk.warm_table`, built on the scan's thread): the scheduler
   swaps it in, O(1) -- indexed there, a million slots stalled one step for 1.1 s (a
   review).
3. :meth:`WarmScan.close` (engine close): the scan stops within
   :data:`~kvshm.disk.slab.SCAN_STOP_SLOTS` slots; a result not taken is dropped.

A slab the scan cannot read (OSError) starts cold (counted in ``errors``); anything else
the thread raises (a bug) is logged and the whole tier starts cold: the tier never
stays warming for good.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvshm.disk import SlabSpec, scan
from kvshm.offload.disk import WarmTable, warm_table

__all__ = ["ScanResult", "WarmScan", "agree"]

log = logging.getLogger("kvshm.engine.runtime")

#: Seconds :meth:`WarmScan.close` waits for the thread to see its stop.
CLOSE_WAIT_S = 5.0


@dataclass(frozen=True)
class ScanResult:
    """What the scan found: ``table``, the slot table with the slots every rank's
    header names the same block in indexed (built on the scan's thread: the scheduler
    only swaps it in; None: the scan failed), ``disagreed`` (slots with a header on
    some rank that not every rank agrees on), ``errors`` (slab files unreadable:
    started cold), and the scan's wall time."""

    table: WarmTable | None = None
    disagreed: int = 0
    errors: int = 0
    seconds: float = 0.0


def agree(found: Sequence[dict[int, bytes]]) -> tuple[dict[int, bytes], int]:
    """The slots whose header names the same block on every rank (``found``: one dict a
    rank), and how many slots some rank has a header in that are not among them."""
    if not found:
        return {}, 0
    first, rest = found[0], found[1:]
    agreed = {s: h for s, h in first.items() if all(f.get(s) == h for f in rest)}
    every = set(first).union(*rest) if rest else set(first)
    return agreed, len(every) - len(agreed)


class WarmScan:
    """See the module docstring. ``slabs``: (path, spec) of every rank, in rank order;
    ``slots``: the slot count of each (the table's size)."""

    def __init__(self, slabs: Sequence[tuple[str, SlabSpec]], slots: int) -> None:
        self._slabs = list(slabs)
        self._num_slots = slots
        self._stop = threading.Event()
        self._done = threading.Event()
        self._result: ScanResult | None = None
        self._taken = False
        self._thread = threading.Thread(target=self._run, name="kvshm-disk-scan", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take(self) -> ScanResult | None:
        """The result, once, when the scan has ended; None before and after."""
        if self._taken or not self._done.is_set():
            return None
        self._taken = True
        return self._result

    def close(self) -> None:
        """Stop the scan (bounded wait); a result not taken is dropped."""
        self._stop.set()
        self._taken = True
        if self._thread.is_alive():
            self._thread.join(CLOSE_WAIT_S)

    def _run(self) -> None:
        began = time.monotonic()
        try:
            result = self._scan_all(began)
        except BaseException:  # a bug here must not leave the tier warming for good
            log.exception("kvshm: the disk tier's warm scan failed: starting cold")
            result = ScanResult(errors=len(self._slabs), seconds=time.monotonic() - began)
        self._result = result
        self._done.set()

    def _scan_all(self, began: float) -> ScanResult:
        found: list[dict[int, bytes]] = []
        errors = 0
        for path, spec in self._slabs:
            try:
                found.append(scan(path, spec, stop=self._stop))
            except OSError as exc:
                errors += 1
                log.warning("kvshm: disk slab %s unreadable (%s): starting cold", path, exc)
                found.append({})
        agreed, disagreed = agree(found)
        table = warm_table(self._num_slots, agreed)
        return ScanResult(table, disagreed, errors, time.monotonic() - began)
