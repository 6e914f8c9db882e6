"""eventfd doorbells and the park/ring handshake that keeps idle readers asleep.

A reader that finds its ring empty *parks*; a writer rings the reader's eventfd only when
the reader is parked (doorbell suppression: a busy reader costs its writer no syscall).
The handshake is a Dekker pattern: each side stores one field, then loads the other's::

    reader (park)                          writer (publish + notify)
    0. drain the eventfd (old rings)       1. payload, then ring.head      (ring.py)
    1. ring.parked = new token (!= 0)      2. full_fence()
    2. full_fence()                        3. load ring.parked: a token not rung yet?
    3. load head: records? -> unpark, go      -> eventfd_write, remember the token
    4. poll([eventfd, lifeline], 1 s)
    5. ring.parked = 0

x86 may move a load before an older store to another address, so without both fences
each side could read the other's *old* value and the wake-up would be lost. With them,
at least one side sees the other: the reader finds the record in step 3, or the writer
finds the token and rings. Ringing once per token is enough: the eventfd stays readable
until the reader drains it, which it does only *before* storing its next token (step 0),
and a reader never sleeps again without a new token and a new re-check. The 1 s poll
timeout is only the safety net; a wake-up it rescues is counted (:attr:`Parker.rescues`)
and tests require zero.

A full fence here is an uncontended lock acquire/release (a locked instruction, ~0.2 us),
paid only on the park path and once per publish batch.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
from enum import Enum
from typing import Final

from kvshm.errors import PeerDied
from kvshm.ipc.ring import Ring

#: ``with FENCE_LOCK: pass`` is :func:`full_fence` inlined (:func:`notify`, per publish).
FENCE_LOCK: Final = threading.Lock()
_HUP: Final = select.POLLHUP | select.POLLERR | select.POLLNVAL
#: The park timeout: the longest a lost wake-up could delay a reader (never expected).
PARK_TIMEOUT_S: Final = 1.0


def full_fence() -> None:
    """A full memory barrier: acquiring a lock is a locked read-modify-write."""
    with FENCE_LOCK:
        pass


def create_eventfd() -> int:
    """A fresh non-blocking, close-on-exec eventfd with a zero counter."""
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


class Doorbell:
    """One eventfd. The writer side rings it; the reader side drains it.

    ``rung`` counts this process's writes; ``received`` sums the counter values this
    process drained (= how many times the other side rang, as seen by the reader).
    """

    __slots__ = ("fd", "rung", "received", "last_token", "_closed")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.rung = 0
        self.last_token = 0
        self.received = 0
        self._closed = False

    def ring(self) -> None:
        """Add 1 to the counter, making the fd readable."""
        os.eventfd_write(self.fd, 1)
        self.rung += 1

    def drain(self) -> int:
        """Reset the counter; returns its value (0 when it was not readable)."""
        try:
            value = os.eventfd_read(self.fd)
        except BlockingIOError:
            return 0
        self.received += value
        return value

    def close(self) -> None:
        """Close the fd (idempotent)."""
        if not self._closed:
            self._closed = True
            os.close(self.fd)


def notify(ring: Ring, bell: Doorbell) -> bool:
    """Writer side, after :meth:`Ring.publish`: fence, then ring a parked reader once.

    The one doorbell path of every writer (both channel ends and the stress tests).
    Returns True when it rang.
    """
    # the caller's head store, fence, then the token load (never before the store): a
    # reader whose re-check missed the record had stored its token first, so it is rung
    with FENCE_LOCK:  # full_fence(), inlined: this runs once per publish batch
        pass
    token = ring.park_token
    if token and token != bell.last_token:
        bell.last_token = token
        bell.ring()
        return True
    return False


class WakeReason(Enum):
    """Why :meth:`Parker.park` returned."""

    DATA = "data"  # the re-check after parking found records; never slept
    DOORBELL = "doorbell"  # the writer rang
    TIMEOUT = "timeout"  # the poll timed out (the ring may still hold records: a rescue)
    LIFELINE = "lifeline"  # the lifeline has data for its owner to read
    WATCHED = "watched"  # an fd added with Parker.watch is readable (never consumed here)


def lifeline_alive(fd: int) -> bool:
    """False when the socket ``fd`` reached EOF or failed (the peer is gone).

    A non-socket fd (a pipe) reports EOF as POLLHUP instead; it counts as alive here.
    """
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return True
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError as exc:
        return exc.errno in (errno.EAGAIN, errno.EINTR)
    finally:
        sock.detach()


class Parker:
    """Reader side of the handshake for one ring: park until rung, timed out or peer gone.

    ``lifeline_fd`` (optional) is a connected socket whose EOF/HUP means the peer died:
    :meth:`park` then raises :class:`PeerDied`. Data waiting on it returns LIFELINE (its
    owner reads it; the parker never consumes it).
    """

    def __init__(
        self,
        ring: Ring,
        bell: Doorbell,
        lifeline_fd: int | None = None,
        park_timeout: float = PARK_TIMEOUT_S,
    ) -> None:
        self._ring = ring
        self._bell = bell
        self._lifeline = lifeline_fd
        self._park_timeout = park_timeout
        self._poll = select.poll()
        self._poll.register(bell.fd, select.POLLIN)
        if lifeline_fd is not None:
            self._poll.register(lifeline_fd, select.POLLIN)
        self._watched: set[int] = set()
        self._undrained = True  # the eventfd may hold rings from before we existed
        self.parks = 0  # times it actually slept in poll()
        self.rechecks = 0  # parks avoided by the re-check (records arrived meanwhile)
        self.timeouts = 0  # polls that timed out
        self.rescues = 0  # timeouts after which the ring held records (lost wake-ups)
        self.spurious = 0  # doorbell wake-ups that found the ring empty

    def watch(self, fd: int) -> None:
        """Also wake (WATCHED) when ``fd`` is readable, e.g. a copy engine's completion
        eventfd or a signal wake-up pipe. The parker never reads it: its owner must drain
        it, or every later park returns at once. Idempotent."""
        if fd not in self._watched:
            self._poll.register(fd, select.POLLIN)
            self._watched.add(fd)

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd`` (idempotent); call it before closing the fd."""
        if fd in self._watched:
            self._watched.discard(fd)
            self._poll.unregister(fd)

    def park(self, timeout: float = PARK_TIMEOUT_S) -> WakeReason:
        """Park, re-check, sleep at most ``timeout`` seconds, unpark. See module doc.

        The eventfd is drained here, *before* the new token is stored, not on waking:
        that keeps the read() syscall off the wake-up path, and a ring for the new token
        can never be eaten by it.
        """
        ring = self._ring
        if self._undrained:
            self._undrained = False
            self._bell.drain()
        ring.park()
        # token store, fence, then the re-check: a record published before the writer
        # could see the token is found here; a later one finds the token and is rung
        full_fence()
        if not ring.is_empty():
            ring.unpark()
            self.rechecks += 1
            return WakeReason.DATA
        self.parks += 1
        try:
            events = self._poll.poll(max(0, int(timeout * 1000 + 0.999)))
        finally:
            ring.unpark()
        return self._classify(events)

    def wait(self, timeout: float | None, spin_ns: int = 0) -> WakeReason:
        """Until the ring has records (DATA or DOORBELL), the lifeline has data
        (LIFELINE), a watched fd is readable (WATCHED) or ``timeout`` seconds passed
        (TIMEOUT; None waits forever).

        Spins up to ``spin_ns`` first, then parks for at most ``park_timeout`` at a time
        (a timed-out wake re-parks). A doorbell with nothing published returns too
        (DOORBELL): it is how the scheduler wakes a rank it revoked, which its owner
        checks at once -- a re-park would leave it unaware for a whole park timeout. It
        is rare otherwise (a ring for records already drained: counted ``spurious``).
        PeerDied when the lifeline closes.
        """
        ring = self._ring
        if spin_ns:
            end = time.perf_counter_ns() + spin_ns
            while time.perf_counter_ns() < end:
                if not ring.is_empty():
                    return WakeReason.DATA
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = self._park_timeout
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            reason = self.park(wait)
            if reason is not WakeReason.TIMEOUT or not ring.is_empty():
                return reason
            if deadline is not None and time.monotonic() >= deadline:
                return WakeReason.TIMEOUT

    def _classify(self, events: list[tuple[int, int]]) -> WakeReason:
        reason = WakeReason.TIMEOUT
        for fd, mask in events:
            if fd == self._bell.fd:
                self._undrained = True  # drained at the next park
                reason = WakeReason.DOORBELL
            elif fd in self._watched:
                if reason is not WakeReason.DOORBELL:
                    reason = WakeReason.WATCHED
            elif mask & _HUP or not lifeline_alive(fd):
                raise PeerDied(f"lifeline fd {fd} closed: the peer is gone")
            elif reason is WakeReason.TIMEOUT:
                reason = WakeReason.LIFELINE
        if reason is WakeReason.TIMEOUT:
            self.timeouts += 1
            if not self._ring.is_empty():
                self.rescues += 1
        elif reason is WakeReason.DOORBELL and self._ring.is_empty():
            self.spurious += 1
        return reason

    def check_lifeline(self) -> None:
        """Raise PeerDied if the lifeline is closed (no waiting)."""
        if self._lifeline is not None and not lifeline_alive(self._lifeline):
            raise PeerDied(f"lifeline fd {self._lifeline} closed: the peer is gone")
