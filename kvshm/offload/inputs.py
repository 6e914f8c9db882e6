"""The input of each :class:`~kvshm.offload.manager.OffloadManager` call, checked whole.

:class:`CallCheck` holds the field checks, an :class:`~kvshm.offload.validate.InputCheck`
(which states the rules: what valid input is, which hashes a call reads, what an
unchanged listed request is spared), and composes them into one method per call:
``view`` (``lookup``), ``allocated`` and ``reach`` (phase B), ``finished``,
``step_input`` and ``step_head`` (``build_step``), and for the request tracker
(:mod:`kvshm.offload.requests`) ``listed`` and ``malformed`` (one listed request, a
listing that cannot be read).

Order: a method checks every field before it returns and raises the first refusal
(``InvalidRequest``, counted in ``invalid_calls``); the manager calls it before it
changes anything, then uses only the values handed back (never its raw arguments).
:func:`for_pool` binds the checks to a GPU pool's limits, refusing a pool that says
something impossible.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from kvshm.errors import ConfigError, InvalidRequest
from kvshm.hashing import BlockHash
from kvshm.offload.counters import ManagerCounters
from kvshm.offload.pd.manifest import is_handoff
from kvshm.offload.validate import (
    COUNT_LIMIT,
    NOT_SEQUENCES,
    InputCheck,
    Tables,
    describe,
    text_ok,
)
from kvshm.types import GpuBlocks, ScheduledRequest

__all__ = ["CallCheck", "View", "for_pool"]


class CallCheck:
    """One method per manager call (see the module docstring) over ``fields``, the field
    checks it holds; every refusal goes through their
    :meth:`~kvshm.offload.validate.InputCheck.refuse`. The limits the fast paths test
    inline are copied here (read once per call, no second attribute hop), and so are the
    two field checks the manager and the tracker call themselves (``refuse``,
    ``hashes``)."""

    __slots__ = ("block_size", "fields", "hash_max", "hash_min", "hashes", "n_groups", "no_new",
                 "null_refused", "num_gpu_blocks", "refuse", "tuples_ok")

    def __init__(self, fields: InputCheck) -> None:
        self.fields = fields
        self.block_size = fields.block_size
        self.n_groups = fields.n_groups
        self.no_new = fields.no_new
        self.num_gpu_blocks = fields.num_gpu_blocks
        self.null_refused = fields.null_refused
        self.hash_min, self.hash_max = fields.hash_min, fields.hash_max
        self.refuse = fields.refuse
        self.hashes = fields.hashes
        self.tuples_ok = fields.tuples_ok

    # ---- a step's listing -----------------------------------------------------------

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
        plain = (type(rid) is str and (rid.isascii() or text_ok(rid)) and type(num_tokens) is int
                 and type(confirmed) is int
                 and 0 <= num_tokens < COUNT_LIMIT and 0 <= confirmed < COUNT_LIMIT
                 and type(new) is bool
                 and type(preempted) is bool and (type(hashes) is list or type(hashes) is tuple)
                 and (params is None or type(params) is dict))
        if not plain:
            rid = self.fields.req_id(call, rid)
            hashes = self.fields.hash_seq(call, rid, "block_hashes", hashes)
            num_tokens = self.fields.count(call, rid, "num_tokens", num_tokens)
            new = self.fields.flag(call, rid, "new_or_resumed", new)
            confirmed = self.fields.count(call, rid, "num_confirmed_tokens", confirmed)
            preempted = self.fields.flag(call, rid, "preempted", preempted)
            params = self.fields.params(call, rid, params)
        if len(hashes) * self.block_size > num_tokens:
            self.fields.hash_count(call, rid, hashes, num_tokens)
        if nb is not self.no_new:
            ok = type(nb) is tuple and len(nb) == self.n_groups
            if ok:
                if len(nb) == 1 and type(t := nb[0]) is tuple and len(t) == 1:
                    b = t[0]  # one id appended to one group: a decode step's change
                    ok = (type(b) is int and 0 <= b < self.num_gpu_blocks
                          and b != self.null_refused[0])
                else:
                    ok = self.tuples_ok(nb)
            if not ok:
                nb = self.fields.tables(call, rid, "new_block_ids", nb)
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
        step_no = self.fields.count(call, None, "step", step)
        if isinstance(finished, NOT_SEQUENCES) or not isinstance(finished, Iterable):
            raise self.refuse(call, None, "finished",
                              f"must be a sequence of request ids, got {describe(finished)}")
        gone = tuple(finished)
        for rid in gone:
            self.fields.req_id(call, rid)
        if isinstance(allocated, NOT_SEQUENCES) or not isinstance(allocated, Iterable):
            raise self.refuse(call, None, "allocated_block_ids",
                              f"must be a collection of block ids, got {describe(allocated)}")
        ids: tuple[Any, ...] = tuple(allocated)
        if ids and (set(map(type, ids)) != {int} or min(ids) < 0
                    or max(ids) >= self.num_gpu_blocks):
            self.fields.bad_id(call, None, "allocated_block_ids", ids)
        return step_no, gone, frozenset(ids)

    # ---- the manager's calls ---------------------------------------------------------

    def view(self, req: Any, num_local_tokens: object) -> View:
        """``lookup``'s input; checks the hashes it may read (from the engine's hit to
        the lookup cap)."""
        call = "lookup"
        try:
            rid, hashes, num_tokens, params = (req.req_id, req.block_hashes, req.num_tokens,
                                               req.kv_transfer_params)
        except AttributeError:
            raise self.refuse(call, None, "req",
                              f"must be a RequestView, got {describe(req)}") from None
        local: Any = num_local_tokens
        if not (type(rid) is str and (rid.isascii() or text_ok(rid))
                and (type(hashes) is list or type(hashes) is tuple)
                and type(num_tokens) is int and 0 <= num_tokens < COUNT_LIMIT
                and type(local) is int and local >= 0
                and (params is None or type(params) is dict)):
            rid = self.fields.req_id(call, rid)  # the field checks, in this order
            hashes = self.fields.hash_seq(call, rid, "block_hashes", hashes)
            num_tokens = self.fields.count(call, rid, "num_tokens", num_tokens)
            local = self.fields.count(call, rid, "num_local_tokens", local)
            if local <= num_tokens and len(hashes) * self.block_size <= num_tokens:
                params = self.fields.params(call, rid, params)
        if local > num_tokens:
            raise self.refuse(call, rid, "num_local_tokens",
                              f"{local} local tokens of a {num_tokens}-token request")
        if len(hashes) * self.block_size > num_tokens:
            self.fields.hash_count(call, rid, hashes, num_tokens)
        bs = self.block_size
        if params is not None and is_handoff(params):
            # a P/D hand-off reads more: its manifest check every hash from position 0,
            # its hit up to the block holding token num_tokens - 2 (handoff_extent)
            self.hashes(call, rid, "block_hashes", hashes, 0,
                        min(len(hashes), max(0, -(-(num_tokens - 1) // bs))))
        else:
            self.hashes(call, rid, "block_hashes", hashes, local // bs,
                        min(len(hashes), max(0, (num_tokens - 1) // bs)))
        tail = getattr(req, "tail_hash", None)
        if tail is not None:
            tail = self.fields.tail(call, rid, tail, num_tokens)
        return View(rid, hashes, num_tokens, local, params, tail)

    def allocated(self, req_id: object, tables: object,
                  num_external_tokens: object) -> tuple[str, Tables, int]:
        call, f = "allocated", self.fields
        rid = f.req_id(call, req_id)
        checked = f.tables(call, rid, "gpu_block_ids", tables)
        return rid, checked, f.count(call, rid, "num_external_tokens", num_external_tokens)

    def reach(self, call: str, rid: str, tables: Tables, end: int) -> None:
        """Every table covers positions ``[0, end)``."""
        for g, t in enumerate(tables):
            if len(t) < end:
                raise self.refuse(call, rid, f"gpu_block_ids[{g}]",
                                  f"{len(t)} blocks, the accepted hit needs {end}")

    def finished(self, req_id: object, num_confirmed_tokens: object, tables: object,
                 block_hashes: object, tail_hash: object = None
                 ) -> tuple[str, int, Tables, tuple[BlockHash, ...] | None, BlockHash | None]:
        call = "finished"
        rid = self.fields.req_id(call, req_id)
        confirmed = self.fields.count(call, rid, "num_confirmed_tokens", num_confirmed_tokens)
        checked = self.fields.tables(call, rid, "gpu_block_ids", tables)
        hashes = (None if block_hashes is None
                  else self.fields.all_hashes(call, rid, "block_hashes", block_hashes))
        tail = self.fields.tail(call, rid, tail_hash, confirmed)
        return rid, confirmed, checked, hashes, tail

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


class View(msgspec.Struct, gc=False):
    """``lookup``'s checked input. A ``msgspec.Struct``: built in C once per lookup."""

    req_id: str
    hashes: Sequence[BlockHash]
    num_tokens: int
    num_local_tokens: int
    params: Mapping[str, Any] | None
    tail: BlockHash | None = None


def for_pool(gpu: GpuBlocks, *, n_groups: int, block_size: int, hash_bytes: int | None,
             counters: ManagerCounters, full_groups: Sequence[int] = ()) -> CallCheck:
    """The checks for a manager over ``gpu``: its size (``num_blocks``), and its optional
    ``hash_bytes`` (unless given here) and ``null_block_id``. ConfigError for a pool
    that says something impossible. ``full_groups``: the full-attention groups, whose
    tables never hold the null block."""
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
    return CallCheck(InputCheck(n_groups=n_groups, block_size=block_size, num_gpu_blocks=n,
                                hash_bytes=hash_bytes, null_block_id=null, counters=counters,
                                full_groups=full_groups))
