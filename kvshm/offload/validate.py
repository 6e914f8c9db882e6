"""Input checks of :class:`~kvshm.offload.manager.OffloadManager`'s public calls.

Rule: ``lookup``, ``allocated``, ``build_step`` and ``finished`` check their whole input
before they change anything, and refuse bad input with one error,
:class:`~kvshm.errors.InvalidRequest` (a ``ConfigError`` naming the call, the request id
and the field). After a refusal the manager is exactly as before, but for
``counters.invalid_calls``. What was checked is what is used: the checks hand on the
values they read (block tables as tuples of ints; a listed request that is not a plain
``ScheduledRequest`` of plain fields as a normalized copy), and the call reads nothing of
its input again.

Valid input:

* a request id is a ``str``; a step number and a token count an ``int`` in
  ``[0, 2**63)`` (a step number travels in the workers' messages, whose ints are 64-bit;
  ``bool`` and ``float`` are not ints here); flags are ``bool``;
* a GPU block id is an ``int`` in ``[0, gpu.num_blocks)``; within the ids one call hands
  over for one group (a whole table, or the ids a step appends to it) none appears twice
  but the engine's ``null_block_id`` (vLLM's placeholder for a sliding-window block),
  which a full-attention group's ids never hold (its blocks are stored and loaded: the
  null block's bytes would be cached under a real prefix, and a load would write it);
  a call hands over exactly one table per KV group;
* a block hash is ``bytes`` of the engine's hash length (``gpu.hash_bytes``, or the
  manager's ``hash_bytes`` argument; where neither says, any length in
  :data:`HASH_LEN_RANGE`); a request has at most one hash per full block:
  ``len(block_hashes) <= num_tokens // block_size``; a lookup's
  ``num_local_tokens <= num_tokens``;
* ``kv_transfer_params`` is None or a mapping.

Which hashes: a request's ``block_hashes`` may be the engine's live, growing sequence, so
a call checks the entries it reads -- ``lookup`` those from the engine's own hit up to
the lookup cap (a P/D hand-off's: every one from position 0, which its manifest check
reads, up to the block holding token ``num_tokens - 2``, its hit's end), a step those
its store walk may reach (``[cursor, ready)``), ``finished`` those its finish-time store
may reach -- and ``finished``'s explicit ``block_hashes`` in full. An entry no call
reads is never used.

Other refusals: a listing that cannot be read at all (an entry without a
ScheduledRequest's fields, an unhashable id) is refused as a whole, naming the entry; a
request may carry a change only once per step (listed twice with one, the second would be
applied against state the first one changed).

Cost: a call pays O(the ids and hashes it hands over or reads). ``build_step`` checks a
listed request in full only when it carries a change (new, resumed, preempted, ids
appended, a new block confirmed): that is where it costs O(its new ids). An *unchanged*
listed request -- up to 16k of them in every decode step -- is checked in what the step
reads of it and nothing more: its id is known, both flags are exactly False (identity
tests, as cheap as the truth tests they replace), nothing is appended, and
``num_confirmed_tokens // block_size`` is at least 0 (one compare more than before) and
below its next watched block (see :mod:`kvshm.offload.requests`). So a count of the wrong type
that stays below the next block boundary, and the fields a step does not read of an
unchanged request, are not looked at: nothing uses them, and a type test per listed
request measured 0.04 - 0.1 us, 0.6 - 1.6 ms a step at 16k requests.

Layout: this module states the rules and holds the field checks (:class:`InputCheck`:
scalars, hashes, block ids, tables); :mod:`kvshm.offload.inputs` composes them into one
check per call (``CallCheck``, built by ``for_pool``), and the tracker
(:mod:`kvshm.offload.requests`) runs the per-request part of a step's listing.
"""

from __future__ import annotations

import reprlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Final

from kvshm.errors import InvalidRequest
from kvshm.hashing import BlockHash
from kvshm.offload.counters import ManagerCounters
from kvshm.types import no_new_blocks

__all__ = ["COUNT_LIMIT", "HASH_LEN_RANGE", "NOT_SEQUENCES", "InputCheck", "Tables",
           "describe"]

Tables = tuple[tuple[int, ...], ...]
"""Checked block tables: one tuple of GPU block ids per KV group."""

