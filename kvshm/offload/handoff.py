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
(the newest 8 MiB; ``pd_manifest_reused``), judged by the same checks against its own
prefix: collection deletes the manifest, not the blocks (they keep the ordinary TTL).
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

The manifest record, its key and the consumer's hit range: :mod:`kvshm.offload.manifest`
(re-exported here).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvshm.offload.manifest import (
    MANIFEST_BASE,
    MANIFEST_PARAM,
    MANIFEST_PER_BLOCK,
    PD_PREFIX,
    Manifest,
    PdCounters,
    Verdict,
    handoff_extent,
    is_handoff,
    manifest_key,
)
from kvshm.remote.tier import KEY_PREFIX, ReadyIndex, block_key

__all__ = ["MANIFEST_PARAM", "Handoffs", "Manifest", "PdCounters", "Verdict", "handoff_extent",
           "is_handoff", "manifest_key"]

log = logging.getLogger("kvshm.remote")

#: Bytes of collected manifests a decoder remembers for their siblings (newest first).
COLLECTED_BYTES = 8 << 20


@dataclass(slots=True, eq=False)
class _Pub:
    key: str
    keys: list[bytes]
    pending: set[bytes]
    num_tokens: int
    since: float
    tail: int = 0


@dataclass(slots=True, eq=False)
class _Consume:
    key: str
    keys: list[bytes]  # the request's CPU keys from position 0
    token: int
    since: float
    verdict: Verdict = Verdict.WAIT
    manifest: Manifest | None = None


class Handoffs:
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
        # manifests collected here (key -> bytes, newest last, COLLECTED_BYTES at most):
        # a sibling consumer of one hand-off is judged from memory, not the server
        self._done: OrderedDict[str, bytes] = OrderedDict()
        self._done_bytes = 0
        self._next_token = -1  # negative: never collides with the remote book's

    # ---- prefill side ----------------------------------------------------------------

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
        key = manifest_key(self.fingerprint, self.world, rid)
        pending = {k for k in keys if not published(k)}
        self._pubs[rid] = _Pub(key, list(keys), pending, num_tokens, self._clock(), tail)
        for k in pending:
            self._waiting.setdefault(k, set()).add(rid)
        self.counters.published += 1
        if not pending:
            self._write(rid)
        return {"do_remote_prefill": True, "do_remote_decode": False, MANIFEST_PARAM: key}

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
                put.append(self._rhash(k))
                continue
            pub.pending.discard(k)
            rids = self._waiting.get(k)
            if rids is not None:
                rids.discard(rid)
                if not rids:
                    del self._waiting[k]
        if put:
            self._demote(put)
        self.counters.tails_dropped += 1
        if not pub.pending:
            self._write(rid)

    def _write(self, rid: str) -> None:
        pub = self._pubs.pop(rid)
        m = Manifest(1, self.fingerprint, self.world, self.block_size, pub.num_tokens,
                     [self._rhash(k).hex() for k in pub.keys], self._wall() + self._ttl,
                     pub.tail)
        self.index.put_value(pub.key, msgspec.json.encode(m), 2 * self._ttl)
        self.counters.manifests_written += 1

    def _drop(self, rid: str) -> None:
        pub = self._pubs.pop(rid, None)
        if pub is None:
            return
        for k in pub.pending:
            rids = self._waiting.get(k)
            if rids is not None:
                rids.discard(rid)
                if not rids:
                    del self._waiting[k]

    def expire(self) -> None:
        """Drop publications whose blocks were not all put within the publish timeout."""
        now = self._clock()
        for rid in [r for r, p in self._pubs.items()
                    if now - p.since > self._publish_timeout]:
            self._fail(rid)
            self.counters.publish_timeouts += 1

    def _fail(self, rid: str) -> None:
        """A publication that will write no manifest: its blocks put so far (kept, no
        TTL) get the ordinary TTL back, so nothing is pinned on the server for ever."""
        pub = self._pubs.get(rid)
        if pub is not None:
            self._demote([self._rhash(k) for k in pub.keys])
        self._drop(rid)

    def _demote(self, hashes: Sequence[bytes]) -> None:
        """Give blocks (every rank's shard) and their readiness keys the ordinary TTL."""
        keys = [block_key(KEY_PREFIX, self.fingerprint, r, self.world, h)
                for h in hashes for r in range(self.world)]
        self.index.expire(keys + [self._ready_key(h) for h in hashes])

    # ---- decode side -----------------------------------------------------------------

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
        raw = self._done.get(key)
        if raw is not None and self._read(raw, own)[1]:
            # collected here already, by a sibling: judged from memory (one that does
            # not match this request's prefix -- a reused request id -- asks the server)
            self.counters.manifest_reused += 1
            st = self._reqs[rid] = _Consume(key, own, 0, self._clock())
            self._judge(rid, st, raw)
            return st.verdict
        if not self.index.healthy():
            self.counters.unhealthy += 1  # no wait for a manifest nobody can read
            return Verdict.REFUSED
        st = self._reqs[rid] = _Consume(key, own, self._ask(rid, key), self._clock())
        return st.verdict

    def _ask(self, rid: str, key: str) -> int:
        token = self._next_token
        self._next_token -= 1
        self._tokens[token] = rid
        self.index.get_value(token, key)
        return token

    def poll(self) -> None:
        """Apply the manifests that arrived; re-ask a missing one until ``wait_s``."""
        for token, raw in self.index.values():
            rid = self._tokens.pop(token, None)
            st = self._reqs.get(rid) if rid is not None else None
            if rid is None or st is None or st.verdict is not Verdict.WAIT:
                continue
            self._judge(rid, st, raw)

    def _read(self, raw: bytes, keys: Sequence[bytes]) -> tuple[Manifest | None, bool]:
        """Decode a manifest (None: unreadable or too long for ``keys``) and whether it
        passes the checks against this engine and the request's own ``keys``
        (fingerprint, world, block size, the full blocks' hashes; not the expiry)."""
        m = None
        if len(raw) <= MANIFEST_BASE + MANIFEST_PER_BLOCK * len(keys):
            try:
                m = msgspec.json.decode(raw, type=Manifest)
            except msgspec.DecodeError:
                pass
        if m is None:
            return None, False
        full = len(m.hashes) - m.tail
        ok = (m.version == 1 and m.fingerprint == self.fingerprint
              and m.world == self.world and m.block_size == self.block_size
              and 0 <= m.tail < len(m.hashes) and full <= len(keys)
              and [self._rhash(k).hex() for k in keys[:full]] == m.hashes[:full])
        return m, ok

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
        """Demote ``m``'s blocks, delete it and remember it (False: collected here
        already, by a sibling consumer: nothing to do)."""
        if key in self._done:
            return False
        raw = msgspec.json.encode(m)
        self._done[key] = raw
        self._done_bytes += len(raw)
        while self._done_bytes > COLLECTED_BYTES:
            self._done_bytes -= len(self._done.popitem(last=False)[1])
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
        is collected now: it has served its one consumer. One still unread is left to
        its TTL."""
        st = self._reqs.pop(rid, None)
        if st is not None:
            self._tokens.pop(st.token, None)
            if (st.verdict is Verdict.GO and st.manifest is not None
                    and self._collect(st.key, st.manifest)):
                self.counters.collected += 1

    def drop_all(self) -> None:
        """Reset or engine failure: every pending publication is dropped (no manifest)."""
        for rid in list(self._pubs):
            self._drop(rid)
