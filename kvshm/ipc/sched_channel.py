"""The scheduler side of one rank's channel (:mod:`kvshm.ipc.channel` has the shared parts
and the ordering and loss rules; :mod:`kvshm.ipc.worker_channel` the worker side).

Never blocks: an asyncio loop (uvloop) watches the ``done`` doorbell with
``loop.add_reader``, or a synchronous caller polls with the ``*_nowait`` calls. A full
``cmd`` ring queues the encoded record in the overflow deque (:meth:`post`), flushed in
order on every receive and by the re-check timer.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Final

from kvshm.errors import (
    ClosedError,
    ConfigError,
    ProtocolError,
    StateError,
    TransportError,
    WouldBlock,
)
from kvshm.ipc import protocol
from kvshm.ipc.channel import RECHECK_INTERVAL_S, ChannelEndpoint, ChannelStats
from kvshm.ipc.doorbell import full_fence
from kvshm.ipc.ring_pair import RevokeReason, RingPair
from kvshm.ipc.unanswered import Unanswered

__all__ = ["DRAINS_PER_PUMP", "SchedulerChannel"]

#: Drains of the ``done`` ring one doorbell callback makes at most; past them, the rest
#: is read at the loop's next turn (other ranks' callbacks, timers and the host's
#: coroutines run in between). Unbounded, a rank refilling its ring as fast as it was
#: read kept the loop in one callback for as long as it went on (a hostile probe: 26 s).
DRAINS_PER_PUMP: Final = 8


class SchedulerChannel(ChannelEndpoint[protocol.CmdMsg, protocol.Done]):
    """Scheduler side of rank ``rank``: writes ``cmd``, reads ``done``; never blocks."""

    def __init__(
        self,
        rank: int,
        rings: RingPair,
        cmd_efd: int,
        done_efd: int,
        *,
        recheck_interval: float = RECHECK_INTERVAL_S,
        close_fds: bool = True,
    ) -> None:
        super().__init__(
            rank, rings, rings.cmd, cmd_efd, rings.done, done_efd,
            protocol.done_decoder(), close_fds,
        )  # fmt: skip
        if recheck_interval <= 0:
            raise ConfigError(f"recheck_interval must be > 0, got {recheck_interval}")
        self._interval = recheck_interval
        self._overflow: collections.deque[bytes] = collections.deque()
        self._overflow_peak = self._dropped = 0
        self._unanswered = Unanswered()  # the hang clock's count (tier jobs apart)
        self._answered_good: list[protocol.Done] = []  # beside strays (take_salvaged)
        self._again: asyncio.Handle | None = None  # the pump scheduled for the next turn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_done: Callable[[list[protocol.Done]], None] | None = None
        self._on_error: Callable[[TransportError], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._rechecks = self._rescues = 0

    @property
    def overflow_depth(self) -> int:
        """Encoded records waiting for room in the ``cmd`` ring."""
        return len(self._overflow)

    @property
    def max_record(self) -> int:
        """The largest encoded command the ``cmd`` ring can ever take."""
        return self._tx.max_payload()

    @property
    def outstanding(self) -> int:
        """Transfers in the ring or overflow not yet answered by a Done."""
        return self._unanswered.count

    # -- sending -------------------------------------------------------------------
    def send_nowait(self, msg: protocol.CmdMsg) -> None:
        """Publish ``msg`` now; WouldBlock if the ring (or the overflow before it) is full.

        ConfigError if the record could never fit the ring.
        """
        self._check_open()
        if self._overflow:
            self.flush_overflow()
        if self._overflow:
            self._full_events += 1
            raise WouldBlock(f"cmd ring of rank {self.rank}: older records still queued")
        payload = self._encode(msg)
        if not self._tx.stage(payload):
            self._full_events += 1
            raise WouldBlock(f"cmd ring of rank {self.rank} is full")
        self._tx.publish()
        self._unanswered.sent(msg)
        self._published(1, len(payload))
        self._arm_timer()

    def post(self, msg: protocol.CmdMsg) -> bool:
        """Publish ``msg``, or queue it behind a full ring; True if it is in the ring.

        Never blocks and never raises for a full ring (ConfigError for a record larger
        than the ring could ever hold, ClosedError after close).
        """
        if self._overflow or self._closed:
            return self.post_many((msg,)) == 1
        payload = self._scratch  # fast path: nothing queued, one record
        self._encoder.encode_into(msg, payload)
        self._unanswered.sent(msg)
        try:
            staged = self._tx.stage(payload)
        except ConfigError:  # refused: nothing of it stays (the count, a tier job's id)
            self._unanswered.unsent(msg)
            raise
        if not staged:
            self._full_events += 1
            self._overflow.append(bytes(payload))
            self._overflow_peak = max(self._overflow_peak, 1)
            self._arm_timer()
            return False
        self._tx.publish()  # head store first, then the doorbell (in _published)
        self._published(1, len(payload))
        if self._timer is None:
            self._arm_timer()
        return True

    def post_many(self, msgs: Sequence[protocol.CmdMsg]) -> int:
        """:meth:`post` for several messages, in order, with one head store and at most
        one doorbell; returns how many went into the ring (the rest are queued).

        A record too large for the ring raises ConfigError; the messages before it are
        sent (or queued) as usual, it and the ones after it are not.
        """
        self._check_open()
        tx, overflow = self._tx, self._overflow
        limit = tx.max_payload()
        staged = nbytes = 0
        for msg in msgs:
            payload = self._encode(msg)
            if len(payload) > limit:
                if staged:
                    tx.publish()
                    self._published(staged, nbytes)
                raise ConfigError(
                    f"record of {len(payload)} bytes exceeds the cmd ring limit of {limit} "
                    f"(rank {self.rank})"
                )
            self._unanswered.sent(msg)
            if not overflow and tx.stage(payload):
                staged += 1
                nbytes += len(payload)
                continue
            if not overflow:
                self._full_events += 1
            overflow.append(bytes(payload))
        if overflow and len(overflow) > self._overflow_peak:
            self._overflow_peak = len(overflow)
        if staged:
            tx.publish()
            self._published(staged, nbytes)
        self._arm_timer()
        return staged

    async def send(self, msg: protocol.CmdMsg) -> None:
        """:meth:`post`, then wait (re-checking every ``recheck_interval``) until nothing
        is left in the overflow, i.e. ``msg`` is in the ring. Cancelling the wait does
        not withdraw the message."""
        if self.post(msg):
            return
        while self._overflow:
            await asyncio.sleep(self._interval)
            self.flush_overflow()

    def flush_overflow(self) -> int:
        """Move queued records into the ring, in order, as far as they fit; returns how many."""
        self._check_open()
        overflow, tx = self._overflow, self._tx
        count = nbytes = 0
        while overflow and tx.stage(overflow[0]):
            nbytes += len(overflow.popleft())
            count += 1
        if count:
            tx.publish()
            self._published(count, nbytes)
        return count

    # -- receiving -----------------------------------------------------------------
    def receive_nowait(self) -> list[protocol.Done]:
        """Every Done published so far ([] if none); then flushes the overflow.
        ProtocolError for a Done that answers nothing sent to this rank (a stray:
        :mod:`kvshm.ipc.unanswered`), the others kept for :meth:`take_salvaged` (or, as
        the records around an undecodable one, returned by the next receive).
        """
        self._check_open()
        carried, self._answered_good = self._answered_good, []
        try:
            msgs = self._drain()
        except BaseException:  # an undecodable record: the carried Dones wait again
            self._answered_good = carried  # (a review: they were lost)
            raise
        if msgs:
            stray = self._unanswered.answered(msgs, self.rank)
            if stray:
                raise self._strays(carried, msgs, stray)
        if self._overflow:
            self.flush_overflow()
        return carried + msgs if carried else msgs

    def _strays(self, carried: list[protocol.Done], msgs: list[protocol.Done],
                stray: list[protocol.Done]) -> ProtocolError:
        """The error for ``stray`` among ``msgs`` (the rest already marked answered):
        the rest are kept, after ``carried`` (kept by an earlier error), for
        :meth:`take_salvaged` or the next receive, in order."""
        self._protocol_errors += len(stray)
        bad = {id(d) for d in stray}  # by identity: a duplicate equals its original
        self._answered_good = carried + [d for d in msgs if id(d) not in bad]
        first = stray[0]
        return ProtocolError(
            f"{len(stray)} Done(s) from rank {self.rank} answering nothing sent to it, "
            f"first Done(job {first.job_id}, rank {first.rank}, ok={first.ok}): a job "
            f"never sent, another rank's, or one already answered",
            ring=self._rx.name)

    def take_salvaged(self) -> list[protocol.Done]:
        """The good Dones kept back when a receive raised ProtocolError (the records
        around an undecodable one or a stray one); a caller about to fail the rank
        applies them first, so no message is dropped because its neighbour was bad."""
        good, self._answered_good = self._answered_good, []
        pending, self._pending = self._pending, []
        if pending:
            stray = self._unanswered.answered(pending, self.rank)
            if stray:  # the rank is failed anyway: only the answering ones are applied
                self._protocol_errors += len(stray)
                bad = {id(d) for d in stray}
                pending = [d for d in pending if id(d) not in bad]
            good += pending
        return good

    async def receive(self) -> list[protocol.Done]:
        """Wait for at least one Done. Not allowed when attached with an ``on_done``."""
        self._check_open()
        if self._on_done is not None:
            raise StateError("channel attached with on_done: Dones go to that callback")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self.attach(loop)
        while True:
            msgs = self.receive_nowait()
            if msgs:
                return msgs
            self._rx.park()  # a fresh token: the worker rings once for this wait
            # token store, fence, then the re-check: a Done published before the worker
            # could see the token is found here; one published after it gets rung
            full_fence()
            if not self._rx.is_empty():
                continue
            self._waiter = loop.create_future()
            self._arm_timer()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def attach(
        self,
        loop: asyncio.AbstractEventLoop,
        on_done: Callable[[list[protocol.Done]], None] | None = None,
        on_error: Callable[[TransportError], None] | None = None,
    ) -> None:
        """Watch the done eventfd with ``loop.add_reader`` (asyncio or uvloop).

        With ``on_done``, every batch of Dones goes to it from the loop; without, use
        :meth:`receive`. ``on_error`` gets ProtocolErrors (default: the loop's exception
        handler); after a broken ring no more callbacks run.
        """
        self._check_open()
        if self._loop is not None:
            raise StateError(f"channel of rank {self.rank} is already attached")
        self._loop, self._on_done, self._on_error = loop, on_done, on_error
        loop.add_reader(self._rx_bell.fd, self._on_doorbell)
        self._arm_timer()

    def _on_doorbell(self) -> None:
        if self._closed:
            return
        self._rx_bell.drain()
        self._wakeups += 1
        self._pump()

    def _pump(self) -> None:
        if self._closed or self._rx.broken is not None:
            return
        if self._on_done is None:  # receive() drains, then re-parks with a new token
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)
            return
        rx = self._rx
        rx.unpark()  # awake and reading: the worker need not ring
        try:
            for _ in range(DRAINS_PER_PUMP):
                if not self._deliver():
                    return
                rx.park()
                full_fence()  # park, fence, re-check: a Done that raced the park is read now
                if rx.is_empty():
                    return
                rx.unpark()
            # still not empty: the rest at the loop's next turn (the finally below), so
            # one rank's ring, refilled as fast as it is read, cannot hold the loop
        finally:
            if not self._closed and not rx.parked:
                # left early (on_done raised, or the drains' bound): park with the same
                # re-check, or a Done the worker published unrung while this side read
                # would wait for a doorbell
                rx.park()
                full_fence()
                if not rx.is_empty() and self._loop is not None and self._again is None:
                    self._again = self._loop.call_soon(self._pump_again)

    def _pump_again(self) -> None:
        """:meth:`_pump` at the loop's next turn, scheduled once at a time (one chain per
        channel: each pump that left records behind used to schedule one more, and with
        the doorbell's own the pumps of one loop turn grew turn by turn)."""
        self._again = None
        self._pump()

    def _deliver(self) -> bool:
        """One drain to on_done; False when the ring broke or the channel closed."""
        assert self._on_done is not None
        while True:  # each failed try consumed records, so this ends
            try:
                msgs = self.receive_nowait()
                break
            except ProtocolError as exc:
                # the good records around the bad one go out first: a message is never
                # dropped because its neighbour was bad (the report may close us)
                good = self.take_salvaged()
                if good:
                    self._on_done(good)
                    if self._closed:  # on_done failed the peer itself: no more callbacks
                        return False
                self._report(exc)
                if self._closed or self._rx.broken is not None:
                    return False
            except ClosedError:
                return False
        if msgs:
            self._on_done(msgs)
        return not self._closed

    def _report(self, exc: TransportError) -> None:
        if self._on_error is not None:
            self._on_error(exc)
        elif self._loop is not None:
            self._loop.call_exception_handler(
                {"message": f"kvshm channel of rank {self.rank}", "exception": exc}
            )

    def _arm_timer(self) -> None:
        loop = self._loop
        if loop is None or self._timer is not None or self._closed or loop.is_closed():
            return  # (a closed loop: the engine is being closed from another one)
        if self._unanswered.count or self._overflow or self._waiter is not None:
            self._timer = loop.call_later(self._interval, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._closed:
            return
        self._rechecks += 1
        if not self._rx.is_empty():
            # Records, yet no doorbell pending and no waiter already woken: a lost wake-up,
            # or a late one (the worker preempted between its publish and its eventfd
            # write). A steady rate of these means lost wake-ups.
            woken = self._waiter is not None and self._waiter.done()
            if self._rx_bell.drain() == 0 and not woken:
                self._rescues += 1
            self._pump()
        if self._overflow and not self._closed:
            self.flush_overflow()
        self._arm_timer()

    # -- lifecycle -----------------------------------------------------------------
    def revoke(self, reason: RevokeReason) -> None:
        """Declare the rank dead in its control block, then ring its ``cmd`` doorbell so
        a parked worker wakes and sees it. Call before :meth:`close` (which drops this
        side's view of the segment); a no-op once closed."""
        if self._closed:
            return
        self.rings.revoke(reason)
        full_fence()  # the revocation word before the doorbell: the woken worker reads it
        self._tx_bell.ring()

    def close(self) -> None:
        """Idempotent; see module doc. Later calls raise ClosedError."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._rx_bell.fd)
            except RuntimeError:  # pragma: no cover - loop closing concurrently
                pass
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._again is not None:
            self._again.cancel()
            self._again = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ClosedError(f"channel of rank {self.rank} closed"))
        self._dropped += len(self._overflow)
        self._overflow.clear()
        self._close_common()

    def disown(self) -> None:
        """This process is a fork of the channel's owner (:mod:`kvshm.engine.forks`):
        closed here -- the copied loop callbacks do nothing, no call is allowed -- with
        nothing shared touched (no ring, doorbell or loop registration)."""
        self._closed = True
        self._timer = None
        self._again = None
        self._loop = None

    async def aclose(self) -> None:
        """Async spelling of :meth:`close` (idempotent)."""
        self.close()

    def statistics(self) -> ChannelStats:
        """A snapshot of the counters (allowed after close)."""
        return self._stats(
            "scheduler", True, overflow_depth=len(self._overflow),
            overflow_peak=self._overflow_peak, dropped=self._dropped,
            rechecks=self._rechecks, rescues=self._rescues,
        )  # fmt: skip
