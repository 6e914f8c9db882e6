"""The local disk tier's scheduler side (``kvshm.offload.disk``), narrated with exact
block ids, slot ids and ref counts, on the real manager, CPU pool and slot table.

The workers are played by the test: it acks each Disk job per rank (ok or not). The
bytes moving between host rows and slab slots are tested with real workers in
``tests/test_disk_tier.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from manager_rig import BS, Req, Rig, refs

from kvshm.ipc.protocol import Disk, DiskOp, unpack_ids
from kvshm.offload.disk import MAX_DISK_BLOCKS, DiskBook, warm_table
from kvshm.offload.manager import OffloadManager
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote_puts import remote_hash

WORLD = 2


class DiskRig(Rig):
    """The manager rig with a disk tier of ``slots`` slots (LRU slot table)."""

    def __init__(self, *, cpu: int = 4, slots: int = 4, window: int | None = None,
                 clock: list[float] | None = None, write_through: bool = False,
                 max_window: int | None = None, max_job: int = MAX_DISK_BLOCKS) -> None:
        super().__init__(cpu=cpu, gpu=16, world_size=WORLD)
        table = BlockPool(slots)
        self.now = clock if clock is not None else [0.0]

        def make(pool: BlockPool, gs: object, jobs: object) -> DiskBook:
            return DiskBook(pool, gs, jobs, table, window=window,  # type: ignore[arg-type]
                            clock=lambda: self.now[0], pause_s=30.0,
                            write_through=write_through, max_window=max_window,
                            max_job_blocks=max_job)
        self.m = OffloadManager(self.cpu, self.gpu, block_size=BS, world_size=WORLD,
                                disk=make)

    @property
    def book(self) -> DiskBook:
        assert self.m.disk is not None
        return self.m.disk

    @property
    def slots(self) -> BlockPool:
        """The book's slot table (a warm start swaps in another: ``end_warming``)."""
        return self.book.slots

    def store(self, req: Req) -> tuple[list[int], tuple[Disk, ...]]:
        """``req`` computed all its full blocks and finished; its store acked by both
        ranks. Returns its CPU ids and the disk jobs of the storing step."""
        g = self.alloc(len(req.h), req.h)
        p = self.step(req.sched(g, confirmed=len(req.toks), new=True))
        assert p.store is not None
        self.ack(p.store, ranks=range(WORLD))
        self.m.finished(req.rid, len(req.toks), [g])
        self.gpu.free(reversed(g))
        return unpack_ids(p.store.dst_ids), p.disk

    def ack_disk(self, msg: Disk, oks: Sequence[bool] = (True, True)) -> None:
        for rank, ok in enumerate(oks):
            self.m.on_done(msg.job_id, rank, ok)
            self.m.check_invariants()

    def on_disk(self, req: Req) -> None:
        """Write every block of ``req`` to the disk (stored, written back, acked), then
        drop the CPU copies (as if evicted)."""
        self.store(req)
        for msg in self.step().disk:
            self.ack_disk(msg)
        for h in req.h:
            c = self.cpu.get_cached(h)
            if c is not None:
                self.cpu.remove_hashes(c)
        self.m.check_invariants()


def test_a_block_about_to_be_evicted_is_written_back_and_indexed_only_after_every_rank_acked(
) -> None:
    """A stores 2 blocks into CPU 0, 1 (freed tail first: the CPU tier would reuse 2, 3,
    then 1, then 0). With a write-back window of 3, the next plan writes only CPU 1 --
    the one cached block among the next three victims -- into fresh slot 0: CPU 1 is
    pinned (ref 1) and slot 0 pinned without a hash (a slot being written is never
    read). Rank 0's ack indexes nothing; rank 1's indexes slot 0 under A's second
    block, unpins both, and CPU 1 goes back as the next block to reuse (the disk holds
    it now). Later plans do not write it again."""
    rig = DiskRig(window=3)
    a = Req("a", 9)
    cpu, disk = rig.store(a)
    assert cpu == [0, 1] and disk == ()                         # still being stored then
    assert list(rig.cpu.iter_free_from_lru()) == [2, 3, 1, 0]
    (w,) = rig.step().disk
    assert w.op is DiskOp.WRITE and unpack_ids(w.cpu_ids) == [1] and unpack_ids(w.slots) == [0]
    assert w.hashes == remote_hash(a.h[1]) and w.hash_len == 32
    assert refs(rig.cpu, [0, 1]) == [0, 1] and rig.slots.ref_cnt(0) == 1
    assert rig.slots.block_hashes(0) == ()
    rig.m.on_done(w.job_id, 0, True)
    rig.m.check_invariants()
    assert rig.slots.num_hashes == 0 and refs(rig.cpu, [1]) == [1]
    rig.m.on_done(w.job_id, 1, True)
    rig.m.check_invariants()
    assert rig.slots.get_cached(remote_hash(a.h[1])) == 0 and rig.slots.ref_cnt(0) == 0
    assert refs(rig.cpu, [0, 1]) == [0, 0] and rig.cpu.get_cached(a.h[1]) == 1
    assert next(rig.cpu.iter_free_from_lru()) == 1
    assert rig.step().disk == () and rig.book.counters.written_blocks == 1


