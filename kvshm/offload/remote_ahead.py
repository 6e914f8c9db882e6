"""A hand-off's readiness keys, asked while its manifest is still being read.

A decoder's hand-off lookup first reads the manifest, then asks the readiness keys of
the blocks it would fetch (a manifest alone is never trusted). Asked one after the
other, that is two rounds of the index's thread and at least two engine steps; on a
busy engine each wake-up of that thread can wait up to the GIL's switch interval.
:class:`AskAhead` lets the remote book send the readiness query *with* each manifest
read (the same drain of the index's queue: one wake-up, one batch of rounds) and use
its answer when the manifest is trusted. The index reads the manifest first and the
readiness keys after it in that batch (:meth:`ValkeyReadyIndex._round
<kvshm.remote.valkey_index.ValkeyReadyIndex._round>`): a manifest found means its
readiness keys were written before it, so the answer that came with it is full but for
an eviction.

Rules (safety first: the answer is used only when it can change nothing):

* An answer is used only for exactly the keys it asked (the fetch range of the lookup
  that is trusted now) and only when every key was present. Anything less (an answer
  still in flight, another range, a shorter prefix: e.g. an answer from a read before
  the manifest existed, or blocks evicted meanwhile) is thrown away and the book asks
  the ordinary way, as without this object.
* A present readiness key says every rank stored that block when it was read; so does
  the ordinary query's answer, which is also read before the GET. Using one read a
  round earlier trusts nothing more: the GET still checks every block's header and
  checksum, a missing block fails the job (recompute).
* At most one query per request is in flight; a short answer is asked again with the
  next manifest read (the manifest may not exist yet: the prefill side writes it after
  the readiness keys), never before it: the book passes the count of the request's
  manifest reads, and a query is sent at most once per read. (Asked again at every
  lookup, the query ran at the index's round-trip rate while a manifest was missing.)

Tokens are the book's (positive, never colliding with its fetch queries': one counter).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AskAhead"]


@dataclass(slots=True, eq=False)
class _Ahead:
    token: int
    keys: list[bytes]  # the CPU keys whose readiness keys were asked, in order
    read: int  # the manifest read it went with (its count)
    present: int | None = None  # the answer; None while in flight


class AskAhead:
    """See the module docstring: per request, its one readiness query sent beside its
    manifest read, and the answer."""

    def __init__(self) -> None:
        self._reqs: dict[str, _Ahead] = {}
        self._tokens: dict[int, str] = {}

    def wants(self, rid: str, keys: list[bytes], read: int) -> bool:
        """Whether ``rid``'s lookup should send a query for ``keys`` now, its manifest
        read ``read`` times so far: none is in flight, none went with this read, and no
        full answer for exactly these keys is held."""
        st = self._reqs.get(rid)
        if st is None:
            return True
        if st.present is None or st.read == read:
            return False
        return not (st.keys == keys and st.present == len(keys))

    def asked(self, rid: str, token: int, keys: list[bytes], read: int) -> None:
        """The book sent query ``token`` for ``keys`` for ``rid`` with its manifest read
        ``read`` (replacing any other)."""
        self._reqs[rid] = _Ahead(token, keys, read)
        self._tokens[token] = rid

    def answered(self, token: int, present: int) -> bool:
        """An answer from the index: True if ``token`` was one of these queries (an
        answer for a request gone meanwhile is dropped here too)."""
        rid = self._tokens.pop(token, None)
        if rid is None:
            return False
        st = self._reqs.get(rid)
        if st is not None and st.token == token:
            st.present = present
        return True

    def take(self, rid: str, keys: list[bytes]) -> bool:
        """``rid``'s manifest is trusted and it would fetch ``keys``: True when its
        answer covers exactly these keys, every one present (use it: no query); else
        False (ask the ordinary way). Either way the request's entry is forgotten."""
        st = self._reqs.get(rid)
        self.forget(rid)
        return st is not None and st.keys == keys and st.present == len(keys)

    def forget(self, rid: str) -> None:
        """Drop ``rid``'s entry. A reply still in flight is still recognised as one of
        these queries (and ignored) when it comes: the index answers every query."""
        self._reqs.pop(rid, None)

    def __len__(self) -> int:
        return len(self._reqs)
