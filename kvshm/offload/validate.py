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

* a request id is a ``str``; a step number an ``int``; a token count an ``int >= 0``
  (``bool`` and ``float`` are not ints here); flags are ``bool``;
* a GPU block id is an ``int`` in ``[0, gpu.num_blocks)``; within the ids one call hands
  over for one group (a whole table, or the ids a step appends to it) none appears twice
  but the engine's ``null_block_id`` (vLLM's placeholder for a sliding-window block);
  a call hands over exactly one table per KV group;
* a block hash is ``bytes`` of the engine's hash length (``gpu.hash_bytes``, or the
  manager's ``hash_bytes`` argument; where neither says, any length in
  :data:`HASH_LEN_RANGE`); a request has at most one hash per full block:
  ``len(block_hashes) <= num_tokens // block_size``; a lookup's
  ``num_local_tokens <= num_tokens``;
* ``kv_transfer_params`` is None or a mapping.

Which hashes: a request's ``block_hashes`` may be the engine's live, growing sequence, so
a call checks the entries it reads -- ``lookup`` those from the engine's own hit up to
the lookup cap, a step those its store walk may reach (``[cursor, ready)``),
``finished`` those its finish-time store may reach -- and ``finished``'s explicit
``block_hashes`` in full. An entry no call reads is never used.

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
"""

from __future__ import annotations

import reprlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from kvshm.errors import ConfigError, InvalidRequest
from kvshm.types import BlockHash, GpuBlocks, ManagerCounters, ScheduledRequest, no_new_blocks

__all__ = ["HASH_LEN_RANGE", "InputCheck", "Tables", "View", "for_pool"]

Tables = tuple[tuple[int, ...], ...]
"""Checked block tables: one tuple of GPU block ids per KV group."""

HASH_LEN_RANGE: Final = (8, 64)
"""Hash lengths accepted when the engine does not name its own: kvshm's hashes are 16
bytes (:data:`kvshm.hashing.HASH_BYTES`), vLLM's 32 (sha256) or 16 (xxh3-128)."""

_NOT_SEQUENCES = (str, bytes, bytearray, memoryview)
_SHORT = 8
"""Up to this many ids or hashes are checked one by one; more in C."""
_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 40


def describe(value: object) -> str:
    """A short description of a refused value: its type and a clipped repr."""
    return f"{type(value).__name__} {_repr.repr(value)}"