def test_a_cpu_miss_the_disk_holds_is_read_into_fresh_blocks_then_an_ordinary_hit() -> None:
    """A's 2 blocks are on disk (slots 0, 1) and gone from the CPU tier. R (same tokens)
    misses the CPU tier: its lookup asks the disk and says "ask again"; the next plan
    READs slots 0, 1 into fresh CPU blocks (ref 1, no hash; the slots pinned). Rank 0's
    ack indexes nothing; rank 1's indexes both, held for R (ref 1), and unpins the
    slots (still indexed). R's next lookup is an ordinary 8-token CPU hit: its own pin
    (ref 1) once the read's goes."""
    rig = DiskRig()
    a = Req("a", 9)
    rig.on_disk(a)
    assert rig.slots.num_hashes == 2 and rig.cpu.num_hashes == 0
    r = Req("r", 9)
    assert rig.m.lookup(r.view(), 0) is None
    (rd,) = rig.step().disk
    assert rd.op is DiskOp.READ and sorted(unpack_ids(rd.slots)) == [0, 1]
    got = unpack_ids(rd.cpu_ids)
    assert unpack_ids(rd.slots) == [rig.slots.get_cached(remote_hash(h)) for h in a.h]
    assert refs(rig.cpu, got) == [1, 1] and rig.cpu.num_hashes == 0
    assert [rig.slots.ref_cnt(s) for s in (0, 1)] == [1, 1]
    assert rig.m.lookup(r.view(), 0) is None                     # being read
    rig.m.on_done(rd.job_id, 0, True)
    rig.m.check_invariants()
    assert rig.cpu.num_hashes == 0
    rig.m.on_done(rd.job_id, 1, True)
    rig.m.check_invariants()
    assert [rig.cpu.get_cached(h) for h in a.h] == got and refs(rig.cpu, got) == [1, 1]
    assert [rig.slots.ref_cnt(s) for s in (0, 1)] == [0, 0] and rig.slots.num_hashes == 2
    assert rig.m.lookup(r.view(), 0) == 2 * BS
    rig.m.check_invariants()
    assert refs(rig.cpu, got) == [1, 1]                          # the hit's pin only
    assert rig.book.counters.hit_blocks == 2 and rig.book.counters.get_jobs == 1


def test_a_partial_cpu_hit_holds_its_prefix_while_the_disk_reads_the_rest() -> None:
    """A's 3 blocks are on disk; the CPU tier still holds the first two (CPU 0, 1) but
    lost the third. R's lookup finds a 2-block CPU hit that ends short of the 3 the
    prompt allows: the disk holds the third, so the lookup says "ask again" holding CPU
    0, 1 (ref 1: the READ's allocation must not evict the prefix it extends). Once the
    READ is done on both ranks, R's next lookup hits all 12 tokens and the hold goes
    (each block: the hit's own pin)."""
    rig = DiskRig(cpu=5, slots=4)
    a = Req("a", 13)
    cpu, _ = rig.store(a)
    for msg in rig.step().disk:
        rig.ack_disk(msg)
    assert rig.slots.num_hashes == 3
    rig.cpu.remove_hashes(cpu[2])
    r = Req("r", 13)
    assert rig.m.lookup(r.view(), 0) is None
    assert refs(rig.cpu, cpu[:2]) == [1, 1]                      # held
    (rd,) = rig.step().disk
    assert rd.op is DiskOp.READ and unpack_ids(rd.slots) == [
        rig.slots.get_cached(remote_hash(a.h[2]))]
    rig.ack_disk(rd)
    assert rig.m.lookup(r.view(), 0) == 3 * BS
    rig.m.check_invariants()
    assert refs(rig.cpu, cpu[:2]) == [1, 1]
    assert refs(rig.cpu, unpack_ids(rd.cpu_ids)) == [1]


def test_a_failed_read_drops_its_slots_and_the_request_recomputes() -> None:
    """Rank 1 fails R's READ (a header or CRC mismatch): the CPU blocks stay pinned until
    rank 0 acked too, then go back unindexed; slots 0, 1 are suspect: dropped from the
    index (ref 0, no hash). R's lookup says 0 (recompute), counted."""
    rig = DiskRig()
    a = Req("a", 9)
    rig.on_disk(a)
    r = Req("r", 9)
    assert rig.m.lookup(r.view(), 0) is None
    (rd,) = rig.step().disk
    got = unpack_ids(rd.cpu_ids)
    rig.m.on_done(rd.job_id, 1, False)
    rig.m.check_invariants()
    assert refs(rig.cpu, got) == [1, 1]                          # rank 0 may still read
    rig.m.on_done(rd.job_id, 0, True)
    rig.m.check_invariants()
    assert refs(rig.cpu, got) == [0, 0] and rig.cpu.num_hashes == 0
    assert rig.slots.num_hashes == 0 and [rig.slots.ref_cnt(s) for s in (0, 1)] == [0, 0]
    assert rig.m.lookup(r.view(), 0) == 0
    c = rig.book.counters
    assert (c.get_failed_jobs, c.get_failed_blocks, c.dropped_slots) == (1, 2, 2)


def test_a_slot_being_read_is_never_reused_by_a_write() -> None:
    """Two slots, both holding A's blocks and both being read for R (pinned). B's blocks
    then near eviction: the write-back finds no free slot, writes nothing and counts the
    declined blocks; once the READ is done, the next plan writes B's blocks over the
    least recently used slots."""
    rig = DiskRig(cpu=4, slots=2)
    a = Req("a", 9)
    rig.on_disk(a)
    r = Req("r", 9)
    assert rig.m.lookup(r.view(), 0) is None
    (rd,) = rig.step().disk
    assert rd.op is DiskOp.READ
    b = Req("b", 9, base=100)
    rig.store(b)
    assert rig.step().disk == () and rig.book.counters.write_declined_no_slot == 2
    assert [rig.slots.ref_cnt(s) for s in (0, 1)] == [1, 1]
    rig.ack_disk(rd)
    writes = [m for m in rig.step().disk if m.op is DiskOp.WRITE]
    assert sorted(s for m in writes for s in unpack_ids(m.slots)) == [0, 1]


def test_a_rank_declared_dead_during_a_write_quarantines_its_slot_and_row_until_fenced(
) -> None:
    """Rank 1 is declared dead while CPU 1 is written into slot 0: the job fails at once,
    but rank 1 may still be writing, so after rank 0's ack slot 0 and CPU 1 stay pinned
    (quarantined, counted); rank 1's fence releases both, slot 0 unindexed."""
    rig = DiskRig(window=3)
    rig.store(Req("a", 9))
    (w,) = rig.step().disk
    rig.m.rank_failed(1)
    rig.m.check_invariants()
    rig.m.on_done(w.job_id, 0, True)
    rig.m.check_invariants()
    assert rig.slots.ref_cnt(0) == 1 and refs(rig.cpu, [1]) == [1]
    assert rig.book.quarantined_slots() == 1 and rig.m.quarantined_blocks() == (0, 1)
    rig.m.rank_fenced(1)
    rig.m.check_invariants()
    assert rig.slots.ref_cnt(0) == 0 and rig.slots.num_hashes == 0
    assert refs(rig.cpu, [1]) == [0] and rig.book.quarantined_slots() == 0


