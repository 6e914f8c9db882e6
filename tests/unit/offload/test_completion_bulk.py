"""A store's completion in bulk decides what the general path decides: the one-group
check (every GPU block carries no hash or exactly its key, read in one
``block_hashes_of`` call where the pool has one) sends the job to ``add_keys``, else the
pairs go one by one; either way the CPU tier ends with the same index, hashes, depths
and events (with events on and off: off, ``add_keys`` takes its bulk path)."""

from __future__ import annotations

from typing import Any

import pytest

from kvshm.config import Eviction
from kvshm.offload.counters import ManagerCounters
from kvshm.offload.groups import GroupSet
from kvshm.offload.pool import BlockPool
from kvshm.offload.stores import StorePlanner
from kvshm.types import KVGroup

H = [bytes([i]) * 16 for i in range(8)]


class _Gpu:
    """A GPU pool stand-in whose blocks answer fixed hashes; ``bulk``: it also has the
    one-call read."""

    def __init__(self, hashes: dict[int, tuple[bytes, ...]], bulk: bool) -> None:
        self._h = hashes
        if bulk:
            self.block_hashes_of = lambda ids: [self.block_hashes(b) for b in ids]

    def block_hashes(self, block_id: int) -> tuple[bytes, ...]:
        return self._h.get(block_id, ())


def _complete(keys: list[bytes], gh: dict[int, tuple[bytes, ...]], single: bool,
              events: bool, bulk: bool) -> Any:
    """Register a 3-block store (GPU ids 0, 1, 2 into CPU ids 0, 1, 2, depths 0, 1, 2);
    the CPU tier's state after it."""
    cpu = BlockPool(4, enable_events=events, eviction=Eviction.DEPTH_AGED)
    cpu.allocate(len(keys))
    gs = GroupSet((KVGroup.full(),), 16)
    gs.single = single  # False: the general pairs-one-by-one path
    plan = StorePlanner(cpu, _Gpu(gh, bulk), gs, 16, ManagerCounters(), 4,  # type: ignore[arg-type]
                        set())
    n = len(keys)
    plan._register(list(range(n)), list(range(n)), [0] * n, keys, list(range(n)))
    cpu.check_invariants()
    return ([(cpu.block_hashes(b), cpu._blocks[b].depth) for b in range(4)],
            [cpu.get_cached(h) for h in H], cpu.take_events(), plan.counters.stored_blocks)


@pytest.mark.parametrize("gh", [
    {},  # no GPU block hashed: stored under the keys
    {0: (H[0],), 1: (H[1],), 2: (H[2],)},  # each carries exactly its key
    {0: (H[0],), 1: (H[5],)},  # block 1 re-hashed for other content: both indexed
    {1: (H[1], H[6])},  # block 1 carries a second hash
    {2: (H[5], H[2])},  # its key second
])
@pytest.mark.parametrize("events", [True, False])
@pytest.mark.parametrize("bulk", [True, False])
def test_one_group_completion_indexes_what_the_pairs_one_by_one_index(
        gh: dict[int, tuple[bytes, ...]], events: bool, bulk: bool) -> None:
    keys = [H[0], H[1], H[2]]
    assert _complete(keys, gh, True, events, bulk) == _complete(keys, gh, False, events,
                                                                bulk)
