"""kvshm.disk.slab: the slab file format on this machine's disk (real files under
pytest's tmp_path, real O_DIRECT and buffered I/O, real torch tensors as rows): round
trips bit-exact with one and two regions, zero-copy vs bounce, scan, every way a slot
reads as a miss (empty, torn, another block, a corrupted payload), the open's refusals
(no space, another holder) and check_directory's four refusals."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvshm.disk import (
    PAGE,
    SlabFile,
    SlabLocked,
    SlabSpec,
    SlotOutcome,
    check_directory,
    remove_unheld,
    scan,
    slab_path,
)
from kvshm.disk.slab import SCAN_RUN_BYTES, SCAN_SEQUENTIAL_STRIDE
from kvshm.errors import ConfigError

FP = "test-model.bf16.bs16"
H_A, H_B = b"\xaa" * 32, b"\xbb" * 32
#: A row whose slots lie past SCAN_SEQUENTIAL_STRIDE: scanned one header at a time.
BIG_ROW = 16 * PAGE


def view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous uint8 tensor (as the disk mover makes)."""
    assert t.dtype is torch.uint8 and t.is_contiguous()
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


def aligned(n: int) -> torch.Tensor:
    """``n`` bytes at a PAGE-aligned address (a slice of a larger tensor)."""
    raw = torch.zeros(n + PAGE, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip:skip + n]


def rand_rows(sizes: tuple[int, ...], seed: int, *,
              page_aligned: bool = True) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        t = aligned(n) if page_aligned else torch.empty(n + 1, dtype=torch.uint8)[1:]
        t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
        out.append(t)
    return out


def blank(sizes: tuple[int, ...], *, page_aligned: bool = True) -> list[torch.Tensor]:
    return [aligned(n) if page_aligned else torch.zeros(n + 1, dtype=torch.uint8)[1:]
            for n in sizes]


@pytest.fixture
def slab(tmp_path: Path) -> Iterator[SlabFile]:
    s = SlabFile.open(str(tmp_path / "s.slab"), SlabSpec(FP, 0, 1, 8, 3 * PAGE), direct=True)
    yield s
    s.close()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("sizes", [(3 * PAGE,), (PAGE, 2 * PAGE)], ids=["1region", "2regions"])
def test_round_trip_is_bit_exact(tmp_path: Path, sizes: tuple[int, ...], direct: bool) -> None:
    spec = SlabSpec(FP, 1, 2, 6, sum(sizes))
    src = rand_rows(sizes, seed=1)
    with_path = str(tmp_path / "s.slab")
    s = SlabFile.open(with_path, spec, direct=direct)
    try:
        s.write(4, [view(t) for t in src], H_A)
        dst = blank(sizes)
        assert s.read_into(4, [view(t) for t in dst], H_A) is SlotOutcome.HIT
        assert all(torch.equal(a, b) for a, b in zip(src, dst))
        assert s.counts["bounce"] == 0 and s.counts["writes"] == 1 and s.counts["reads"] == 1
        assert s.counts["bytes_read"] == s.counts["bytes_written"] == sum(sizes)
    finally:
        s.close()
    assert os.path.getsize(with_path) == spec.file_bytes == PAGE + 6 * (PAGE + sum(sizes))


def test_unaligned_rows_go_through_the_bounce_buffer_and_are_counted(slab: SlabFile) -> None:
    """Rows at odd addresses or of odd lengths cannot be O_DIRECT buffers: the bytes
    travel through the one bounce buffer, still bit-exact, each slot counted once."""
    sizes = (1000, 3 * PAGE - 1000)
    src = rand_rows(sizes, seed=2, page_aligned=False)
    slab.write(0, [view(t) for t in src], H_A)
    assert slab.counts["bounce"] == 1
    dst = blank(sizes, page_aligned=False)
    assert slab.read_into(0, [view(t) for t in dst], H_A) is SlotOutcome.HIT
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    assert slab.counts["bounce"] == 2
    # and aligned reads of that slot take no bounce
    whole = blank((3 * PAGE,))
    assert slab.read_into(0, [view(whole[0])], H_A) is SlotOutcome.HIT
    assert torch.equal(whole[0], torch.cat(src)) and slab.counts["bounce"] == 2


def test_a_bounce_read_that_misses_leaves_the_rows_alone(slab: SlabFile) -> None:
    slab.write(1, [view(rand_rows((3 * PAGE,), seed=3)[0])], H_A)
    dst = torch.full((3 * PAGE + 1,), 7, dtype=torch.uint8)[1:]
    assert slab.read_into(1, [view(dst)], H_B) is SlotOutcome.BAD_HEADER
    assert bool((dst == 7).all())


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[int, int]]:
    """Record (buffers, offset) of every ``os.<name>`` call the slab makes (the real call
    still runs)."""
    real, calls = getattr(os, name), []

    def spy(fd: int, bufs: list[memoryview], off: int) -> int:
        calls.append((len(bufs), off))
        return int(real(fd, bufs, off))

    monkeypatch.setattr(os, name, spy)
    return calls