def test_three_failed_writes_pause_write_back_and_reads_go_on() -> None:
    """A disk that fails every WRITE (full: ENOSPC): after three failed jobs in a row,
    write-back pauses for 30 s (counted; plans write nothing), while a READ of what the
    disk already holds still runs; after the pause it tries again."""
    now = [0.0]
    rig = DiskRig(cpu=8, slots=8, clock=now)
    a = Req("a", 9)
    rig.on_disk(a)
    b = Req("b", 17, base=100)
    rig.store(b)
    for _ in range(3):
        (w,) = rig.step().disk
        assert w.op is DiskOp.WRITE
        rig.ack_disk(w, (False, True))
    c = rig.book.counters
    assert (c.write_failed_jobs, c.writes_paused) == (3, 1)
    assert rig.step().disk == () and c.write_skipped_paused == 1
    r = Req("r", 9)
    assert rig.m.lookup(r.view(), 0) is None
    (rd,) = rig.step().disk
    assert rd.op is DiskOp.READ
    now[0] = 31.0
    rig.ack_disk(rd)
    assert any(m.op is DiskOp.WRITE for m in rig.step().disk)


def test_reset_forgets_every_slot() -> None:
    """A reset drops the disk index with the CPU one (the engine's KV may mean something
    else now): a later lookup misses both."""
    rig = DiskRig()
    a = Req("a", 9)
    rig.on_disk(a)
    assert rig.m.reset() and rig.slots.num_hashes == 0
    assert rig.m.lookup(Req("r", 9).view(), 0) == 0


def test_a_write_and_a_read_a_reset_abandoned_count_as_abandoned_not_failed() -> None:
    """A reset abandons a WRITE and a READ that then succeed on both ranks. They were
    counted as failures (``write_failed_jobs`` 1, ``get_failed_jobs`` 1) while the
    manager's ``jobs_failed`` said 0 -- an operator saw disk failures that never
    happened (found by a hostile review). Now ``write_abandoned_jobs`` and
    ``get_abandoned_jobs`` count them, the failure counters stay 0, nothing is
    indexed, and write-back is not brought nearer its pause."""
    rig = DiskRig(cpu=4, window=1, max_window=8, write_through=True)
    b = Req("b", 9, base=100)
    rig.on_disk(b)                                              # B's blocks only on disk
    assert rig.m.lookup(b.view(), 0) is None
    (read,) = rig.step().disk
    rig.store(Req("a", 9))
    (write,) = rig.step().disk
    assert read.op is DiskOp.READ and write.op is DiskOp.WRITE
    assert rig.m.reset() is False
    rig.ack_disk(write)
    rig.ack_disk(read)
    assert rig.m.reset_done() and rig.slots.num_hashes == 0 and rig.cpu.num_hashes == 0
    c = rig.book.counters
    assert (c.write_abandoned_jobs, c.get_abandoned_jobs) == (1, 1)
    assert (c.write_failed_jobs, c.write_failed_blocks) == (0, 0)
    assert (c.get_failed_jobs, c.get_failed_blocks) == (0, 0)
    assert rig.m.counters.jobs_failed == 0 and rig.m.counters.jobs_abandoned == 2


def test_a_write_a_rank_failed_inside_a_resets_window_is_a_failure() -> None:
    """The other side of the rule above: a reset abandons a WRITE and rank 1 then fails
    it (an I/O error). That is a disk failure -- ``write_failed_jobs`` 1, fed to
    write-back's pause -- not an abandoned job that merely ended."""
    rig = DiskRig(cpu=4, window=1, max_window=8, write_through=True)
    rig.store(Req("a", 9))
    (write,) = rig.step().disk
    assert rig.m.reset() is False
    rig.ack_disk(write, (True, False))
    c = rig.book.counters
    assert (c.write_failed_jobs, c.write_abandoned_jobs) == (1, 0)
    assert rig.m.reset_done() and rig.slots.num_hashes == 0


def test_a_write_in_flight_at_the_close_is_abandoned_not_a_disk_failure() -> None:
    """The engine closes with a WRITE in flight; once its ranks are reaped
    (``close([0, 1])``) the job ends as if acked. That fence acked it failed, which
    counted a failed write of the disk (``write_failed_jobs``, fed to the pause) for
    what was only the close (a review). Now it is counted abandoned; every slot and
    CPU pin goes."""
    rig = DiskRig(cpu=4, window=1, max_window=8, write_through=True)
    rig.store(Req("a", 9))
    (write,) = rig.step().disk
    assert write.op is DiskOp.WRITE
    rig.m.close([0, 1])
    c = rig.book.counters
    assert (c.write_failed_jobs, c.write_abandoned_jobs) == (0, 1)
    assert rig.slots.num_pinned == 0 and rig.m.pins_held() == 0
    rig.m.check_invariants()


def test_warm_slots_serve_a_hit_at_once() -> None:
    """Slots 2 and 3 indexed at start from the slabs' headers (a restarted engine): R's
    first lookup reads them; then it is an ordinary CPU hit."""
    rig = DiskRig()
    a = Req("a", 9)
    rig.book.warm({2: remote_hash(a.h[0]), 3: remote_hash(a.h[1])})
    rig.m.check_invariants()
    assert rig.book.counters.warm_slots == 2 and rig.slots.num_hashes == 2
    r = Req("r", 9)
    assert rig.m.lookup(r.view(), 0) is None
    (rd,) = rig.step().disk
    assert unpack_ids(rd.slots) == [2, 3]
    rig.ack_disk(rd)
    assert rig.m.lookup(r.view(), 0) == 2 * BS


