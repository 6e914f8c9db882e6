"""The chaos run's invalid API calls among valid ones (``bad_call``).

Each call must raise a typed :class:`~kvshm.errors.KvshmError` and change nothing the
client relies on; the client catches it and goes on, and the engine must still serve a
store + load round trip afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Final

from kvshm.errors import KvshmError
from kvshm.hashing import chain_hashes
from kvshm.types import RequestView, ScheduledRequest, StepInput
from tools.chaos.rig import BS, GPU_BLOCKS, PREFIXES
from tools.chaos.traffic import Traffic


def expect_error(t: Traffic, what: str, fn: Callable[..., object], *args: Any,
                 must_refuse: bool = True) -> str:
    """Call ``fn(*args)``, which is invalid (``must_refuse``) or at best a no-op: report
    how the engine answered; an acceptance that should have been a refusal is noted."""
    try:
        fn(*args)
    except KvshmError as exc:
        return f"{what}: {type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - an engine that raises something else: noted
        t.out.notes.append(f"{what}: raised {type(exc).__name__} (not a KvshmError): {exc}")
        return f"{what}: {type(exc).__name__}!"
    if must_refuse:
        t.out.notes.append(f"{what}: accepted without an error")
    return f"{what}: accepted"


async def _hit_request(t: Traffic) -> tuple[str, list[int], list[bytes], int,
                                            list[int]] | None:
    """A request over a shared prefix after its lookup, with its GPU blocks."""
    rid, toks = t.prompt(t.rng.randrange(PREFIXES), 1)
    hashes = chain_hashes(toks, BS)
    hit = await t.lookup(rid, hashes, len(toks))
    table = await t.allocate(len(hashes))
    if table is None:
        t.call("finished", t.eng.finished, rid, 0, [[]])
        return None
    return rid, toks, hashes, hit, table


async def bad_step_hash(t: Traffic) -> str:
    """step() listing a new, fully computed request one of whose hashes is not bytes (its
    store walk reads every hash); the client aborts the request."""
    rid, toks = t.prompt(None, 2)
    hashes = chain_hashes(toks, BS)
    table = await t.allocate(len(hashes))
    if table is None:
        return "step(hash not bytes): skipped"
    t.call("allocated", t.eng.allocated, rid, [table], 0)
    t.write(table, hashes)
    bad: list[Any] = list(hashes)
    bad[t.rng.randrange(len(bad))] = t.rng.choice((12345, "not-bytes", None))
    req = ScheduledRequest(rid, bad, len(toks), (tuple(table),), new_or_resumed=True,
                           num_confirmed_tokens=len(toks))
    res = expect_error(t, "step(hash not bytes)", t.eng.step, StepInput(t.next_step(), [req]))
    t.finish(rid, 0, table)
    return res


async def bad_allocated_id(t: Traffic) -> str:
    """allocated() with a GPU id out of range, each kind of wrong id in turn while they
    are refused, then the valid call and the whole request. Once one is accepted, the
    client goes on with that table as a client that made the mistake would."""
    got = await _hit_request(t)
    if got is None:
        return "allocated(bad id): skipped"
    rid, toks, hashes, hit, table = got
    said = []
    for wrong in (GPU_BLOCKS, GPU_BLOCKS + 1000, -1):
        said.append(expect_error(t, f"allocated(gpu id {wrong})", t.eng.allocated, rid,
                                 [[wrong, *table[1:]]], hit))  # block 0: in the hit
        if said[-1].endswith("accepted"):
            await _go_on_tainted(t, rid, toks, hashes, table, hit)
            return "; ".join(said)
    try:
        await t.run(rid, toks, hashes, table, hit, 0.0)
    finally:
        t.finish(rid, len(toks), table)
    return "; ".join(said)


async def _go_on_tainted(t: Traffic, rid: str, toks: list[int], hashes: list[bytes],
                         table: list[int], hit: int) -> None:
    """The engine accepted an invalid ``allocated``: list the request, await its load,
    finish it. What raises now is the late price of that acceptance: noted."""
    req = ScheduledRequest(rid, hashes, len(toks), (tuple(table),), new_or_resumed=True)
    try:
        t.quiet("step after it", t.eng.step, StepInput(t.next_step(), [req]))
        if hit:
            await t.quiet_wait(rid)
    finally:
        t.quiet("finished after it", t.eng.finished, rid, 0, [table])
        t.gpu.free(reversed(table))


async def bad_finished_id(t: Traffic) -> str:
    """finished() with a GPU id out of range, then (if it was refused) the valid one."""
    got = await _hit_request(t)
    if got is None:
        return "finished(bad id): skipped"
    rid, toks, hashes, hit, table = got
    try:
        await t.run(rid, toks, hashes, table, hit, 0.0)
    except BaseException:
        t.finish(rid, len(toks), table)
        raise
    res = expect_error(t, "finished(gpu id 10**6)", t.eng.finished, rid, len(toks),
                       [[*table, 10**6]])
    if res.endswith("accepted"):  # the engine took it as the request's finish
        t.gpu.free(reversed(table))
    else:
        t.finish(rid, len(toks), table)
    return res


async def bad_lookup(t: Traffic) -> str:
    """lookup() with num_local_tokens past the prompt and below 0, then the whole valid
    request."""
    rid, toks = t.prompt(t.rng.randrange(PREFIXES), 1)
    hashes = chain_hashes(toks, BS)
    said = [expect_error(t, f"lookup(num_local_tokens={local})", t.eng.lookup,
                         RequestView(rid, hashes, len(toks)), local)
            for local in (len(toks) + 3 * BS, -BS)]
    hit = await t.lookup(rid, hashes, len(toks))
    table = await t.allocate(len(hashes))
    if table is None:
        t.call("finished", t.eng.finished, rid, 0, [[]])
        return "; ".join(said)
    try:
        await t.run(rid, toks, hashes, table, hit, 0.0)
    finally:
        t.finish(rid, len(toks), table)
    return "; ".join(said)


async def bad_duplicate_listing(t: Traffic) -> str:
    """One step listing the same new request twice; the client aborts it."""
    got = await _hit_request(t)
    if got is None:
        return "step(listed twice): skipped"
    rid, toks, hashes, hit, table = got
    t.call("allocated", t.eng.allocated, rid, [table], hit)
    req = ScheduledRequest(rid, hashes, len(toks), (tuple(table),), new_or_resumed=True)
    res = expect_error(t, "step(request listed twice)", t.eng.step,
                       StepInput(t.next_step(), [req, req]))
    t.finish(rid, 0, table)
    return res


async def bad_ghost(t: Traffic) -> str:
    """allocated() / finished() of a request the engine never saw, naming blocks another
    live request owns: those blocks' reference counts must not change."""
    got = await _hit_request(t)
    if got is None:
        return "ghost: skipped"
    rid, toks, hashes, hit, table = got
    ghost = f"ghost-{t.seq}"
    try:
        t.call("allocated", t.eng.allocated, rid, [table], hit)
        refs = [t.gpu.ref_cnt(b) for b in table]
        a = expect_error(t, "allocated(unknown request)", t.eng.allocated, ghost, [table],
                         len(hashes) * BS, must_refuse=False)
        if a.endswith("accepted"):
            await _ghost_wait(t, ghost)
        f = expect_error(t, "finished(unknown request)", t.eng.finished, ghost, len(toks),
                         [table], must_refuse=False)
        if [t.gpu.ref_cnt(b) for b in table] != refs:
            t.out.notes.append("ghost request calls changed a live request's block refs")
        t.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),),
                                new_or_resumed=True))
        if hit:
            await t.wait_load(rid, table, hashes)
    finally:
        t.finish(rid, 0, table)
    return f"{a}; {f}"