HASH_LEN_RANGE: Final = (8, 64)
"""Hash lengths accepted when the engine does not name its own: kvshm's hashes are 16
bytes (:data:`kvshm.hashing.HASH_BYTES`), vLLM's 32 (sha256) or 16 (xxh3-128)."""

NOT_SEQUENCES = (str, bytes, bytearray, memoryview)
"""Sequences that are never a sequence of ids or hashes (a str is not a list of hashes)."""
UNORDERED = (AbstractSet, Mapping)
"""Iterables whose order means nothing: never a block table (its positions are the
prefix's blocks in order)."""
_SHORT = 8
"""Up to this many ids or hashes are checked one by one; more in C."""
COUNT_LIMIT: Final = 1 << 63
"""Token counts and step numbers are below this: a step number is posted to the ranks
(msgpack carries 64-bit ints; 2**64 failed the post after the step was planned, its
pins held for good)."""
_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 40


def text_ok(s: str) -> bool:
    """``s`` can be encoded as UTF-8 (no lone surrogate, which a JSON body may carry
    and Python's ``json`` accepts). A request id without it raised UnicodeEncodeError
    -- no InvalidRequest -- from the first call that encoded it (a P/D hand-off's
    manifest name), after that call had changed state (a hostile probe). ASCII, the
    usual case, is one C test."""
    if s.isascii():
        return True
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


def describe(value: object) -> str:
    """A short description of a refused value: its type and a clipped repr."""
    return f"{type(value).__name__} {_repr.repr(value)}"


