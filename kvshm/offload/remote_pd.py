"""The remote book's P/D side (:class:`HandoffSide`, a base of
:class:`~kvshm.offload.remote.RemoteBook`): what a hand-off asks of the book beside the
ordinary read and write paths.

Decode side: a hand-off whose CPU hit ends short of its extent waits *holding* that hit
(:meth:`HandoffSide.hold`): the GET for the rest allocates CPU blocks, and an unpinned
local prefix could be the LRU block it evicts. Ordering: the new pins are taken before
the old go; any answer of the request's lookup ends the hold (:meth:`HandoffSide.unhold`,
called by the manager), as do its end, a reset and a failed rank (the book's
``release``); FETCHED pins are not the hold's and keep their own rule. A hit covering the
whole extent reads the manifest without waiting (:meth:`HandoffSide.served`) so that the
request's end collects it: a manifest name from a client's params is only ever deleted
after the manifest was read and matched the request's own prefix.

Prefill side: a finished request's publication (its keys, the partial last block's
pinned by the caller's ``pin_tail``) and its ``kv_transfer_params``, kept until asked
for once (the newest 4,096).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvshm.offload.groups import GroupSet
from kvshm.offload.handoff import Handoffs
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote_puts import PutQueue

__all__ = ["HandoffSide"]


class HandoffSide:
    """See the module docstring. The book sets every attribute below in its
    ``__init__``; ``_held``: request -> its held CPU ids (recorded in the book's
    ``pinned``)."""

    cpu: BlockPool
    _gs: GroupSet
    pd: Handoffs | None
    puts: PutQueue
    _held: dict[str, list[int]]
    _params: dict[str, dict[str, Any]]

    # ---- decode side -----------------------------------------------------------------

    def hold(self, rid: str, cpu_ids: Sequence[int]) -> None:
        """A hand-off waits for the rest of its extent after a local CPU hit on
        ``cpu_ids``: pin them until the lookup answers or the request goes (module
        docstring). A repeated hold replaces the last one (the new pins are taken
        before the old go)."""
        self.cpu.touch(cpu_ids)
        old = self._held.pop(rid, None)
        if old:
            self.cpu.free(reversed(old))
        self._held[rid] = list(cpu_ids)

    def unhold(self, rid: str) -> None:
        """``rid``'s lookup answered (a hit, or 0): its held prefix, if any, goes (a hit
        pinned it itself first). FETCHED pins stay until ``RemoteBook.release``."""
        held = self._held.pop(rid, None)
        if held:
            self.cpu.free(reversed(held))

    def served(self, rid: str, hashes: Sequence[bytes], params: Any) -> None:
        """A hand-off's CPU hit covers its whole extent: nothing is fetched, but its
        manifest is still read (never waited for) so that the request's end collects it
        once it is checked (:meth:`Handoffs.forget`); without this it stayed on the
        server until its TTL. A name is only ever deleted after its manifest was read
        and matched the request's own prefix."""
        if self.pd is not None:
            self.pd.consume(rid, params, lambda: self._keys(hashes, 0, len(hashes)))

    def _keys(self, hashes: Sequence[bytes], start: int, end: int) -> list[bytes]:
        """CPU index keys of positions ``start..end``, position-major (every group's
        key of a position before the next position's; the read path's order too)."""
        key = self._gs.key
        return [key(hashes[p], g) for p in range(start, end) for g in range(self._gs.n)]

    # ---- prefill side ----------------------------------------------------------------

    def store_dropped(self, keys: Sequence[bytes]) -> None:
        """Finish-time stores of ``keys`` were dropped (no CPU blocks): never put. A P/D
        publication waiting for its partial last block's goes on without it."""
        if self.pd is not None:
            self.pd.store_dropped(keys)

    def publish(self, rid: str, keys: Sequence[bytes], num_tokens: int, tail: int = 0
                ) -> dict[str, Any] | None:
        """A P/D prefill request finished: its hand-off's ``kv_transfer_params``
        (``tail``: how many of the last ``keys`` are its partial last block's)."""
        return self.puts.publish(rid, keys, num_tokens, tail)

    def publish_request(self, rid: str, hashes: Sequence[bytes], confirmed: int,
                        tables: Sequence[Sequence[int]], tail: bytes | None,
                        pin_tail: Callable[[Sequence[Sequence[int]], int, bytes],
                                           list[bytes] | None]) -> None:
        """A P/D prefill request finished (the manager's ``finished``): its hand-off
        names its full blocks' keys, then its partial last block's when ``tail`` names
        one of 2+ tokens (a decoder computes the last token anyway) and ``pin_tail``
        (:func:`~kvshm.offload.side_stores.pin_tail`) could queue it. The params
        wait for :meth:`transfer_params` (the newest 4,096 are kept)."""
        assert self.pd is not None, "a hand-off without the hand-off book"
        bs, gs = self.pd.block_size, self._gs
        n = min(confirmed // bs, len(hashes))
        keys = [gs.key(hashes[p], g) for p in range(n) for g in range(gs.n)]
        tail_keys = None
        full, rest = divmod(confirmed, bs)
        if tail is not None and n == full and rest > 1:
            tail_keys = pin_tail(tables, n, tail)
        params = self.publish(rid, keys + (tail_keys or []), confirmed,
                              len(tail_keys or ()))
        if params is not None:
            self._params[rid] = params
        if len(self._params) > 4096:  # never asked for: keep the newest only
            del self._params[next(iter(self._params))]

    def transfer_params(self, rid: str) -> dict[str, Any] | None:
        """A finished P/D prefill request's ``kv_transfer_params``, once."""
        return self._params.pop(rid, None)
