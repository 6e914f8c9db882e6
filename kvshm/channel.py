"""One rank's channel: its rings, the msgspec codec and the eventfd doorbells.

:class:`SchedulerChannel` (asyncio loop or a synchronous caller; never blocks) writes
``cmd`` and reads ``done``; :class:`WorkerChannel` (a synchronous worker loop) the
reverse. Each direction has one encoder (into a reused bytearray, then one slice-copy into
the ring) and one typed decoder that decodes straight from the ring's memoryview, before
the tail moves.

Ordering and loss rules:

* Messages arrive in the order they were sent. A full ``cmd`` ring is back-pressure,
  never a drop: :meth:`SchedulerChannel.post` queues the encoded record in a per-rank
  overflow deque, flushed in order on every receive and by the re-check timer;
  :meth:`SchedulerChannel.send_nowait` raises WouldBlock instead (and also while older
  records wait in the overflow, so it never overtakes them).
* A record that does not decode raises ProtocolError(ring, offset) once; the records
  around it are kept and returned by the next receive. A record whose *framing* is bad
  breaks the ring: every later receive raises (the caller fails that peer).
* Wake-ups: the writer fences and rings only a parked reader (:mod:`kvshm.doorbell`).
  Attached to a loop, the scheduler side keeps ``done`` parked except while it is
  draining inside its callback, and runs a re-check timer while Transfers are unanswered
  or the overflow is non-empty (safety net against a lost wake-up). It never spins: a
  ``Done`` always reaches it through the doorbell and one epoll wake-up of the loop.
  DESIGN.md's hot round-trip target (1.8x below ``multiprocessing`` pipes) does not hold
  under that rule: mp pays the same doorbell-and-wake-up (~24 us of kvshm's hot RTT on
  the H100 machine, ~16-20 us on the dev VM), and the rings save only the command side's
  syscalls (~11 us), so the measured ratio is 1.4-1.5x (README, "Transport").
* ``close()`` is idempotent: it stops the loop callbacks, releases the ring views and
  closes both eventfds (the lifeline and the segment belong to the caller); every later
  call except ``statistics()`` raises ClosedError. Overflow records still queued at
  close are dropped and counted.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Final, Generic, TypeVar

import msgspec

from kvshm import protocol
from kvshm.doorbell import FENCE_LOCK, PARK_TIMEOUT_S, Doorbell, Parker, full_fence
from kvshm.errors import ClosedError, ConfigError, ProtocolError, StateError, TransportError
from kvshm.errors import WouldBlock
from kvshm.ring import Ring, RingPair, WorkerState

RECHECK_INTERVAL_S: Final = 0.005
MAX_ERROR_CHARS: Final = 2048
SendT = TypeVar("SendT")
RecvT = TypeVar("RecvT")


@dataclass(frozen=True, slots=True)
class ChannelStats:
    """Counters of one side of one rank's channel (direction names: cmd and done).

    ``*_doorbells``: eventfd writes this side made, or for the direction it reads, the
    sum of counter values it drained (= the peer's writes it saw). ``wakeups``: times
    this side woke to read (doorbell callback or poll return, not spins or polls by the
    caller). ``rechecks``/``rescues``: scheduler: re-check timer runs / runs that found
    records with no doorbell pending (lost or late wake-ups); worker: parks avoided by
    the re-check / 1 s poll timeouts that found records (lost wake-ups). Expected 0.
    """

    side: str
    rank: int
    cmd_messages: int
    cmd_bytes: int
    done_messages: int
    done_bytes: int
    cmd_doorbells: int
    done_doorbells: int
    wakeups: int
    receives_per_wakeup: float
    full_ring_events: int
    overflow_depth: int
    overflow_peak: int
    overflow_dropped_at_close: int
    peak_depth_bytes: int
    protocol_errors: int
    parks: int
    rechecks: int
    rescues: int

    def as_dict(self) -> dict[str, int | float | str]:
        """Plain dict (for JSON / Prometheus export)."""
        return asdict(self)


class _Endpoint(Generic[SendT, RecvT]):
    """The half both sides share: encode + stage + notify, read + decode + commit."""

    def __init__(
        self,
        rank: int,
        rings: RingPair,
        tx: Ring,
        tx_fd: int,
        rx: Ring,
        rx_fd: int,
        decoder: msgspec.msgpack.Decoder[RecvT],
        close_fds: bool,
    ) -> None:
        self.rank = rank
        self.rings = rings
        self._tx, self._rx = tx, rx
        self._tx_bell, self._rx_bell = Doorbell(tx_fd), Doorbell(rx_fd)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = decoder
        self._scratch = bytearray(256)
        self._close_fds = close_fds
        self._closed = False
        self._pending: list[RecvT] = []
        self._sent_msgs = self._sent_bytes = self._recv_msgs = self._recv_bytes = 0
        self._wakeups = self._full_events = self._peak_depth = self._protocol_errors = 0
        self._last_error: ProtocolError | None = None

    @property
    def closed(self) -> bool:
        """True once close() ran."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"channel of rank {self.rank} is closed")

    def _encode(self, msg: SendT) -> bytearray:
        self._encoder.encode_into(msg, self._scratch)
        return self._scratch

    def _published(self, count: int, nbytes: int) -> None:
        """After tx.publish(): count, track depth, ring a parked reader (see notify)."""
        self._sent_msgs += count
        self._sent_bytes += nbytes
        tx = self._tx
        depth = tx.used()
        if depth > self._peak_depth:
            self._peak_depth = depth
        with FENCE_LOCK:
            pass
        token = tx.park_token
        if token and token != self._tx_bell.last_token:
            self._tx_bell.last_token = token
            self._tx_bell.ring()

    def _drain(self) -> list[RecvT]:
        """Decode every published record, commit once; see module doc for errors."""
        rx = self._rx
        try:
            views = rx.read_available()
        except ProtocolError as exc:
            if exc is not self._last_error:
                self._last_error = exc
                self._protocol_errors += 1
            raise
        pending = self._pending
        if not views:
            if pending:
                self._pending = []
            return pending
        decode = self._decoder.decode
        try:
            out = [decode(view) for view in views]
        except msgspec.DecodeError:
            return self._drain_slow(views)
        rx.commit_read()
        self._recv_msgs += len(out)
        self._recv_bytes += sum(map(len, views))
        if pending:
            self._pending = []
            return pending + out
        return out

    def _drain_slow(self, views: list[memoryview]) -> list[RecvT]:
        """Some record does not decode: keep the others for the next call, then raise."""
        out, bad = self._pending, []
        for i, view in enumerate(views):
            try:
                out.append(self._decoder.decode(view))
            except msgspec.DecodeError:
                bad.append(i)
        positions = self._rx.positions_of(bad)
        self._rx.commit_read()
        self._recv_msgs += len(views) - len(bad)
        self._recv_bytes += sum(map(len, views))
        self._protocol_errors += len(bad)
        self._pending = out
        raise ProtocolError(
            f"{len(bad)} undecodable record(s) from rank {self.rank}, first skipped",
            ring=self._rx.name,
            offset=positions[0],
        )

    def _stats(self, side: str, tx_is_cmd: bool, **extra: int) -> ChannelStats:
        sent = (self._sent_msgs, self._sent_bytes, self._tx_bell.rung)
        recv = (self._recv_msgs, self._recv_bytes, self._rx_bell.received)
        cmd, done = (sent, recv) if tx_is_cmd else (recv, sent)
        wakeups = self._wakeups
        return ChannelStats(
            side, self.rank, cmd[0], cmd[1], done[0], done[1], cmd[2], done[2], wakeups,
            self._recv_msgs / wakeups if wakeups else 0.0, self._full_events,
            extra.get("overflow_depth", 0), extra.get("overflow_peak", 0),
            extra.get("dropped", 0), self._peak_depth, self._protocol_errors,
            extra.get("parks", 0), extra.get("rechecks", 0), extra.get("rescues", 0),
        )  # fmt: skip

    def _close_common(self) -> None:
        self._closed = True
        self._pending = []
        if self._close_fds:
            self._tx_bell.close()
            self._rx_bell.close()
        self.rings.close()


class SchedulerChannel(_Endpoint[protocol.CmdMsg, protocol.Done]):
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
        self._outstanding = 0
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
    def outstanding(self) -> int:
        """Transfers in the ring or overflow not yet answered by a Done (approximate)."""
        return self._outstanding

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
        self._outstanding += isinstance(msg, protocol.Transfer)
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
        self._outstanding += isinstance(msg, protocol.Transfer)
        try:
            staged = self._tx.stage(payload)
        except ConfigError:
            self._outstanding -= isinstance(msg, protocol.Transfer)
            raise
        if not staged:
            self._full_events += 1
            self._overflow.append(bytes(payload))
            self._overflow_peak = max(self._overflow_peak, 1)
            self._arm_timer()
            return False
        self._tx.publish()
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
            self._outstanding += isinstance(msg, protocol.Transfer)
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
        """Every Done published so far ([] if none); then flushes the overflow."""
        self._check_open()
        msgs = self._drain()
        if msgs:
            self._outstanding = max(0, self._outstanding - len(msgs))
        if self._overflow:
            self.flush_overflow()
        return msgs

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
            while self._deliver():
                rx.park()
                full_fence()
                if rx.is_empty():
                    return
                rx.unpark()
        finally:
            if not self._closed and not rx.parked:
                rx.park()

    def _deliver(self) -> bool:
        """One drain to on_done; False when the ring broke or the channel closed."""
        assert self._on_done is not None
        while True:  # each failed try consumed records, so this ends
            try:
                msgs = self.receive_nowait()
                break
            except ProtocolError as exc:
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
        if self._loop is None or self._timer is not None or self._closed:
            return
        if self._outstanding or self._overflow or self._waiter is not None:
            self._timer = self._loop.call_later(self._interval, self._on_timer)

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
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ClosedError(f"channel of rank {self.rank} closed"))
        self._dropped += len(self._overflow)
        self._overflow.clear()
        self._close_common()

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