def test_a_warming_book_writes_nothing_and_indexes_the_scan_when_it_ends() -> None:
    """The start's scan of the slabs runs on a thread (``kvshm.engine.warm_scan``): while
    the book warms, a store's victim is lost (``evicted_lost``) and each plan's
    write-back is skipped (``write_skipped_warming``) -- a slot written meanwhile could
    be read by the scan before or after its new header -- and a lookup finds nothing.
    The scan's result, once it ends, indexes slots 2 and 3; a header whose hash is no
    disk hash (8 bytes: no rank writes that) is left out and counted with the slots the
    ranks disagree on, never raised into the step that applies it. The table is built
    off the scheduler's thread (``warm_table``) and swapped in. Then R's lookup reads
    slots 2 and 3, and the plans write again."""
    rig = DiskRig(cpu=4, window=1, max_window=8)
    book, c = rig.book, rig.book.counters
    book.begin_warming()
    assert book.warming and book.statistics()["warming"] == 1
    a = Req("a", 9)
    for i, rid in enumerate("xyz"):            # z evicts x's two blocks: lost while warming
        rig.store(Req(rid, 9, base=100 * (i + 1)))
    assert rig.step().disk == ()
    assert (c.write_jobs, c.evicted_lost) == (0, 2) and c.write_skipped_warming >= 2
    assert rig.m.lookup(Req("q", 9).view(), 0) == 0
    table = warm_table(4, {2: remote_hash(a.h[0]), 3: remote_hash(a.h[1]), 5: b"8 bytes!"})
    assert book.end_warming(table, disagreed=1, seconds=0.25) is True
    assert rig.slots is table.slots          # swapped in, not indexed inside the step
    assert not book.warming and book.statistics()["warming"] == 0
    assert (c.warm_slots, c.warm_disagreed, c.warm_scan_ms) == (2, 2, 250)
    assert sorted(rig.slots.cached_keys) == sorted(remote_hash(h) for h in a.h[:2])
    rig.m.check_invariants()
    r = Req("r", 9)
    assert rig.m.lookup(r.view(), 0) is None
    jobs = rig.step().disk
    (rd,) = [d for d in jobs if d.op is DiskOp.READ]
    assert unpack_ids(rd.slots) == [2, 3] and c.write_jobs > 0  # writes again
    for d in jobs:
        rig.ack_disk(d)
    assert rig.m.lookup(r.view(), 0) == 2 * BS


def test_a_reset_while_the_disk_warms_voids_the_scans_result() -> None:
    """A reset (vLLM's ``reset_prefix_cache``: e.g. new weights) while the start's scan
    still runs: the scan's result names blocks from before the reset, so it is void --
    ``end_warming`` indexes nothing (``warm_voided`` 1), and writes resume at the reset
    (the result they could race with will not be used)."""
    rig = DiskRig()
    book, c = rig.book, rig.book.counters
    book.begin_warming()
    assert rig.m.reset() is True and rig.m.reset_done()
    assert not book.warming and c.warm_voided == 1
    a = Req("a", 9)
    table = warm_table(4, {2: remote_hash(a.h[0]), 3: remote_hash(a.h[1])})
    assert book.end_warming(table, disagreed=0) is False
    assert rig.slots is not table.slots and rig.slots.num_hashes == 0 and c.warm_slots == 0
    assert rig.m.lookup(Req("r", 9).view(), 0) == 0
    rig.m.check_invariants()


def test_two_requests_asking_for_the_same_disk_blocks_in_one_step_read_them_once() -> None:
    """R and S (same prompt) both miss the CPU tier before a plan: R's lookup claims the
    disk prefix, S asks again (counted) instead of reading it a second time; the plan
    has one READ; once it is done, both hit the same CPU blocks."""
    rig = DiskRig()
    a = Req("a", 9)
    rig.on_disk(a)
    r, s = Req("r", 9), Req("s", 9)
    assert rig.m.lookup(r.view(), 0) is None and rig.m.lookup(s.view(), 0) is None
    assert rig.book.counters.asked_again == 1
    (rd,) = rig.step().disk
    rig.ack_disk(rd)
    assert rig.m.lookup(r.view(), 0) == 2 * BS and rig.m.lookup(s.view(), 0) == 2 * BS
    rig.m.check_invariants()
    assert refs(rig.cpu, unpack_ids(rd.cpu_ids)) == [2, 2]
    assert rig.book.counters.get_jobs == 1


def test_write_through_writes_every_stored_block_and_leaves_it_where_it_was() -> None:
    """With write-through and a scan window of 1 (the eviction scan sees only the
    uncached CPU 2 at the front), A's stored blocks CPU 0, 1 are written anyway, in one job,
    into slots 0, 1, indexed once both ranks acked; freed normally afterwards (cached, at
    the MRU end: they were not about to be evicted), unlike a write-back's."""
    rig = DiskRig(cpu=4, window=1, max_window=8, write_through=True)
    a = Req("a", 9)
    cpu, _ = rig.store(a)
    assert cpu == [0, 1]
    (w,) = rig.step().disk
    assert sorted(unpack_ids(w.cpu_ids)) == [0, 1] and unpack_ids(w.slots) == [0, 1]
    rig.ack_disk(w)
    assert rig.slots.num_hashes == 2 and refs(rig.cpu, cpu) == [0, 0]
    assert list(rig.cpu.iter_free_from_lru())[:2] == [2, 3]
    assert rig.step().disk == ()


