"""The prefill side of a P/D hand-off: publications, whose manifests are written last
(the protocol: :mod:`kvshm.offload.pd.handoffs`).

A finished ``do_remote_decode`` request's publication waits for every block it names to
be put and acked by every rank (:meth:`Publications.put_done`, from the write path);
then, and only then, its manifest is written: a manifest's presence means its blocks
are there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvshm.offload.pd.manifest import (
    DECODE_PARAM,
    MANIFEST_PARAM,
    PREFILL_PARAM,
    Manifest,
    PdCounters,
    manifest_key,
)
from kvshm.offload.pd.scope import HandoffScope

__all__ = ["Publications"]


@dataclass(slots=True, eq=False)
class _Pub:
    key: str
    keys: list[bytes]
    pending: set[bytes]
    num_tokens: int
    since: float
    tail: int = 0


class Publications:
    """The pending publications of one engine (the prefill side).

    Owns each pending publication (its manifest key, its blocks' keys in prefix order,
    those not put yet, its token count and tail) and ``_waiting``, each pending block
    key -> the publications waiting for it; both agree at every return. Counts into the
    hand-offs' shared :class:`~kvshm.offload.pd.manifest.PdCounters`.

    Ordering: a manifest is written only once every block it names was put by every
    rank; a failed PUT of any of its blocks, or blocks not all put within
    ``publish_timeout_s``, drop the publication and write nothing -- the blocks put so
    far are demoted (the ordinary TTL, never a hold with no end). A partial last block
    whose finish-time store was dropped is left out (:meth:`store_dropped`) rather than
    let the hand-off time out. A written manifest expires ``manifest_ttl_s`` after it
    was written (wall clock) and lives twice that on the server.
    """

    def __init__(self, scope: HandoffScope, counters: PdCounters, *,
                 publish_timeout_s: float = 30.0, manifest_ttl_s: int = 600,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self._scope = scope
        self.counters = counters
        self._publish_timeout = publish_timeout_s
        self._ttl = manifest_ttl_s
        self._clock, self._wall = clock, wall
        self._pubs: dict[str, _Pub] = {}
        self._waiting: dict[bytes, set[str]] = {}  # block key -> publications waiting

    def publish(self, rid: str, keys: Sequence[bytes], num_tokens: int,
                published: Callable[[bytes], bool], tail: int = 0) -> dict[str, Any] | None:
        """Record ``rid``'s publication; its ``kv_transfer_params`` (None: not one full
        block, nothing to hand off). ``published(k)``: whether block ``k`` is on the
        server already. The params follow vLLM's P/D convention (a proxy forwards the
        prefill's params to the decode engine as they are): ``do_remote_prefill`` for
        the decoder, and the manifest's name. ``tail``: how many of the last ``keys``
        are the partial last block's."""
        if len(keys) <= tail:
            self.counters.publish_empty += 1
            return None
        scope = self._scope
        key = manifest_key(scope.fingerprint, scope.world, rid)
        pending = {k for k in keys if not published(k)}
        if rid in self._pubs:  # an earlier request under this id still waits: it ends
            # here (its waits went under the id, so its failed PUT would fail this one)
            self._fail(rid, keep=frozenset(keys))
            self.counters.publish_superseded += 1
        self._pubs[rid] = _Pub(key, list(keys), pending, num_tokens, self._clock(), tail)
        for k in pending:
            self._waiting.setdefault(k, set()).add(rid)
        self.counters.published += 1
        if not pending:
            self._write(rid)
        return {PREFILL_PARAM: True, DECODE_PARAM: False, MANIFEST_PARAM: key}

    def wants(self, key: bytes) -> bool:
        """Whether a publication waits for block ``key`` (it is put whatever the mode)."""
        return key in self._waiting

    def put_done(self, keys: Sequence[bytes], ok: bool) -> None:
        """A PUT of ``keys`` completed on every rank (``ok``: without failure)."""
        for k in keys:
            for rid in self._waiting.pop(k, ()):
                pub = self._pubs.get(rid)
                if pub is None:
                    continue
                if not ok:
                    self._fail(rid)
                    self.counters.publish_failed += 1
                    continue
                pub.pending.discard(k)
                if not pub.pending:
                    self._write(rid)

    def store_dropped(self, keys: Sequence[bytes]) -> None:
        """Finish-time stores of ``keys`` were dropped (the CPU tier had no room): they
        will never be put. A publication waiting for its partial last block's drops its
        tail (``tails_dropped``) and is written as soon as its full blocks are all put
        -- the decoder loads those and computes the rest, as without a tail key. One
        waiting for a full block's times out as before (another request may still store
        that block)."""
        for k in keys:
            for rid in list(self._waiting.get(k, ())):
                pub = self._pubs.get(rid)
                if pub is not None and pub.tail and k in pub.keys[len(pub.keys) - pub.tail:]:
                    self._drop_tail(rid, pub)

    def _drop_tail(self, rid: str, pub: _Pub) -> None:
        tail = pub.keys[len(pub.keys) - pub.tail:]
        del pub.keys[len(pub.keys) - pub.tail:]
        pub.tail = 0
        put = []  # another group's tail, on the server already: no manifest names it
        for k in tail:
            if k not in pub.pending:
                put.append(self._scope.remote_hash(k))
                continue
            pub.pending.discard(k)
            self._unwait(k, rid)
        if put:
            self._scope.demote(put)
        self.counters.tails_dropped += 1
        if not pub.pending:
            self._write(rid)

    def _unwait(self, k: bytes, rid: str) -> None:
        rids = self._waiting.get(k)
        if rids is not None:
            rids.discard(rid)
            if not rids:
                del self._waiting[k]

    def _write(self, rid: str) -> None:
        pub = self._pubs.pop(rid)
        scope = self._scope
        hashes = [scope.remote_hash(k) for k in pub.keys]
        m = Manifest(1, scope.fingerprint, scope.world, scope.block_size, pub.num_tokens,
                     [h.hex() for h in hashes], self._wall() + self._ttl, pub.tail)
        scope.index.put_value(pub.key, msgspec.json.encode(m), 2 * self._ttl,
                              after=[scope.ready_key(h) for h in hashes])
        self.counters.manifests_written += 1

    def _drop(self, rid: str) -> None:
        pub = self._pubs.pop(rid, None)
        if pub is None:
            return
        for k in pub.pending:
            self._unwait(k, rid)

    def expire(self) -> None:
        """Drop publications whose blocks were not all put within the publish timeout."""
        now = self._clock()
        for rid in [r for r, p in self._pubs.items()
                    if now - p.since > self._publish_timeout]:
            self._fail(rid)
            self.counters.publish_timeouts += 1

    def _fail(self, rid: str, keep: frozenset[bytes] = frozenset()) -> None:
        """A publication that will write no manifest: its blocks put so far (kept, no
        TTL) get the ordinary TTL back, so nothing is pinned on the server for ever --
        but those in ``keep`` (the blocks of the publication that supersedes it)."""
        pub = self._pubs.get(rid)
        if pub is not None:
            self._scope.demote([self._scope.remote_hash(k) for k in pub.keys
                                if k not in keep])
        self._drop(rid)

    def drop_all(self) -> None:
        """Reset or engine failure: every pending publication is dropped (no manifest)."""
        for rid in list(self._pubs):
            self._drop(rid)
