"""The manager's counters: what it did, declined and refused, for stats and tests.

Monotonic: no counter ever goes down, not even at ``OffloadManager.reset()``. One
:class:`ManagerCounters` per manager, shared by its parts (:mod:`kvshm.offload.jobs`,
:mod:`kvshm.offload.stores`, :mod:`kvshm.offload.loads`, :mod:`kvshm.offload.validate`),
each of which bumps only the counters of its own decisions. The engine reads them by
attribute (``manager.counters``) and flattens them with :meth:`ManagerCounters.as_dict`
(``kvshm.engine.supervision``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum

__all__ = ["DeclineReason", "ManagerCounters"]


class DeclineReason(Enum):
    """Why a candidate block was not stored (one counter each)."""

    CPU_FULL = "cpu_full"
    """The CPU pool could not supply a block (eager: retried next step)."""
    IN_FLIGHT = "in_flight"
    """The GPU block, or another block with its hash, is being stored."""
    ALREADY_CACHED = "already_cached"
    UNHASHED = "unhashed"
    """Neither the request nor the GPU pool knows the block's hash."""
    STALE_WINDOW = "stale_window"
    """A sliding-window id no longer valid for its position (freed, reused)."""
    HASH_MISMATCH = "hash_mismatch"
    """A full-attention GPU block carries hashes other than the position's."""
    ENGINE_FAILED = "engine_failed"
    """A finish-time store dropped because a rank failed."""
    RESET = "reset"
    """A finish-time store dropped by ``reset()`` before it was sent."""
    ENGINE_CLOSED = "engine_closed"
    """A finish-time store dropped because the engine closed before it was sent."""


def _zero_declines() -> dict[DeclineReason, int]:
    return {r: 0 for r in DeclineReason}


@dataclass(slots=True)
class ManagerCounters:
    """Monotonic counters of the manager (never reset, not even by ``reset()``)."""

    lookups: int = 0
    #: tokens offered by lookup answers, every answer counted (a request that waits for
    #: the serving engine's KV space is looked up again every step): not what was used
    lookup_hit_tokens: int = 0
    #: tokens the serving engine accepted from a hit, once per request: at its first
    #: phase B (``allocated``), what vLLM counts as ``external_prefix_cache_hits``
    hit_tokens: int = 0
    #: tokens accepted by a request's later phase B (re-admitted after a preemption)
    hit_tokens_readmitted: int = 0
    lookups_asked_again: int = 0
    lookups_unaligned: int = 0
    lookups_during_reset: int = 0  # answered 0: a reset's abandoned jobs still in flight
    #: lookups that started no disk or remote read (a CPU miss answered 0, or a CPU hit
    #: short of its extent not extended by the disk) because an earlier read of a lower
    #: tier is past its fetch timeout and still out (``LowerTiers.gated``)
    lookups_tier_overdue: int = 0
    loads_planned: int = 0
    loaded_blocks: int = 0
    loads_failed: int = 0
    #: phase B calls that accepted external tokens no lookup offered (no hit held):
    #: their load fails at once (``no_pin``), the tokens are not counted as a hit
    phase_b_unoffered: int = 0
    #: load outcomes not reported because their request ended, or a newer phase B of
    #: it came, while the load was in flight (``LoadBook.supersede``)
    load_results_superseded: int = 0
    stores_planned_blocks: int = 0
    stored_blocks: int = 0
    declined: dict[DeclineReason, int] = field(default_factory=_zero_declines)
    jobs_failed: int = 0
    jobs_abandoned: int = 0
    acks_unknown: int = 0
    acks_duplicate: int = 0
    invalid_calls: int = 0
    """Calls refused with ``InvalidRequest`` (nothing else changed)."""

    def as_dict(self) -> dict[str, int]:
        """Flat ``name -> value`` (declines as ``declined_<reason>``), for stats."""
        out: dict[str, int] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                for reason, n in value.items():
                    out[f"declined_{reason.value}"] = n
            else:
                out[f.name] = value
        return out
