"""An engine whose process forks, for tests/test_fork.py: ``python tests/fork_proc.py
MODE`` with MODE ``engine`` (a SPAWN :class:`~kvshm.engine.Engine`, forked inside a
coroutine on its loop) or ``client`` (a :class:`~kvshm.engine.SyncClient` with
``kvshm-workers`` ranks).

Before the fork one request's blocks are stored and loaded back (``engine``: then a
second one's stores are left in flight, their Dones in the ring). The child then tries the
parent's engine (a step, a lookup: each must raise StateError), closes it, and ends the
way a child that ran to its end does (``engine``: its coroutine returns through
``asyncio.run``, which closes the child's copy of the loop). The parent, once the child
is gone, stores and loads again, closes, and prints one JSON line: what the child saw
(``child``: the errors' types and texts, how long ``close`` took, and -- ``engine`` --
how many Dones its copy of the loop applied), the byte
checks before and after, the state after, and the counters of lost or failed ranks.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
from engine_rig import BS, GPU_BLOCKS, config, shards, tokens

from kvshm.engine import SPAWN, Engine, SyncClient
from kvshm.engine.facade import Facade
from kvshm.errors import StateError
from kvshm.hashing import chain_hashes
from kvshm.offload.pool import BlockPool
from kvshm.types import RequestView, ScheduledRequest, StepInput

TOKENS = 4 * BS + 1  # four full blocks (a hit never covers the last token)
BLOCKS = 4


class Rig:
    """Store then load one request's blocks through ``eng`` (either face), pumping with
    ``pump`` (a sync callable that returns the loads' results so far)."""

    def __init__(self, eng: Engine | SyncClient, gpu: BlockPool, ks: list[torch.Tensor]) -> None:
        self.eng, self.gpu, self.ks, self.n = eng, gpu, ks, 0

    def step(self, *reqs: ScheduledRequest) -> None:
        self.n += 1
        self.eng.step(StepInput(self.n, list(reqs)))

    def store(self, rid: str, toks: list[int]) -> list[torch.Tensor]:
        hashes = chain_hashes(toks, BS)
        table = self.gpu.allocate(len(hashes))
        self.eng.allocated(rid, [table], 0)
        self.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),),
                                   new_or_resumed=True, num_confirmed_tokens=len(toks)))
        self.eng.finished(rid, len(toks), [table])
        rows = [k[table].clone() for k in self.ks]
        self.gpu.free(reversed(table))
        return rows

    def unsettled(self, deadline: float) -> bool:
        """Whether jobs are still in flight; if so, one more (empty) step. The caller
        sleeps between calls (its own way: the engine's loop must run meanwhile)."""
        if not self.eng.has_pending_work():
            return False
        assert time.monotonic() < deadline, "stores never settled"
        self.step()
        return True

    def load(self, rid: str, toks: list[int]) -> tuple[int, list[int]]:
        hashes = chain_hashes(toks, BS)
        self.gpu.drop_all_hashes()
        hit = self.eng.lookup(RequestView(rid, hashes, len(toks)), 0) or 0
        table = self.gpu.allocate(len(hashes))
        for k in self.ks:
            k[table] = 0xEE
        self.eng.allocated(rid, [table], hit)
        self.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),),
                                   new_or_resumed=True))
        return hit, table

    def exact(self, rows: list[torch.Tensor], table: list[int]) -> bool:
        return all(torch.equal(k[table[:BLOCKS]], r[:BLOCKS])
                   for k, r in zip(self.ks, rows, strict=True))


def child_tries(eng: Facade) -> dict[str, Any]:
    """What the child sees of its parent's engine: a step and a lookup (StateError
    expected), ``statistics()`` (its own copy's, at once: state and seconds), then
    ``close`` (returns, touching nothing shared)."""
    seen: dict[str, Any] = {}
    for call, fn in (("step", lambda: eng.step(StepInput(10_000, []))),
                     ("lookup", lambda: eng.lookup(RequestView("c", [b"\1" * 16], BS), 0))):
        try:
            fn()
            seen[call] = "returned"
        except StateError as exc:
            seen[call] = f"StateError: {exc}"
        except BaseException as exc:  # noqa: BLE001 - reported, not raised
            seen[call] = f"{type(exc).__name__}: {exc}"
    t = time.monotonic()  # the child's copy, read at once (the parent's loop is not ours)
    state = eng.statistics().state
    seen["statistics"] = [state, time.monotonic() - t]
    return seen