def test_write_through_waits_for_a_free_slot_instead_of_dropping_its_blocks() -> None:
    """Write-through with 2 slots, both pinned by R's READ of X. A stores 2 blocks: the
    plan has no free slot, so it takes neither off the write-through queue (before, it
    took both and the write declined them: lost for good, counted
    ``write_declined_no_slot``). Once the READ is done, the next plan writes A's
    blocks (the scan window of 1 sees only an uncached block: write-through alone)."""
    rig = DiskRig(cpu=8, slots=2, window=1, max_window=8, write_through=True)
    x = Req("x", 9, base=700)
    rig.on_disk(x)
    r = Req("r", 9, base=700)
    assert rig.m.lookup(r.view(), 0) is None
    (rd,) = rig.step().disk
    assert rd.op is DiskOp.READ and rig.slots.num_free == 0
    a = Req("a", 9)
    cpu, _ = rig.store(a)
    assert rig.step().disk == ()
    assert rig.book.counters.write_declined_no_slot == 0
    rig.ack_disk(rd)
    (w,) = rig.step().disk
    assert w.op is DiskOp.WRITE and sorted(unpack_ids(w.cpu_ids)) == sorted(cpu)
    rig.ack_disk(w)
    assert all(rig.slots.get_cached(remote_hash(h)) is not None for h in a.h)


def test_a_block_evicted_before_write_back_reached_it_is_written_down_before_its_reuse(
) -> None:
    """Write-back may not reach a block before an allocation takes it (here a window of
    1 that scans only uncached CPU 2). A's 2 blocks sit in CPU 0, 1 (reuse order 2, 3,
    1, 0). B's store of 3 blocks takes CPU 2, 3 and 1 -- A's second block, on no disk:
    the same step writes it down, a WRITE of CPU 1 into slot 0 under A's second hash,
    posted before the store (``plan.disk`` goes out first; each rank's store waits for
    it). CPU 1 carries both pins: the store's and the WRITE's (ref 2 until the store's
    ack, 1 after it). Both ranks' WRITE acks index slot 0 under A's second block and
    unpin CPU 1, which keeps B's third block. R (A's tokens) then hits CPU 0 and asks
    the disk for slot 0: the READ's fresh block is CPU 3 (B's second block, on no
    disk), so the plan is the WRITE of CPU 3 into slot 1, then the READ of slot 0 into
    CPU 3 (ref 2: the READ's and the WRITE's)."""
    rig = DiskRig(cpu=4, slots=8, window=1, max_window=1)
    a, b = Req("a", 9), Req("b", 13, base=500)
    assert rig.store(a) == ([0, 1], ())
    assert rig.step().disk == ()                                 # window 1: only CPU 2
    g = rig.alloc(3, b.h)
    p = rig.step(b.sched(g, confirmed=len(b.toks), new=True))
    assert p.store is not None and unpack_ids(p.store.dst_ids) == [2, 3, 1]
    (w,) = p.disk
    assert (w.op, unpack_ids(w.cpu_ids), unpack_ids(w.slots)) == (DiskOp.WRITE, [1], [0])
    assert w.hashes == remote_hash(a.h[1]) and rig.cpu.get_cached(a.h[1]) is None
    assert refs(rig.cpu, [0, 1, 2, 3]) == [0, 2, 1, 1] and rig.slots.ref_cnt(0) == 1
    rig.ack(p.store, ranks=range(WORLD))
    rig.m.finished(b.rid, len(b.toks), [g])
    rig.gpu.free(reversed(g))
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1, 2, 3]) == [0, 1, 0, 0] and rig.cpu.get_cached(b.h[2]) == 1
    rig.ack_disk(w)
    assert rig.slots.get_cached(remote_hash(a.h[1])) == 0 and rig.slots.ref_cnt(0) == 0
    assert refs(rig.cpu, [0, 1, 2, 3]) == [0, 0, 0, 0] and rig.cpu.get_cached(b.h[2]) == 1
    c = rig.book.counters
    assert (c.evicted_written, c.evicted_lost, c.written_blocks) == (1, 0, 1)

    r = Req("r", 9)
    assert rig.m.lookup(r.view(), 0) is None                     # CPU 0 held, slot 0 next
    w2, rd = rig.step().disk
    assert (w2.op, unpack_ids(w2.cpu_ids), unpack_ids(w2.slots)) == (DiskOp.WRITE, [3], [1])
    assert w2.hashes == remote_hash(b.h[1])
    assert (rd.op, unpack_ids(rd.cpu_ids), unpack_ids(rd.slots)) == (DiskOp.READ, [3], [0])
    assert refs(rig.cpu, [0, 1, 2, 3]) == [1, 0, 0, 2] and c.evicted_written == 2
    rig.ack_disk(rd)
    rig.ack_disk(w2)
    assert rig.slots.get_cached(remote_hash(b.h[1])) == 1
    assert rig.m.lookup(r.view(), 0) == 2 * BS
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1, 2, 3]) == [1, 0, 0, 1]           # the hit's pins only


def test_a_victim_without_a_free_slot_is_lost_and_counted() -> None:
    """Every slot pinned by a READ in flight (X's 2 blocks, the disk's 2 slots): B's
    store evicts a cached block with no slot to write it into -- no WRITE, counted
    lost (once: not as a declined write too); the store goes on."""
    rig = DiskRig(cpu=4, slots=2)
    x = Req("x", 9, base=900)
    rig.on_disk(x)                                               # slots 0, 1 hold X
    assert rig.m.lookup(Req("rx", 9, base=900).view(), 0) is None
    (rd,) = rig.step().disk                                      # slot 0 pinned: no free
    assert rd.op is DiskOp.READ and rig.slots.num_free == 0
    a, b = Req("a", 9), Req("b", 13, base=500)
    rig.store(a)
    c = rig.book.counters
    lost, declined = c.evicted_lost, c.write_declined_no_slot
    g = rig.alloc(3, b.h)
    p = rig.step(b.sched(g, confirmed=len(b.toks), new=True))
    assert p.store is not None and all(m.op is not DiskOp.WRITE for m in p.disk)
    assert c.evicted_lost > lost and c.write_declined_no_slot == declined
    rig.m.check_invariants()


