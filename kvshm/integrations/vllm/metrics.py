"""kvshm's counters in vLLM's KV-connector statistics (its log line and ``/metrics``).

vLLM 0.32 asks the scheduler-side connector for ``get_kv_connector_stats()`` after every
step's output, aggregates it with the workers' (``KVConnectorStats.aggregate``), ships the
``data`` dict to its stat loggers, rebuilds it there with the connector class's
``build_kv_connector_stats`` (the periodic log line uses ``reduce``) and hands it to the
object ``build_prom_metrics`` returned (``observe``, once per engine and interval).

What travels (:class:`KvshmConnectorStats`'s ``data``, JSON-able):

* the *increments* since the previous report of the counters in :data:`COUNTERS`
  (summed by ``aggregate``: two reports of one interval add up);
* the *current value* of the gauges in :data:`GAUGES` (``aggregate`` keeps the later
  report's value: a gauge is a level, not an amount);
* ``ack_latency``: per rank (``"0"``, ``"1"``, ...), the *increments* of its ack-latency
  histogram -- ``counts`` per bucket of :data:`kvshm.stats.LATENCY_BUCKETS_US` (the last
  one +Inf) and ``sum_s`` -- summed bucket by bucket by ``aggregate``.

Only the scheduler side reports (the workers' counters are in ``kvshm stats``), and at
most once per :data:`REPORT_PERIOD_S`: a report reads a whole statistics snapshot.
Prometheus series (:class:`KvshmPromMetrics`, every one labelled like vLLM's own):
``kvshm_<counter>_total`` counters and ``kvshm_<gauge>`` gauges, plus
``kvshm_cpu_tier_occupancy`` (cached / capacity, 0..1) and the histogram
``kvshm_ack_latency_seconds`` with a ``rank`` label, on kvshm's own bucket bounds.
kvshm keeps bucket counts, not samples, so each increment is replayed as that many
observations of one value inside its bucket: the bucket counts and ``_count`` are exact;
``_sum`` is exact when an interval's samples fall in one bucket and otherwise near it
(each bucket replays the interval's mean latency, clamped into the bucket).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvshm.stats import LATENCY_BUCKETS_US

__all__ = ["ACK_BUCKETS_S", "COUNTERS", "GAUGES", "REPORT_PERIOD_S", "KvshmConnectorStats",
           "KvshmPromMetrics", "StatsReporter"]

#: name in ``data`` -> (where it is read in ``SchedulerSide.statistics()``, help text)
COUNTERS: Final[dict[str, tuple[tuple[str, ...], str]]] = {
    "hit_tokens": (("counters", "lookup_hit_tokens"), "tokens offered from the CPU tier"),
    "stored_blocks": (("counters", "stored_blocks"), "blocks stored to the CPU tier"),
    "loaded_blocks": (("counters", "loaded_blocks"), "blocks loaded from the CPU tier"),
    "stored_bytes": (("stored_bytes",), "bytes stored to the CPU tier"),
    "loaded_bytes": (("loaded_bytes",), "bytes loaded from the CPU tier"),
    "jobs_failed": (("counters", "jobs_failed"), "transfer jobs that failed"),
    "loads_failed": (("counters", "loads_failed"), "request loads that failed"),
    "ranks_failed": (("counters", "ranks_failed"), "worker ranks declared dead"),
    "ranks_left": (("counters", "ranks_left"), "worker ranks that left cleanly (Goodbye)"),
}

#: name in ``data`` -> (where it is read, help text)
GAUGES: Final[dict[str, tuple[tuple[str, ...], str]]] = {
    "pins_held": (("pins_held",), "pins held on GPU and CPU blocks"),
    "cpu_blocks_cached": (("cpu_blocks_cached",), "blocks cached in the CPU tier"),
    "num_cpu_blocks": (("num_cpu_blocks",), "capacity of the CPU tier in blocks"),
    "jobs_in_flight": (("jobs_in_flight",), "transfer jobs not yet acked"),
}

#: The most often the scheduler side builds a report (seconds).
REPORT_PERIOD_S: Final = 1.0
#: ``kvshm_ack_latency_seconds``'s bucket upper bounds (+Inf is implied).
ACK_BUCKETS_S: Final = tuple(b / 1e6 for b in LATENCY_BUCKETS_US)
#: Key of the per-rank ack-latency increments in the reported ``data``.
ACK_KEY: Final = "ack_latency"

Hist = dict[str, Any]  # {"counts": [per bucket, +Inf last], "sum_s": float}


def _hist_add(a: Hist | None, b: Hist) -> Hist:
    """Bucket-by-bucket sum of two histogram increments."""
    if a is None:
        return {"counts": list(b["counts"]), "sum_s": float(b["sum_s"])}
    return {"counts": [int(x) + int(y) for x, y in zip(a["counts"], b["counts"])],
            "sum_s": float(a["sum_s"]) + float(b["sum_s"])}


def _rank_hists(stats: dict[str, Any]) -> dict[str, Hist]:
    """Each rank's ack-latency histogram so far (``counts``, ``sum_s``), by rank label."""
    out: dict[str, Hist] = {}
    for r in stats.get("ranks") or ():
        hist = r.get("ack_latency_hist") if isinstance(r, dict) else None
        if isinstance(hist, dict) and "counts" in hist:
            out[str(r.get("rank", len(out)))] = {"counts": [int(c) for c in hist["counts"]],
                                                 "sum_s": float(hist.get("sum_s", 0.0))}
    return out


