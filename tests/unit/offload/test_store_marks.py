"""``InFlightMarks`` and ``FinishQueue`` alone, with exact GPU ref counts."""

from __future__ import annotations

import pytest

from kvshm.offload.counters import DeclineReason, ManagerCounters
from kvshm.offload.jobs import Cand, Selection
from kvshm.offload.pool import BlockPool
from kvshm.offload.store_marks import FinishQueue, InFlightMarks


def test_marks_are_set_and_cleared_pair_by_pair_or_a_whole_job_at_once() -> None:
    m = InFlightMarks()
    for b in (1, 2, 3):
        m.mark(Cand(b, 0, bytes([b]) * 16))
    m.unmark(2, b"\x02" * 16)
    assert m.gpu == {1, 3} and m.keys == {b"\x01" * 16, b"\x03" * 16}
    m.unmark_all([1, 3], [b"\x01" * 16, b"\x03" * 16])
    assert not m.gpu and not m.keys
    m.mark(Cand(4, 0, b"\x04" * 16))
    with pytest.raises(AssertionError, match="marks were not all set"):
        m.unmark_all([4, 5], [b"\x04" * 16, b"\x05" * 16])


def test_the_queue_pins_what_it_holds_sends_what_fits_and_drops_the_rest() -> None:
    """GPU 0, 1, 2 queued (each pinned once more: ref 2); two CPU blocks free: 0, 1 go
    into the step's selection (their pins now the job's), 2 waits while jobs are in
    flight, then is dropped (unpinned: ref 1, unmarked, counted CPU_FULL) and its key
    told to ``on_dropped``."""
    gpu, counters, marks = BlockPool(4), ManagerCounters(), InFlightMarks()
    told: list[list[bytes]] = []
    q = FinishQueue(gpu, marks, counters, told.append)
    ids = gpu.allocate(3)
    cands = [Cand(b, 0, bytes([b + 1]) * 16, b) for b in ids]
    for c in cands:
        marks.mark(c)
    q.queue(cands)
    assert [gpu.ref_cnt(b) for b in ids] == [2, 2, 2] and len(q) == 3
    sel = Selection()
    assert q.take(2, True, sel) == 0
    assert sel.gpu_ids == ids[:2] and len(q) == 1
    assert q.take(0, False, Selection()) == 0
    assert len(q) == 0 and gpu.ref_cnt(ids[2]) == 1 and ids[2] not in marks.gpu
    assert told == [[cands[2].key]] and counters.declined[DeclineReason.CPU_FULL] == 1