@pytest.mark.parametrize("direct", [True, False])
def test_neighbouring_slots_move_in_one_vectored_call_each_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    """Blocks in slots 2, 3, 4 (neighbours), 6 and 1 with one unaligned block (slot 6):
    one write and one read for 2-4 (a header page and two rows per slot), one bounced
    I/O for 6, one for 1; every block bit-exact, counted once."""
    spec = SlabSpec(FP, 0, 1, 8, 3 * PAGE)
    s = SlabFile.open(str(tmp_path / "g.slab"), spec, direct=direct)
    slots, hs = [2, 3, 4, 6, 1], [bytes([k]) * 32 for k in range(1, 6)]
    sizes = (PAGE, 2 * PAGE)
    src = [rand_rows(sizes, seed=k, page_aligned=slot != 6) for k, slot in enumerate(slots)]
    dst = [blank(sizes, page_aligned=slot != 6) for slot in slots]
    writes, reads = _spy(monkeypatch, "pwritev"), _spy(monkeypatch, "preadv")
    try:
        assert s.write_many(slots, [[view(t) for t in b] for b in src], hs) == [None] * 5
        got = s.read_many(slots, [[view(t) for t in b] for b in dst], hs)
        assert got == [SlotOutcome.HIT] * 5
        for a, b in zip(src, dst):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        bounced = 0 if not direct else 1
        assert s.counts["writes"] == s.counts["reads"] == 5
        assert s.counts["bounce"] == 2 * bounced
    finally:
        s.close()
    group = [(9, spec.slot_offset(2))]
    six = [(1 if direct else 3, spec.slot_offset(6))]
    one = [(3, spec.slot_offset(1))]
    assert writes == group + six + one and reads == group + six + one


@pytest.mark.parametrize("direct", [True, False])
def test_falling_neighbouring_slots_are_read_in_one_vectored_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    """A read of slots 5, 4, 3 (write-back's order: a chain's deepest block first) and
    then 7 is one read from slot 3's offset in file order and one of slot 7; each block
    lands in its own rows bit-exact, and a slot holding another block is still a miss
    in its own place (slot 4 asked under the wrong hash: BAD_HEADER)."""
    spec = SlabSpec(FP, 0, 1, 8, 3 * PAGE)
    s = SlabFile.open(str(tmp_path / "f.slab"), spec, direct=direct)
    slots, hs = [5, 4, 3, 7], [bytes([k]) * 32 for k in range(1, 5)]
    sizes = (PAGE, 2 * PAGE)
    src = [rand_rows(sizes, seed=k) for k in range(4)]
    try:
        assert s.write_many(slots, [[view(t) for t in b] for b in src], hs) == [None] * 4
        reads = _spy(monkeypatch, "preadv")
        dst = [blank(sizes) for _ in slots]
        got = s.read_many(slots, [[view(t) for t in b] for b in dst], hs)
        assert got == [SlotOutcome.HIT] * 4
        for a, b in zip(src, dst):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert reads == [(9, spec.slot_offset(3)), (3, spec.slot_offset(7))]
        dst = [blank(sizes) for _ in slots]
        wrong = [hs[0], b"x" * 32, hs[2], hs[3]]
        got = s.read_many(slots, [[view(t) for t in b] for b in dst], wrong)
        assert got == [SlotOutcome.HIT, SlotOutcome.BAD_HEADER, SlotOutcome.HIT,
                       SlotOutcome.HIT]
        assert torch.equal(dst[0][1], src[0][1]) and torch.equal(dst[2][0], src[2][0])
    finally:
        s.close()


def test_a_group_write_torn_part_way_reads_whole_slots_one_bad_and_the_old(
        tmp_path: Path, slab: SlabFile) -> None:
    """A write of slots 0-3 in one call that stopped inside slot 2's payload (made by
    copying that prefix of the same write on another file): slots 0 and 1 are the new
    blocks, slot 2 BAD_CRC, slot 3 still the old block -- never a wrong HIT."""
    old = [rand_rows((3 * PAGE,), seed=20 + k)[0] for k in range(4)]
    new = [rand_rows((3 * PAGE,), seed=30 + k)[0] for k in range(4)]
    h_old, h_new = [bytes([1, k]) * 16 for k in range(4)], [bytes([2, k]) * 16 for k in range(4)]
    assert slab.write_many(range(4), [[view(t)] for t in old], h_old) == [None] * 4
    other = SlabFile.open(str(tmp_path / "other.slab"), slab.spec, direct=True)
    try:
        other.write_many(range(4), [[view(t)] for t in new], h_new)
    finally:
        other.close()
    start, stop = slab.spec.slot_offset(0), slab.spec.slot_offset(2) + PAGE + 5 * 1024
    with open(tmp_path / "other.slab", "rb") as f:
        f.seek(start)
        prefix = f.read(stop - start)
    with open(slab.path, "r+b") as f:
        f.seek(start)
        f.write(prefix)
    got = [blank((3 * PAGE,))[0] for _ in range(4)]
    out = slab.read_many(range(4), [[view(t)] for t in got], h_new)
    assert out == [SlotOutcome.HIT, SlotOutcome.HIT, SlotOutcome.BAD_CRC,
                   SlotOutcome.BAD_HEADER]
    assert torch.equal(got[0], new[0]) and torch.equal(got[1], new[1])
    assert slab.read_into(3, [view(got[3])], h_old[3]) is SlotOutcome.HIT
    assert torch.equal(got[3], old[3])