def test_a_block_a_remote_get_evicts_is_written_down_before_the_get_fills_its_row(
) -> None:
    """The GET's allocation is an allocation like a store's: what it evicts must reach
    the disk first. CPU tier of 3 blocks, disk of 8 slots (write-back window 1: the scan
    sees only uncached CPU 2), a remote tier in write-through. A's 2 blocks are stored
    into CPU 0, 1, put and published (ref 0 again, cached; reuse order 2, 1, 0). R (other
    tokens) misses CPU and disk and finds 2 blocks on the server: the plan's GET takes
    CPU 2 and CPU 1 -- A's second block, on no disk -- so the same plan writes it down:
    a WRITE of CPU 1 into slot 0 under A's second hash, which the runtime posts before
    the GET (``plan.disk`` first; each rank's GET waits for the WRITE that still reads
    the row). CPU 1 carries both pins (ref 2) and no hash. The WRITE's acks index slot 0
    and drop its pin (ref 1: the GET's); the GET's acks index R's blocks in CPU 2, 1."""
    from test_remote_book import HeldIndex, key, rkey

    from kvshm.config import RemoteMode
    from kvshm.offload.remote import RemoteBook

    index = HeldIndex()
    rig = Rig(cpu=3, gpu=16, world_size=WORLD)
    slots = BlockPool(8)

    def disk(pool: BlockPool, gs: object, jobs: object) -> DiskBook:
        return DiskBook(pool, gs, jobs, slots, window=1, max_window=1,  # type: ignore[arg-type]
                        clock=lambda: 0.0)

    def remote(pool: BlockPool, gs: object, jobs: object) -> RemoteBook:
        return RemoteBook(pool, gs, jobs, index, key,  # type: ignore[arg-type]
                          mode=RemoteMode.WRITE_THROUGH, clock=lambda: 0.0)
    rig.m = OffloadManager(rig.cpu, rig.gpu, block_size=BS, world_size=WORLD, disk=disk,
                           remote=remote)
    a, r = Req("a", 9), Req("r", 9, base=500)
    g = rig.alloc(2, a.h)
    p = rig.step(a.sched(g, confirmed=len(a.toks), new=True))
    assert p.store is not None and unpack_ids(p.store.dst_ids) == [0, 1]
    rig.ack(p.store, ranks=range(WORLD))
    rig.m.finished(a.rid, len(a.toks), [g])
    rig.gpu.free(reversed(g))
    p = rig.step()
    (put,) = p.remote
    assert p.disk == () and unpack_ids(put.cpu_ids) == [0, 1]       # window 1: CPU 2 only
    for rank in range(WORLD):
        rig.m.on_done(put.job_id, rank, True)
    assert refs(rig.cpu, [0, 1, 2]) == [0, 0, 0] and index.published == [rkey(a.h[0]),
                                                                        rkey(a.h[1])]
    index.ready.update(rkey(h) for h in r.h)
    assert rig.m.lookup(r.view(), 0) is None
    index.answer_all()
    assert rig.m.lookup(r.view(), 0) is None
    p = rig.step()
    (get,) = p.remote
    assert get.op.name == "GET" and unpack_ids(get.cpu_ids) == [2, 1]
    (w,) = p.disk
    assert (w.op, unpack_ids(w.cpu_ids), unpack_ids(w.slots)) == (DiskOp.WRITE, [1], [0])
    assert w.hashes == remote_hash(a.h[1]) and rig.cpu.get_cached(a.h[1]) is None
    assert refs(rig.cpu, [0, 1, 2]) == [0, 2, 1] and slots.ref_cnt(0) == 1
    rig.m.check_invariants()
    book = rig.m.disk
    assert book is not None
    c = book.counters
    assert (c.evicted_written, c.evicted_lost) == (1, 0)
    for rank in range(WORLD):
        rig.m.on_done(w.job_id, rank, True)
    rig.m.check_invariants()
    assert slots.get_cached(remote_hash(a.h[1])) == 0 and refs(rig.cpu, [0, 1, 2]) == [0, 1, 1]
    for rank in range(WORLD):
        rig.m.on_done(get.job_id, rank, True)
    rig.m.check_invariants()
    assert rig.cpu.get_cached(r.h[0]) == 2 and rig.cpu.get_cached(r.h[1]) == 1


def test_two_cpu_copies_of_one_block_evicted_together_are_written_once() -> None:
    """Hazard "two CPU copies of one block evicted together". A's block K is on disk
    (slot 0) and nowhere in the CPU tier. R misses on the CPU and reads K from disk into
    CPU 0; meanwhile B, the same prompt, computes K and stores it into CPU 1. Both
    complete: CPU 0 and CPU 1 both carry K. K then leaves the slot table (later writes
    took slot 0). One allocation of all 3 CPU blocks evicts both copies: the write-down
    writes K once (CPU 0 into slot 1; CPU 1 counted as on disk), where it used to write
    both (slots 1 and 2 for one block; with one block a job, two WRITE jobs of K, the
    first to end dropping K from the keys being written while the second was out)."""
    from kvshm.types import StepInput

    rig = DiskRig(cpu=3, slots=3)
    a = Req("a", 5)
    k = a.h[0]
    rig.on_disk(a)
    assert rig.slots.get_cached(remote_hash(k)) == 0 and rig.cpu.num_hashes == 0
    r = Req("r", 5)
    assert rig.m.lookup(r.view(), 0) is None
    (rd,) = [m for m in rig.m.plan_reads() if m.op is DiskOp.READ]
    assert unpack_ids(rd.cpu_ids) == [0]
    cpu_b, _ = rig.store(Req("b", 5))
    assert cpu_b == [1]
    rig.ack_disk(rd)
    assert [c for c in range(3) if k in rig.cpu.block_hashes(c)] == [0, 1]
    assert rig.m.lookup(r.view(), 0) == BS
    rig.m.finished("r", 5, [[]])
    rig.slots.remove_hashes(0)                                    # K leaves the disk
    c = Req("c", 13, base=1000)
    g = rig.alloc(3, c.h)
    before = rig.book.counters.evicted_on_disk
    p = rig.m.build_step(StepInput(99, (c.sched(g, confirmed=13, new=True),), (),
                                   frozenset()))
    (w,) = [m for m in p.disk if m.op is DiskOp.WRITE]
    assert unpack_ids(w.cpu_ids) == [0] and unpack_ids(w.slots) == [1]
    assert rig.book.counters.evicted_on_disk == before + 1        # CPU 1: the same block
    rig.m.check_invariants()
    rig.ack_disk(w)
    assert [s for s in range(3) if remote_hash(k) in rig.slots.block_hashes(s)] == [1]