def report(path: str, seen: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(seen, f)


#: What the child saw (``engine`` mode: written once its ``asyncio.run`` ended).
SEEN: dict[str, Any] = {}
#: Dones the engine's dispatcher applied in this process since the fork.
APPLIED = [0]


def count_dones(eng: Engine) -> None:
    """Count every batch of Dones the engine applies (white-box: the dispatcher's
    ``apply``), so the child can say whether its copy of the loop read the parent's."""
    jobs = eng._core._jobs
    real = jobs.apply

    def apply(rank: int, dones: list[Any], manager: Any) -> None:
        APPLIED[0] += len(dones)
        real(rank, dones, manager)

    jobs.apply = apply  # type: ignore[method-assign]


async def engine_main(out: str) -> str:
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    async with Engine.launch(config(), workers=SPAWN, gpu_blocks=gpu,
                             device_caches=[[k] for k in ks]) as eng:
        rig = Rig(eng, gpu, ks)
        before = await engine_round(rig, eng, 1)
        count_dones(eng)
        rig.store("s0", tokens(TOKENS, 0))  # its stores in flight at the fork:
        time.sleep(0.05)  # the ranks answer, the parent's loop has not read them yet
        pid = os.fork()
        if pid == 0:
            APPLIED[0] = 0
            SEEN.update(child_tries(eng))
            t = time.monotonic()
            await eng.aclose()  # (asyncio.wait_for: the child has no running loop)
            SEEN["close_s"] = time.monotonic() - t
            return "child"  # asyncio.run runs on, then closes the child's copy of the loop
        os.waitpid(pid, 0)
        after = await engine_round(rig, eng, 2)
        counters = eng.statistics().counters
        state = eng.state.name
    print(json.dumps({"before": before, "after": after, "state_after": state,
                      "closed": eng.state.name, "ranks_failed": counters["ranks_failed"],
                      "ranks_left": counters["ranks_left"]}), flush=True)
    return "parent"


async def engine_round(rig: Rig, eng: Engine, seed: int) -> bool:
    toks = tokens(TOKENS, seed)
    rows = rig.store(f"s{seed}", toks)
    deadline = time.monotonic() + 20
    while rig.unsettled(deadline):
        await asyncio.sleep(0.005)
    hit, table = rig.load(f"l{seed}", toks)
    res = await asyncio.wait_for(eng.wait_loaded(f"l{seed}"), 20)
    return hit == BLOCKS * BS and res.ok and rig.exact(rows, table)


def client_main(out: str, name: str) -> None:
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    workers = subprocess.Popen(["kvshm-workers", "--name", name, "--tp", "2"],
                               stdin=subprocess.DEVNULL)
    with SyncClient(config(name=name), gpu_blocks=gpu,
                    device_caches=[[k] for k in ks]) as cli:
        cli.wait_ready()
        rig = Rig(cli, gpu, ks)
        before = client_round(rig, cli, 1)
        pid = os.fork()
        if pid == 0:
            seen = child_tries(cli)
            cli.close()
            seen["close_s"] = 0.0
            report(out, seen)
            os._exit(0)
        os.waitpid(pid, 0)
        after = client_round(rig, cli, 2)
        counters = cli.statistics().counters
        state = cli.state.name
    print(json.dumps({"before": before, "after": after, "state_after": state,
                      "closed": cli.state.name, "ranks_failed": counters["ranks_failed"],
                      "ranks_left": counters["ranks_left"],
                      "workers_rc": workers.wait(20)}), flush=True)


def client_round(rig: Rig, cli: SyncClient, seed: int) -> bool:
    toks = tokens(TOKENS, seed)
    rows = rig.store(f"s{seed}", toks)
    deadline = time.monotonic() + 20
    while rig.unsettled(deadline):
        time.sleep(0.005)
    hit, table = rig.load(f"l{seed}", toks)
    while True:
        done = [r for r in cli.poll() if r.req_id == f"l{seed}"]
        if done:
            return hit == BLOCKS * BS and done[0].ok and rig.exact(rows, table)
        assert time.monotonic() < deadline, "the load never finished"
        time.sleep(0.005)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "engine":
        parent = os.getpid()
        try:  # the child leaves through asyncio.run too: it closes the child's loop
            asyncio.run(engine_main(out))
        finally:
            if os.getpid() != parent:
                SEEN["applied_in_child"] = APPLIED[0]
                report(out, SEEN)
                os._exit(0)
    else:
        client_main(out, sys.argv[3])
