"""The decode side of a P/D hand-off: reading, judging and collecting manifests (the
protocol: :mod:`kvshm.offload.pd.handoffs`).

A lookup whose params carry ``do_remote_prefill`` and ``kvshm_manifest`` reads the
manifest asynchronously (:meth:`Consumers.consume`: "ask again" until it arrives),
checks it against the request's own prefix and only then lets the ordinary remote
lookup run. A consumer that loaded the blocks collects the manifest (deletes it, its
blocks demoted); so does one that trusted it but fetched nothing, when its request ends
-- only when it is the manifest's owner (:func:`~kvshm.offload.pd.manifest.handoff_owner`):
any other request that matches its prefix reads the blocks as ordinary cache, and
deletes or re-times nothing.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from kvshm.offload.pd.collected import CollectedManifests
from kvshm.offload.pd.manifest import (
    MANIFEST_PARAM,
    NAME_MAX,
    PD_PREFIX,
    Manifest,
    PdCounters,
    Verdict,
    checked_hashes,
    handoff_owner,
    key_owner,
    remote_prefill,
)
from kvshm.offload.pd.scope import HandoffScope
from kvshm.offload.validate import text_ok
from kvshm.ratelog import RateLimitedLog

__all__ = ["REASK_FRACTION", "REASK_MAX_S", "REASK_MIN_S", "Consumers", "reask_delay"]

log = logging.getLogger("kvshm.remote")
#: A client chooses the params: one line per kind of refusal per interval.
rlog = RateLimitedLog(log)

#: A manifest not there yet is read again after a delay that grows with the time its
#: request has waited: this fraction of it, at least :data:`REASK_MIN_S`, at most
#: :data:`REASK_MAX_S` -- a manifest that appears is found at most that much later
#: (a decoder that waited 100 ms for its prefill: 6.25 ms more at most). Read again at
#: once, each waiting request cost one round trip per index round, 600 a second here
#: for the whole wait (5 s), and the index's thread as many wake-ups: a dead prefill
#: engine's 100 early-routed requests held 60,000 reads a second against the server.
REASK_FRACTION: Final = 1 / 16
REASK_MIN_S: Final = 0.001
REASK_MAX_S: Final = 0.010


def reask_delay(waited_s: float) -> float:
    """How long after a "not there" answer a manifest is read again, its request having
    waited ``waited_s`` so far (see :data:`REASK_FRACTION`)."""
    return min(REASK_MAX_S, max(REASK_MIN_S, waited_s * REASK_FRACTION))


@dataclass(slots=True, eq=False)
class _Consume:
    rid: str
    key: str
    keys: list[bytes]  # the request's CPU keys from position 0
    owner: bool  # the request is the owner the manifest's name names: it may collect
    since: float
    token: int = 0  # the read in flight; 0: none (WAIT: one is due at ask_at)
    verdict: Verdict = Verdict.WAIT
    manifest: Manifest | None = None
    sent: float = 0.0  # when the last read was sent
    ask_at: float = 0.0
    reads: int = 0  # manifest reads sent for the request
    raw: bytes = b""  # the manifest as read (what its collection deletes, if unchanged)


class Consumers:
    """Each hand-off request's manifest read and verdict, on one decode engine.

    Owns each consuming request's read (its manifest name, own prefix, pending token,
    verdict and the manifest it trusted), the tokens of the reads in flight, the
    *orphans* (reads of requests that ended before the answer came) and the memory of
    the manifests this engine collected (:class:`CollectedManifests`, for siblings of
    one hand-off). Counts into the hand-offs' shared
    :class:`~kvshm.offload.pd.manifest.PdCounters`.

    Invariants and ordering:

    * A verdict leaves WAIT once: GO only for a manifest that is readable, this
      engine's (fingerprint, world size, block size), not expired and whose hashes are
      the request's own prefix; anything else is REFUSED (counted) and the request
      recomputes. A missing manifest is asked again until ``wait_s``, each time after
      :func:`reask_delay` (due reads are sent by :meth:`poll`); an answer that never
      comes at all refuses after ``2 * wait_s``. A WAIT request has either one read in
      flight (``token``) or one due (``token`` 0, an entry in the due heap), never both;
      a read is due :func:`reask_delay` after the last one was *sent* (sent at once from
      the answer when that time has passed: an engine whose steps are longer than the
      delay reads once a step, as before).
    * Only the manifest's owner collects it (deletes it, demotes its blocks; also an
      expired one): a request of another owner with a GO reads the blocks and nothing
      more (``not_owner``). A collection demotes only the entries that are the
      request's own blocks (``checked_hashes``; the others: ``entries_unchecked``).
    * A name outside this deployment's prefix is refused unread.
    * A manifest is collected (demoted and deleted) at most once per publication: the
      memory remembers its bytes, a sibling's second collection does nothing, a new
      publication under a reused name is collected again. The memory is used only for
      a manifest matching the request's prefix and not expired.
    * A request's end (:meth:`forget`) collects a manifest it trusted but never
      collected; a read still in flight (or due: it is sent at once) becomes an orphan,
      collected when it arrives if trusted. A "not there" answer to an orphan is read
      again as a request's would be, until ``wait_s`` (a request that ends quickly --
      one that reads no cache -- usually ends before its prefill publishes); an
      untrusted one, or none by then, is dropped (``orphans_dropped``; also after
      ``2 * wait_s``).
    * Tokens are negative (never colliding with the remote book's queries).
    """

    def __init__(self, scope: HandoffScope, counters: PdCounters, *, wait_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self._scope = scope
        self.counters = counters
        self._prefix = f"{PD_PREFIX}:{scope.fingerprint}:{scope.world}:"
        self._wait = wait_s
        self._clock, self._wall = clock, wall
        self._reqs: dict[str, _Consume] = {}
        self._tokens: dict[int, str] = {}
        self._done = CollectedManifests()  # for a sibling consumer of one hand-off
        self._orphans: dict[int, _Consume] = {}  # token -> an ended request's unread read
        self._orphans_due: dict[int, _Consume] = {}  # heap seq -> an orphan's read due
        self._due: list[tuple[float, int, _Consume]] = []  # heap: (ask_at, seq, consumer)
        # of the reads due; stale entries (gone, answered or asked since) are skipped
        self._seq = itertools.count()
        self._next_token = -1  # negative: never collides with the remote book's

    def expire(self) -> None:
        """Drop orphan reads not answered within ``2 * wait_s`` (counted)."""
        now = self._clock()
        for token in [t for t, o in self._orphans.items() if now - o.since > 2 * self._wait]:
            del self._orphans[token]  # its answer never came: left to the manifest's TTL
            self.counters.orphans_dropped += 1
        for seq in [q for q, o in self._orphans_due.items() if now - o.since > 2 * self._wait]:
            del self._orphans_due[seq]
            self.counters.orphans_dropped += 1

    def consume(self, rid: str, params: Any, keys: Callable[[], list[bytes]]
                ) -> Verdict | None:
        """A lookup of ``rid``: None when it is no hand-off; else where its manifest
        stands. ``keys()``: the request's CPU keys from position 0 (asked once)."""
        key = params.get(MANIFEST_PARAM) if isinstance(params, Mapping) else None
        if not isinstance(key, str) or not remote_prefill(params):
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
        if not key.startswith(self._prefix) or len(key) > len(self._prefix) + NAME_MAX \
                or not text_ok(key):  # (one glide cannot encode failed the batch of every
            # request's index commands, and the server was blamed: a hostile probe)
            self.counters.manifest_refused += 1  # another deployment's, or not a name
            rlog.warning("foreign_name",
                         "kvshm: hand-off manifest name %.200r for request %r is no name "
                         "of this deployment's (%s...): the request recomputes", key, rid,
                         self._prefix)
            self._reqs[rid] = _Consume(rid, key, [], False, self._clock(),
                                       verdict=Verdict.REFUSED)
            return Verdict.REFUSED
        own, owner = keys(), key_owner(key, self._prefix) == handoff_owner(rid)
        if self._remembered(key, own):  # collected here already, by a sibling
            self.counters.manifest_reused += 1
            st = self._reqs[rid] = _Consume(rid, key, own, owner, self._clock())
            self._judge(rid, st, self._done.get(key))
            return st.verdict
        if not self._scope.index.healthy():
            self.counters.unhealthy += 1  # no wait for a manifest nobody can read
            return Verdict.REFUSED
        st = self._reqs[rid] = _Consume(rid, key, own, owner, self._clock())
        self._read(st)
        return st.verdict

    def _remembered(self, key: str, own: Sequence[bytes]) -> bool:
        """Whether ``key``'s manifest is judged from memory: remembered, matching the
        request's own prefix and not expired. One that does not match (a reused request
        id, a hostile name) or has expired is not used: the server is asked, as without
        the memory (an expired entry is forgotten: a fresh publication may follow)."""
        raw = self._done.get(key)
        if raw is None:
            return False
        m, ok = self._scope.read(raw, own)
        if m is not None and m.expires_at < self._wall():
            self._done.discard(key)
            return False
        return ok

    def _send(self, st: _Consume) -> int:
        """Send a read of ``st``'s manifest: its token (stamped, counted)."""
        token = self._next_token
        self._next_token -= 1
        st.token, st.sent = token, self._clock()
        st.reads += 1
        self._scope.index.get_value(token, st.key)
        return token

    def _read(self, st: _Consume) -> None:
        """Read the manifest for ``st``'s live request."""
        self._tokens[self._send(st)] = st.rid

    def _read_orphan(self, st: _Consume) -> None:
        """Read the manifest for ``st``, whose request ended."""
        self._orphans[self._send(st)] = st

    def _again(self, st: _Consume, now: float, orphan: bool) -> None:
        """``st``'s last read found nothing: read again :func:`reask_delay` after it was
        sent -- at once if that has passed, else from the due heap."""
        at = st.sent + reask_delay(st.sent - st.since)
        if at <= now:
            (self._read_orphan if orphan else self._read)(st)
            return
        st.token, st.ask_at = 0, at
        seq = next(self._seq)
        if orphan:
            self._orphans_due[seq] = st
        heapq.heappush(self._due, (at, seq, st))

    def poll(self) -> None:
        """Apply the manifests that arrived; re-ask a missing one until ``wait_s``. One
        read for a request that ended meanwhile (an orphan) is collected if trusted."""
        for token, raw in self._scope.index.values():
            orphan = self._orphans.pop(token, None)
            if orphan is not None:
                self._collect_orphan(orphan, raw)
                continue
            rid = self._tokens.pop(token, None)
            st = self._reqs.get(rid) if rid is not None else None
            if rid is None or st is None or st.verdict is not Verdict.WAIT:
                continue
            self._judge(rid, st, raw)
        due = self._due
        if due and due[0][0] <= self._clock():
            self._send_due(self._clock())

    def _send_due(self, now: float) -> None:
        """Send the manifest reads due by ``now`` (a live request's, or an orphan's)."""
        due = self._due
        while due and due[0][0] <= now:
            at, seq, st = heapq.heappop(due)
            if self._orphans_due.pop(seq, None) is not None:
                self._read_orphan(st)
            elif self._reqs.get(st.rid) is st and st.verdict is Verdict.WAIT \
                    and st.token == 0 and st.ask_at == at:
                self._read(st)

    def reads(self, rid: str) -> int:
        """Manifest reads sent so far for ``rid`` (0: not a consumer here)."""
        st = self._reqs.get(rid)
        return 0 if st is None else st.reads

    def _judge(self, rid: str, st: _Consume, raw: bytes | None) -> None:
        if raw is None and self._remembered(st.key, st.keys):
            # collected here meanwhile (an orphan of an earlier request under this id,
            # or a sibling): judged from memory, not waited for until wait_s (a review)
            self.counters.manifest_reused += 1
            raw = self._done.get(st.key)
        if raw is None:
            now = self._clock()
            if now - st.since > self._wait:
                st.verdict = Verdict.REFUSED
                self.counters.manifest_missing += 1
            else:  # read again later: a missing manifest is not polled at the RTT's rate
                self._again(st, now, orphan=False)
            return
        st.raw = raw
        m, ok = self._scope.read(raw, st.keys)
        if ok and m is not None and m.expires_at < self._wall():
            st.verdict = Verdict.REFUSED
            self.counters.manifest_expired += 1
            self._collect(st, m)  # its owner demotes it: its blocks get the ordinary TTL
            return
        st.manifest = m if ok else None
        if not ok:
            st.verdict = Verdict.REFUSED
            self.counters.manifest_refused += 1
            scope = self._scope
            why = "unreadable" if m is None else (
                f"fingerprint {m.fingerprint} / world {m.world} / block size "
                f"{m.block_size}, this engine {scope.fingerprint} / {scope.world} / "
                f"{scope.block_size}, or other block hashes")
            rlog.warning("refused",
                         "kvshm: hand-off manifest %s for request %r refused (%s); the "
                         "request recomputes its prompt", st.key, rid, why)
            return
        st.verdict = Verdict.GO
        self.counters.consumed += 1
        if not st.owner:
            self.counters.not_owner += 1  # reads the blocks; never collects them

    def collected(self, rid: str) -> None:
        """``rid`` fetched its blocks: they get the ordinary TTL (they stay useful as
        cache) and the manifest goes (collected)."""
        st = self._reqs.get(rid)
        if st is not None and st.verdict is Verdict.GO and st.manifest is not None:
            if self._collect(st, st.manifest):
                self.counters.collected += 1
            st.manifest = None

    def _collect(self, st: _Consume, m: Manifest) -> bool:
        """As ``st``'s request, the owner of trusted ``m``: demote the entries of ``m``
        that are the request's own blocks, delete it and remember it. False, touching
        nothing: the request is not ``m``'s owner, or this very manifest was collected
        here already (by a sibling consumer)."""
        if not st.owner or not self._done.add(st.key, msgspec.json.encode(m)):
            return False
        hashes, unchecked = checked_hashes(m, st.keys, self._scope.remote_hash)
        self.counters.entries_unchecked += unchecked
        self._scope.demote(hashes)
        # compare-and-delete: a manifest published anew under this name since it was
        # read (a proxy retrying the whole request) stays for its own decoder -- a plain
        # DEL removed it, and that decoder waited its 5 s and recomputed (a hostile probe)
        self._scope.index.delete_if_same(st.key, st.raw)
        return True

    def forget(self, rid: str) -> None:
        """The request ended (not a reset: the remote book's ``drop`` keeps the
        consumers). A manifest it trusted but never collected (nothing was fetched: the
        decoder held every block, or the server no longer did) is collected now: it has
        served its one consumer. One still being read becomes an orphan: collected when
        it arrives, if trusted (dropped after ``2 * wait_s``, counted)."""
        st = self._reqs.pop(rid, None)
        if st is None:
            return
        if st.verdict is Verdict.WAIT and st.token == 0:  # a read due: send it now
            self._read_orphan(st)
            return
        if st.verdict is Verdict.WAIT and self._tokens.pop(st.token, None) is not None:
            self._orphans[st.token] = st
            return
        self._tokens.pop(st.token, None)
        if (st.verdict is Verdict.GO and st.manifest is not None
                and self._collect(st, st.manifest)):
            self.counters.collected += 1

    def _collect_orphan(self, st: _Consume, raw: bytes | None) -> None:
        """An ended request's manifest read answered: collected if trusted (an expired
        one is demoted); a missing one is read again until ``wait_s`` (its prefill may
        still publish); an untrusted one, or one still missing then, is left to its TTL
        and the janitor (counted), as is one a sibling collected here already."""
        if raw is None and self._clock() - st.since <= self._wait:
            self._again(st, self._clock(), orphan=True)  # the prefill may publish yet
            return
        m, ok = self._scope.read(raw, st.keys) if raw is not None else (None, False)
        if not ok or m is None or raw is None:
            self.counters.orphans_dropped += 1
            return
        st.raw = raw
        if not st.owner:
            self.counters.not_owner += 1  # read, never collected by another owner
            return
        if not self._collect(st, m):
            return
        if m.expires_at < self._wall():
            self.counters.manifest_expired += 1
        else:
            self.counters.collected += 1