def test_many_calls_check_the_whole_call_before_any_io(slab: SlabFile) -> None:
    row = rand_rows((3 * PAGE,), seed=11)[0]
    with pytest.raises(ConfigError, match="one each per block"):
        slab.write_many([0, 1], [[view(row)]], [H_A, H_B])
    with pytest.raises(ConfigError, match="out of range"):
        slab.read_many([0, 8], [[view(row)], [view(row)]], [H_A, H_B])
    assert slab.counts["writes"] == slab.counts["reads"] == 0


def test_scan_finds_exactly_the_written_slots_and_ignores_another_spec(tmp_path: Path) -> None:
    path = str(tmp_path / "s.slab")
    spec = SlabSpec(FP, 0, 2, 10, PAGE)
    s = SlabFile.open(path, spec, direct=True)
    try:
        row = rand_rows((PAGE,), seed=4)[0]
        for slot, h in ((2, H_A), (7, H_B), (9, b"\x01" * 8)):
            s.write(slot, [view(row)], h)
        s.invalidate(9)
    finally:
        s.close()
    assert scan(path, spec) == {2: H_A, 7: H_B}
    for other in (SlabSpec("other-model", 0, 2, 10, PAGE), SlabSpec(FP, 1, 2, 10, PAGE),
                  SlabSpec(FP, 0, 2, 10, 2 * PAGE), SlabSpec(FP, 0, 2, 11, PAGE)):
        assert scan(path, other) == {}
    assert scan(str(tmp_path / "absent.slab"), spec) == {}


def _scan_calls(monkeypatch: pytest.MonkeyPatch, refuse: bool = False) -> list[tuple[str, int]]:
    """Record, in order, each header the scan asks the kernel to read ahead ("advise",
    offset) and each header it reads ("read", offset); ``refuse``: every advice fails as
    on a file system that does not take it."""
    real_pread, calls = os.pread, []

    def advise(fd: int, off: int, length: int, what: int) -> None:
        assert (length, what) == (PAGE, os.POSIX_FADV_WILLNEED)
        calls.append(("advise", off))
        if refuse:
            raise OSError(errno.EINVAL, "no advice here")

    def pread(fd: int, n: int, off: int) -> bytes:
        calls.append(("read", off))
        return real_pread(fd, n, off)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(os, "pread", pread)
    return calls


def test_a_cold_scan_keeps_headers_in_flight_ahead_of_the_one_it_parses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm restart of a big slab scanned one header ``pread`` at a time: slot headers
    lie a stride apart, beyond the kernel's own read-ahead, so on a cold file each read
    waited for the device alone (91 us a slot on this machine's disk: 1.7 - 2.3 s for
    20,000 slots of 128 KiB, about 14 minutes for 1 TiB), with the scheduler's loop
    blocked before any Ready. Now the header ``ahead`` slots on is asked for
    (``POSIX_FADV_WILLNEED``: the read starts, nobody waits) before each slot is read:
    0.17 - 0.32 s for the same file, 8.1x by the median (``tools.bench_disk --part
    scan``).

    A 10-slot slab of rows past ``SCAN_SEQUENTIAL_STRIDE`` (closer slots are read in
    runs) with ``ahead=3``: the file header is read, then slots 0-2 are advised, then
    each slot i is advised i + 3 (while there is one) before slot i is read; every
    header page is advised exactly once and before its read."""
    path = str(tmp_path / "s.slab")
    spec = SlabSpec(FP, 0, 1, 10, BIG_ROW)
    s = SlabFile.open(path, spec, direct=False)
    try:
        s.write(4, [view(rand_rows((BIG_ROW,), seed=4)[0])], H_A)
    finally:
        s.close()
    calls = _scan_calls(monkeypatch)
    assert scan(path, spec, ahead=3) == {4: H_A}
    off = spec.slot_offset
    want: list[tuple[str, int]] = [("read", 0)] + [("advise", off(i)) for i in range(3)]
    for i in range(10):
        if i + 3 < 10:
            want.append(("advise", off(i + 3)))
        want.append(("read", off(i)))
    assert calls == want
    calls.clear()
    assert scan(path, spec, ahead=0) == {4: H_A}  # no read-ahead: reads only
    assert calls == [("read", 0)] + [("read", off(i)) for i in range(10)]


def test_a_file_system_that_refuses_read_ahead_is_scanned_one_read_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The advice is only a hint: where it fails (a file system or platform without
    it), the first refusal ends it and the scan reads every header as before, finding
    the same slots; it never raises for it."""
    path = str(tmp_path / "s.slab")
    spec = SlabSpec(FP, 0, 1, 6, BIG_ROW)
    s = SlabFile.open(path, spec, direct=False)
    try:
        s.write(1, [view(rand_rows((BIG_ROW,), seed=5)[0])], H_A)
        s.write(5, [view(rand_rows((BIG_ROW,), seed=6)[0])], H_B)
    finally:
        s.close()
    calls = _scan_calls(monkeypatch, refuse=True)
    assert scan(path, spec) == {1: H_A, 5: H_B}
    assert [c for c in calls if c[0] == "advise"] == [("advise", spec.slot_offset(0))]
    assert [c for c in calls if c[0] == "read"] == \
        [("read", 0)] + [("read", spec.slot_offset(i)) for i in range(6)]


