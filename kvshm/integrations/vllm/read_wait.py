"""A lookup's bounded wait for the lower tier's answer (the vLLM scheduler side).

With a disk tier, the lookup that first answers "ask again" for a disk hit has posted
its READ, and the worker's mover publisher starts it on arrival. With a remote tier, a
lookup that asks again waits for the index's answer (a P/D hand-off's manifest, the
readiness keys) or a GET in flight. When every live request is waiting likewise, the
step would run nothing, so the lookup may instead sleep and pump the client
(:meth:`ReadWait.wait`): the read or the answer then lands within this lookup -- the
sleep leaves the GIL to the workers' I/O threads and the index's thread, which a
spinning engine loop starves (a hand-off's manifest read took 100-600 ms a round trip
there, where 0.6 ms when the caller sleeps) -- instead of costing empty engine steps.
A wait ends, besides at the answer or its bound, as soon as the client holds a fetch
answered that only the next step can start (``SyncClient.fetch_to_plan``: a remote
GET), and does not start while one is held: waiting would only delay that step. (A
review found the first version, which ended on any new pending work, sleeping its
whole bound whenever other work was pending at its start.)

State: the ids of the live requests whose last lookup answered "ask again"
(:meth:`ReadWait.asked_again`; dropped by :meth:`ReadWait.answered` and
:meth:`ReadWait.forget`). Invariant: every id held is a live request of the side (the
side calls ``forget`` when it forgets a request), so comparing the count with the live
requests' is exact. Without a lower tier nothing is held and no lookup waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sized
from typing import Any, Final

from kvshm.engine import SyncClient
from kvshm.integrations.vllm.records import SchedulerCounters
from kvshm.types import RequestView

__all__ = ["READ_WAIT_MAX_S", "READ_WAIT_PER_BLOCK_S", "READ_WAIT_S", "READ_WAIT_SLICE_S",
           "ReadWait"]

#: With a disk tier: how long a lookup may wait, sleeping, for the disk read posted for
#: its request before it answers "ask again" (the read's Done then makes it a CPU hit in
#: this step instead of a later one); only while no other request could run
#: (:meth:`ReadWait.may_wait`). The bound grows with the read: this base, plus
#: :data:`READ_WAIT_PER_BLOCK_S` for each block the request could still hit, at most
#: :data:`READ_WAIT_MAX_S` (:meth:`ReadWait.bound`). The wait ends at the read's Done
#: and delays no admitted request, so the bound only limits a stuck read and how long
#: a request that arrives meanwhile waits for its admission. A timed-out wait costs an
#: engine step that spins in Python (starving the read's I/O threads of the GIL) and a
#: second wait: at a fixed 10 ms, 27 and 30 of 40-70 chat waits timed out on the loaded
#: 2-core dev VM (docs/disk.md, runs G).
READ_WAIT_S: Final = 0.010
#: What the wait's bound grows by per block the request could read: a generous
#: allowance (a 32-128 KiB slot reads in 0.04-0.14 ms on an idle host), for a host
#: whose cores the forward and other engines share.
READ_WAIT_PER_BLOCK_S: Final = 0.001
#: The wait's bound, at most.
READ_WAIT_MAX_S: Final = 0.050
#: How long each sleep of that wait is (then the client is pumped and asked again): the
#: read's Done waits half a slice on average before the lookup sees it (0.5 ms cost
#: chat's disk hits about 0.25 ms each on a 2.5 ms wait; a pump and a lookup hold the
#: GIL some 20-40 us, so the read's I/O threads still find it free most of a slice).
READ_WAIT_SLICE_S: Final = 0.0002


class ReadWait:
    """The waits of one scheduler side (module docstring). ``disk``: the engine has a
    disk tier (else no lookup waits); ``live``: the side's live requests (only their
    count is read); ``counters``: the side's, which the waits count in."""

    def __init__(self, *, disk: bool, block_size: int, live: Sized,
                 counters: SchedulerCounters, remote: bool = False) -> None:
        self.base_s = READ_WAIT_S if disk or remote else 0.0
        self.block_size = block_size
        self._live = live
        self._counters = counters
        self._asked: set[str] = set()

    def asked_again(self, rid: str) -> None:
        """``rid``'s lookup answered "ask again" (remembered only with a disk tier)."""
        if self.base_s:
            self._asked.add(rid)

    def answered(self, rid: str) -> None:
        """``rid``'s lookup answered a count: it no longer waits for a read."""
        self._asked.discard(rid)

    forget = answered
    """The side forgot ``rid`` (finished or refused)."""

    def may_wait(self, rid: str) -> bool:
        """With a disk tier, whether every other live request asked again too (then
        nothing would run in this step, so a wait delays no one)."""
        if not self.base_s:
            return False
        return len(self._asked) + (rid not in self._asked) >= len(self._live)

    def bound(self, view: RequestView, num_computed_tokens: int) -> float:
        """The most a wait may last: the base, plus :data:`READ_WAIT_PER_BLOCK_S` per
        block of the request past its local hit (the most its read can hold), at most
        :data:`READ_WAIT_MAX_S`."""
        blocks = max(0, len(view.block_hashes) - num_computed_tokens // self.block_size)
        return min(READ_WAIT_MAX_S, self.base_s + blocks * READ_WAIT_PER_BLOCK_S)

    def wait(self, client: SyncClient, view: RequestView, num_computed_tokens: int,
             absorb: Callable[[Any], None]) -> int | None:
        """Sleep (the GIL free for the workers' I/O threads), pump (``absorb`` takes
        the client's load results) and ask again, in slices of
        :data:`READ_WAIT_SLICE_S`, at most :meth:`bound` in all: the lookup's answer,
        None if the read did not end in time (asked again at the next step)."""
        deadline = time.monotonic() + self.bound(view, num_computed_tokens)
        counters = self._counters
        counters.lookups_waited += 1
        while not client.fetch_to_plan():  # else only the step can move it: no wait
            if time.monotonic() >= deadline:
                counters.lookup_waits_timed_out += 1
                return None
            time.sleep(READ_WAIT_SLICE_S)
            absorb(client.poll())
            hit = client.lookup(view, num_computed_tokens)
            if hit is not None:
                counters.lookups_answered_after_wait += 1
                return hit
        counters.lookup_waits_ended_for_step += 1
        return None