class WorkerChannel(_Endpoint[protocol.Done, protocol.CmdMsg]):
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
        tx = self._tx
        count = nbytes = 0
        for done in dones:
            if len(done.error) > self._max_error:
                done = msgspec.structs.replace(done, error=done.error[: self._max_error])
            payload = self._encode(done)
            if not tx.stage(payload):
                self._flush(count, nbytes)
                count = nbytes = 0
                self._wait_for_room(payload)
            count += 1
            nbytes += len(payload)
        self._flush(count, nbytes)

    def send_available(self, dones: Sequence[protocol.Done]) -> int:
        """Publish as many of ``dones`` as fit now, in order (one head store, at most one
        doorbell); returns how many. Never waits: the caller keeps the rest for later."""
        self._check_open()
        tx = self._tx
        count = nbytes = 0
        for done in dones:
            if len(done.error) > self._max_error:
                done = msgspec.structs.replace(done, error=done.error[: self._max_error])
            payload = self._encode(done)
            if not tx.stage(payload):
                self._full_events += 1
                break
            count += 1
            nbytes += len(payload)
        self._flush(count, nbytes)
        return count

    def _flush(self, count: int, nbytes: int) -> None:
        if self._tx.publish():
            self._published(count, nbytes)
            self.rings.mark_progress()

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

    def receive(self, timeout: float | None = None) -> list[protocol.CmdMsg]:
        """Commands, waiting up to ``timeout`` s (None: until some arrive); [] on timeout.

        Drains; if empty, spins ``spin_us``, then parks in poll() on the cmd eventfd and
        the lifeline (at most ``park_timeout`` per sleep). Returns [] early when the
        lifeline has data for its owner to read, or a :meth:`watch`-ed fd is readable.
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
