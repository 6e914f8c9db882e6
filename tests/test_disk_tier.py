"""The local disk tier end to end: a SPAWN engine (tp=2, real ``kvshm-workers``
processes, real shared memory, real slab files on this machine's disk with O_DIRECT)
whose CPU tier is too small for what it stores, so the blocks it evicts go down to the
disk and come back from it.

Covered: a round trip through the disk bit-exact on both ranks; a corrupted slot is a
miss (the request recomputes) and its slots are dropped; a directory without the space
is refused at start in one line; an engine started again under the same name serves a
hit from the previous engine's slab (warm restart); a worker, or the scheduler's whole
process, SIGKILLed while blocks are being written leaves no slot that a restarted engine
loads with a wrong byte; a disk that fills up while the engine runs (a real ENOSPC on
the workers' writes, in a size-limited tmpfs of a private mount namespace) stops the tier
taking blocks while serving goes on.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_rig import BS, GPU_BLOCKS, ROW, Client, config, shards, spawned_engine, tokens

from kvshm.config import default_name
from kvshm.disk import PAGE, SlabSpec, scan
from kvshm.engine import SPAWN, Engine
from kvshm.errors import ConfigError
from kvshm.hashing import chain_hashes
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote_puts import remote_hash
from kvshm.types import RequestView, ScheduledRequest

#: Slots of each rank's slab (a 1 KiB row takes an 8 KiB slot).
SLOTS = 64
DISK = PAGE + SLOTS * 2 * PAGE


def disk_cfg(tmp: Path, **kw: Any) -> dict[str, Any]:
    return dict(num_cpu_blocks=8, disk_path=str(tmp), disk_bytes_per_rank=DISK, **kw)


async def store(c: Client, rid: str, toks: list[int], ks: Sequence[torch.Tensor]
                ) -> list[torch.Tensor]:
    """Compute, store and finish ``rid``; returns each rank's rows of its full blocks as
    they were computed (what any later load must reproduce)."""
    table, _ = c.compute(rid, toks)
    rows = [k[table].clone() for k in ks]
    c.finish(rid, table, len(toks))
    await c.settle()
    c.gpu.drop_all_hashes()
    return rows


async def drain(c: Client, steps: int = 6) -> None:
    """A few empty steps (write-back happens at plans), each settled."""
    for _ in range(steps):
        c.step()
        await c.settle()


async def lookup(c: Client, rid: str, toks: list[int], timeout: float = 20.0) -> int:
    """Ask until the engine answers (None: the disk is reading), stepping meanwhile."""
    view = RequestView(rid, chain_hashes(toks, BS), len(toks))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        hit = c.eng.lookup(view, 0)
        if hit is not None:
            return hit
        assert loop.time() < deadline, "the disk read never ended"
        c.step()
        await asyncio.sleep(0.005)


async def load(c: Client, ks: Sequence[torch.Tensor], rid: str, toks: list[int], hit: int
               ) -> list[torch.Tensor]:
    """Accept ``hit`` tokens, load them; each rank's rows of the loaded blocks."""
    hashes = chain_hashes(toks, BS)
    table = c.gpu.allocate(len(toks) // BS)
    c.eng.allocated(rid, [table], hit)
    c.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),), new_or_resumed=True,
                            num_confirmed_tokens=0))
    res = await c.loaded(rid)
    assert res.ok, res
    out = [k[table[:hit // BS]].clone() for k in ks]
    c.finish(rid, table, 0)
    return out


async def serves(c: Client, ks: Sequence[torch.Tensor], toks: list[int],
                 rows: list[torch.Tensor]) -> None:
    """``toks`` (a prompt of 4 full blocks) hits whole and loads ``rows`` on each rank."""
    hit = await lookup(c, "a", toks)
    assert hit == 4 * BS
    got = await load(c, ks, "a", toks, hit)
    for r in range(len(rows)):
        assert torch.equal(got[r], rows[r]), f"rank {r}"


async def fill(c: Client, ks: Sequence[torch.Tensor], n: int, seed: int
               ) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Store ``n`` prompts of 4 full blocks each (17 tokens); the CPU tier holds 2."""
    out = []
    for i in range(n):
        toks = tokens(4 * BS + 1, seed=seed + i)
        out.append((toks, await store(c, f"f{seed}.{i}", toks, ks)))
        await drain(c, 2)
    return out


def disk(eng: Engine) -> dict[str, Any]:
    return eng.statistics().disk


async def warmed(eng: Engine, timeout: float = 30.0) -> dict[str, Any]:
    """The disk statistics once the start's scan has been applied (the engine is READY
    before it ends: :mod:`kvshm.engine.warm_scan`)."""
    deadline = time.monotonic() + timeout
    while disk(eng)["warming"]:
        assert time.monotonic() < deadline, "the disk tier still warms"
        await asyncio.sleep(0.02)
    return disk(eng)


async def test_blocks_evicted_from_the_cpu_tier_come_back_from_disk_bit_exact(
        tmp_path: Path) -> None:
    """Four prompts of 4 blocks through a CPU tier of 8: the first two are evicted, and
    written to disk before they go. Looking the first one up asks again while both
    ranks read its 4 slots into fresh CPU blocks, then hits 16 tokens; the load brings
    back each rank's exact rows."""
    async with spawned_engine(**disk_cfg(tmp_path)) as (eng, gpu, ks):
        c = Client(eng, gpu)
        stored = await fill(c, ks, 4, seed=10)
        d = disk(eng)
        assert d["written_blocks"] >= 8 and d["slots"] == SLOTS, d
        toks, rows = stored[0]
        assert eng.lookup(RequestView("a", chain_hashes(toks, BS), len(toks)), 0) is None
        hit = await lookup(c, "a", toks)
        assert hit == 4 * BS
        got = await load(c, ks, "a", toks, hit)
        for r in range(2):
            assert torch.equal(got[r], rows[r]), f"rank {r}"
        d = disk(eng)
        assert d["hit_blocks"] == 4 and d["get_failed_jobs"] == 0
        assert d["read_bytes"] == 4 * 2 * ROW


async def test_a_preempted_request_reads_from_disk_again_when_readmitted(
        tmp_path: Path) -> None:
    """Request r is served its 4 blocks from disk, then preempted; while it waits, the
    CPU tier evicts them again (written back down). r's re-admission lookup answered 0
    without asking the disk -- its read record from the first admission (DONE) stayed
    until r ended -- and r recomputed a prefix the disk held (a new request id with the
    same tokens got the hit; found by a hostile review). An accepted phase B now ends
    the request's lookups: the re-admission reads again, and loads the exact rows."""
    async with spawned_engine(**disk_cfg(tmp_path)) as (eng, gpu, ks):
        c = Client(eng, gpu)
        stored = await fill(c, ks, 4, seed=12)
        toks, rows = stored[0]
        hashes = chain_hashes(toks, BS)
        hit = await lookup(c, "r", toks)
        assert hit == 4 * BS
        table = gpu.allocate(len(toks) // BS)
        eng.allocated("r", [table], hit)
        c.step(ScheduledRequest("r", hashes, len(toks), (tuple(table),), new_or_resumed=True,
                                num_confirmed_tokens=0))
        assert (await c.loaded("r")).ok
        c.step(ScheduledRequest("r", hashes, len(toks), ((),), preempted=True))
        gpu.free(reversed(table))
        gpu.drop_all_hashes()
        await fill(c, ks, 3, seed=13)  # r's blocks leave the CPU tier again
        reads = disk(eng)["lookups"]
        again = await lookup(c, "r", toks)
        assert disk(eng)["lookups"] > reads, "the re-admission never asked the disk"
        assert again == 4 * BS
        got = await load(c, ks, "r", toks, again)
        for r in range(2):
            assert torch.equal(got[r], rows[r]), f"rank {r}"
        assert eng.statistics().pins_held == 0


async def test_a_corrupted_slot_is_a_miss_and_its_slots_are_dropped(tmp_path: Path) -> None:
    """One byte of one of prompt 0's slots is flipped in rank 1's slab: the READ fails
    on rank 1 (its checksum), the lookup ends with 0 (recompute), the job's 4 slots
    leave the index and the failure is counted by name."""
    name = default_name()
    async with spawned_engine(name=name, **disk_cfg(tmp_path)) as (eng, gpu, ks):
        c = Client(eng, gpu)
        stored = await fill(c, ks, 4, seed=20)
        toks, _ = stored[0]
        target = remote_hash(chain_hashes(toks, BS)[2])
        path = tmp_path / f"kvshm-{name}.rank1-of-2.slab"
        fp = eng._core._disk.setups[1].fingerprint
        slots = {h: s for s, h in scan(str(path), SlabSpec(fp, 1, 2, SLOTS, ROW)).items()}
        slot = slots[target]
        with open(path, "r+b") as f:
            off = PAGE + slot * 2 * PAGE + PAGE + 100  # inside the payload
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
        assert await lookup(c, "a", toks) == 0
        d = disk(eng)
        assert (d["get_failed_jobs"], d["dropped_slots"]) == (1, 4), d
        assert eng.statistics().counters["disk_read_bad_crc"] == 1


async def test_a_directory_without_the_space_is_refused_at_start_in_one_line(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        async with spawned_engine(num_cpu_blocks=8, disk_path=str(tmp_path),
                                  disk_bytes_per_rank=1 << 60):
            pass
    msg = str(info.value)
    assert "not enough free space" in msg and "\n" not in msg


async def test_a_directory_every_user_may_write_without_the_sticky_bit_is_said_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Hazard "a refused slab turned the disk tier off without a word": in a directory of
    mode 0777 another user can remove a rank's slab and put a file of theirs in its
    place; the rank refuses that file, and the tier was off for the engine's life with
    no line (a hostile probe). The start now says so, in one line, and goes on (a
    Kubernetes emptyDir is such a directory, and a container that is not root cannot
    chmod it: a review); with the sticky bit (as /tmp) it says nothing."""
    tmp_path.chmod(0o777)
    with caplog.at_level("WARNING", logger="kvshm.engine.runtime"):
        async with spawned_engine(**disk_cfg(tmp_path)) as (eng, _, _):
            assert disk(eng)["writes_paused"] == 0
    (line,) = [r.getMessage() for r in caplog.records if "not sticky" in r.getMessage()]
    assert f"{tmp_path} is writable by every user and not sticky (mode 777)" in line
    caplog.clear()
    tmp_path.chmod(0o1777)
    with caplog.at_level("WARNING", logger="kvshm.engine.runtime"):
        async with spawned_engine(**disk_cfg(tmp_path)):
            pass
    assert not [r for r in caplog.records if "not sticky" in r.getMessage()]


@pytest.mark.parametrize("bad", ["a file", "a NUL byte"])
async def test_a_disk_path_that_is_a_file_or_holds_a_nul_is_refused_in_one_line(
        tmp_path: Path, bad: str) -> None:
    """``disk_path`` naming an existing file failed the start with a bare
    NotADirectoryError (the slab-path check caught only FileNotFoundError); one with a
    NUL byte passed the config and raised ValueError at the start. Both are one-line
    ConfigErrors now."""
    path = tmp_path / "afile"
    path.write_text("x")
    where = str(path) if bad == "a file" else f"{tmp_path}/a\0b"
    with pytest.raises(ConfigError) as info:
        async with spawned_engine(num_cpu_blocks=8, disk_path=where,
                                  disk_bytes_per_rank=1 << 20):
            pass
    assert "\n" not in str(info.value) and "disk_path" in str(info.value)


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
async def test_a_fifo_or_link_where_a_slab_goes_is_refused_at_start_in_one_line(
        tmp_path: Path, kind: str) -> None:
    """Attack: rank 0's slab path is a FIFO (the scheduler's warm scan blocked in
    open(2) on its loop before any Ready: the engine never started, no timeout fired)
    or a link to a file elsewhere (its target was truncated and overwritten). Both are
    refused before any worker starts, in one line naming the path; the link's target is
    untouched."""
    name = default_name()
    path = tmp_path / f"kvshm-{name}.rank0-of-2.slab"
    target = tmp_path / "elsewhere.db"
    target.write_bytes(b"\x11" * 100)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(target)
    with pytest.raises(ConfigError) as info:
        async with asyncio.timeout(20):
            async with spawned_engine(name=name, **disk_cfg(tmp_path)):
                pass
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg, msg
    assert target.read_bytes() == b"\x11" * 100


async def test_a_generated_name_leaves_no_slab_behind_and_a_given_name_keeps_its_own(
        tmp_path: Path) -> None:
    """Each start under the default name (new every start: no later start can serve
    its slabs) preallocated a slab per rank and left it there: in a small directory the
    third start was refused for space. Now its ranks remove their slabs when they close;
    an engine given a name keeps them for a warm restart (the test above)."""
    for _ in range(3):
        async with spawned_engine(**disk_cfg(tmp_path)) as (eng, gpu, ks):
            c = Client(eng, gpu)
            await fill(c, ks, 3, seed=60)
            assert eng.statistics().disk["written_blocks"] >= 4
            assert len(list(tmp_path.glob("*.slab"))) == 2
        assert list(tmp_path.glob("*.slab")) == []
    name = default_name()
    async with spawned_engine(name=name, **disk_cfg(tmp_path)):
        pass
    assert sorted(p.name for p in tmp_path.glob("*.slab")) == [
        f"kvshm-{name}.rank{r}-of-2.slab" for r in range(2)]


async def test_slabs_of_the_name_for_another_world_size_are_said_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An engine named ``name`` ran at tp=2 and kept its two slabs (the warm-restart
    cache); started again at tp=1 it never reads them, and they held their space with no
    line at start (a hostile probe). Now the start names them, their world size and
    the command that removes them; they are kept."""
    name = default_name()
    async with spawned_engine(name=name, **disk_cfg(tmp_path)):
        pass
    ks, gpu = shards(world=1), BlockPool(GPU_BLOCKS)
    with caplog.at_level("WARNING", logger="kvshm.engine.runtime"):
        async with Engine.launch(config(name=name, tp=1, **disk_cfg(tmp_path)),
                                 workers=SPAWN, gpu_blocks=gpu,
                                 device_caches=[[k] for k in ks]):
            pass
    (line,) = [r.getMessage() for r in caplog.records if "never reads" in r.getMessage()]
    assert f"2 slab file(s) of engine {name!r} for world size 2" in line
    assert "kvshm sweep --disk-path" in line
    assert len(list(tmp_path.glob(f"kvshm-{name}.rank*-of-2.slab"))) == 2


async def test_a_generated_names_slab_goes_even_when_its_rank_was_sigkilled(
        tmp_path: Path) -> None:
    """Only a rank removed its own slab (as its mover closed): rank 1 SIGKILLed -- the
    OOM killer -- left its preallocated slab of an engine no later start can serve in
    the directory for good, a start's worth of disk space each time. The engine now
    removes, at its close, every such slab whose lock no process holds: rank 1's here,
    while rank 0 removed its own; a given name's slabs stay (the test above)."""
    async with spawned_engine(**disk_cfg(tmp_path)) as (eng, gpu, ks):
        await fill(Client(eng, gpu), ks, 3, seed=61)
        assert len(list(tmp_path.glob("*.slab"))) == 2
        os.kill(eng.statistics().ranks[1].pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
    assert list(tmp_path.glob("*.slab")) == []
    name = default_name()
    async with spawned_engine(name=name, **disk_cfg(tmp_path)) as (eng, gpu, ks):
        await fill(Client(eng, gpu), ks, 1, seed=62)
        os.kill(eng.statistics().ranks[1].pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
    assert len(list(tmp_path.glob("*.slab"))) == 2


async def test_a_rank_the_close_had_to_kill_leaves_no_slab(tmp_path: Path) -> None:
    """Rank 1 is stuck (SIGSTOP) when the engine closes: past the grace period the
    launcher kills it, so it never removes its slab -- and the engine's own removal ran
    before the ranks were stopped, while rank 1 still held its lock (found by a review
    of the fix above). The engine removes the slabs again once every rank is reaped."""
    async with spawned_engine(shutdown_grace_s=0.3, **disk_cfg(tmp_path)) as (eng, gpu, ks):
        await fill(Client(eng, gpu), ks, 1, seed=63)
        assert len(list(tmp_path.glob("*.slab"))) == 2
        os.kill(eng.statistics().ranks[1].pid, signal.SIGSTOP)
    assert list(tmp_path.glob("*.slab")) == []


async def test_a_restarted_engine_serves_the_previous_ones_slab_at_once(
        tmp_path: Path) -> None:
    """Engine 1 writes prompt 0's blocks down and closes; engine 2, started under the
    same name and layout, indexes every slot whose header agrees on both ranks once its
    scan ends (a thread: the engine is READY before), and prompt 0's first lookup is
    read from the slab: the exact rows engine 1 computed."""
    name = default_name()
    async with spawned_engine(name=name, **disk_cfg(tmp_path)) as (eng, gpu, ks):
        c = Client(eng, gpu)
        stored = await fill(c, ks, 4, seed=30)
        written = disk(eng)["written_blocks"]
    async with spawned_engine(name=name, **disk_cfg(tmp_path)) as (eng, gpu, ks):
        c = Client(eng, gpu)
        d = await warmed(eng)
        assert d["warm_slots"] == min(written, SLOTS) and d["warm_disagreed"] == 0, d
        await serves(c, ks, *stored[0])


async def test_a_restart_with_another_device_block_count_keeps_its_disk_tier(
        tmp_path: Path) -> None:
    """Hazard "a layout fingerprint that missed the shape and covered the device block
    count": engine 1 (32 device blocks a rank) writes prompt 0 down and closes; engine 2,
    the same model under the same name but with 40 device blocks (vLLM: another
    gpu_memory_utilization, a profiling result, another GPU), took the slabs for another
    layout and re-initialised them: no hit, and every slot gone for good (a restart with
    32 again found nothing). The device block count is no part of the fingerprint now:
    engine 2 serves engine 1's rows."""
    name = default_name()
    async with spawned_engine(name=name, **disk_cfg(tmp_path)) as (eng, gpu, ks):
        c = Client(eng, gpu)
        stored = await fill(c, ks, 4, seed=33)
        assert disk(eng)["written_blocks"] >= 4
    ks2, gpu2 = shards(blocks=GPU_BLOCKS + 8), BlockPool(GPU_BLOCKS + 8)
    async with Engine.launch(config(name=name, **disk_cfg(tmp_path)), workers=SPAWN,
                             gpu_blocks=gpu2, device_caches=[[k] for k in ks2]) as eng:
        c = Client(eng, gpu2)
        assert (await warmed(eng))["warm_slots"] >= 4, disk(eng)
        await serves(c, ks2, *stored[0])


async def test_a_warm_restart_is_ready_before_its_disk_scan_ends_and_serves_the_slab_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hazard (a hostile probe at production scale): the start's scan of the slot
    headers ran on the scheduler's loop after every rank connected and before any Ready
    -- 4.5 - 9 us a slot, so 8 ranks of a million slots blocked the start for about a
    minute, and a hand-started rank's ``--connect-timeout`` ran out meanwhile. Now the
    scan runs on a thread (:mod:`kvshm.engine.warm_scan`) and the engine is READY at
    once, its disk tier *warming*: it indexes nothing (a lookup of a prompt engine 1
    wrote down misses: recompute) and writes nothing (a slot written meanwhile could be
    read by the scan before or after its new header; each plan's write-back is skipped,
    counted). Here engine 2's scan is held at a seam until the test lets it go; then
    the slots both ranks agree on are indexed, and the same prompt is read from the
    slab: the exact rows engine 1 computed."""
    from kvshm.disk import slab

    name = default_name()
    async with spawned_engine(name=name, **disk_cfg(tmp_path)) as (eng, gpu, ks):
        c = Client(eng, gpu)
        stored = await fill(c, ks, 4, seed=34)
        written = disk(eng)["written_blocks"]
    assert written >= 4
    gate, real = threading.Event(), slab._scan_slots

    def held(*args: Any) -> dict[int, bytes]:
        assert gate.wait(60), "the test never let the scan go"
        return real(*args)
    monkeypatch.setattr(slab, "_scan_slots", held)
    try:
        async with asyncio.timeout(30):  # the old engine waited for the scan to be READY
            async with spawned_engine(name=name, **disk_cfg(tmp_path)) as (eng, gpu, ks):
                c = Client(eng, gpu)
                d = disk(eng)
                assert (d["warming"], d["slots_used"], d["warm_slots"]) == (1, 0, 0), d
                toks, rows = stored[0]
                assert await lookup(c, "early", toks) == 0  # nothing on disk yet
                c.finish("early", [], 0)
                await fill(c, ks, 3, seed=40)  # stores evict CPU blocks: none written
                d = disk(eng)
                assert d["warming"] == 1 and d["write_jobs"] == 0, d
                assert d["write_skipped_warming"] > 0 and d["evicted_lost"] > 0, d
                gate.set()
                d = await warmed(eng)
                assert d["warm_slots"] == min(written, SLOTS) and d["warm_disagreed"] == 0, d
                hit = await lookup(c, "a", toks)
                assert hit == 4 * BS
                got = await load(c, ks, "a", toks, hit)
                for r in range(2):
                    assert torch.equal(got[r], rows[r]), f"rank {r}"
                await drain(c)
                d = disk(eng)  # the READ's victims (seed 42's blocks) were written down
                assert d["write_jobs"] > 0 and d["evicted_written"] > 0, d
    finally:
        gate.set()


async def test_a_slab_written_under_another_disk_stamp_is_not_served(
        tmp_path: Path) -> None:
    """The hazard: an operator replaced a checkpoint's weights in place (same path,
    same config) and restarted under the same name: the warm restart served the old
    weights' KV from the slab -- 384 tokens, wrong output, no warning (vLLM's
    connector). The stamp of the weights (``disk_stamp``) is now part of the slab's
    fingerprint: engine 2, stamped otherwise, indexes no slot of engine 1's, while
    engine 3, stamped as engine 1, still warm-restarts from what engine 2 left."""
    name = default_name()
    async with spawned_engine(name=name, disk_stamp="weights-a",
                              **disk_cfg(tmp_path)) as (eng, gpu, ks):
        await fill(Client(eng, gpu), ks, 4, seed=31)
        assert disk(eng)["written_blocks"] >= 4
    async with spawned_engine(name=name, disk_stamp="weights-b",
                              **disk_cfg(tmp_path)) as (eng, gpu, ks):
        assert (await warmed(eng))["warm_slots"] == 0, disk(eng)
        await fill(Client(eng, gpu), ks, 1, seed=32)
    async with spawned_engine(name=name, disk_stamp="weights-b",
                              **disk_cfg(tmp_path)) as (eng, gpu, ks):
        assert (await warmed(eng))["warm_slots"] >= 1, disk(eng)


async def test_a_worker_killed_mid_write_leaves_no_wrong_byte_after_restart(
        tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed while the write-back of many blocks runs. An engine started
    again under the same name loads, for every prompt, either nothing (a slot the ranks
    disagree on, or whose checksum fails, is a miss) or the exact rows computed."""
    name = default_name()
    rng = random.Random(5)
    async with spawned_engine(name=name, **disk_cfg(tmp_path)) as (eng, gpu, ks):
        c = Client(eng, gpu)
        stored = await fill(c, ks, 6, seed=40)
        for i in range(6, 12):  # more stores: write-back runs while rank 1 dies
            toks = tokens(4 * BS + 1, seed=40 + i)
            table, _ = c.compute(f"k{i}", toks)
            stored.append((toks, [k[table].clone() for k in ks]))
            c.finish(f"k{i}", table, len(toks))
            c.step()
            await asyncio.sleep(rng.random() * 0.002)
        os.kill(eng.statistics().ranks[1].pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
    async with spawned_engine(name=name, **disk_cfg(tmp_path)) as (eng, gpu, ks):
        c = Client(eng, gpu)
        await warmed(eng)
        hits = 0
        for i, (toks, rows) in enumerate(stored):
            hit = await lookup(c, f"r{i}", toks)
            if not hit:
                eng.finished(f"r{i}", 0, [[]])
                continue
            hits += 1
            got = await load(c, ks, f"r{i}", toks, hit)
            for r in range(2):
                assert torch.equal(got[r], rows[r][:hit // BS]), (i, r)
        assert hits > 0 and disk(eng)["warm_slots"] > 0


def _slabs_free(directory: Path, timeout: float = 30.0) -> None:
    """Wait until no process holds a slab's lock (the dead scheduler's workers exit on
    their lifeline's EOF)."""
    import fcntl
    import time

    deadline = time.monotonic() + timeout
    for path in directory.glob("*.slab"):
        while True:
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{path} still locked"
                time.sleep(0.05)
            finally:
                os.close(fd)


async def test_a_scheduler_killed_mid_write_leaves_no_wrong_byte_after_restart(
        tmp_path: Path) -> None:
    """The scheduler's process (tests/disk_sched_proc.py) is SIGKILLed while write-back
    runs; its workers go with it. An engine started again under the same name loads, for
    every prompt the dead one stored, either nothing or the exact rows computed."""
    import subprocess
    import sys

    name = default_name()
    disk_dir, out = tmp_path / "disk", tmp_path / "rows"
    disk_dir.mkdir()
    out.mkdir()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    proc = subprocess.Popen([sys.executable, str(root / "tests" / "disk_sched_proc.py"),
                             name, str(disk_dir), str(out)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "GO"
        await asyncio.sleep(random.Random(7).random() * 0.02)
    finally:
        proc.kill()
        proc.wait(30)
    _slabs_free(disk_dir)
    saved = sorted(out.glob("*.pt"), key=lambda p: int(p.stem))
    async with spawned_engine(name=name, **disk_cfg(disk_dir)) as (eng, gpu, ks):
        c = Client(eng, gpu)
        assert (await warmed(eng))["warm_slots"] > 0
        hits = 0
        for path in saved:
            i = int(path.stem)
            toks = tokens(4 * BS + 1, seed=60 + i)
            rows = torch.load(path)
            hit = await lookup(c, f"r{i}", toks)
            if not hit:
                eng.finished(f"r{i}", 0, [[]])
                continue
            hits += 1
            got = await load(c, ks, f"r{i}", toks, hit)
            for r in range(2):
                assert torch.equal(got[r], rows[r][:hit // BS]), (i, r)
        assert hits > 0, disk(eng)


def test_a_disk_that_fills_up_stops_the_tier_taking_blocks_and_serving_goes_on(
        tmp_path: Path) -> None:
    """ENOSPC while running, end to end (tests/disk_full_proc.py in a private mount
    namespace over a 2 MiB tmpfs, ``disk_io=buffered``; tp=2 SPAWN workers). A slab is
    preallocated, so its writes meet ENOSPC only where the filesystem does not keep the
    allocation -- copy-on-write or thin-provisioned storage, where an overwrite needs new
    blocks: the script gives back its slots' allocation (``PUNCH_HOLE``) to stand for
    that; the ENOSPC is then the kernel's own, on the workers' real ``pwritev``. Prompts
    0-3 go down to disk while there is room; another file then fills the filesystem;
    prompts 4-11's WRITEs fail with ENOSPC on the ranks. Asserted: each failed WRITE is
    named a full disk (``disk_failed_no_space``), its slots are never indexed, three in a
    row pause write-back and the tier takes no block after (``writes_paused``,
    ``write_skipped_paused``, ``write_jobs`` still); serving goes on: the CPU tier's
    prompts are CPU hits, the evicted unwritten ones are misses (recompute), the ones
    written before the disk filled come back from it; no pin, pinned slot or quarantined
    row is left and the engine stays READY."""
    import json
    import subprocess

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here: cannot mount a private size-limited tmpfs")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    mount = 'mount -t tmpfs -o size=2m kvshm-full "$0" || exit 77; exec "$@"'
    cmd = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount,
           str(tmp_path), sys.executable, str(root / "tests" / "disk_full_proc.py"),
           str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    if proc.returncode in (1, 77) and not proc.stdout:
        if "kvshm" not in proc.stderr:  # unshare or mount refused, nothing of ours ran
            pytest.skip(f"no private tmpfs here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    before, full, after = got["before"]["disk"], got["full"]["disk"], got["after"]["disk"]
    assert before["written_blocks"] == 16 and before["write_failed_jobs"] == 0, before
    assert got["ballast"] > 0
    # the full disk: WRITEs fail naming it, index nothing, and pause write-back
    assert full["write_failed_jobs"] >= 3 and full["writes_paused"] == 1, full
    assert got["full"]["counters"]["disk_failed_no_space"] >= 3, got["full"]["counters"]
    assert got["full"]["counters"]["disk_failed_other"] == 0
    assert full["written_blocks"] == before["written_blocks"]
    assert full["slots_used"] == before["slots_used"] == 16 and full["slot_evictions"] == 0
    assert full["write_skipped_paused"] > 0
    assert after["write_jobs"] == full["write_jobs"]  # the tier takes no more blocks
    assert after["write_skipped_paused"] > full["write_skipped_paused"]
    # serving goes on: CPU hits, misses that recompute, disk hits of what was written
    hits = {int(k): v for k, v in got["hits"].items()}
    assert hits[11] == hits[10] == 4 * BS
    assert all(hits[i] == 0 for i in range(4, 10)), hits
    assert all(hits[i] == 4 * BS for i in range(4)), hits
    assert after["hit_blocks"] == 16 and after["get_failed_jobs"] == 0
    # nothing leaked
    assert got["after"]["state"] == "ready" and got["after"]["pins_held"] == 0
    assert after["slots_pinned"] == 0 and after["quarantined_slots"] == 0
    assert got["after"]["quarantined_cpu_blocks"] == 0