def test_a_slab_of_small_rows_is_scanned_in_a_few_reads_beside_a_busy_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hazard "the warm scan starved of the GIL": the scan runs on a thread of the
    serving process and each ``pread`` lets go of the GIL; while vLLM's loop spun (its
    first lookups ask again until the scan is applied) each read waited up to the
    switch interval to get it back. 910 slots of 32 KiB rows took 0.6 s beside a busy
    thread (4 ms alone) and 10 s in CI, past the start's wait: the restarted engine
    recomputed its first request (``vllm/test_vllm_connector::test_a_restarted_engine_
    serves_its_first_request_from_its_disk_tier``, red in CI). Slots that close are now
    read in runs of ``SCAN_RUN_BYTES``: 9 reads instead of 910 (and as many advices),
    the same slots found; a ``stop`` still ends it within ``SCAN_STOP_SLOTS`` slots."""
    path = str(tmp_path / "s.slab")
    spec = SlabSpec(FP, 0, 1, 910, 8 * PAGE)
    assert spec.slot_stride <= SCAN_SEQUENTIAL_STRIDE
    s = SlabFile.open(path, spec, direct=False)
    try:
        for slot, h in ((0, H_A), (500, H_B), (909, b"\x02" * 8)):
            s.write(slot, [view(rand_rows((8 * PAGE,), seed=slot)[0])], h)
    finally:
        s.close()
    calls = _scan_calls(monkeypatch)
    assert scan(path, spec) == {0: H_A, 500: H_B, 909: b"\x02" * 8}
    per = SCAN_RUN_BYTES // spec.slot_stride
    assert calls == [("read", 0)] + [("read", spec.slot_offset(first))
                                     for first in range(0, 910, per)]
    assert len(calls) == 10
    stop = threading.Event()
    stop.set()
    assert scan(path, spec, stop=stop) == {}


def test_scan_and_open_agree_on_a_slab_grown_past_its_spec(tmp_path: Path) -> None:
    """A slab something outside kvshm grew by one page: ``SlabFile.open`` reuses only a
    file of exactly the spec's size and re-initialises this one, so ``scan`` must not
    index its slots either (it used to accept any file at least that long: the warm
    index named slot 2, which the worker had just wiped -- a READ of EMPTY)."""
    path = str(tmp_path / "s.slab")
    spec = SlabSpec(FP, 0, 1, 4, PAGE)
    row = rand_rows((PAGE,), seed=6)[0]
    s = SlabFile.open(path, spec, direct=False)
    s.write(2, [view(row)], H_A)
    s.close()
    assert scan(path, spec) == {2: H_A}
    os.truncate(path, spec.file_bytes + PAGE)
    assert scan(path, spec) == {}
    again = SlabFile.open(path, spec, direct=False)
    try:
        got = blank((PAGE,))[0]
        assert again.read_into(2, [view(got)], H_A) is SlotOutcome.EMPTY
    finally:
        again.close()


def test_reopen_keeps_the_slots_and_another_spec_reinitialises(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "s.slab")
    spec = SlabSpec(FP, 0, 1, 4, PAGE)
    row = rand_rows((PAGE,), seed=5)[0]
    with_a = SlabFile.open(path, spec, direct=True)
    with_a.write(3, [view(row)], H_A)
    with_a.close()
    again = SlabFile.open(path, spec, direct=True)
    got = blank((PAGE,))[0]
    assert again.read_into(3, [view(got)], H_A) is SlotOutcome.HIT and torch.equal(got, row)
    again.close()
    other = SlabSpec("another-model", 0, 1, 4, PAGE)
    with caplog.at_level(logging.WARNING, logger="kvshm.disk.slab"):
        s = SlabFile.open(path, other, direct=True)
    s.close()
    assert [r.message for r in caplog.records if "re-initialising" in r.message]
    assert scan(path, spec) == {} and scan(path, other) == {}
    s = SlabFile.open(path, spec, direct=True)  # back to the first spec: nothing left
    try:
        assert s.read_into(3, [view(got)], H_A) is SlotOutcome.EMPTY
    finally:
        s.close()


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_corrupted_payload_byte_is_bad_crc_and_a_corrupted_header_bad_header(
        slab: SlabFile) -> None:
    row = rand_rows((3 * PAGE,), seed=6)[0]
    slab.write(2, [view(row)], H_A)
    slab.write(5, [view(row)], H_A)
    off2, off5 = slab.spec.slot_offset(2), slab.spec.slot_offset(5)
    _flip(slab.path, off2 + PAGE + 5000)
    _flip(slab.path, off5 + 40)  # inside the header: its own CRC fails
    got = blank((3 * PAGE,))[0]
    assert slab.read_into(2, [view(got)], H_A) is SlotOutcome.BAD_CRC
    assert slab.read_into(5, [view(got)], H_A) is SlotOutcome.BAD_HEADER
    assert slab.read_into(0, [view(got)], H_A) is SlotOutcome.EMPTY
    assert slab.counts["crc_mismatch"] == 1 and slab.counts["bad_header"] == 1
    assert slab.counts["empty"] == 1 and slab.counts["reads"] == 0


def test_a_header_copied_into_another_slot_is_not_that_slots(slab: SlabFile) -> None:
    row = rand_rows((3 * PAGE,), seed=7)[0]
    slab.write(1, [view(row)], H_A)
    with open(slab.path, "r+b") as f:  # copy slot 1 (header and payload) over slot 6
        f.seek(slab.spec.slot_offset(1))
        whole = f.read(slab.spec.slot_stride)
        f.seek(slab.spec.slot_offset(6))
        f.write(whole)
    got = blank((3 * PAGE,))[0]
    assert slab.read_into(6, [view(got)], H_A) is SlotOutcome.BAD_HEADER


def test_torn_writes_never_read_as_a_hit(slab: SlabFile) -> None:
    """The states a write can stop in (module docstring), made by hand on the file:
    (1) the new block's payload landed behind a zeroed header (killed before the header
    write): EMPTY; (2) a power loss kept block A's header but B's payload: BAD_CRC for
    A, BAD_HEADER for B; (3) half a header page: BAD_HEADER."""
    a, b = rand_rows((3 * PAGE,), seed=8)[0], rand_rows((3 * PAGE,), seed=9)[0]
    off = slab.spec.slot_offset(3)
    slab.write(3, [view(a)], H_A)
    with open(slab.path, "r+b") as f:
        f.seek(off)
        f.write(bytes(PAGE) + b.numpy().tobytes())
    got = blank((3 * PAGE,))[0]
    assert slab.read_into(3, [view(got)], H_B) is SlotOutcome.EMPTY
    assert slab.read_into(3, [view(got)], H_A) is SlotOutcome.EMPTY

    slab.write(3, [view(a)], H_A)
    with open(slab.path, "r+b") as f:
        f.seek(off + PAGE)
        f.write(b.numpy().tobytes())
    assert slab.read_into(3, [view(got)], H_A) is SlotOutcome.BAD_CRC
    assert slab.read_into(3, [view(got)], H_B) is SlotOutcome.BAD_HEADER

    slab.write(3, [view(b)], H_B)
    with open(slab.path, "r+b") as f:
        f.seek(off + 64)
        f.write(bytes(64))
    assert slab.read_into(3, [view(got)], H_B) is SlotOutcome.BAD_HEADER


def test_bad_input_is_a_config_error(slab: SlabFile) -> None:
    row = rand_rows((3 * PAGE,), seed=10)[0]
    with pytest.raises(ConfigError, match="out of range"):
        slab.write(8, [view(row)], H_A)
    with pytest.raises(ConfigError, match="rows hold"):
        slab.write(0, [view(row[:PAGE])], H_A)
    with pytest.raises(ConfigError, match="block hash"):
        slab.write(0, [view(row)], b"x" * 65)


def test_a_second_opener_is_refused(slab: SlabFile) -> None:
    with pytest.raises(SlabLocked, match="in use by another engine"):
        SlabFile.open(slab.path, slab.spec, direct=True)


def test_a_symlink_at_the_slab_path_is_refused_and_its_target_untouched(
        tmp_path: Path) -> None:
    """Attack: ``disk_path`` is shared, and someone puts a symbolic link where an
    engine's slab goes, pointing at a file of theirs (or of the engine's user) elsewhere.
    The open followed it and re-initialised the "foreign slab": the target truncated to
    0 and overwritten with a slab of 36,864 bytes, one warning line. Now the open refuses
    (ConfigError naming the link) and the target keeps its 2,000 bytes; a dangling link
    is refused too and left in place (it is not the engine's to remove)."""
    target = tmp_path / "precious.db"
    target.write_bytes(b"\x5a" * 2000)
    link = tmp_path / "s.slab"
    link.symlink_to(target)
    spec = SlabSpec(FP, 0, 1, 8, PAGE)
    for direct in (True, False):
        with pytest.raises(ConfigError, match="symbolic link"):
            SlabFile.open(str(link), spec, direct=direct)
    assert target.read_bytes() == b"\x5a" * 2000
    with pytest.raises(OSError):  # the scan does not follow it either (the engine
        scan(str(link), spec)  # logs "unreadable: starting cold"; open_disk refused first)
    dangling = tmp_path / "d.slab"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="symbolic link"):
        SlabFile.open(str(dangling), spec, direct=False)
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()