class InputCheck:
    """The field checks, bound to one manager's limits (``for_pool`` in
    :mod:`kvshm.offload.inputs` builds them). Every refusal goes through :meth:`refuse`,
    which counts it: ``raise check.refuse(...)``."""

    __slots__ = ("block_size", "counters", "hash_max", "hash_min", "n_groups", "no_new",
                 "null_block_id", "num_gpu_blocks", "null_refused", "null_checked")

    def __init__(self, *, n_groups: int, block_size: int, num_gpu_blocks: int,
                 hash_bytes: int | None, null_block_id: int | None,
                 counters: ManagerCounters, full_groups: Sequence[int] = ()) -> None:
        self.n_groups = n_groups
        #: per group: the null block's id where it is refused (a full-attention group),
        #: None where it may appear (a sliding-window group; or no null block)
        self.null_refused: tuple[int | None, ...] = tuple(
            null_block_id if g in full_groups else None for g in range(n_groups))
        #: some group refuses the null block (else the scans for it are skipped)
        self.null_checked = any(n is not None for n in self.null_refused)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.hash_min, self.hash_max = (HASH_LEN_RANGE if hash_bytes is None
                                        else (hash_bytes, hash_bytes))
        self.null_block_id = null_block_id
        self.counters = counters
        self.no_new = no_new_blocks(n_groups)

    def refuse(self, call: str, req_id: str | None, field: str, problem: str) -> InvalidRequest:
        """The error to raise for a refused call (counted in ``invalid_calls``)."""
        self.counters.invalid_calls += 1
        return InvalidRequest(call, req_id, field, problem)

    # ---- scalars -------------------------------------------------------------------

    def req_id(self, call: str, value: object) -> str:
        if not isinstance(value, str):
            raise self.refuse(call, None, "req_id", f"must be a str, got {describe(value)}")
        if not text_ok(value):
            raise self.refuse(call, None, "req_id",
                              f"must be text that UTF-8 can encode, got {value!a:.80}")
        return value

    def count(self, call: str, rid: str | None, field: str, value: object) -> int:
        """A token count (or step number): an int in ``[0, COUNT_LIMIT)``."""
        if type(value) is not int or not 0 <= value < COUNT_LIMIT:
            raise self.refuse(call, rid, field,
                              f"must be an int in [0, 2**63), got {describe(value)}")
        return value

    def flag(self, call: str, rid: str, field: str, value: object) -> bool:
        if type(value) is not bool:
            raise self.refuse(call, rid, field, f"must be a bool, got {describe(value)}")
        return value

    def params(self, call: str, rid: str, value: object) -> Mapping[str, Any] | None:
        if value is not None and not isinstance(value, Mapping):
            raise self.refuse(call, rid, "kv_transfer_params",
                              f"must be None or a mapping, got {describe(value)}")
        return value

    # ---- hashes --------------------------------------------------------------------

    def hash_seq(self, call: str, rid: str, field: str, value: object) -> Sequence[BlockHash]:
        """A sequence of hashes (its entries are checked where they are read)."""
        if type(value) is list or type(value) is tuple:
            return value
        if isinstance(value, NOT_SEQUENCES) or not isinstance(value, Sequence):
            raise self.refuse(call, rid, field,
                              f"must be a sequence of bytes, got {describe(value)}")
        return value

    def hashes(self, call: str, rid: str, field: str, seq: Sequence[BlockHash], lo: int,
               hi: int) -> None:
        """Entries ``[lo, hi)`` of ``seq`` (``hi <= len(seq)``) are hashes. A few are
        checked one by one, many in C (type and length sets of a slice)."""
        if hi - lo <= _SHORT:
            least, most = self.hash_min, self.hash_max
            for i in range(lo, hi):
                h = seq[i]
                if type(h) is not bytes or not least <= len(h) <= most:
                    self._hash(call, rid, field, i, h)
            return
        if type(seq) is list or type(seq) is tuple:
            chunk = seq[lo:hi]
            if set(map(type, chunk)) == {bytes}:
                lens = set(map(len, chunk))
                if min(lens) >= self.hash_min and max(lens) <= self.hash_max:
                    return
        for i in range(lo, hi):
            self._hash(call, rid, field, i, seq[i])

    def _hash(self, call: str, rid: str, field: str, i: int, h: object) -> None:
        problem = self._hash_problem(h)
        if problem is not None:
            raise self.refuse(call, rid, f"{field}[{i}]", problem)

    def _hash_problem(self, h: object) -> str | None:
        """What is wrong with ``h`` as a block hash (None: nothing)."""
        if type(h) is not bytes:
            return f"a block hash must be bytes, got {describe(h)}"
        if not self.hash_min <= len(h) <= self.hash_max:
            want = (str(self.hash_min) if self.hash_min == self.hash_max
                    else f"{self.hash_min}..{self.hash_max}")
            return f"a block hash must be {want} bytes, got {len(h)}"
        return None

    def all_hashes(self, call: str, rid: str, field: str, value: object) -> tuple[BlockHash, ...]:
        """A whole sequence of hashes, every entry checked (a one-off argument)."""
        seq = self.hash_seq(call, rid, field, value)
        out = tuple(seq)
        self.hashes(call, rid, field, out, 0, len(out))
        return out

    def tail(self, call: str, rid: str, value: object, num_tokens: int) -> BlockHash | None:
        """A partial last block's hash (``tail_hash``): None, or a hash when
        ``num_tokens`` does not end on a block boundary (else there is no partial block
        to name)."""
        if value is None:
            return None
        problem = self._hash_problem(value)
        if problem is not None:
            raise self.refuse(call, rid, "tail_hash", problem)
        assert type(value) is bytes  # _hash_problem checked it
        if num_tokens % self.block_size == 0:
            raise self.refuse(call, rid, "tail_hash",
                              f"names a partial last block, but {num_tokens} tokens end "
                              f"on a block boundary (block_size {self.block_size})")
        return value

    def hash_count(self, call: str, rid: str, hashes: Sequence[BlockHash],
                   num_tokens: int) -> None:
        """At most one hash per full block of ``num_tokens``."""
        if len(hashes) * self.block_size > num_tokens:
            raise self.refuse(call, rid, "block_hashes",
                              f"{len(hashes)} hashes for {num_tokens} tokens: at most "
                              f"{num_tokens // self.block_size} full blocks of "
                              f"{self.block_size}")

    # ---- block ids -----------------------------------------------------------------

    def ids_ok(self, t: tuple[Any, ...]) -> bool:
        """Fast verdict on a tuple of GPU block ids: ints in range, none repeated but
        the null block's (a few checked one by one, many in C)."""
        n = self.num_gpu_blocks
        if len(t) == 1:
            b = t[0]
            return type(b) is int and 0 <= b < n
        if len(t) <= _SHORT:
            for b in t:
                if type(b) is not int or not 0 <= b < n:
                    return False
        elif set(map(type, t)) != {int} or min(t) < 0 or max(t) >= n:
            return False
        return len(t) < 2 or len(set(t)) == len(t) or self._null_repeats_only(t)

    def tuples_ok(self, tables: tuple[Any, ...]) -> bool:
        """Every entry a tuple of good ids (:meth:`ids_ok`), no refused null block
        (:meth:`null_free`); one appended id -- the usual change of a decode step -- is
        checked inline."""
        n = self.num_gpu_blocks
        for t in tables:
            if type(t) is not tuple:
                return False
            if len(t) == 1:
                b = t[0]
                if type(b) is not int or not 0 <= b < n:
                    return False
            elif t and not self.ids_ok(t):
                return False
        return not self.null_checked or not any(
            null is not None and null in t
            for t, null in zip(tables, self.null_refused, strict=True))

    def null_free(self, call: str, rid: str | None, field: str, tables: Tables) -> Tables:
        """``tables`` (good ids, one per group), refused where a full-attention group's
        holds the null block."""
        if not self.null_checked:
            return tables
        for g, (t, null) in enumerate(zip(tables, self.null_refused, strict=True)):
            if null is not None and null in t:
                raise self.refuse(call, rid, f"{field}[{g}][{t.index(null)}]",
                                  f"the null block {null} in a full-attention group's "
                                  "table")
        return tables

    def _null_repeats_only(self, t: tuple[int, ...]) -> bool:
        null = self.null_block_id
        return null is not None and len(set(t)) + t.count(null) - 1 == len(t)

    def ids(self, call: str, rid: str | None, field: str, value: object) -> tuple[int, ...]:
        """GPU block ids (see :meth:`ids_ok`), as a tuple; refused naming the first bad
        one."""
        if type(value) is tuple:
            t: tuple[Any, ...] = value
        elif type(value) is list:
            t = tuple(value)
        elif isinstance(value, NOT_SEQUENCES) or not isinstance(value, Iterable) \
                or isinstance(value, UNORDERED):  # (a set's order is not a table's)
            raise self.refuse(call, rid, field,
                              f"must be a sequence of block ids, got {describe(value)}")
        else:
            t = tuple(value)
        if not self.ids_ok(t):
            self.bad_id(call, rid, field, t)
            self._repeated_id(call, rid, field, t)
            raise self.refuse(call, rid, field, f"bad block ids {describe(t)}")
        return t

    def bad_id(self, call: str, rid: str | None, field: str, t: tuple[Any, ...]) -> None:
        n = self.num_gpu_blocks
        for i, b in enumerate(t):
            if type(b) is not int:
                raise self.refuse(call, rid, f"{field}[{i}]",
                                  f"a block id must be an int, got {describe(b)}")
            if not 0 <= b < n:
                raise self.refuse(call, rid, f"{field}[{i}]",
                                  f"block id {b} out of range: the GPU pool has {n} blocks")

    def _repeated_id(self, call: str, rid: str | None, field: str, t: tuple[int, ...]) -> None:
        for b, k in Counter(t).items():
            if k > 1 and b != self.null_block_id:
                raise self.refuse(call, rid, field, f"block id {b} appears {k} times")

    def tables(self, call: str, rid: str | None, field: str,
               value: object) -> Tables:
        """One id sequence per KV group, as a tuple of tuples (lists and tuples of good
        ids take a fast path; anything else is checked field by field)."""
        if (type(value) is tuple or type(value) is list) and len(value) == self.n_groups:
            out = []
            for t in value:
                if type(t) is list:
                    t = tuple(t)
                elif type(t) is not tuple:
                    break
                if not self.ids_ok(t):
                    break
                out.append(t)
            else:
                return self.null_free(call, rid, field, tuple(out))
        if isinstance(value, NOT_SEQUENCES) or not isinstance(value, Sequence):
            raise self.refuse(call, rid, field,
                              f"must be one sequence of block ids per KV group, got "
                              f"{describe(value)}")
        if len(value) != self.n_groups:
            raise self.refuse(call, rid, field, f"{len(value)} block tables, expected "
                              f"{self.n_groups} (one per KV group)")
        return self.null_free(call, rid, field, tuple(
            self.ids(call, rid, f"{field}[{g}]", t) for g, t in enumerate(value)))
