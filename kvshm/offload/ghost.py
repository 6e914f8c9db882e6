"""Ghost keys: the keys of blocks an eviction order let go lately, oldest forgotten first.

An order with a probation segment (``s3fifo``, ``adaptive`` and the adaptive order's
simulations) remembers the key of each block it evicts from probation, for as many keys
as it holds blocks; a block stored again under a remembered key skips probation.

Every operation is O(1), also after any number of evictions. That is why the keys live
in an :class:`~collections.OrderedDict`: a plain dict used as a FIFO (``del
d[next(iter(d))]``) leaves a deleted entry at its front for each key let go, and each
``next(iter(d))`` walks all of them until the dict is next resized -- up to the ghost's
capacity per eviction. On a full CPU tier of 400k blocks taking a stream of one-off
blocks, a store's eviction grew from 6 us to 430 us that way (found by a soak probe).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["GhostKeys"]


class GhostKeys(OrderedDict[Hashable, None]):
    """At most ``capacity`` keys in the order they were remembered. Invariant:
    ``len(self) <= capacity``; a key remembered again keeps its first place.

    An OrderedDict itself (not one held inside), so that ``key in ghost`` -- asked for
    every block placed, nearly always a miss -- stays a C-level dict probe: a method of
    a holder cost 60 ns a block there against 25 (measured by the review of this
    change). Read it as a set of keys; write it only through :meth:`remember` and
    :meth:`take`."""

    __slots__ = ("capacity",)

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def remember(self, key: Hashable) -> None:
        """Add ``key`` (its block was evicted); past the capacity the oldest goes."""
        self[key] = None
        if len(self) > self.capacity:
            self.popitem(last=False)

    def take(self, key: Hashable) -> bool:
        """Whether ``key`` is remembered; if so it is forgotten (its block is back). On a
        hot path ask ``key in ghost`` first: a miss then costs no call."""
        return self.pop(key, False) is None