def _slab_with_a_block(path: str, spec: SlabSpec) -> None:
    s = SlabFile.open(path, spec, direct=False)
    try:
        s.write(2, [view(rand_rows((PAGE,), seed=8)[0])], H_A)
    finally:
        s.close()


def test_a_slab_others_may_write_is_refused_and_never_scanned(tmp_path: Path) -> None:
    """Attack: ``disk_path`` is shared; a slab file others may write (mode 0666: another
    user made it and the engine's open, O_CREAT with 0600, kept its mode) was reused as
    is. Its slot headers are plain to read and a CRC is no seal: the other user rewrote
    every payload with its own bytes and matching checksums, and the next engine's warm
    start loaded them as ok (a hostile probe: 16 of 16 blocks). Now neither the warm
    scan nor the open trusts such a file: the scan indexes nothing, the open is a
    ConfigError naming the mode, and the file made private again serves as before."""
    path = str(tmp_path / "s.slab")
    spec = SlabSpec(FP, 0, 1, 4, PAGE)
    _slab_with_a_block(path, spec)
    assert scan(path, spec) == {2: H_A}
    for mode in (0o666, 0o620, 0o602):
        os.chmod(path, mode)
        assert scan(path, spec) == {}
        with pytest.raises(ConfigError, match=f"may be written by others \\(mode {mode:o}\\)"):
            SlabFile.open(path, spec, direct=False)
    os.chmod(path, 0o600)
    assert scan(path, spec) == {2: H_A}
    SlabFile.open(path, spec, direct=False).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_slab_another_user_owns_is_refused_never_scanned_and_never_swept(
        tmp_path: Path) -> None:
    """Attack: another user (``nobody``) created the slab file before the engine did, so
    it stays theirs whatever mode the engine asks for: they may rewrite its blocks at
    any time (found by a hostile probe, as root: the forged blocks loaded as ok). Now a
    file this process's user does not own is never scanned or opened, and ``kvshm
    sweep --remove-slabs`` does not remove it either (it is not this user's to remove)."""
    path = str(tmp_path / "s.slab")
    spec = SlabSpec(FP, 0, 1, 4, PAGE)
    _slab_with_a_block(path, spec)
    os.chown(path, 65534, 65534)
    assert scan(path, spec) == {}
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        SlabFile.open(path, spec, direct=False)
    with pytest.raises(PermissionError):
        remove_unheld(path)
    assert os.path.exists(path)


