"""A rank's slab file, opened at once or -- while another process holds its lock -- later.

Why later: an engine started again under its name may find the previous run's rank
still holding the slab's lock (a rank slow to exit: stopped, in uninterruptible I/O, on
a loaded host). One attempt at Ready left the rank without its disk tier for the new
engine's whole life -- every Disk job failed, the warm slots were dropped as suspect one
failed READ at a time -- although the lock was free seconds later (a hostile probe).

:class:`SlabOpener` tries the open when the disk mover is made. On
:class:`~kvshm.disk.SlabLocked` it logs one line and starts a thread of its own that
tries again every :data:`RETRY_S` until one try takes the lock (one line then), or
fails otherwise (that reason stays: no more tries), or :meth:`close`. The tries run off
the rank's loop: a re-initialised file (another layout) is truncated and preallocated
whole, which may take seconds that a rank's loop must not stall for. Only a held lock
is waited for: any other refusal at the first try (no space, O_DIRECT refused, a file
another user could write) is raised at once, as before.

Threads: :attr:`slab` is set once, by the retry thread (or the constructor), and never
unset; the mover reads it at each job (a job accepted once it is set is run by the
pool threads on it). :meth:`close` stops the thread and joins it (a slab it opens
after the close is closed by the thread itself, never handed over); the caller then
closes :attr:`slab` if set.
"""

from __future__ import annotations

import logging
import threading
from typing import Final

from kvshm.disk import SlabFile, SlabLocked, SlabSpec

__all__ = ["RETRY_S", "SlabOpener"]

#: Seconds between two tries of a slab whose lock another process holds.
RETRY_S: Final = 1.0

log = logging.getLogger(__name__)


class SlabOpener:
    """See the module docstring. Raises what :meth:`SlabFile.open` raises but
    SlabLocked (ConfigError: the caller fails every Disk job with the reason)."""

    def __init__(self, path: str, spec: SlabSpec, *, direct: bool, keep: bool = True,
                 retry_s: float | None = None) -> None:
        self.path, self._spec, self._direct, self._keep = path, spec, direct, keep
        self._retry_s = RETRY_S if retry_s is None else retry_s  # (read at the call: tests)
        self.slab: SlabFile | None = None
        #: Why the slab is not open (None once it is).
        self.waiting: str | None = None
        #: Tries after the first.
        self.retries = 0
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self.slab = SlabFile.open(path, spec, direct=direct)
        except SlabLocked as exc:
            self.waiting = f"{type(exc).__name__}: {exc}"
            log.warning("kvshm disk tier, rank %d: %s; this rank's disk jobs fail until "
                        "it is free (tried again every %g s)", spec.rank, exc, self._retry_s)
            self._thread = threading.Thread(target=self._retry, daemon=True,
                                            name=f"kvshm-slab-r{spec.rank}")
            self._thread.start()

    def _retry(self) -> None:
        """The retry thread: a try every ``retry_s`` until one opens, one fails for
        another reason, or :meth:`close`."""
        while not self._stop.wait(self._retry_s):
            self.retries += 1
            try:
                slab = SlabFile.open(self.path, self._spec, direct=self._direct)
            except SlabLocked as exc:
                self.waiting = f"{type(exc).__name__}: {exc}"
                continue
            except Exception as exc:  # noqa: BLE001 - kept as the reason; no more tries
                self.waiting = f"{type(exc).__name__}: {exc}"
                log.warning("kvshm disk tier, rank %d: slab %s: %s; this rank's disk jobs "
                            "fail", self._spec.rank, self.path, self.waiting)
                return
            with self._lock:
                if self._closed:  # the mover closed meanwhile: nobody will use it (and a
                    slab.close(remove=not self._keep)  # slab no start keeps goes: a review)
                    return
                self.slab, self.waiting = slab, None
            log.warning("kvshm disk tier, rank %d: slab %s opened after %d more tries",
                        self._spec.rank, self.path, self.retries)
            return

    def close(self) -> None:
        """Stop trying (idempotent); after it returns :attr:`slab` no longer changes. A
        try under way is waited for (a re-initialised file's preallocation: seconds)."""
        with self._lock:
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
