"""The remote book's P/D side: what a hand-off asks of the book beside the ordinary read
and write paths.

:class:`HandoffSide` is an object the :class:`~kvshm.offload.remote.RemoteBook` holds
when the engine hands off (composition: the book calls it, it never calls the book). It
owns the decode side's *holds* and the prefill side's finished publications'
``kv_transfer_params``; it is handed the book's CPU pool and groups, its PUT queue and
the engine's :class:`~kvshm.offload.pd.handoffs.Handoffs`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final

from kvshm.offload.groups import GroupSet
from kvshm.offload.pd.handoffs import Handoffs
from kvshm.offload.pd.manifest import Verdict
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote_puts import PutQueue

__all__ = ["PARAMS_KEPT", "HandoffSide"]

#: Finished publications' ``kv_transfer_params`` kept until asked for (the newest).
PARAMS_KEPT: Final = 4096


class HandoffSide:
    """See the module docstring.

    Decode side: a hand-off whose CPU hit ends short of its extent waits *holding* that
    hit (:meth:`hold`): the GET for the rest allocates CPU blocks, and an unpinned local
    prefix could be the LRU block it evicts. Ordering: the new pins are taken before the
    old go; any answer of the request's lookup ends the hold (:meth:`unhold`, called by
    the manager), as do its end, a reset and a failed rank (the book's ``release`` and
    :meth:`drop`); FETCHED pins are not the hold's and keep their own rule. A hit
    covering the whole extent reads the manifest without waiting (:meth:`served`) so that
    the request's end collects it: a manifest name from a client's params is only ever
    deleted after the manifest was read and matched the request's own prefix.

    Prefill side: a finished request's publication (its keys, the partial last block's
    pinned by the caller's ``pin_tail``) is recorded with the publications *before* its
    cached blocks are queued for a kept PUT (the queue asks which blocks a publication
    waits for); its ``kv_transfer_params`` are kept until asked for once (the newest
    :data:`PARAMS_KEPT`).

    Invariants: every CPU id in a hold is pinned once for it (:meth:`pinned` lists them,
    the book's ``pinned`` includes them); at most one hold per request.
    """

    def __init__(self, cpu: BlockPool, gs: GroupSet, puts: PutQueue,
                 handoffs: Handoffs) -> None:
        self._cpu, self._gs, self._puts = cpu, gs, puts
        self.handoffs = handoffs
        self._held: dict[str, list[int]] = {}  # request -> its held CPU ids
        # finished publications' params, oldest first (an OrderedDict: dropping the
        # oldest is O(1), see kvshm.offload.ghost)
        self._params: OrderedDict[str, dict[str, Any]] = OrderedDict()

    # ---- views -------------------------------------------------------------------------

    def pinned(self) -> list[int]:
        """CPU ids the holds pin, with repeats."""
        return [c for held in self._held.values() for c in held]

    def holds(self) -> dict[str, list[int]]:
        """request -> its held CPU ids (a copy)."""
        return {rid: list(held) for rid, held in self._held.items()}

    # ---- decode side -------------------------------------------------------------------

    def consume(self, rid: str, hashes: Sequence[bytes], params: Any) -> Verdict | None:
        """Where ``rid``'s manifest stands (None: no hand-off;
        :meth:`Consumers.consume <kvshm.offload.pd.consume.Consumers.consume>`)."""
        return self.handoffs.consumers.consume(
            rid, params, lambda: self._gs.keys(hashes, 0, len(hashes)))

    def manifest_reads(self, rid: str) -> int:
        """Reads of ``rid``'s manifest sent so far (:meth:`Consumers.reads
        <kvshm.offload.pd.consume.Consumers.reads>`)."""
        return self.handoffs.consumers.reads(rid)

    def served(self, rid: str, hashes: Sequence[bytes], params: Any) -> None:
        """A hand-off's CPU hit covers its whole extent: nothing is fetched, but its
        manifest is still read (never waited for) so that the request's end collects it
        once it is checked (:meth:`forget`); without this it stayed on the server until
        its TTL. A name is only ever deleted after its manifest was read and matched the
        request's own prefix."""
        self.consume(rid, hashes, params)

    def hold(self, rid: str, cpu_ids: Sequence[int]) -> None:
        """A hand-off waits for the rest of its extent after a local CPU hit on
        ``cpu_ids``: pin them until the lookup answers or the request goes (class
        docstring). A repeated hold replaces the last one (the new pins are taken
        before the old go)."""
        self._cpu.touch(cpu_ids)
        self.unhold(rid)
        self._held[rid] = list(cpu_ids)

    def unhold(self, rid: str) -> None:
        """``rid``'s lookup answered (a hit, or 0), or it goes: its held prefix, if any,
        is released (a hit pinned it itself first)."""
        held = self._held.pop(rid, None)
        if held:
            self._cpu.free(reversed(held))

    def collected(self, rid: str) -> None:
        """``rid``'s GET fetched its blocks: its manifest is collected."""
        self.handoffs.consumers.collected(rid)

    def forget(self, rid: str) -> None:
        """``rid`` ended: a manifest it trusted is collected (or its read orphaned)."""
        self.handoffs.consumers.forget(rid)

    def tick(self) -> None:
        """A plan's upkeep (:meth:`Handoffs.tick <kvshm.offload.pd.handoffs.Handoffs.tick>`)."""
        self.handoffs.tick()

    def drop(self) -> None:
        """Reset or engine failure: every pending publication is dropped (no manifest)
        and every hold released. The consumers are kept (their requests go on)."""
        self.handoffs.publications.drop_all()
        for rid in list(self._held):
            self.unhold(rid)

    # ---- prefill side ------------------------------------------------------------------

    def store_dropped(self, keys: Sequence[bytes]) -> None:
        """Finish-time stores of ``keys`` were dropped (no CPU blocks): never put. A P/D
        publication waiting for its partial last block's goes on without it."""
        self.handoffs.publications.store_dropped(keys)

    def publish_request(self, rid: str, hashes: Sequence[bytes], confirmed: int,
                        tables: Sequence[Sequence[int]], tail: bytes | None,
                        pin_tail: Callable[[Sequence[Sequence[int]], int, bytes],
                                           list[bytes] | None]) -> None:
        """A P/D prefill request finished (the manager's ``finished``): its hand-off
        names its full blocks' keys, then its partial last block's when ``tail`` names
        one of 2+ tokens (a decoder computes the last token anyway) and ``pin_tail``
        (:func:`~kvshm.offload.side_stores.pin_tail`) could queue it. Its blocks cached
        here but not on the server are queued for a kept PUT now; the others come from
        its finish-time store or are there already. The params wait for
        :meth:`transfer_params`."""
        pubs = self.handoffs.publications
        self._puts.forget_lost()  # before asking what is on the server already
        bs = self.handoffs.block_size
        n = min(confirmed // bs, len(hashes))
        keys = self._gs.keys(hashes, 0, n)
        tail_keys = None
        full, rest = divmod(confirmed, bs)
        if n == full and rest > 1:  # a partial last block a decoder would reuse
            if tail is None:
                self.handoffs.counters.tails_unkeyed += 1
            else:
                tail_keys = pin_tail(tables, n, tail)
                if tail_keys is None:
                    self.handoffs.counters.tails_declined += 1
        keys += tail_keys or []
        params = pubs.publish(rid, keys, confirmed, self._puts.is_published,
                              len(tail_keys or ()))
        self._puts.queue_kept([k for k in keys if pubs.wants(k)])
        if params is not None:
            self._params[rid] = params
        if len(self._params) > PARAMS_KEPT:  # never asked for: keep the newest only
            self._params.popitem(last=False)

    def transfer_params(self, rid: str) -> dict[str, Any] | None:
        """A finished P/D prefill request's ``kv_transfer_params``, once."""
        return self._params.pop(rid, None)