def test_a_hard_link_at_the_slab_path_is_refused_and_its_other_file_untouched(
        tmp_path: Path) -> None:
    """Attack: the symbolic-link hazard with a hard link (``fs.protected_hardlinks=0``,
    or an operator's ``cp -al`` snapshot of the cache directory): the open did not see
    it, re-initialised the "foreign layout" and so truncated and overwrote the file
    behind the other name (a probe's 15,000-byte database became a slab). Now a file
    with more than one name is refused, and the other name's bytes stay."""
    precious = tmp_path / "precious.db"
    precious.write_bytes(b"\x5a" * 15000)
    precious.chmod(0o600)
    path = tmp_path / "s.slab"
    os.link(precious, path)
    spec = SlabSpec(FP, 0, 1, 4, PAGE)
    assert scan(str(path), spec) == {}
    with pytest.raises(ConfigError, match="2 names \\(a hard link\\)"):
        SlabFile.open(str(path), spec, direct=False)
    assert precious.read_bytes() == b"\x5a" * 15000


def test_a_fifo_at_the_slab_path_never_blocks_scan_or_open(tmp_path: Path) -> None:
    """Attack: a FIFO named like a slab. ``scan`` opened it read-only and blocking, on the
    scheduler's loop before any Ready: the engine's start hung for good (no connect or
    hang timeout fires there). Now the scan returns at once with no warm slots, and the
    open refuses it in one line (a worker would otherwise wait for a writer too)."""
    fifo = tmp_path / "s.slab"
    os.mkfifo(fifo)
    spec = SlabSpec(FP, 0, 1, 8, PAGE)
    assert scan(str(fifo), spec) == {}
    with pytest.raises(ConfigError, match="not a regular file"):
        SlabFile.open(str(fifo), spec, direct=False)
    assert fifo.is_fifo()


