"""Remote-tier jobs through the dispatcher: off the hang clock, and a command too large
for a ring fails its job instead of raising into the scheduler.

The channel is a stand-in for :class:`~kvshm.ipc.sched_channel.SchedulerChannel` (the
dispatcher only posts to it and reads ``closed`` / ``outstanding``): the seam here is
the clock of the hang check, which the test drives."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from kvshm.engine.dispatch import Dispatcher
from kvshm.engine.snapshot import CoreCounters
from kvshm.engine.supervision import RankWatch
from kvshm.errors import ConfigError
from kvshm.ipc.protocol import Disk, DiskOp, Done, Remote, RemoteOp, pack_ids
from kvshm.offload.remote_puts import REMOTE_HASH_BYTES, max_job_blocks


class Chan(SimpleNamespace):
    """Posts are recorded; a record over ``limit`` bytes raises like a real ring."""

    def __init__(self, limit: int = 1 << 20) -> None:
        super().__init__(closed=False, outstanding=1, overflow_depth=0, posted=[],
                         limit=limit, rings=SimpleNamespace(last_progress_ns=0, heartbeat=0))

    def post(self, msg: Any) -> bool:
        n = len(msgspec.msgpack.encode(msg))
        if n > self.limit:
            raise ConfigError(f"record of {n} bytes exceeds the cmd ring limit")
        self.posted.append(msg)
        return True


def remote(job_id: int, blocks: int = 1) -> Remote:
    return Remote(job_id, RemoteOp.PUT, pack_ids(list(range(blocks))),
                  bytes(REMOTE_HASH_BYTES * blocks), REMOTE_HASH_BYTES, True)


def test_remote_dones_do_not_reset_a_wedged_transfers_stall(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Transfer waits on rank 0 for a minute while its remote mover acks one PUT job a
    second: those acks are no progress of the rank's copies, so the stall grows past
    the hang timeout (10 s); a Transfer's Done does reset it."""
    now = [0.0]
    monkeypatch.setattr("kvshm.engine.dispatch.time.monotonic", lambda: now[0])
    chan, watch = Chan(), RankWatch(0)
    watch.ready(chan)  # type: ignore[arg-type]
    watch.posted(0.0)
    counters = CoreCounters()
    d = Dispatcher("e", {0: chan}, {0: watch}, counters)  # type: ignore[dict-item]
    worst = 0.0
    for i in range(1, 61):
        now[0] = float(i)
        worst = max(worst, watch.stalled_for(now[0]))
        d.post_remote(remote(1000 + i))
        d.apply(0, [Done(1000 + i, 0, True)], None)
    assert worst >= 59.0 and counters.remote_acks == 60 and watch.acks == 0
    d.apply(0, [Done(7, 0, True)], None)                          # a Transfer's Done
    assert watch.stalled_for(60.0) == 0.0 and watch.acks == 1


def test_a_remote_command_too_large_for_a_ring_is_refused_not_raised() -> None:
    """Rank 1's ring takes at most 2040-byte records: a 100-block PUT is refused there
    (counted, logged) and reported back so the caller fails the job; rank 0 got it."""
    big, small = Chan(), Chan(limit=2040)
    counters = CoreCounters()
    d = Dispatcher("e", {0: big, 1: small}, {0: RankWatch(0), 1: RankWatch(1)},  # type: ignore[dict-item]
                   counters)
    assert d.post_remote(remote(5, blocks=100)) == [1]
    assert len(big.posted) == 1 and small.posted == [] and counters.remote_post_refused == 1


def test_max_job_blocks_fits_the_record_limit() -> None:
    """The bound the book uses: a command of ``max_job_blocks(limit)`` blocks encodes
    within ``limit`` bytes (the largest ids and job id), one more block may not."""
    for limit in (2040, 8184, 1 << 20):
        n = max_job_blocks(limit)
        msg = Remote(2 ** 62, RemoteOp.GET, pack_ids([2 ** 31 - 1] * n),
                     bytes(REMOTE_HASH_BYTES * n), REMOTE_HASH_BYTES, True)
        assert len(msgspec.msgpack.encode(msg)) <= limit
    assert max_job_blocks(2040) == 54


def test_a_long_copy_that_stamps_its_progress_is_not_a_hang() -> None:
    """One Transfer of 100,000 blocks over 80 layers took over 10 s on an oversubscribed
    machine; its rank copied all along, yet no Done came, so the stall clock passed the
    hang timeout and the rank was declared hung (six of eight ranks killed, offload off
    for the engine's life: a hostile probe). The CPU copy engine now stamps the rank's
    copy progress every few thousand ``memmove`` calls: a stamp that moved between two
    looks restarts the stall; one that stopped (a copy wedged) lets it grow again."""
    chan, watch = Chan(), RankWatch(0)
    watch.ready(chan)  # type: ignore[arg-type]
    watch.posted(0.0)
    for t in range(1, 31):                              # 30 s, a stamp every second
        chan.rings.last_progress_ns = t * 10**9
        assert watch.stalled_for(float(t)) == 0.0
    assert watch.stalled_for(31.0) == 1.0               # the stamp stopped: stalled again
    assert watch.stalled_for(45.0) == 15.0


def test_a_disk_job_failed_for_no_known_reason_is_counted_and_said(
        caplog: pytest.LogCaptureFixture) -> None:
    """Hazard "a refused slab turned the disk tier off without a word": a rank with no
    slab fails every disk job ("no slab ..."), counted in ``disk_failed_other`` only.
    The engine now also says it, one line per interval (rate-limited); a checksum
    mismatch, the expected outcome of a damaged slot, is counted and not said."""
    chan, watch = Chan(), RankWatch(0)
    watch.ready(chan)  # type: ignore[arg-type]
    counters = CoreCounters()
    d = Dispatcher("e", {0: chan}, {0: watch}, counters)  # type: ignore[dict-item]
    disk = Disk(7, DiskOp.READ, pack_ids([0]), pack_ids([0]), bytes(16), 16)
    d.post_remote(disk)
    d.post_remote(msgspec.structs.replace(disk, job_id=8))
    with caplog.at_level("WARNING", logger="kvshm.engine.runtime"):
        d.apply(0, [Done(7, 0, False, "ConfigError: no slab (may be written by others)"),
                    Done(8, 0, False, "slot crc mismatch")], None)
    assert (counters.disk_failed_other, counters.disk_read_bad_crc) == (1, 1)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "rank 0 failed disk job 7: ConfigError: no slab" in line
