"""The chaos run's process and transport faults: SIGKILL, SIGSTOP, a corrupt done
record, rogue rendezvous connections (see :mod:`tools.chaos`, "Faults").

A corrupt done record is written through this process's own mapping of the rank's
ring segment, at the done ring's head, while the rank is frozen (so no real Done races
it); the offsets are the control block's words drawn in ``kvshm/ipc/ring_pair.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from typing import Final

from kvshm.engine import Engine
from kvshm.hashing import chain_hashes
from kvshm.ipc import protocol
from kvshm.ipc.rendezvous_client import query_stats
from kvshm.ipc.ring_pair import CONTROL_SIZE, LINE, RingPair
from kvshm.types import ScheduledRequest
from tools.chaos.rig import (
    BS,
    CORRUPT_VERDICT_S,
    HANG_S_STOP,
    LOAD_S,
    PREFIXES,
    QUERY_S,
    TP,
    VERDICT_S,
    bounded,
    send_signal,
)
from tools.chaos.traffic import Traffic

# the ring segment's control block (documented in kvshm/ipc/ring_pair.py): u64 words
_W_DONE_CAP: Final = 3
_W_DONE_OFF: Final = 5
_W_DONE_HEAD: Final = 4 * LINE // 8


def _victim(t: Traffic) -> tuple[int, int]:
    """A random rank and its pid."""
    r = t.rng.randrange(TP)
    return r, t.rig.pids[r]


async def fault_sigkill(t: Traffic) -> str:
    """SIGKILL a rank (ATTACH, one time in three: the kvshm-workers parent, whose ranks
    then get their parent-death SIGTERM); the engine must notice within the deadline."""
    r, pid = _victim(t)
    parent = t.rig.parent
    whom = f"rank {r} (pid {pid})"
    if parent is not None and t.rng.random() < 1 / 3:
        pid, whom = parent.pid, f"the kvshm-workers parent (pid {parent.pid})"
    send_signal(pid, signal.SIGKILL)
    t0 = time.monotonic()
    await t.until(lambda: not t.rank(r).alive, VERDICT_S, f"verdict after SIGKILL of {whom}",
                  hang=True)
    return f"SIGKILL {whom}; verdict on rank {r} after {time.monotonic() - t0:.2f}s"


async def fault_sigstop(t: Traffic) -> str:
    """SIGSTOP a rank and queue a load on it; wait for the hang verdict and that load's
    result. The rank is resumed later, in the canary phase -- or, for an ATTACH rank one
    time in three, only after the engine is closed. A ``kvshm-workers`` rank offers
    ``fence_by_kill``, so the verdict kills it and its exit fences it; a rank that did
    not offer it could not be fenced meanwhile: its blocks would stay quarantined
    (reported, not leaked). Either way the close must not hang."""
    r, pid = _victim(t)
    send_signal(pid, signal.SIGSTOP)
    keep = t.rig.parent is not None and t.rng.random() < 1 / 3
    (t.rig.kept_stopped if keep else t.rig.stopped).append(pid)
    t0 = time.monotonic()
    victim = asyncio.ensure_future(t.request(t.rng.randrange(PREFIXES), 1))
    await t.until(lambda: not t.rank(r).alive, HANG_S_STOP + VERDICT_S,
                  f"hang verdict on stopped rank {r}", hang=True)
    took = time.monotonic() - t0
    await bounded(t.out, victim, LOAD_S, "the request loading from the stopped rank")
    until = "the close" if keep else "the canary"
    return (f"SIGSTOP rank {r} (pid {pid}) with a load queued, resumed after {until}; "
            f"verdict after {took:.2f}s")


def _ring_segment(eng: Engine, rank: int) -> memoryview | None:
    """This process's mapping of ``rank``'s ring segment (through the engine's channel;
    private attributes, so None when they are not there)."""
    core = getattr(eng, "_core", None)
    chans = getattr(core, "_channels", None)
    chan = chans.get(rank) if isinstance(chans, dict) else None
    if chan is None or getattr(chan, "closed", True):
        return None
    mv = getattr(getattr(chan, "rings", None), "_mv", None)
    return mv if isinstance(mv, memoryview) else None


def _publish_bad_header(mv: memoryview) -> bool:
    """Write a record with an impossible header at the done ring's head and publish it."""
    ctl = mv[:CONTROL_SIZE].cast("Q")
    try:
        cap, off, head = ctl[_W_DONE_CAP], ctl[_W_DONE_OFF], ctl[_W_DONE_HEAD]
        at = head % cap
        if at + 16 > cap:
            return False
        data = mv[off + at: off + at + 16].cast("Q")
        data[0], data[1] = 0x0BAD_F00D_0000_0008, 0xFFFF_FFFF_FFFF_FFFF
        data.release()
        ctl[_W_DONE_HEAD] = head + 16
        return True
    finally:
        ctl.release()


