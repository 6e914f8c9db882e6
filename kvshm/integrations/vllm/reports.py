"""What the vLLM scheduler side reports to vLLM's stat loggers, and when (no vLLM import).

vLLM asks the scheduler-side connector for its statistics after every step's output
(``get_kv_connector_stats``) and ships them to its stat loggers, in its front end's
process, where :mod:`~kvshm.integrations.vllm.metrics` turns them into ``/metrics``
series. A report's ``data`` (JSON-able):

* ``counters``: for every counter of :func:`kvshm.series.vllm_series` in the snapshot,
  the *increment* since the previous report (the first report carries the totals so
  far, so the sums over all reports are the engine's totals);
* ``gauges``: the current value of those gauges;
* ``breaker``: the remote tier's breaker state (only with a remote tier);
* ``ack_latency``: per rank (``"0"``, ``"1"``, ...) the increments of its ack-latency
  histogram -- ``counts`` per bucket of :data:`kvshm.stats.LATENCY_BUCKETS_US` (+Inf
  last) and ``sum_s``.

When (:class:`ReportClock`): a report reads a whole statistics snapshot, so a busy
engine reports at most once per :data:`REPORT_PERIOD_S`; and once more, at once, when
it goes idle (no request known to the scheduler side, no kvshm work pending), or is
found idle after a lookup since the last report (a request that began and ended in one
step): vLLM calls
``get_kv_connector_stats`` at the end of the last step before it idles, and an idle
vLLM calls nothing, so without that report ``/metrics`` would keep the state of up to a
second before the load ended (issue 28 saw ``kvshm_pins_held 34`` on an idle server
whose ``kvshm stats`` said 0).
"""

from __future__ import annotations

from typing import Any, Final

from kvshm.series import Kind, breaker_state, scalars, vllm_series

__all__ = ["REPORT_PERIOD_S", "ReportBuilder", "ReportClock", "VLLM_COUNTERS",
           "VLLM_GAUGES"]

#: The most often a busy engine's scheduler side builds a report (seconds).
REPORT_PERIOD_S: Final = 1.0
#: Counter and gauge families a report carries (vLLM's ``/metrics`` ones; the
#: histogram travels as ``ack_latency``, the breaker's state as ``breaker``).
VLLM_COUNTERS: Final = tuple(s.name for s in vllm_series(remote=True, disk=True)
                             if s.kind is Kind.COUNTER)
VLLM_GAUGES: Final = tuple(s.name for s in vllm_series(remote=True, disk=True)
                           if s.kind is Kind.GAUGE and not s.labels)

Hist = dict[str, Any]  # {"counts": [per bucket, +Inf last], "sum_s": float}


class ReportClock:
    """When to report: at most once per period while busy, once when idle (see the
    module docstring). Going busy again re-arms the idle report, and the next busy
    report comes a period after the side went busy: the idle report carried the state
    until then, and a report due at once would be built in the step that schedules
    the first request after a pause, before its first token (a snapshot: 0.3 ms of CPU
    idle, 1.3 ms a request measured at load 15 in ``tools.bench_e2e``, whose arms go
    idle after every request).

    ``activity`` (the side's lookup count, read at every call) re-arms the idle report
    too: a request that starts and ends within one step (one output token, nothing to
    wait for) leaves the side idle at every report call, so it was never seen busy, and
    after one idle report nothing was reported again -- ``/metrics``, the live stats
    file and the front end's final line stayed behind for good (an observability
    probe: ``kvshm_lookups_total`` 2 against 12). Idle after a lookup since the last
    report is a report due. Every request kvshm serves is looked up; the step vLLM runs
    after a request ends (nothing scheduled, only the finished ids) looks up none, so a
    burst still ends in one idle report (counting steps gave two: a review)."""

    def __init__(self, period_s: float = REPORT_PERIOD_S) -> None:
        self._period = period_s
        self._next = 0.0
        self._idle_sent = False
        self._activity = -1  # the activity count the last report saw

    def should_report(self, now: float, idle: bool, activity: int) -> bool:
        """True when a report is due now (``idle``: nothing is running or pending;
        ``activity``: the side's lookups so far)."""
        if idle:
            return not self._idle_sent or activity != self._activity
        if self._idle_sent:  # busy again after the idle report: a period from now
            self._idle_sent = False
            self._next = max(self._next, now + self._period)
        return now >= self._next

    def reported(self, now: float, idle: bool, activity: int) -> None:
        """A report was built at ``now``, after ``activity`` lookups."""
        self._next = now + self._period
        self._idle_sent = idle
        self._activity = activity


def _rank_hists(stats: dict[str, Any]) -> dict[str, Hist]:
    """Each rank's ack-latency histogram so far (``counts``, ``sum_s``), by rank label."""
    out: dict[str, Hist] = {}
    for r in stats.get("ranks") or ():
        hist = r.get("ack_latency_hist") if isinstance(r, dict) else None
        if isinstance(hist, dict) and "counts" in hist:
            out[str(r.get("rank", len(out)))] = {"counts": [int(c) for c in hist["counts"]],
                                                 "sum_s": float(hist.get("sum_s", 0.0))}
    return out


class ReportBuilder:
    """Turns statistics snapshots into report data (increments since the last call).

    A counter that went down (never: the engine's only grow) reports 0.
    """

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._last_hist: dict[str, Hist] = {}

    def build(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The report of snapshot ``stats`` (``SchedulerSide.statistics()``)."""
        counters, gauges = scalars(stats)
        inc: dict[str, int] = {}
        for name in VLLM_COUNTERS:
            if name in counters:
                value = counters[name]
                inc[name] = max(0, value - self._last.get(name, 0))
                self._last[name] = value
        data: dict[str, Any] = {"counters": inc,
                                "gauges": {k: gauges[k] for k in VLLM_GAUGES if k in gauges}}
        state = breaker_state(stats)
        if state is not None:
            data["breaker"] = state
        acks = self._hist_increments(_rank_hists(stats))
        if acks:
            data["ack_latency"] = acks
        return data

    def _hist_increments(self, now: dict[str, Hist]) -> dict[str, Hist]:
        """Each rank's bucket increments since the last report (ranks with none left out)."""
        out: dict[str, Hist] = {}
        for rank, hist in now.items():
            last = self._last_hist.get(rank)
            counts = hist["counts"] if last is None else [
                max(0, c - p) for c, p in zip(hist["counts"], last["counts"])]
            sum_s = hist["sum_s"] - (0.0 if last is None else last["sum_s"])
            self._last_hist[rank] = hist
            if any(counts):
                out[rank] = {"counts": counts, "sum_s": max(0.0, sum_s)}
        return out
