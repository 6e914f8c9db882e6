"""Running a call's requests in parallel: the caller's thread and a small pool.

:meth:`FanOut.run` runs ``one(i)`` for ``i`` in ``range(n)`` on ``threads`` threads --
the caller's own, which takes the first share instead of waiting (one hand-off fewer,
none for ``n == 1``), and ``threads - 1`` of a pool -- thread ``t`` taking ``i = t, t +
T, ...`` in order, and returns the results in ``i`` order. It returns only once every
item it started has finished (a request never writes into a caller's buffers after the
call returned); an item it did not start keeps ``failed`` -- after :meth:`FanOut.close`,
when the pool refuses the shares, the call runs none of them, the caller's share
included.

**Probes first, alone.** ``probe(i)`` (asked once per item, before anything runs)
marks the items that must not race others of their kind: a store's parts whose shard's
breaker is not closed. A half-open breaker lets one request through (its probe) and
refuses every request that would race it, which would fail the rest of the call (a
whole job) against a server that is back; and which request of the shard is the probe
is not known in advance. So the marked items run one at a time, in order, on the
caller's thread -- each sees the breaker its predecessor left -- while the others fan
out over the pool at once: one shard down or recovering does not slow the calls' parts
of the healthy shards. The caller's thread takes its share of the others after the
marked ones.

**Nothing raises.** An item that raises is a bug, not an outage: it is logged (rate
limited), ``crashed()`` is called (the owner counts it) and its result is ``failed``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvshm.ratelog import RateLimitedLog

__all__ = ["FanOut"]

rlog = RateLimitedLog(logging.getLogger(__name__))


class FanOut:
    """``threads`` threads for a call's items (module docstring)."""

    def __init__(self, threads: int, *, crashed: Callable[[], None],
                 name: str = "kvshm-remote") -> None:
        self.threads = max(1, threads)
        self._crashed = crashed
        self._pool = ThreadPoolExecutor(self.threads - 1 or 1, thread_name_prefix=name)

    def run(self, n: int, one: Callable[[int], Any], failed: Any,
            probe: Callable[[int], bool] | None = None) -> list[Any]:
        """``[one(0), ..., one(n - 1)]`` over the threads, the items ``probe`` marks
        one at a time on the caller's thread (module docstring)."""
        out: list[Any] = [failed] * n
        probes: list[int] = []
        rest: list[int] = []
        for i in range(n):
            (probes if probe is not None and probe(i) else rest).append(i)
        threads = min(self.threads, len(rest)) or 1

        def chunk(t: int) -> None:
            for i in rest[t::threads]:
                out[i] = self._one(one, i, failed)
        futures = []
        try:
            for t in range(1, threads):
                futures.append(self._pool.submit(chunk, t))
        except RuntimeError:  # closed concurrently: wait for the shares already handed
            for f in futures:
                f.result()
            return out
        for i in probes:  # alone and in order (no recursion: any n)
            out[i] = self._one(one, i, failed)
        chunk(0)
        for f in futures:
            f.result()
        return out

    def close(self) -> None:
        """Wait for the pool's items in flight and stop it (a later :meth:`run`: the
        module docstring). It does not wait for a caller's own share."""
        self._pool.shutdown(wait=True)

    def _one(self, one: Callable[[int], Any], i: int, failed: Any) -> Any:
        try:
            return one(i)
        except Exception:  # noqa: BLE001 - a bug must not raise into a worker: logged
            rlog.error("unexpected", "remote tier: unexpected error", exc_info=True)
            self._crashed()
            return failed
