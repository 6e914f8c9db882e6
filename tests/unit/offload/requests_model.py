"""The stateful tests' model of the engine's requests in flight, shared by the tier
machines (``test_remote_stateful``, ``test_disk_stateful``).

A request is *live* from its first lookup until it finishes. A lookup's hit waits in
``hits`` until the engine's phase B (:meth:`Requests.accept`) gives it a GPU table, which
the request holds in ``tables`` until it finishes. Ordering, as in vLLM: lookup, then
phase B at most once per hit, then ``finished``; a finish frees the GPU table only after
the manager was told (its load may still be writing into those blocks until then, and
the manager holds them). Every call ends with the manager's own cross-check.
"""

from __future__ import annotations

from manager_rig import BS, Rig


class Requests:
    """Live request ids, hits awaiting phase B, GPU tables held; the rig they act on."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.live: set[str] = set()
        self.hits: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}

    def looked_up(self, rid: str, hit: int | None) -> None:
        """``rid``'s lookup answered ``hit`` (None: no answer yet or nothing to load)."""
        self.live.add(rid)
        if hit is None:
            self.hits.pop(rid, None)
        else:
            self.hits[rid] = hit

    def accept(self, rid: str) -> None:
        """Phase B of ``rid``'s last hit: a GPU table if the engine has the blocks (the
        hit is consumed either way, as vLLM's scheduler retries with a new lookup)."""
        hit = self.hits.pop(rid)
        n = -(-hit // BS)
        if self.rig.gpu.num_free < n:
            return
        self.tables[rid] = self.rig.gpu.allocate(n)
        self.rig.m.allocated(rid, [self.tables[rid]], hit)
        self.rig.m.check_invariants()

    def finish(self, rid: str) -> None:
        """``rid`` finishes (or is aborted): the manager first, then its GPU table."""
        self.live.discard(rid)
        self.hits.pop(rid, None)
        self.rig.m.finished(rid, 0, [[]])
        table = self.tables.pop(rid, None)
        if table is not None:
            self.rig.gpu.free(reversed(table))
        self.rig.m.check_invariants()

    def finish_all(self) -> None:
        """Teardown: every live request finishes."""
        for rid in sorted(self.live):
            self.finish(rid)