def test_a_slab_closed_with_remove_is_gone_and_one_closed_without_stays(
        tmp_path: Path) -> None:
    """``close(remove=True)`` (a slab no later start can serve) unlinks the file under
    its lock; a plain close keeps it; a path that names another file by then (removed
    and created again) is left alone."""
    spec = SlabSpec(FP, 0, 1, 8, PAGE)
    a, b = tmp_path / "a.slab", tmp_path / "b.slab"
    SlabFile.open(str(a), spec, direct=False).close(remove=True)
    SlabFile.open(str(b), spec, direct=False).close()
    assert not a.exists() and b.exists()
    s = SlabFile.open(str(a), spec, direct=False)
    os.unlink(a)
    a.write_bytes(b"someone else's")
    s.close(remove=True)
    assert a.read_bytes() == b"someone else's"


def test_slab_path_refuses_names_with_separators(tmp_path: Path) -> None:
    assert slab_path(str(tmp_path), "eng-1", 1, 2).endswith("kvshm-eng-1.rank1-of-2.slab")
    for bad in ("a/b", "..", ".", "", "x\0y"):
        with pytest.raises(ConfigError, match="cannot name a slab file"):
            slab_path(str(tmp_path), bad, 0, 1)


def test_open_without_the_space_is_refused_naming_the_size(tmp_path: Path) -> None:
    """A slab larger than the directory's free space (read here: twice the filesystem's
    whole size, so no other process freeing space can make it fit) is refused before any
    allocation, and leaves no file."""
    st = os.statvfs(tmp_path)
    slots = 2 * st.f_blocks * st.f_frsize // (PAGE + PAGE)
    spec = SlabSpec(FP, 0, 1, slots, PAGE)
    path = tmp_path / "big.slab"
    with pytest.raises(ConfigError, match=f"cannot allocate {spec.file_bytes} bytes"):
        SlabFile.open(str(path), spec, direct=True)
    assert not path.exists()


