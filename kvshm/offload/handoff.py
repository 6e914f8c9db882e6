"""Prefill/decode hand-off through the remote tier: manifests, published last.

A P/D prefill request (``do_remote_decode``) must reach a decode engine whole. When it
finishes, :meth:`Handoffs.publish` records a *publication*: its blocks' CPU keys (in
prefix order) and token count, and the manifest key it will write,
``kvshm:v1:pd:<fingerprint>:<request>``, which the engine hands back at once as the
request's ``kv_transfer_params`` (``{"kvshm_manifest": key}``). The manifest is written
**last**: only once every one of its blocks was put and acked by every rank (the remote
book reports each ok PUT through :meth:`put_done`); a failed PUT, or blocks that never
reach the server within ``publish_timeout_s`` (30 s), drop the publication (counted)
and no manifest is ever written. A manifest names the fingerprint, world size, block
size, token count, the blocks' remote hashes and an expiry (wall clock).

The decode side (:meth:`Handoffs.consume`, from a lookup whose params carry
``do_remote_prefill`` and ``kvshm_manifest``) reads the manifest asynchronously: "ask
again" (None) until it arrives. Missing: ask again until ``wait_s`` (5 s; the prefill may
still be publishing), then 0; an answer that never arrives at all: 0 after twice that.
Present: it is checked -- fingerprint, world size and block size equal the consumer's,
not expired, its hashes are the request's own prefix -- and only then does the ordinary
remote lookup run (the readiness keys are still asked: a manifest is never trusted
alone). An expired one is deleted (demoted: its blocks keep their ordinary TTL). A
consumer that loaded the blocks deletes the manifest (collected); so does one that
trusted it but fetched nothing (it held every block already, or the server no longer
did), when its request ends -- a reset or a failed rank does not end it. A decoder
whose CPU tier holds a prefix of the hand-off (a shared system prompt) still fetches the
rest (the manager asks the remote tier from the end of that hit, holding the hit
meanwhile); one whose CPU tier (or engine) holds all of it reads the manifest without
waiting for it, so that its end collects it too -- and never waits 5 s for a manifest a
sibling (vLLM's parallel sampling shares one hand-off) already collected. A sibling that
does need the server finds the manifest in the decoder's memory of those it collected
(the newest 8 MiB; ``pd_manifest_reused``; :mod:`kvshm.offload.collected`), judged by
the same checks against its own prefix -- one that does not match, or has expired, is
not used: the server is asked. Collection deletes the manifest, not the blocks (they
keep the ordinary TTL). A request that ends while its manifest is still being read
leaves an *orphan* read, collected when it arrives if trusted; one that collects nothing
(no answer within ``2 * wait_s``, missing, untrusted) is counted ``pd_orphans_dropped``.
Every refusal is a counted miss: the request recomputes.

Lifetime: a hand-off's blocks and readiness keys are put with the tier's *hold* TTL
(``keep``; ``RemoteSpec.hold_ttl_s``, 30 min), not the ordinary one; the decoder that
loaded them gives them the ordinary TTL (they stay useful as cache); so does the
publisher when its publication fails, and the first engine that finds a manifest
expired (demotion). Not "no TTL", as first planned: a hand-off nobody collects (the
decode request aborted or served from another tier, the manifest refused, the prefill
killed mid-publish) would pin server memory for ever, and ``volatile-lru`` can never
evict a key without a TTL -- the server would fill up and refuse writes. The price: under
memory pressure ``volatile-lru`` may evict a hand-off in flight (the decoder then
recomputes, counted).

The partial last block (a prompt that does not end on a block boundary) travels too:
the prefill stores it under a *tail key* (:func:`kvshm.hashing.tail_hash` of the last
full block's hash and the remaining tokens; the engine passes it to ``finished``), puts
it like the others and names it last in the manifest (``Manifest.tail``); the decoder
derives the same key from its own tokens (``RequestView.tail_hash``) and its hit covers
``num_tokens - 1`` tokens (:func:`handoff_extent`), so it computes only the last token,
as vLLM's own P/D connectors do. A decoder without the tail key (or with another one)
loads the full blocks only. The tail is an extra: when its finish-time store is dropped
for want of CPU blocks (:meth:`Handoffs.store_dropped`, from the store planner's
``on_dropped`` hook), the publication goes on without it rather than time out.

The manifest record, its key, its checks and the consumer's hit range:
:mod:`kvshm.offload.manifest` (re-exported here); the prefill side's publications:
:mod:`kvshm.offload.handoff_publish`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvshm.offload.collected import CollectedManifests
from kvshm.offload.handoff_publish import Publications, _Pub
from kvshm.offload.manifest import (
    MANIFEST_PARAM,
    PD_PREFIX,
    Manifest,
    PdCounters,
    Verdict,
    check_manifest,
    handoff_extent,
    is_handoff,
    manifest_key,
)
from kvshm.remote.tier import ReadyIndex

__all__ = ["MANIFEST_PARAM", "Handoffs", "Manifest", "PdCounters", "Verdict", "handoff_extent",
           "is_handoff", "manifest_key"]

log = logging.getLogger("kvshm.remote")


@dataclass(slots=True, eq=False)
class _Consume:
    key: str
    keys: list[bytes]  # the request's CPU keys from position 0
    token: int
    since: float
    verdict: Verdict = Verdict.WAIT
    manifest: Manifest | None = None


class Handoffs(Publications):
    """See the module docstring. ``remote_hash``: a CPU key's remote hash."""

    def __init__(self, index: ReadyIndex, fingerprint: str, world: int, block_size: int,
                 remote_hash: Callable[[bytes], bytes], ready_key: Callable[[bytes], str],
                 *, wait_s: float = 5.0, publish_timeout_s: float = 30.0,
                 manifest_ttl_s: int = 600, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.index, self.fingerprint, self.world = index, fingerprint, world
        self.block_size = block_size
        self._rhash = remote_hash
        self._ready_key = ready_key
        self._prefix = f"{PD_PREFIX}:{fingerprint}:{world}:"
        self._wait = wait_s
        self._publish_timeout = publish_timeout_s
        self._ttl = manifest_ttl_s
        self._clock, self._wall = clock, wall
        self.counters = PdCounters()
        self._pubs: dict[str, _Pub] = {}
        self._waiting: dict[bytes, set[str]] = {}  # block key -> publications waiting
        self._reqs: dict[str, _Consume] = {}
        self._tokens: dict[int, str] = {}
        self._done = CollectedManifests()  # for a sibling consumer of one hand-off
        self._orphans: dict[int, _Consume] = {}  # token -> an ended request's unread read
        self._next_token = -1  # negative: never collides with the remote book's

    # ---- decode side (the prefill side: kvshm.offload.handoff_publish) ----------------

    def expire(self) -> None:
        """Drop publications whose blocks were not all put within the publish timeout,
        and orphan reads not answered within ``2 * wait_s`` (counted)."""
        super().expire()
        now = self._clock()
        for token in [t for t, o in self._orphans.items() if now - o.since > 2 * self._wait]:
            del self._orphans[token]  # its answer never came: left to the manifest's TTL
            self.counters.orphans_dropped += 1

    def consume(self, rid: str, params: Any, keys: Callable[[], list[bytes]]
                ) -> Verdict | None:
        """A lookup of ``rid``: None when it is no hand-off; else where its manifest
        stands. ``keys()``: the request's CPU keys from position 0 (asked once)."""
        key = params.get(MANIFEST_PARAM) if isinstance(params, Mapping) else None
        if not isinstance(key, str) or not params.get("do_remote_prefill"):
            return None
        self.poll()
        st = self._reqs.get(rid)
        if st is not None:
            if st.verdict is Verdict.WAIT and self._clock() - st.since > 2 * self._wait:
                # an answer that never came (the last ask is answered within wait_s)
                st.verdict = Verdict.REFUSED
                self._tokens.pop(st.token, None)
                self.counters.manifest_missing += 1
            return st.verdict
        if not key.startswith(self._prefix) or len(key) > len(self._prefix) + 120:
            self.counters.manifest_refused += 1  # another deployment's, or not a name
            log.warning("kvshm: hand-off manifest name %.200r for request %r is not this "
                        "deployment's (%s...): the request recomputes", key, rid,
                        self._prefix)
            self._reqs[rid] = _Consume(key, [], 0, self._clock(), Verdict.REFUSED)
            return Verdict.REFUSED
        own = keys()
        if self._remembered(key, own):  # collected here already, by a sibling
            self.counters.manifest_reused += 1
            st = self._reqs[rid] = _Consume(key, own, 0, self._clock())
            self._judge(rid, st, self._done.get(key))
            return st.verdict
        if not self.index.healthy():
            self.counters.unhealthy += 1  # no wait for a manifest nobody can read
            return Verdict.REFUSED
        st = self._reqs[rid] = _Consume(key, own, self._ask(rid, key), self._clock())
        return st.verdict

    def _remembered(self, key: str, own: Sequence[bytes]) -> bool:
        """Whether ``key``'s manifest is judged from memory: remembered, matching the
        request's own prefix and not expired. One that does not match (a reused request
        id, a hostile name) or has expired is not used: the server is asked, as without
        the memory (an expired entry is forgotten: a fresh publication may follow)."""
        raw = self._done.get(key)
        if raw is None:
            return False
        m, ok = self._read(raw, own)
        if m is not None and m.expires_at < self._wall():
            self._done.discard(key)
            return False
        return ok

    def _ask(self, rid: str, key: str) -> int:
        token = self._next_token
        self._next_token -= 1
        self._tokens[token] = rid
        self.index.get_value(token, key)
        return token

    def poll(self) -> None:
        """Apply the manifests that arrived; re-ask a missing one until ``wait_s``. One
        read for a request that ended meanwhile (an orphan) is collected if trusted."""
        for token, raw in self.index.values():
            orphan = self._orphans.pop(token, None)
            if orphan is not None:
                self._collect_orphan(orphan, raw)
                continue
            rid = self._tokens.pop(token, None)
            st = self._reqs.get(rid) if rid is not None else None
            if rid is None or st is None or st.verdict is not Verdict.WAIT:
                continue
            self._judge(rid, st, raw)

    def _read(self, raw: bytes, keys: Sequence[bytes]) -> tuple[Manifest | None, bool]:
        return check_manifest(raw, keys, self.fingerprint, self.world, self.block_size,
                              self._rhash)

    def _judge(self, rid: str, st: _Consume, raw: bytes | None) -> None:
        if raw is None:
            if self._clock() - st.since > self._wait:
                st.verdict = Verdict.REFUSED
                self.counters.manifest_missing += 1
            else:
                st.token = self._ask(rid, st.key)
            return
        m, ok = self._read(raw, st.keys)
        if ok and m is not None and m.expires_at < self._wall():
            st.verdict = Verdict.REFUSED
            self.counters.manifest_expired += 1
            self._collect(st.key, m)  # demoted: its blocks get the ordinary TTL
            return
        st.manifest = m if ok else None
        if not ok:
            st.verdict = Verdict.REFUSED
            self.counters.manifest_refused += 1
            why = "unreadable" if m is None else (
                f"fingerprint {m.fingerprint} / world {m.world} / block size "
                f"{m.block_size}, this engine {self.fingerprint} / {self.world} / "
                f"{self.block_size}, or other block hashes")
            log.warning("kvshm: hand-off manifest %s for request %r refused (%s); the "
                        "request recomputes its prompt", st.key, rid, why)
            return
        st.verdict = Verdict.GO
        self.counters.consumed += 1

    def collected(self, rid: str) -> None:
        """``rid`` fetched its blocks: they get the ordinary TTL (they stay useful as
        cache) and the manifest goes (collected)."""
        st = self._reqs.get(rid)
        if st is not None and st.verdict is Verdict.GO and st.manifest is not None:
            if self._collect(st.key, st.manifest):
                self.counters.collected += 1
            st.manifest = None

    def _collect(self, key: str, m: Manifest) -> bool:
        """Demote ``m``'s blocks, delete it and remember it (False: this very manifest
        was collected here already, by a sibling consumer: nothing to do)."""
        if not self._done.add(key, msgspec.json.encode(m)):
            return False
        hashes = []
        for h in m.hashes:
            try:
                hashes.append(bytes.fromhex(h))
            except ValueError:
                continue
        self._demote(hashes)
        self.index.delete([key])
        return True

    def forget(self, rid: str) -> None:
        """The request ended (not a reset: :meth:`RemoteBook.drop` keeps the consumers;
        its publication, if any, goes on). A manifest it trusted but never collected
        (nothing was fetched: the decoder held every block, or the server no longer did)
        is collected now: it has served its one consumer. One still being read becomes
        an orphan: collected when it arrives, if trusted (dropped after ``2 * wait_s``,
        counted)."""
        st = self._reqs.pop(rid, None)
        if st is None:
            return
        if st.verdict is Verdict.WAIT and self._tokens.pop(st.token, None) is not None:
            self._orphans[st.token] = st
            return
        self._tokens.pop(st.token, None)
        if (st.verdict is Verdict.GO and st.manifest is not None
                and self._collect(st.key, st.manifest)):
            self.counters.collected += 1

    def _collect_orphan(self, st: _Consume, raw: bytes | None) -> None:
        """An ended request's manifest arrived: collected if trusted (an expired one is
        demoted); a missing or untrusted one is left to its TTL and the janitor
        (counted), as is one a sibling collected here already."""
        m, ok = self._read(raw, st.keys) if raw is not None else (None, False)
        if not ok or m is None:
            self.counters.orphans_dropped += 1
            return
        if not self._collect(st.key, m):
            return
        if m.expires_at < self._wall():
            self.counters.manifest_expired += 1
        else:
            self.counters.collected += 1