def _with_remote(rig: DiskRig, index: Any, now: list[float], *,
                 write_through: bool = False) -> None:
    """Give ``rig`` a manager with its disk slots and a remote tier on ``index`` (blocks
    written to the server only on eviction), both on the clock ``now``."""
    from test_remote_book import key

    from kvshm.config import RemoteMode
    from kvshm.offload.remote import RemoteBook

    def disk(pool: BlockPool, gs: object, jobs: object) -> DiskBook:
        return DiskBook(pool, gs, jobs, rig.slots, clock=lambda: now[0],  # type: ignore[arg-type]
                        write_through=write_through)

    def remote(pool: BlockPool, gs: object, jobs: object) -> RemoteBook:
        return RemoteBook(pool, gs, jobs, index, key,  # type: ignore[arg-type]
                          mode=RemoteMode.ON_EVICT, clock=lambda: now[0])
    rig.m = OffloadManager(rig.cpu, rig.gpu, block_size=BS, world_size=WORLD, disk=disk,
                           remote=remote)


def test_a_read_overdue_on_a_stuck_rank_keeps_requests_from_every_lower_tier() -> None:
    """Hazard "a stopped rank holding only tier jobs" (no copy is outstanding, so the
    hang clock never starts): R's 2 blocks are on disk and on the server. R's READ
    (into CPU 0, 1) is acked by rank 0 only -- rank 1 is stopped. After the fetch
    timeout R recomputes at once: no readiness query, no GET (it used to post a GET
    to the same stopped rank and wait a second timeout: 30 s in all). Q, whose blocks
    only the server holds, is not sent there either (``lookups_tier_overdue`` 2). When
    rank 1 acks, CPU 0, 1 are indexed and Q queries the server again."""
    from test_remote_book import HeldIndex, rkey


    now = [0.0]
    rig = DiskRig(cpu=8, slots=8, clock=now)
    r, q = Req("r", 9), Req("q", 9, base=300)
    rig.on_disk(r)
    index = HeldIndex()
    index.ready.update(rkey(h) for h in r.h + q.h)

    _with_remote(rig, index, now)
    assert rig.m.lookup(r.view(), 0) is None
    (rd,) = rig.step().disk
    assert rd.op is DiskOp.READ and unpack_ids(rd.cpu_ids) == [0, 1]
    rig.m.on_done(rd.job_id, 0, True)
    now[0] += 10.0
    assert rig.m.lookup(r.view(), 0) is None                      # within the timeout
    now[0] += 6.0
    assert rig.m.lookup(r.view(), 0) == 0                         # R recomputes now
    assert rig.book.counters.fetch_timeouts == 1
    assert rig.m.lookup(q.view(), 0) == 0                         # Q too, at once
    assert index.queries == [] and rig.step().remote == ()
    assert rig.m.counters.lookups_tier_overdue == 2
    assert refs(rig.cpu, [0, 1]) == [1, 1]                        # the READ's pins
    rig.m.on_done(rd.job_id, 1, True)
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1]) == [0, 0] and rig.cpu.get_cached(r.h[0]) == 0
    assert rig.m.lookup(q.view(), 0) is None                      # the server again
    assert len(index.queries) == 1 and rig.m.counters.lookups_tier_overdue == 2


def test_a_request_waiting_on_the_server_starts_no_disk_read_while_one_is_overdue(
) -> None:
    """The overdue gate's exemption is per tier. Q queries the server (its blocks are on
    no disk yet: the query is held). Its 2 blocks then reach the disk (written by W, the
    same prompt). R's READ (CPU 0, 1) is stuck on rank 1 past the fetch timeout. Q's next
    lookup still waits for its own query (None), but starts no disk READ: it would wait
    on rank 1 too (before, a request whose remote query waited was exempt from the gate
    as a whole and began one). When its answer comes the plan declines the GET
    (``get_declined_overdue``) and Q recomputes (0, ``lookups_tier_overdue`` 1); the
    server's blocks are fetched by nobody, R's READ keeps only its own pins."""
    from test_remote_book import HeldIndex, rkey


    now = [0.0]
    rig = DiskRig(cpu=8, slots=8, clock=now)
    r, q = Req("r", 9), Req("q", 9, base=300)
    rig.on_disk(r)
    index = HeldIndex()
    index.ready.update(rkey(h) for h in q.h)

    _with_remote(rig, index, now, write_through=True)
    assert rig.m.lookup(r.view(), 0) is None
    (rd,) = [m for m in rig.step().disk if m.op is DiskOp.READ]
    assert unpack_ids(rd.cpu_ids) == [0, 1]
    rig.m.on_done(rd.job_id, 0, True)                             # rank 1: stopped
    now[0] += 14.5
    assert rig.m.lookup(q.view(), 0) is None                      # Q: a query, held
    assert len(index.queries) == 1
    rig.on_disk(Req("w", 9, base=300))                            # Q's blocks on disk
    book = rig.book
    assert all(rig.slots.get_cached(remote_hash(h)) is not None for h in q.h)
    now[0] += 1.0                                                 # R's READ: overdue
    hits = book.counters.lookup_hits
    assert rig.m.lookup(q.view(), 0) is None                      # its own query waits
    assert book.fetches.get("q") is None and book.counters.lookup_hits == hits
    assert rig.m.counters.lookups_tier_overdue == 0
    index.answer_all()
    assert rig.step().remote == () and not [m for m in rig.step().disk
                                             if m.op is DiskOp.READ]
    assert rig.m.remote is not None and rig.m.remote.counters.get_declined_overdue == 1
    assert rig.m.lookup(q.view(), 0) == 0                         # Q recomputes
    assert rig.m.counters.lookups_tier_overdue == 1
    assert book.fetches.get("q") is None
    assert refs(rig.cpu, [0, 1]) == [1, 1]                        # the READ's pins only
    rig.m.check_invariants()