class InputCheck:
    """The checks, bound to one manager's limits. Every refusal goes through
    :meth:`refuse`, which counts it: ``raise check.refuse(...)``."""

    __slots__ = ("block_size", "counters", "hash_max", "hash_min", "n_groups", "no_new",
                 "null_block_id", "num_gpu_blocks")

    def __init__(self, *, n_groups: int, block_size: int, num_gpu_blocks: int,
                 hash_bytes: int | None, null_block_id: int | None,
                 counters: ManagerCounters) -> None:
        self.n_groups = n_groups
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
        return value

    def count(self, call: str, rid: str | None, field: str, value: object) -> int:
        """A token count (or step number): an int >= 0."""
        if type(value) is not int or value < 0:
            raise self.refuse(call, rid, field, f"must be an int >= 0, got {describe(value)}")
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
        if isinstance(value, _NOT_SEQUENCES) or not isinstance(value, Sequence):
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
        if type(h) is not bytes:
            raise self.refuse(call, rid, f"{field}[{i}]",
                              f"a block hash must be bytes, got {describe(h)}")
        if not self.hash_min <= len(h) <= self.hash_max:
            want = (str(self.hash_min) if self.hash_min == self.hash_max
                    else f"{self.hash_min}..{self.hash_max}")
            raise self.refuse(call, rid, f"{field}[{i}]",
                              f"a block hash must be {want} bytes, got {len(h)}")

    def all_hashes(self, call: str, rid: str, field: str, value: object) -> tuple[BlockHash, ...]:
        """A whole sequence of hashes, every entry checked (a one-off argument)."""
        seq = self.hash_seq(call, rid, field, value)
        out = tuple(seq)
        self.hashes(call, rid, field, out, 0, len(out))
        return out

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

    def _tuples_ok(self, tables: tuple[Any, ...]) -> bool:
        """Every entry a tuple of good ids (:meth:`ids_ok`); one appended id -- the
        usual change of a decode step -- is checked inline."""
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
        return True

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
        elif isinstance(value, _NOT_SEQUENCES) or not isinstance(value, Iterable):
            raise self.refuse(call, rid, field,
                              f"must be a sequence of block ids, got {describe(value)}")
        else:
            t = tuple(value)
        if not self.ids_ok(t):
            self._bad_id(call, rid, field, t)
            self._repeated_id(call, rid, field, t)
            raise self.refuse(call, rid, field, f"bad block ids {describe(t)}")
        return t

    def _bad_id(self, call: str, rid: str | None, field: str, t: tuple[Any, ...]) -> None:
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
                return tuple(out)
        if isinstance(value, _NOT_SEQUENCES) or not isinstance(value, Sequence):
            raise self.refuse(call, rid, field,
                              f"must be one sequence of block ids per KV group, got "
                              f"{describe(value)}")
        if len(value) != self.n_groups:
            raise self.refuse(call, rid, field, f"{len(value)} block tables, expected "
                              f"{self.n_groups} (one per KV group)")
        return tuple(self.ids(call, rid, f"{field}[{g}]", t) for g, t in enumerate(value))

    # ---- whole calls ---------------------------------------------------------------

    def listed(self, r: Any) -> ScheduledRequest:
        """Read and check every field of a listed request (an object without a
        ScheduledRequest's fields raises AttributeError: see :meth:`malformed`). A
        ``ScheduledRequest`` whose fields have the plain types (str, list or tuple of
        hashes, ints, bools, None or a dict, a tuple of tuples of ids) is handed back as
        it is -- one inlined test; anything else is checked field by field and handed
        back as a normalized copy."""
        call = "build_step"
        rid, hashes, num_tokens, nb = r.req_id, r.block_hashes, r.num_tokens, r.new_block_ids
        new, confirmed, preempted = r.new_or_resumed, r.num_confirmed_tokens, r.preempted
        params = r.kv_transfer_params
        plain = (type(rid) is str and type(num_tokens) is int and type(confirmed) is int
                 and num_tokens >= 0 and confirmed >= 0 and type(new) is bool
                 and type(preempted) is bool and (type(hashes) is list or type(hashes) is tuple)
                 and (params is None or type(params) is dict))
        if not plain:
            rid = self.req_id(call, rid)
            hashes = self.hash_seq(call, rid, "block_hashes", hashes)
            num_tokens = self.count(call, rid, "num_tokens", num_tokens)
            new = self.flag(call, rid, "new_or_resumed", new)
            confirmed = self.count(call, rid, "num_confirmed_tokens", confirmed)
            preempted = self.flag(call, rid, "preempted", preempted)
            params = self.params(call, rid, params)
        if len(hashes) * self.block_size > num_tokens:
            self.hash_count(call, rid, hashes, num_tokens)
        if nb is not self.no_new and not (type(nb) is tuple and len(nb) == self.n_groups
                                          and self._tuples_ok(nb)):
            nb = self.tables(call, rid, "new_block_ids", nb)
            plain = False
        if plain and type(r) is ScheduledRequest:
            return r
        return ScheduledRequest(rid, hashes, num_tokens, nb, new, confirmed, preempted, params)

    def malformed(self, requests: object, r: object, exc: Exception) -> InvalidRequest:
        """The refusal of a listing whose request ``r`` could not be read at all (not a
        ScheduledRequest, an unhashable id, a count that cannot be divided)."""
        where = "requests"
        if type(requests) is list or type(requests) is tuple:
            idx = next((i for i, x in enumerate(requests) if x is r), None)
            if idx is not None:
                where = f"requests[{idx}]"
        rid = getattr(r, "req_id", None)
        return self.refuse("build_step", rid if isinstance(rid, str) else None, where,
                           f"not a well-formed ScheduledRequest ({type(exc).__name__}: {exc})")

    def step_head(self, step: object, finished: object,
                  allocated: object) -> tuple[int, tuple[str, ...], frozenset[int]]:
        """A StepInput's step number, finished ids and allocated ids."""
        call = "build_step"
        step_no = self.count(call, None, "step", step)
        if isinstance(finished, _NOT_SEQUENCES) or not isinstance(finished, Iterable):
            raise self.refuse(call, None, "finished",
                              f"must be a sequence of request ids, got {describe(finished)}")
        gone = tuple(finished)
        for rid in gone:
            self.req_id(call, rid)
        if isinstance(allocated, _NOT_SEQUENCES) or not isinstance(allocated, Iterable):
            raise self.refuse(call, None, "allocated_block_ids",
                              f"must be a collection of block ids, got {describe(allocated)}")
        ids: tuple[Any, ...] = tuple(allocated)
        if ids and (set(map(type, ids)) != {int} or min(ids) < 0
                    or max(ids) >= self.num_gpu_blocks):
            self._bad_id(call, None, "allocated_block_ids", ids)
        return step_no, gone, frozenset(ids)

    # ---- the manager's calls ---------------------------------------------------------

    def view(self, req: Any, num_local_tokens: object) -> View:
        """``lookup``'s input; checks the hashes it may read (from the engine's hit to
        the lookup cap)."""
        call = "lookup"
        try:
            fields = (req.req_id, req.block_hashes, req.num_tokens, req.kv_transfer_params)
        except AttributeError:
            raise self.refuse(call, None, "req",
                              f"must be a RequestView, got {describe(req)}") from None
        rid = self.req_id(call, fields[0])
        hashes = self.hash_seq(call, rid, "block_hashes", fields[1])
        num_tokens = self.count(call, rid, "num_tokens", fields[2])
        local = self.count(call, rid, "num_local_tokens", num_local_tokens)
        if local > num_tokens:
            raise self.refuse(call, rid, "num_local_tokens",
                              f"{local} local tokens of a {num_tokens}-token request")
        self.hash_count(call, rid, hashes, num_tokens)
        params = self.params(call, rid, fields[3])
        bs = self.block_size
        self.hashes(call, rid, "block_hashes", hashes, local // bs,
                    min(len(hashes), max(0, (num_tokens - 1) // bs)))
        return View(rid, hashes, num_tokens, local, params)

    def allocated(self, req_id: object, tables: object,
                  num_external_tokens: object) -> tuple[str, Tables, int]:
        call = "allocated"
        rid = self.req_id(call, req_id)
        checked = self.tables(call, rid, "gpu_block_ids", tables)
        return rid, checked, self.count(call, rid, "num_external_tokens", num_external_tokens)

    def reach(self, call: str, rid: str, tables: Tables, end: int) -> None:
        """Every table covers positions ``[0, end)``."""
        for g, t in enumerate(tables):
            if len(t) < end:
                raise self.refuse(call, rid, f"gpu_block_ids[{g}]",
                                  f"{len(t)} blocks, the accepted hit needs {end}")

    def finished(self, req_id: object, num_confirmed_tokens: object, tables: object,
                 block_hashes: object) -> tuple[str, int, Tables, tuple[BlockHash, ...] | None]:
        call = "finished"
        rid = self.req_id(call, req_id)
        confirmed = self.count(call, rid, "num_confirmed_tokens", num_confirmed_tokens)
        checked = self.tables(call, rid, "gpu_block_ids", tables)
        hashes = (None if block_hashes is None
                  else self.all_hashes(call, rid, "block_hashes", block_hashes))
        return rid, confirmed, checked, hashes

    def step_input(self, inp: Any) -> tuple[int, Any, tuple[str, ...], frozenset[int]]:
        """A StepInput's fields: step, requests (checked by the tracker), finished ids,
        allocated ids."""
        try:
            fields = (inp.step, inp.requests, inp.finished, inp.allocated_block_ids)
        except AttributeError:
            raise self.refuse("build_step", None, "inp",
                              f"must be a StepInput, got {describe(inp)}") from None
        step, gone, alloc = self.step_head(fields[0], fields[2], fields[3])
        return step, fields[1], gone, alloc


class View:
    """``lookup``'s checked input."""

    __slots__ = ("hashes", "num_local_tokens", "num_tokens", "params", "req_id")

    def __init__(self, req_id: str, hashes: Sequence[BlockHash], num_tokens: int,
                 num_local_tokens: int, params: Mapping[str, Any] | None) -> None:
        self.req_id = req_id
        self.hashes = hashes
        self.num_tokens = num_tokens
        self.num_local_tokens = num_local_tokens
        self.params = params


def for_pool(gpu: GpuBlocks, *, n_groups: int, block_size: int, hash_bytes: int | None,
             counters: ManagerCounters) -> InputCheck:
    """The checks for a manager over ``gpu``: its size (``num_blocks``), and its optional
    ``hash_bytes`` (unless given here) and ``null_block_id``. ConfigError for a pool
    that says something impossible."""
    n = gpu.num_blocks
    if type(n) is not int or n < 1:
        raise ConfigError(f"the GPU pool's num_blocks must be an int >= 1, got {describe(n)}")
    if hash_bytes is None:
        hash_bytes = getattr(gpu, "hash_bytes", None)
    if hash_bytes is not None and (type(hash_bytes) is not int or not 1 <= hash_bytes <= 255):
        raise ConfigError(f"hash_bytes must be an int in 1..255, got {describe(hash_bytes)}")
    null = getattr(gpu, "null_block_id", None)
    if null is not None and (type(null) is not int or not 0 <= null < n):
        raise ConfigError(f"the GPU pool's null_block_id must be None or a block id, got "
                          f"{describe(null)}")
    return InputCheck(n_groups=n_groups, block_size=block_size, num_gpu_blocks=n,
                      hash_bytes=hash_bytes, null_block_id=null, counters=counters)