def test_enospc_from_fallocate_is_a_config_error(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The space went between the check and the allocation: posix_fallocate's ENOSPC
    (faked at the syscall seam) is the same one-line refusal."""
    def no_space(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    spec = SlabSpec(FP, 0, 1, 4, PAGE)
    with pytest.raises(ConfigError, match=f"cannot allocate {spec.file_bytes} bytes"):
        SlabFile.open(str(tmp_path / "s.slab"), spec, direct=True)
    assert not (tmp_path / "s.slab").exists()


# ---------------------------------------------------------------------------- check_directory


def test_check_directory_passes_and_leaves_nothing(tmp_path: Path) -> None:
    check_directory(str(tmp_path), PAGE, direct=True)
    check_directory(str(tmp_path), PAGE, direct=False)
    assert list(tmp_path.iterdir()) == []


def test_check_directory_refuses_a_filesystem_whose_files_could_not_be_trusted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review of the slab trust check: on a filesystem that squashes owners (NFS
    root_squash: files show as nobody's) or ignores modes (CIFS or vfat at 0777) every
    rank's slab open is now refused, while the start's directory check passed -- each
    rank ran without its disk tier, every Disk job failing. Now the directory check's
    probe file is judged like a slab: one ConfigError at the start. Simulated by a probe
    file the "filesystem" shows as mode 0666."""
    real = tempfile.mkstemp

    def loose(*args: Any, **kw: Any) -> tuple[int, str]:
        fd, path = real(*args, **kw)
        os.fchmod(fd, 0o666)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", loose)
    with pytest.raises(ConfigError, match="may be written by others .* no slab could be "
                       "trusted"):
        check_directory(str(tmp_path), PAGE, direct=False)
    assert list(tmp_path.iterdir()) == []


def test_the_o_direct_probe_never_writes_through_a_link_swapped_in_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hazard (a hostile probe): the start's O_DIRECT probe made its file with
    ``mkstemp``, closed it and opened it again by name to write a page of zeros. A local
    user who could write to a shared ``disk_path`` (group-writable, no sticky bit) swapped
    the probe for a link between the two opens -- the probe won the race in 43 tries --
    and the engine zeroed the first page of the file the link named. Here the swap is
    made at once (at the ``mkstemp`` seam): the probe's open (``O_NOFOLLOW``) refuses
    the link -- one ConfigError saying another user writes to the directory --, the
    victim keeps its bytes, and the link is removed with the probe. The same for a
    regular file swapped in (the probe writes only to the file it made)."""
    if os.O_DIRECT == 0 or _probe_direct_ok(tmp_path) is False:
        pytest.skip("this file system refuses O_DIRECT")
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * (2 * PAGE))
    shared = tmp_path / "shared"
    shared.mkdir()
    real = tempfile.mkstemp

    def swapped(*args: Any, **kw: Any) -> tuple[int, str]:
        fd, path = real(*args, **kw)
        if kw.get("prefix") == ".kvshm-odirect-":  # the O_DIRECT probe's file
            os.unlink(path)  # the other user's swap: the name now a link to the victim
            os.symlink(victim, path)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", swapped)
    with pytest.raises(ConfigError, match="probe file was replaced while it was open"):
        check_directory(str(shared), PAGE, direct=True)
    assert victim.read_bytes() == b"v" * (2 * PAGE)
    assert list(shared.iterdir()) == []

    def replaced(*args: Any, **kw: Any) -> tuple[int, str]:
        fd, path = real(*args, **kw)
        if kw.get("prefix") == ".kvshm-odirect-":
            os.unlink(path)  # a regular file of the other user's in its place
            Path(path).write_bytes(b"w" * PAGE)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", replaced)
    with pytest.raises(ConfigError, match="probe file was replaced while it was open"):
        check_directory(str(shared), PAGE, direct=True)
    monkeypatch.undo()
    assert list(shared.iterdir()) == []


def _probe_direct_ok(directory: Path) -> bool:
    try:
        fd = os.open(directory / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(directory / "probe")
    return True


def test_check_directory_refuses_a_file(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        check_directory(str(f), PAGE, direct=True)
    with pytest.raises(ConfigError, match="is not a directory"):
        check_directory(str(tmp_path / "missing"), PAGE, direct=True)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody can create files in: immutable (root ignores mode bits), or
    mode 0500 for other users."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:
        chattr = shutil.which("chattr")
        if chattr is None or subprocess.run([chattr, "+i", str(d)],
                                            capture_output=True).returncode != 0:
            pytest.skip("root without chattr +i: no way to make a read-only directory")
        yield d
        subprocess.run([chattr, "-i", str(d)], check=True)
    else:
        d.chmod(0o500)
        yield d
        d.chmod(0o700)


def test_check_directory_refuses_a_read_only_directory(read_only_dir: Path) -> None:
    with pytest.raises(ConfigError, match="is not writable"):
        check_directory(str(read_only_dir), PAGE, direct=True)


def test_check_directory_refuses_too_little_space_saying_needed_and_free(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    need = st.f_bavail * st.f_frsize + (1 << 40)
    with pytest.raises(ConfigError, match=rf"needs {need} bytes, \d+ are free"):
        check_directory(str(tmp_path), need, direct=True)


def test_check_directory_counts_the_reused_slab_as_free(tmp_path: Path) -> None:
    path = tmp_path / "s.slab"
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 1 << 20)
    st = os.statvfs(tmp_path)
    need = st.f_bavail * st.f_frsize + (1 << 19)
    with pytest.raises(ConfigError, match="not enough free space"):
        check_directory(str(tmp_path), need, direct=True)
    check_directory(str(tmp_path), need, direct=True, reuse_path=str(path))


def test_check_directory_refuses_a_filesystem_without_o_direct(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that refuses O_DIRECT (open returns EINVAL, as overlayfs does; faked
    at the syscall seam): refused with the buffered hint, unless buffered I/O was asked."""
    real_open = os.open

    def open_no_direct(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_no_direct)
    with pytest.raises(ConfigError, match="refuses O_DIRECT.*set disk_io=buffered to use "
                                          "the page cache"):
        check_directory(str(tmp_path), PAGE, direct=True)
    check_directory(str(tmp_path), PAGE, direct=False)
    with pytest.raises(ConfigError, match="disk_io=buffered"):
        SlabFile.open(str(tmp_path / "s.slab"), SlabSpec(FP, 0, 1, 2, PAGE), direct=True)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_an_open_that_creates_the_file_then_refuses_o_direct_leaves_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """open(2) with O_CREAT | O_DIRECT on a filesystem without O_DIRECT may create the
    file and then fail with EINVAL (faked at the syscall seam: tmpfs here accepts
    O_DIRECT). The refusal names the fix, and the file it created is removed -- it was
    left behind, an empty slab file in the user's directory."""
    real_open = os.open

    def create_then_refuse(path: str, flags: int, mode: int = 0o777) -> int:
        os.close(real_open(path, flags & ~os.O_DIRECT, mode))
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    path = tmp_path / "s.slab"
    monkeypatch.setattr(os, "open", create_then_refuse)
    with pytest.raises(ConfigError, match="refuses O_DIRECT, set disk_io=buffered"):
        SlabFile.open(str(path), SlabSpec(FP, 0, 1, 4, PAGE), direct=True)
    monkeypatch.undo()
    assert not path.exists()