def replay_values(counts: list[int], sum_s: float) -> list[tuple[float, int]]:
    """(value, times) per non-empty bucket: the interval's mean latency clamped into the
    bucket (its lower bound excluded), so observing each value ``times`` times lands
    every count in its own bucket (see the module docstring)."""
    total = sum(counts)
    if total <= 0:
        return []
    mean = sum_s / total
    out: list[tuple[float, int]] = []
    for i, n in enumerate(counts):
        if n <= 0:
            continue
        lo = ACK_BUCKETS_S[i - 1] if i > 0 else 0.0
        hi = ACK_BUCKETS_S[i] if i < len(ACK_BUCKETS_S) else float("inf")
        value = min(max(mean, lo), hi)
        if value <= lo:  # the bound itself belongs to the bucket below
            value = min(lo * 1.000001 + 1e-12, hi)
        out.append((value, n))
    return out


def _read(stats: dict[str, Any], path: tuple[str, ...]) -> int:
    value: Any = stats
    for key in path:
        value = value.get(key, 0) if isinstance(value, dict) else 0
    return int(value)


@dataclass
class KvshmConnectorStats(KVConnectorStats):  # type: ignore[misc, unused-ignore]
    """Counter increments and gauge values (see the module docstring)."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> KvshmConnectorStats:
        """Counters add up, gauges take ``other``'s value where it has one; a report of
        another connector (a MultiConnector's neighbour) contributes nothing."""
        out = dict(self.data)
        theirs = other.data if isinstance(other, KvshmConnectorStats) else {}
        for key in COUNTERS:
            if key in theirs:
                out[key] = int(out.get(key, 0)) + int(theirs[key])
        for key in GAUGES:
            if key in theirs:
                out[key] = int(theirs[key])
        if theirs.get(ACK_KEY):
            mine: dict[str, Hist] = dict(out.get(ACK_KEY) or {})
            for rank, hist in theirs[ACK_KEY].items():
                mine[rank] = _hist_add(mine.get(rank), hist)
            out[ACK_KEY] = mine
        return KvshmConnectorStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        """The interval's values for vLLM's log line, with the CPU tier's occupancy."""
        out: dict[str, int | float] = {k: int(self.data[k])
                                       for k in (*COUNTERS, *GAUGES) if k in self.data}
        cap = int(self.data.get("num_cpu_blocks", 0))
        if cap > 0:
            out["cpu_tier_occupancy"] = round(
                int(self.data.get("cpu_blocks_cached", 0)) / cap, 4)
        return out


class StatsReporter:
    """Turns statistics snapshots into :class:`KvshmConnectorStats` increments.

    The first report carries the counters' totals so far (nothing was reported before);
    a counter that went down (never, as the engine's only grow) reports 0.
    """

    def __init__(self, period_s: float = REPORT_PERIOD_S) -> None:
        self._period = period_s
        self._last: dict[str, int] = {k: 0 for k in COUNTERS}
        self._last_hist: dict[str, Hist] = {}
        self._due = 0.0

    def due(self, now: float | None = None) -> bool:
        """True when a report may be built now (at most one per period)."""
        return (time.monotonic() if now is None else now) >= self._due

    def report(self, stats: dict[str, Any], now: float | None = None) -> KvshmConnectorStats:
        """The increments since the last report and the gauges' values in ``stats``."""
        self._due = (time.monotonic() if now is None else now) + self._period
        data: dict[str, Any] = {}
        for key, (path, _) in COUNTERS.items():
            value = _read(stats, path)
            data[key] = max(0, value - self._last[key])
            self._last[key] = value
        for key, (path, _) in GAUGES.items():
            data[key] = _read(stats, path)
        acks = self._hist_increments(_rank_hists(stats))
        if acks:
            data[ACK_KEY] = acks
        return KvshmConnectorStats(data=data)

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


def _unregister_stale() -> None:
    """Drop ``kvshm_*`` collectors a previous engine of this process left in the global
    registry (vLLM does the same for its ``vllm:*`` ones), so a second engine can
    register its series instead of failing on a duplicate name."""
    from prometheus_client import REGISTRY

    for collector, names in list(REGISTRY._collector_to_names.items()):
        if any(n.startswith("kvshm_") for n in names):
            REGISTRY.unregister(collector)


class KvshmPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc, unused-ignore]
    """kvshm's Prometheus series, registered once per engine label set."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric],
                                                             type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_stale()
        self._counters = {k: self._per_engine(self._counter_cls, f"kvshm_{k}", text)
                          for k, (_, text) in COUNTERS.items()}
        self._gauges = {k: self._per_engine(self._gauge_cls, f"kvshm_{k}", text)
                        for k, (_, text) in GAUGES.items()}
        self._occupancy = self._per_engine(
            self._gauge_cls, "kvshm_cpu_tier_occupancy",
            "fraction of the CPU tier's blocks that hold cached KV (0..1)")
        hist_cls: Any = self._histogram_cls
        self._ack: Any = hist_cls(
            name="kvshm_ack_latency_seconds",
            documentation="kvshm: per-rank time from posting a transfer job to its ack",
            labelnames=[*self._labelnames, "rank"], buckets=list(ACK_BUCKETS_S))

    def _per_engine(self, cls: Any, name: str, text: str) -> dict[int, Any]:
        metric = cls(name=name, documentation=f"kvshm: {text}",
                     labelnames=self._labelnames)
        return {idx: metric.labels(*values)
                for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add the counters' increments, set the gauges (keys absent: untouched)."""
        data = transfer_stats_data
        for key, series in self._counters.items():
            if int(data.get(key, 0)) > 0:
                series[engine_idx].inc(int(data[key]))
        for key, series in self._gauges.items():
            if key in data:
                series[engine_idx].set(int(data[key]))
        cap = int(data.get("num_cpu_blocks", 0))
        if cap > 0:
            self._occupancy[engine_idx].set(int(data.get("cpu_blocks_cached", 0)) / cap)
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for rank, hist in (data.get(ACK_KEY) or {}).items():
            ack = self._ack.labels(*labels, str(rank))
            for value, times in replay_values(list(hist["counts"]), float(hist["sum_s"])):
                for _ in range(times):
                    ack.observe(value)
