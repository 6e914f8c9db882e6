"""Hazard: one bad message in a batch of Dones. Rule: applying a Done that raises fails
that one job (counted, logged once); every other Done of the batch is still applied and
the batch's load outcomes reach their waiters in the same pass."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine_rig import BS, Client, embedded_engine, tokens

from kvshm.hashing import chain_hashes
from kvshm.types import RequestView


async def test_one_bad_done_in_a_batch_fails_only_its_job() -> None:
    """Both embedded ranks are paused while three steps each plan a store (jobs 1, 2, 3
    for prefixes p0, p1, p2); resumed, each rank runs all three and sends their Dones
    together. Applying job 2's first Done raises (injected): job 2 fails -- p1 is not
    cached -- while jobs 1 and 3 complete and are indexed; no pin is left."""
    async with embedded_engine() as (eng, gpu, _, ranks):
        manager = eng._core.manager
        assert manager is not None
        real: Callable[[int, int, bool], None] = manager.on_done
        seen: list[tuple[int, int, bool]] = []

        def on_done(job_id: int, rank: int, ok: bool) -> None:
            seen.append((job_id, rank, ok))
            if job_id == 2 and len([s for s in seen if s[0] == 2]) == 1:
                raise RuntimeError("injected: applying this Done fails")
            real(job_id, rank, ok)

        manager.on_done = on_done  # type: ignore[method-assign]
        c = Client(eng, gpu)
        ranks.paused = True
        prompts = [tokens(2 * BS + 1, seed=40 + i) for i in range(3)]
        tables = []
        for i, toks in enumerate(prompts):
            table, plan = c.compute(f"p{i}", toks)
            assert plan.store is not None and plan.store.job_id == i + 1
            tables.append(table)
        ranks.paused = False
        await c.settle()
        assert eng.statistics().counters["done_errors"] == 1
        assert (2, 0, False) in seen or (2, 1, False) in seen  # the job was failed
        for i, (toks, table) in enumerate(zip(prompts, tables)):
            c.finish(f"p{i}", table, len(toks))
        gpu.drop_all_hashes()
        hits = [eng.lookup(RequestView(f"q{i}", chain_hashes(t, BS), len(t)), 0)
                for i, t in enumerate(prompts)]
        assert hits == [2 * BS, 0, 2 * BS]
        for i in range(3):
            eng.allocated(f"q{i}", [[]], 0)
        st = eng.statistics()
        assert st.pins_held == 0 and st.jobs_in_flight == 0
        manager.check_invariants()
    await asyncio.sleep(0)
