"""A forked child never drives its parent's engines.

After ``os.fork()`` (or ``multiprocessing`` with the ``fork`` start method) a child holds
copies of everything an engine holds: the cmd rings' shared memory, the rendezvous
socket, the eventfd doorbells, the spawned ranks' pidfds. Those copies are the parent's
engine, not a second one: a Shutdown the child posts reaches the parent's ranks (they
detach and the parent loses its offload for good), a step it posts moves the ring's head
under the parent's feet (the ranks fail with a protocol error), a load it posts writes
into device blocks the parent may have given to another request.

The event loop an ``Engine`` runs on is copied too, and an asyncio selector loop's
epoll instance is *shared* with the parent: the child's loop, running on or closing,
would read the parent's done rings in its copied callbacks (taking the parent's Dones)
and take the parent's fds out of the shared epoll set (``loop.close()`` removes its
self-pipe: the parent's loop then no longer wakes for a result handed over from another
thread, and its ``aclose()`` and ``asyncio.run``'s final executor join waited for good).

So every runtime opened in this process is tracked here with its owner's pid, and in a
forked child each is *disowned* at once (``os.register_at_fork``): it reads CLOSED, so
every call raises :class:`~kvshm.errors.StateError` naming the owning process, and
``close()`` / ``aclose()`` return at once having touched nothing shared; its channels
and rendezvous ignore their copied callbacks; and the loop it was attached to gets an
epoll instance of its own in the child (:func:`own_selector`), so nothing the child
does with its copy of the loop reaches the parent's. The child's copies of the fds go
when it exits. The parent's engines are untouched. A child that wants offload creates
its own engine.

Invariant: a runtime is disowned only in a process other than the one that opened it,
before any code of the child runs (``after_in_child`` runs inside ``fork`` itself).
"""

from __future__ import annotations

import asyncio
import os
import selectors
import weakref
from typing import Any, Protocol

__all__ = ["own_selector", "track"]


class Disownable(Protocol):
    def disown(self, owner_pid: int) -> None:
        """This process is a fork of ``owner_pid``: let go of everything shared."""


#: runtime -> the pid of the process that opened it
_live: weakref.WeakKeyDictionary[Disownable, int] = weakref.WeakKeyDictionary()


def track(runtime: Disownable) -> None:
    """Disown ``runtime`` in every child this process forks from now on."""
    _live[runtime] = os.getpid()


def own_selector(loop: asyncio.AbstractEventLoop | None) -> None:
    """In a forked child: give its copy of a selector event loop an epoll instance and a
    self-pipe of its own (the old ones are shared with the parent: their fds are closed
    here, which removes no registration of the parent's). Every other reader or writer
    registered on that loop is dropped in the child. A closed loop, a loop of another
    kind (uvloop) or one whose selector cannot be made again is left as it is. Never
    raises: the at-fork hook must reach every runtime.

    Left shared on Python 3.11: a signal wake-up fd (``add_signal_handler``) still
    names the parent's self-pipe (3.12 resets it at fork)."""
    if not isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop) \
            or loop.is_closed():
        return
    raw: Any = loop
    shared = raw._selector
    if shared is None:
        return
    try:
        fresh: selectors.BaseSelector = type(shared)()
    except Exception:  # noqa: BLE001 - e.g. out of fds: leave the loop as it is
        return
    raw._selector = fresh
    shared.close()
    if getattr(raw, "_ssock", None) is not None:  # the parent's self-pipe: closed here
        raw._ssock.close()  # only (``_close_self_pipe`` without its unregistering)
        raw._csock.close()
        raw._ssock = raw._csock = None
        raw._internal_fds -= 1
    try:
        raw._make_self_pipe()
    except Exception:  # noqa: BLE001 - the child's loop then has no wake-up: its own
        pass


def _after_fork_in_child() -> None:
    """Disown every runtime tracked (``os.register_at_fork``'s hook in the child); one
    that raises does not keep the others from being disowned."""
    for runtime, owner in list(_live.items()):
        try:
            runtime.disown(owner)
        except Exception:  # noqa: BLE001 - the others must still be disowned
            pass
    _live.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
