"""The worker side of one rank's channel (:mod:`kvshm.ipc.channel` has the shared parts
and the ordering and loss rules; :mod:`kvshm.ipc.sched_channel` the scheduler side).

A synchronous worker loop reads ``cmd`` and writes ``done``. When ``cmd`` runs dry it
spins briefly, then parks in poll() on the ``cmd`` eventfd and the lifeline
(:class:`~kvshm.ipc.doorbell.Parker`); its state word in the control block says
RUNNING, PARKED or STOPPED. A full ``done`` ring makes :meth:`WorkerChannel.send_many`
wait (bounded) for the scheduler to drain it; it never drops a Done.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from kvshm.errors import ConfigError, WouldBlock
from kvshm.ipc import protocol
from kvshm.ipc.channel import MAX_ERROR_CHARS, ChannelEndpoint, ChannelStats
from kvshm.ipc.doorbell import PARK_TIMEOUT_S, Parker, full_fence
from kvshm.ipc.ring_pair import RingPair, WorkerState

__all__ = ["WorkerChannel"]


class WorkerChannel(ChannelEndpoint[protocol.Done, protocol.CmdMsg]):
    """Worker side of rank ``rank``: reads ``cmd``, writes ``done``; a synchronous loop.

    ``lifeline_fd`` is the connected rendezvous socket (or None in tests): its EOF/HUP
    while waiting raises PeerDied. ``spin_us`` bounds the busy-wait after the ring runs
    dry before parking (0 parks at once); ``full_wait_s`` bounds the wait for room in a
    full ``done`` ring before WouldBlock.
    """

    def __init__(
        self,
        rank: int,
        rings: RingPair,
        cmd_efd: int,
        done_efd: int,
        lifeline_fd: int | None,
        *,
        spin_us: float = 50.0,
        park_timeout: float = PARK_TIMEOUT_S,
        full_wait_s: float = 1.0,
        close_fds: bool = True,
    ) -> None:
        super().__init__(
            rank, rings, rings.done, done_efd, rings.cmd, cmd_efd,
            protocol.cmd_decoder(), close_fds,
        )  # fmt: skip
        if spin_us < 0 or park_timeout <= 0 or full_wait_s < 0:
            raise ConfigError("spin_us and full_wait_s must be >= 0, park_timeout > 0")
        self._spin_ns = int(spin_us * 1000)
        self._full_wait = full_wait_s
        # error texts are cut so a Done always fits (4 UTF-8 bytes per char at worst)
        self._max_error = min(MAX_ERROR_CHARS, (rings.done.max_payload() - 64) // 4)
        self._parker = Parker(rings.cmd, self._rx_bell, lifeline_fd, park_timeout)
        rings.cmd.unpark()
        rings.worker_state = WorkerState.RUNNING

    def send_nowait(self, done: protocol.Done) -> None:
        """Publish one Done (see :meth:`send_many`)."""
        self.send_many((done,))

    def send_many(self, dones: Sequence[protocol.Done]) -> None:
        """Publish Dones with one head store and at most one doorbell per ring-full.

        A full ``done`` ring: waits up to ``full_wait_s`` for the scheduler to drain it,
        then WouldBlock (the Dones before the one that did not fit are sent); PeerDied if
        the lifeline closes meanwhile. Long error texts are cut to fit (MAX_ERROR_CHARS at most).
        """
        self._check_open()
        start, carried = 0, (0, 0)
        while True:
            count, nbytes, blocked = self._stage_from(dones, start)
            start += count
            self._flush(count + carried[0], nbytes + carried[1])
            if blocked is None:
                return
            self._wait_for_room(blocked)  # stages it once there is room
            start += 1
            carried = (1, len(blocked))

    def send_available(self, dones: Sequence[protocol.Done]) -> int:
        """Publish as many of ``dones`` as fit now, in order (one head store, at most one
        doorbell); returns how many. Never waits: the caller keeps the rest for later."""
        self._check_open()
        count, nbytes, blocked = self._stage_from(dones, 0)
        if blocked is not None:
            self._full_events += 1
        self._flush(count, nbytes)
        return count

    def _stage_from(self, dones: Sequence[protocol.Done],
                    start: int) -> tuple[int, int, bytearray | None]:
        """Stage ``dones[start:]`` in order until one does not fit: (how many were staged,
        their bytes, the encoded Done that did not fit or None). The one loop both
        senders use; nothing is visible to the scheduler before ``_flush``."""
        tx = self._tx
        nbytes = 0
        for i in range(start, len(dones)):
            done = dones[i]
            if len(done.error) > self._max_error:
                done = msgspec.structs.replace(done, error=done.error[: self._max_error])
            payload = self._encode(done)
            if not tx.stage(payload):
                return i - start, nbytes, payload
            nbytes += len(payload)
        return len(dones) - start, nbytes, None

    def _flush(self, count: int, nbytes: int) -> None:
        if self._tx.publish():  # head store first, then the doorbell (in _published)
            self._published(count, nbytes)

    def _wait_for_room(self, payload: bytearray) -> None:
        self._full_events += 1
        deadline = time.monotonic() + self._full_wait
        while not self._tx.stage(payload):
            self._parker.check_lifeline()
            if time.monotonic() >= deadline:
                raise WouldBlock(
                    f"done ring of rank {self.rank} still full after {self._full_wait}s: "
                    "the scheduler is not draining it"
                )
            time.sleep(0.0002)

    def receive_nowait(self) -> list[protocol.CmdMsg]:
        """Every command published so far; [] if none."""
        self._check_open()
        return self._drain()

    def take_salvaged(self) -> list[protocol.CmdMsg]:
        """The good commands kept back when a receive raised ProtocolError (the records
        around an undecodable one, over however many failed receives); a caller about
        to detach fails them locally first: none is dropped because a neighbour was
        bad."""
        good, self._pending = self._pending, []
        return good

    def receive(self, timeout: float | None = None) -> list[protocol.CmdMsg]:
        """Commands, waiting up to ``timeout`` s (None: until some arrive); [] on timeout.

        Drains; if empty, spins ``spin_us``, then parks in poll() on the cmd eventfd and
        the lifeline (at most ``park_timeout`` per sleep). Returns [] early when the
        lifeline has data for its owner to read, a :meth:`watch`-ed fd is readable, or
        the doorbell rang with nothing published (the scheduler revoked the rank).
        PeerDied on lifeline EOF/HUP.
        """
        self._check_open()
        msgs = self._drain()
        if msgs:
            return msgs
        self.rings.worker_state = WorkerState.PARKED
        parks = self._parker.parks
        try:
            self._parker.wait(timeout, self._spin_ns)
        finally:
            self.rings.worker_state = WorkerState.RUNNING
        self._wakeups += self._parker.parks - parks
        return self._drain()

    def watch(self, fd: int) -> None:
        """Make :meth:`receive` also return (early, maybe with []) when ``fd`` is
        readable: a copy engine's completion eventfd, a signal wake-up pipe. The channel
        never reads it; its owner drains it. Call :meth:`unwatch` before closing it."""
        self._check_open()
        self._parker.watch(fd)

    def unwatch(self, fd: int) -> None:
        """Undo :meth:`watch` (idempotent)."""
        self._parker.unwatch(fd)

    def watch_fd(self) -> int:
        """The ``cmd`` doorbell's eventfd: what a helper thread that waits for commands
        beside a host that never parks polls after :meth:`arm` (it never reads it)."""
        return self._rx_bell.fd

    def arm(self) -> bool:
        """A helper thread asks to be rung for the next command (an embedded worker's
        mover publisher, :mod:`workers.mover_publisher`): drain the doorbell, store a
        fresh park token, fence, re-check -- the park handshake of
        :mod:`kvshm.ipc.doorbell` without the sleep. True when commands already wait
        (the token is withdrawn: nothing will ring). Only for a channel whose owner never
        parks in :meth:`receive` (the two would share the token); the caller serialises
        it with every other call on this channel and calls :meth:`disarm` once awake.
        ClosedError after close."""
        self._check_open()
        ring = self.rings.cmd
        self._rx_bell.drain()
        ring.park()
        full_fence()  # the token store before the re-check (module doc of doorbell)
        if ring.is_empty():
            return False
        ring.unpark()
        return True

    def disarm(self) -> None:
        """Withdraw :meth:`arm`'s token (awake: the scheduler need not ring)."""
        self._check_open()
        self.rings.cmd.unpark()

    def beat(self) -> int:
        """Bump the heartbeat in the control block; returns the new count."""
        return self.rings.beat()

    def close(self) -> None:
        """Idempotent: marks the worker STOPPED, releases views, closes the eventfds."""
        if self._closed:
            return
        self.rings.worker_state = WorkerState.STOPPED
        self._close_common()

    def statistics(self) -> ChannelStats:
        """A snapshot of the counters (allowed after close)."""
        p = self._parker
        return self._stats(
            "worker", False, parks=p.parks, rechecks=p.rechecks, rescues=p.rescues
        )