def inject_done_garbage(eng: Engine, rank: int, variant: str) -> str:
    """Publish one garbage record in ``rank``'s done ring (its writer must be frozen);
    returns what was done."""
    mv = _ring_segment(eng, rank)
    if mv is None:
        return "ring segment not reachable: nothing injected"
    if variant == "header" and _publish_bad_header(mv):
        return "a record with an impossible header"
    pair = RingPair.attach(mv)
    try:
        pair.done.stage(b"\xc1" * 24)  # 0xc1 is never valid msgpack
        pair.done.publish()
    finally:
        pair.close()
    return "an undecodable record (0xc1 bytes)"


async def fault_corrupt_done(t: Traffic) -> str:
    """Freeze a rank, post a store to it, publish a garbage Done record in its ring and
    wait for the engine's verdict (a broken ring); the rank is resumed later."""
    r, pid = _victim(t)
    send_signal(pid, signal.SIGSTOP)
    t.rig.stopped.append(pid)
    rid, toks = t.prompt(None, 2)
    hashes = chain_hashes(toks, BS)
    table = await t.allocate(len(hashes))
    if table is not None:  # a store outstanding on the frozen rank: the ring is read
        t.call("allocated", t.eng.allocated, rid, [table], 0)
        t.write(table, hashes)
        t.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),),
                                new_or_resumed=True, num_confirmed_tokens=len(toks)))
    what = inject_done_garbage(t.eng, r, t.rng.choice(("payload", "header")))
    t.out.injected = not what.startswith("ring segment")
    seen = await t.until(lambda: not t.rank(r).alive, CORRUPT_VERDICT_S,
                         "verdict on the corrupt ring", hang=False)
    if table is not None:
        t.finish(rid, len(toks), table)
    if not seen and t.out.injected:
        t.out.notes.append(f"corrupt done record not detected within {CORRUPT_VERDICT_S}s")
    return f"rank {r} frozen, done ring got {what}; verdict={'yes' if seen else 'NO'}"


def _rogue_frames(world: int) -> list[tuple[str, bytes]]:
    """What the rogue connections send, one frame each."""
    enc = protocol.control_encoder()
    v, pid = protocol.PROTOCOL_VERSION, os.getpid()

    def hello(ver: int, rank: int, ws: int) -> bytes:
        return enc.encode(protocol.Hello(ver, rank, ws, pid))

    return [("garbage", os.urandom(97)),
            ("nested msgpack", b"\x91" * 60_000 + b"\xc0"),
            ("nested map", b"\x81\xa1k" * 20_000 + b"\xc0"),
            ("oversize frame", b"\x92" + b"\x00" * (1 << 17)),
            ("empty frame", b""),
            ("hello wrong rank", hello(v, world + 3, world)),
            ("hello live rank 0", hello(v, 0, world)),
            ("hello wrong version", hello(v + 99, 1, world)),
            ("hello wrong world", hello(v, 1, world + 1)),
            ("stats request never read", enc.encode(protocol.StatsRequest()))]


def rogue_connect(name: str, world: int, idle: int) -> tuple[list[socket.socket], list[str]]:
    """Open the rogue connections (blocking calls: run in a thread); returns the sockets
    (kept open) and what failed on the way."""
    addr = b"\0kvshm." + name.encode()
    socks: list[socket.socket] = []
    errs: list[str] = []
    frames: list[tuple[str, bytes | None]] = [*_rogue_frames(world)]
    frames += [("idle", None)] * idle
    for label, frame in frames:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(2.0)
        socks.append(s)
        try:
            s.connect(addr)
            if frame is not None:
                s.send(frame)
        except OSError as exc:
            errs.append(f"{label}: {exc.strerror or exc}")
    return socks, errs


async def fault_rogue_conn(t: Traffic) -> str:
    """Rogue connections on the rendezvous socket, held open; then ``kvshm stats`` must
    still answer and the engine must stay READY."""
    eng = t.eng
    got = await bounded(t.out, asyncio.to_thread(rogue_connect, eng.name, TP, 24), QUERY_S,
                        "rogue connections")
    if got is None:
        return "rogue connections: connect hung"
    socks, errs = got
    t.rig.held.extend(socks)
    await asyncio.sleep(0.2)
    stats = await bounded(t.out, asyncio.to_thread(query_stats, eng.name, QUERY_S), QUERY_S + 2,
                          "kvshm stats query beside rogue connections")
    refused = stats.get("counters", {}).get("refused", "?") if stats else "no answer"
    if stats is None:
        t.out.unusable.append("kvshm stats query got no answer beside rogue connections")
    sent = ", ".join(errs) if errs else "all sent"
    return f"{len(socks)} rogue connections ({sent}); engine counted refused={refused}"
