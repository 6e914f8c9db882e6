"""The CPU tier's size when nobody gives one, and the progress of large reservations.

Before issue 14 an ``EngineConfig`` without a size took as much of /dev/shm and memory
as it could (9.8 GiB a rank, ~20 s of silent ``posix_fallocate`` for a toy). Now the
default is :data:`~kvshm.config.DEFAULT_CPU_BYTES_PER_RANK` (1 GiB) per rank, explicit
sizes mean what they meant, and a segment of :data:`~kvshm.shm.PROGRESS_BYTES` or more
is reserved with INFO lines on ``kvshm.shm``.
"""

from __future__ import annotations

import logging
import os

import pytest

from kvshm import shm
from kvshm.config import DEFAULT_CPU_BYTES_PER_RANK, EngineConfig
from kvshm.ipc.protocol import LayoutSpec, RegionSpec
from kvshm.layout import SCHEDULER_BYTES_PER_BLOCK, reconcile

#: One region of 1 MiB per block: the default budget holds exactly 1024 blocks.
SPEC = LayoutSpec((RegionSpec(1 << 20, 64, "uint8"),))
#: As much as /dev/shm could give, in the test (more than the default).
PLENTY = 64 << 30


def _blocks(cfg: EngineConfig, world: int = 1) -> int:
    """What provisioning decides for ``cfg`` (the same call, with a fixed budget)."""
    return reconcile([SPEC] * world, cfg.cpu_bytes_per_rank, cfg.num_cpu_blocks, PLENTY)


def test_default_is_one_gib_per_rank() -> None:
    cfg = EngineConfig(block_size=16)
    assert cfg.cpu_bytes_per_rank == DEFAULT_CPU_BYTES_PER_RANK == 1 << 30
    assert cfg.num_cpu_blocks is None
    assert _blocks(cfg) == 1024
    assert _blocks(EngineConfig(block_size=16, tp=4), world=4) == 1024  # per rank


def test_explicit_sizes_are_unchanged() -> None:
    assert _blocks(EngineConfig(block_size=16, num_cpu_blocks=7)) == 7
    assert _blocks(EngineConfig(block_size=16, num_cpu_blocks=5000)) == 5000  # > 1 GiB
    assert _blocks(EngineConfig(block_size=16, cpu_bytes_per_rank=3 << 30)) == 3072
    assert _blocks(EngineConfig(block_size=16, cpu_bytes_per_rank=(1 << 20) * 10)) == 10


def test_explicit_none_still_takes_what_fits() -> None:
    """The old behaviour stays available, but only when asked for."""
    assert _blocks(EngineConfig(block_size=16, cpu_bytes_per_rank=None)) == \
        PLENTY // ((1 << 20) + SCHEDULER_BYTES_PER_BLOCK)


def test_the_default_is_lowered_to_what_the_machine_allows() -> None:
    """A 64 MiB Docker /dev/shm still starts: the budget is a ceiling, not a demand."""
    blocks = 40  # 1 MiB blocks, and the scheduler's bookkeeping of each
    assert reconcile([SPEC], DEFAULT_CPU_BYTES_PER_RANK, None,
                     blocks * ((1 << 20) + SCHEDULER_BYTES_PER_BLOCK)) == blocks


def test_large_reservation_logs_progress(caplog: pytest.LogCaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Thresholds lowered to MiB so the test reserves 5 MiB, not 5 GiB: a start line,
    one line per piece with the running total, and a segment of full size, zeroed."""
    monkeypatch.setattr(shm, "PROGRESS_BYTES", 4 << 20)
    monkeypatch.setattr(shm, "PROGRESS_CHUNK", 2 << 20)
    with caplog.at_level(logging.INFO, logger="kvshm.shm"):
        seg = shm.create_segment(5 << 20, purpose="host-pool-r0")
    try:
        assert os.fstat(seg.fd).st_size == 5 << 20 and seg.buf[:] == bytes(5 << 20)
    finally:
        seg.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvshm.shm"]
    assert lines[0] == ("kvshm: reserving 5 MiB of shared memory for host-pool-r0 "
                        "(posix_fallocate, 0.5 - 2 s a GiB)")
    assert [line.split(" reserved (")[0] for line in lines[1:]] == [
        "kvshm: host-pool-r0: 2 MiB of 5 MiB", "kvshm: host-pool-r0: 4 MiB of 5 MiB",
        "kvshm: host-pool-r0: 5 MiB of 5 MiB"]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_small_reservation_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvshm.shm"):
        shm.create_segment(1 << 20, purpose="rings-r0").close()
    assert [r for r in caplog.records if r.name == "kvshm.shm"] == []
    assert shm.PROGRESS_BYTES == 4 << 30  # "more than a few GiB"