async def _ghost_wait(t: Traffic, ghost: str) -> None:
    """After an accepted ``allocated`` of an unknown request with external tokens: its
    ``wait_loaded`` must resolve (a failed result or an error), not wait forever."""
    try:
        await asyncio.wait_for(t.eng.wait_loaded(ghost), 2.0)
    except KvshmError:
        pass
    except TimeoutError:
        t.out.notes.append("wait_loaded() of an unknown request whose allocated() was "
                           "accepted never resolves")


async def bad_double_finish(t: Traffic) -> str:
    """A whole request, then finished() a second time."""
    got = await _hit_request(t)
    if got is None:
        return "finished twice: skipped"
    rid, toks, hashes, hit, table = got
    try:
        await t.run(rid, toks, hashes, table, hit, 0.0)
    finally:
        t.finish(rid, len(toks), table)
    return expect_error(t, "finished twice", t.eng.finished, rid, len(toks), [table],
                        must_refuse=False)


async def bad_wait_unknown(t: Traffic) -> str:
    """wait_loaded() of a request with no load pending."""
    try:
        await asyncio.wait_for(t.eng.wait_loaded(f"nobody-{t.seq}"), 2.0)
    except KvshmError as exc:
        return f"wait_loaded(unknown): {type(exc).__name__}"
    except TimeoutError:
        t.out.notes.append("wait_loaded(unknown request) waited instead of raising")
        return "wait_loaded(unknown): waited"
    return "wait_loaded(unknown): returned"


BAD_CALLS: Final[tuple[Callable[[Traffic], Awaitable[str]], ...]] = (
    bad_step_hash, bad_allocated_id, bad_finished_id, bad_lookup, bad_duplicate_listing,
    bad_ghost, bad_double_finish, bad_wait_unknown)


async def fault_bad_call(t: Traffic) -> str:
    """Every invalid call, in random order, each after a valid request."""
    calls = list(BAD_CALLS)
    t.rng.shuffle(calls)
    said = []
    for bad in calls:
        await t.request(t.rng.randrange(PREFIXES), 1)
        said.append(await bad(t))
    return "; ".join(said)
