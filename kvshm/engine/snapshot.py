"""The runtime's own counters and the statistics snapshot built from every source.

:class:`CoreCounters` are the engine-level counters (the manager keeps its own); every
field only grows. :func:`build_stats` reads -- never changes -- the manager, the CPU
pool and the counters, in any lifecycle state (before READY there is no manager and
no pool: their fields read 0, and the manager's counters are there as zeros, so a
snapshot has the same keys in every state); the per-rank records come in already built
(:meth:`~kvshm.engine.supervision.RankWatch.snapshot`). The manager's counters are
merged into the runtime's in one dict.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvshm.config import EngineConfig
from kvshm.offload.counters import ManagerCounters
from kvshm.offload.manager import OffloadManager
from kvshm.offload.pool import BlockPool
from kvshm.stats import EngineStats, RankStats

__all__ = ["CoreCounters", "build_stats"]

_NO_MANAGER: dict[str, int] = ManagerCounters().as_dict()
"""The manager's counters before there is a manager (before READY): all zero."""


@dataclass
class CoreCounters:
    """Engine-level counters (the manager keeps its own); monotonic."""

    store_jobs: int = 0
    load_jobs: int = 0
    lookups_not_ready: int = 0
    ranks_failed: int = 0
    ranks_left: int = 0  # said Goodbye and closed while the engine ran: not failures
    hangs: int = 0
    ranks_killed_to_fence: int = 0  # ranks that offered it, SIGKILLed at a verdict
    tick_errors: int = 0  # Engine ticks that raised (the ticks go on)
    protocol_errors: int = 0
    refused: int = 0
    done_errors: int = 0  # Dones whose handling raised (their jobs were failed)
    lookup_tokens: int = 0  # tokens asked for beyond the GPU's own hit (answered lookups)
    lookups_hit: int = 0  # answered lookups with a CPU-tier hit
    remote_jobs: int = 0  # remote-tier jobs (PUT / GET) posted
    remote_acks: int = 0  # their Dones and the disk jobs' (no progress for the hang clock)
    disk_jobs: int = 0  # disk-tier jobs (WRITE / READ) posted
    disk_read_bad_crc: int = 0  # failed disk Dones naming a payload checksum mismatch
    disk_read_bad_header: int = 0  # ... naming a torn or foreign slot header
    disk_failed_no_space: int = 0  # ... naming a full disk or quota (ENOSPC, EDQUOT)
    disk_failed_other: int = 0  # ... any other failure (an I/O error)
    remote_post_refused: int = 0  # (rank, job) posts a ring could never hold: failed


def build_stats(config: EngineConfig, state: str, manager: OffloadManager | None,
                cpu: BlockPool | None, bytes_per_block: int, ranks: Sequence[RankStats],
                counters: CoreCounters, uptime_s: float = 0.0) -> EngineStats:
    """One :class:`EngineStats` snapshot; ``bytes_per_block`` sums every rank's shard;
    ``uptime_s``: since the engine opened."""
    merged: dict[str, int] = dict(asdict(counters))
    stored = loaded = pins = jobs = q_gpu = q_cpu = 0
    merged.update(_NO_MANAGER)
    if manager is not None:
        q_gpu, q_cpu = manager.quarantined_blocks()
        merged.update(manager.counters.as_dict())
        stored = manager.counters.stored_blocks * bytes_per_block
        loaded = manager.counters.loaded_blocks * bytes_per_block
        pins, jobs = manager.pins_held(), manager.num_jobs_in_flight
    return EngineStats(
        name=config.name, state=state, world_size=config.world_size,
        num_cpu_blocks=cpu.num_blocks if cpu is not None else 0,
        cpu_blocks_cached=cpu.num_hashes if cpu is not None else 0,
        cpu_tier_bytes=cpu.num_blocks * bytes_per_block if cpu is not None else 0,
        pins_held=pins, jobs_in_flight=jobs, stored_bytes=stored, loaded_bytes=loaded,
        quarantined_gpu_blocks=q_gpu, quarantined_cpu_blocks=q_cpu,
        counters=merged, ranks=list(ranks), uptime_s=uptime_s, pid=os.getpid(),
        eviction=(cpu.eviction if cpu is not None else config.eviction).value,
        evictions=cpu.evictions if cpu is not None else 0,
        remote=_remote_stats(config, manager, bytes_per_block),
        disk=_disk_stats(config, manager, bytes_per_block))


def _disk_stats(config: EngineConfig, manager: OffloadManager | None,
                bytes_per_block: int) -> dict[str, Any]:
    """The disk tier's section: its directory and I/O mode, the book's occupancy and
    counters, read and written bytes ({} without a disk tier)."""
    if config.disk_path is None:
        return {}
    out: dict[str, Any] = {"path": config.disk_path, "io": config.disk_io.value,
                           "mode": config.disk_mode.value,
                           "bytes_per_rank": config.disk_bytes_per_rank}
    book = manager.disk if manager is not None else None
    if book is None:
        return out
    out.update(book.statistics())
    out["quarantined_slots"] = book.quarantined_slots()
    out["read_bytes"] = book.counters.hit_blocks * bytes_per_block
    out["write_bytes"] = book.counters.written_blocks * bytes_per_block
    return out


def _remote_stats(config: EngineConfig, manager: OffloadManager | None,
                  bytes_per_block: int) -> dict[str, Any]:
    """The remote tier's section: the book's counters, bytes, the index's counters and
    breaker state ({} without a remote tier)."""
    if config.remote_url is None:
        return {}
    out: dict[str, Any] = {"url": config.remote_url, "mode": config.remote_mode.value}
    book = manager.remote if manager is not None else None
    if book is None:
        return out
    out.update(book.counters.as_dict())
    if book.pd is not None:
        out.update(book.pd.counters.as_dict())
    out["hit_bytes"] = book.counters.hit_blocks * bytes_per_block
    out["put_bytes"] = book.counters.published_blocks * bytes_per_block
    out.update({f"index_{k}": v for k, v in book.index.statistics().items()})
    return out
