"""A forked child never drives its parent's engines.

After ``os.fork()`` (or ``multiprocessing`` with the ``fork`` start method) a child holds
copies of everything an engine holds: the cmd rings' shared memory, the rendezvous
socket, the eventfd doorbells, the spawned ranks' pidfds. Those copies are the parent's
engine, not a second one: a Shutdown the child posts reaches the parent's ranks (they
detach and the parent loses its offload for good), a step it posts moves the ring's head
under the parent's feet (the ranks fail with a protocol error), a load it posts writes
into device blocks the parent may have given to another request.

So every runtime opened in this process is tracked here, and in a forked child each is
*disowned* at once (``os.register_at_fork``): it reads CLOSED, so every call raises
:class:`~kvshm.errors.StateError` naming the owning process, and ``close()`` /
``aclose()`` return at once having touched nothing shared (the child's copies of the fds
go when it exits). The parent's engines are untouched. A child that wants offload
creates its own engine.

Invariant: a runtime is disowned only in a process other than the one that opened it,
before any code of the child runs (``after_in_child`` runs inside ``fork`` itself).
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

__all__ = ["track"]


class Disownable(Protocol):
    def disown(self, owner_pid: int) -> None: ...


_live: weakref.WeakSet[Disownable] = weakref.WeakSet()


def track(runtime: Disownable) -> None:
    """Disown ``runtime`` in every child this process forks from now on."""
    _live.add(runtime)


def _after_fork_in_child() -> None:
    owner = os.getppid()
    for runtime in list(_live):
        runtime.disown(owner)
    _live.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