def test_a_read_answered_once_another_is_overdue_is_not_planned() -> None:
    """R's READ (CPU 0, 1) is stuck on rank 1. At 14 s Q's lookup finds its 2 blocks on
    disk and asks again (the READ would go out with the next plan); at 16 s, R's READ
    past the fetch timeout, the plan posts no READ for Q -- it would wait on rank 1 too
    -- (``get_declined_overdue``) and Q's next lookup recomputes (0), its CPU pool
    untouched."""
    now = [0.0]
    rig = DiskRig(cpu=8, slots=8, clock=now)
    r, q = Req("r", 9), Req("q", 9, base=300)
    rig.on_disk(r)
    rig.on_disk(q)
    assert rig.m.lookup(r.view(), 0) is None
    (rd,) = [m for m in rig.step().disk if m.op is DiskOp.READ]
    rig.m.on_done(rd.job_id, 0, True)
    read_cpu = unpack_ids(rd.cpu_ids)
    now[0] += 14.0
    assert rig.m.lookup(q.view(), 0) is None                      # not overdue yet
    now[0] += 2.0
    assert not [m for m in rig.step().disk if m.op is DiskOp.READ]
    c = rig.book.counters
    assert (c.get_declined_overdue, c.get_jobs) == (1, 1)
    assert rig.m.lookup(q.view(), 0) == 0
    assert rig.m.counters.lookups_tier_overdue == 1
    assert refs(rig.cpu, read_cpu) == [1, 1]                      # R's READ only
    rig.m.check_invariants()


def test_a_warm_start_with_a_bad_entry_changes_nothing() -> None:
    """``DiskBook.warm`` pinned every slot, then indexed them one by one: a hash that
    is no 32-byte ``bytes`` raised ConfigError after slot 0 was indexed, with both slots
    left at ref 1 that no job records (``check_invariants``: "slot 0: ref 1, jobs pin it
    0 time(s)"; a review). Now every entry is checked first: ConfigError, nothing
    changed; a good call after it indexes both."""
    import pytest

    from kvshm.errors import ConfigError

    rig = DiskRig(slots=4)
    h0, h1 = remote_hash(Req("a", 5).h[0]), remote_hash(Req("b", 5, base=9).h[0])
    for bad in ("not bytes", h1[:8]):
        with pytest.raises(ConfigError, match="a slot id and a 32-byte disk hash expected"):
            rig.book.warm({0: h0, 1: bad})  # type: ignore[dict-item]
        assert refs(rig.slots, range(4)) == [0, 0, 0, 0] and rig.slots.num_hashes == 0
        rig.m.check_invariants()
    rig.book.warm({0: h0, 1: h1})
    assert rig.slots.num_hashes == 2 and refs(rig.slots, range(4)) == [0, 0, 0, 0]
    rig.m.check_invariants()


def test_a_disk_hit_longer_than_one_read_is_read_whole() -> None:
    """A's 3 blocks are on disk; a READ carries at most 2 here (``MAX_DISK_BLOCKS``, 128,
    in the engine). R's lookup was served the first READ's worth and recomputed the rest
    -- a 50,000-block prompt got 128 blocks back (a hostile probe at production scale).
    Now R's hit is read by READs of 2 and 1, R waits until both are in, and its lookup
    hits all 3 blocks; nothing stays pinned after its end."""
    rig = DiskRig(cpu=6, slots=6, max_job=2)
    a = Req("a", 13)
    rig.on_disk(a)
    assert rig.slots.num_hashes == 3 and rig.cpu.num_hashes == 0
    r = Req("r", 13)
    assert rig.m.lookup(r.view(), 0) is None
    reads = [d for d in rig.step().disk if d.op is DiskOp.READ]
    assert [len(unpack_ids(d.cpu_ids)) for d in reads] == [2, 1]
    rig.ack_disk(reads[1])
    assert rig.m.lookup(r.view(), 0) is None                     # the first is still out
    rig.ack_disk(reads[0])
    assert rig.m.lookup(r.view(), 0) == 3 * BS
    assert rig.book.counters.get_jobs == 2 and rig.book.counters.get_capped == 0
    rig.m.finished("r", 3 * BS, [rig.alloc(3)])
    assert rig.m.pins_held() == 0
    rig.m.check_invariants()


def test_a_long_disk_read_of_healthy_reads_is_neither_overdue_nor_timed_out() -> None:
    """R's 10-block disk hit goes out as 5 READs of 2, served one after another by the
    rank (4 s each: healthy, far under the 15 s fetch timeout). Every job of the read
    carried its planning time, so at 15.5 s the read as a whole had timed out (R got 6
    of 10 blocks) and the tier was overdue: another request's lookup was turned away (a
    review). A READ done now restarts the clocks of its request's others: nothing is
    overdue, and R hits all 10 blocks."""
    now = [0.0]
    rig = DiskRig(cpu=24, slots=24, max_job=2, clock=now, write_through=True)
    a, b = Req("a", 41), Req("b", 9, base=1000)        # 10 and 2 blocks
    rig.on_disk(a)
    rig.on_disk(b)
    r = Req("r", 41)
    assert rig.m.lookup(r.view(), 0) is None
    reads = [d for d in rig.step().disk if d.op is DiskOp.READ]
    assert len(reads) == 5
    for i, rd in enumerate(reads[:3]):
        now[0] = 4.0 * (i + 1)
        rig.ack_disk(rd)
    now[0] = 15.5
    assert not rig.m._tiers.overdue()
    assert rig.m.lookup(r.view(), 0) is None                     # still reading, no timeout
    assert rig.m.lookup(Req("b2", 9, base=1000).view(), 0) is None  # b's READ: not turned away
    assert rig.m.counters.lookups_tier_overdue == 0
    for i, rd in enumerate(reads[3:]):
        now[0] = 4.0 * (i + 4)
        rig.ack_disk(rd)
    assert rig.m.lookup(r.view(), 0) == 10 * BS
    assert rig.book.counters.fetch_timeouts == 0
    rig.m.check_invariants()
