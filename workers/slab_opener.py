"""A rank's slab file, opened at once or -- while another process holds its lock -- later.

Why later: an engine started again under its name may find the previous run's rank
still holding the slab's lock (a rank slow to exit: stopped, in uninterruptible I/O, on
a loaded host). One attempt at Ready left the rank without its disk tier for the new
engine's whole life -- every Disk job failed, the warm slots were dropped as suspect one
failed READ at a time -- although the lock was free seconds later (a hostile probe).

:class:`SlabOpener` tries the open when the disk mover is made; on
:class:`~kvshm.disk.SlabLocked` it logs one line and tries again whenever :meth:`get` is
called at least :data:`RETRY_S` after the last try (the mover asks at each Disk job: a
non-blocking open and ``flock``, never a wait on the rank's loop), until one takes the
lock. Only a held lock is retried: another refusal (no space, O_DIRECT refused, a file
another user could write) does not pass by itself and is raised at once, as before.
Until the open, :meth:`get` is None and the mover fails each job with :attr:`waiting`.

Threads: :meth:`get` runs on the thread that submits jobs; the slab, once set, is never
unset (the mover's pool threads use it only for jobs accepted after it was).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from kvshm.disk import SlabFile, SlabLocked, SlabSpec

__all__ = ["RETRY_S", "SlabOpener"]

#: Least seconds between two tries of a slab whose lock another process holds.
RETRY_S: Final = 1.0

log = logging.getLogger(__name__)


class SlabOpener:
    """See the module docstring. Raises what :meth:`SlabFile.open` raises but
    SlabLocked (ConfigError: the caller fails every Disk job with the reason)."""

    def __init__(self, path: str, spec: SlabSpec, *, direct: bool,
                 retry_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self._spec, self._direct = path, spec, direct
        self._retry_s = RETRY_S if retry_s is None else retry_s  # (read at the call: tests)
        self._clock = clock
        self.slab: SlabFile | None = None
        #: Why the slab is not open yet (None once it is).
        self.waiting: str | None = None
        #: Tries after the first (each ``get`` past the interval while the lock is held).
        self.retries = 0
        self._next = 0.0
        try:
            self.slab = SlabFile.open(path, spec, direct=direct)
        except SlabLocked as exc:
            self._locked(exc)
            log.warning("kvshm disk tier, rank %d: %s; this rank's disk jobs fail until "
                        "it is free (tried again every %g s)", spec.rank, exc, self._retry_s)

    def get(self) -> SlabFile | None:
        """The open slab; None while another process holds its lock (tried again here at
        most every ``retry_s``; a try never raises: what went wrong is :attr:`waiting`)."""
        if self.slab is not None or self._clock() < self._next:
            return self.slab
        self.retries += 1
        try:
            self.slab = SlabFile.open(self.path, self._spec, direct=self._direct)
        except SlabLocked as exc:
            self._locked(exc)
            return None
        except Exception as exc:  # noqa: BLE001 - (space, a swapped file): try again later
            self._locked(exc)
            return None
        self.waiting = None
        log.warning("kvshm disk tier, rank %d: slab %s opened after %d more tries",
                    self._spec.rank, self.path, self.retries)
        return self.slab

    def _locked(self, exc: Exception) -> None:
        self.waiting = f"{type(exc).__name__}: {exc}"
        self._next = self._clock() + self._retry_s
