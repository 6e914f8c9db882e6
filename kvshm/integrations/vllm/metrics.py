"""kvshm's series in vLLM's KV-connector statistics (its log line and ``/metrics``).

vLLM 0.32 asks the scheduler-side connector for ``get_kv_connector_stats()`` after every
step's output; with vLLM's stats on (``vllm serve``'s default) it ships the result's
``to_dict()`` to its stat loggers in the front end's process (the API server), rebuilds
it there with the connector class's ``build_kv_connector_stats`` (the periodic ``KV
Transfer metrics:`` log line uses ``reduce``) and hands it to the object
``build_prom_metrics`` returned (``observe``, once per engine and report). What a report
carries and when the scheduler side builds one:
:mod:`~kvshm.integrations.vllm.reports`.

:class:`KvshmConnectorStats` aggregates reports as vLLM does (counters add up, gauges and
the breaker state keep the later report's value, histogram increments add up bucket by
bucket); ``to_dict`` -- which vLLM calls only to ship a report -- tells the scheduler
side that its reports reach a front end.

:class:`KvshmPromMetrics` (in the front end) registers the series of
:func:`kvshm.series.vllm_series` -- names, types and HELP from :mod:`kvshm.series`, the
same as ``kvshm stats --prometheus`` -- labelled ``model_name`` (vLLM's) and
``engine`` = the kvshm engine's name, as ``kvshm stats --name`` takes it (not vLLM's
engine index). The ack-latency histogram ``kvshm_ack_latency_seconds`` has a ``rank``
label and kvshm's bucket bounds; kvshm keeps bucket counts, not samples, so each
increment is replayed as that many observations of one value inside its bucket: the
bucket counts and ``_count`` are exact, ``_sum`` exact when an interval's samples fall in
one bucket and otherwise near it (each bucket replays the interval's mean, clamped into
the bucket).

The front end also keeps the sums of the reports it received
(:data:`~kvshm.integrations.vllm.final_stats.FINAL_LINES`), from which it logs each
engine's final-statistics line when its process exits: vLLM's default
``shutdown_timeout`` of 0 SIGKILLs the engine core at once, so the line must come from
the process that survives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvshm.integrations.vllm.config import engine_name
from kvshm.integrations.vllm.final_stats import FINAL_LINES
from kvshm.integrations.vllm.logs import route_kvshm_logs
from kvshm.integrations.vllm.reports import Hist
from kvshm.series import BREAKER_STATES, Kind, Series, vllm_series
from kvshm.stats import LATENCY_BUCKETS_US

__all__ = ["ACK_BUCKETS_S", "REDUCED", "KvshmConnectorStats", "KvshmPromMetrics",
           "StatsReporter", "engine_labels", "replay_values"]

#: ``kvshm_ack_latency_seconds``'s bucket upper bounds (+Inf is implied).
ACK_BUCKETS_S: Final = tuple(b / 1e6 for b in LATENCY_BUCKETS_US)
#: What ``reduce`` gives vLLM's periodic log line (the interval's increments and the
#: latest gauges), by family.
REDUCED: Final = ("kvshm_hit_tokens", "kvshm_lookups", "kvshm_stored_blocks",
                  "kvshm_loaded_blocks", "kvshm_stored_bytes", "kvshm_loaded_bytes",
                  "kvshm_jobs_failed", "kvshm_loads_failed", "kvshm_pins_held",
                  "kvshm_jobs_in_flight")


def _hist_add(a: Hist | None, b: Hist) -> Hist:
    """Bucket-by-bucket sum of two histogram increments."""
    if a is None:
        return {"counts": list(b["counts"]), "sum_s": float(b["sum_s"])}
    return {"counts": [int(x) + int(y) for x, y in zip(a["counts"], b["counts"])],
            "sum_s": float(a["sum_s"]) + float(b["sum_s"])}


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


def aggregate_data(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Two reports of one interval as one: counters add up, gauges and the breaker
    state take ``theirs`` where it has them, histogram increments add up."""
    out = dict(mine)
    counters = dict(mine.get("counters") or {})
    for key, n in (theirs.get("counters") or {}).items():
        counters[key] = int(counters.get(key, 0)) + int(n)
    out["counters"] = counters
    out["gauges"] = {**(mine.get("gauges") or {}), **(theirs.get("gauges") or {})}
    if "breaker" in theirs:
        out["breaker"] = theirs["breaker"]
    if theirs.get("ack_latency"):
        acks: dict[str, Hist] = dict(mine.get("ack_latency") or {})
        for rank, hist in theirs["ack_latency"].items():
            acks[rank] = _hist_add(acks.get(rank), hist)
        out["ack_latency"] = acks
    return out


@dataclass
class KvshmConnectorStats(KVConnectorStats):  # type: ignore[misc, unused-ignore]
    """One report (``data``: :mod:`~kvshm.integrations.vllm.reports`). ``on_ship``
    (set by :class:`StatsReporter`, kept by ``aggregate``) runs when vLLM ships it."""

    on_ship: Callable[[], None] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The payload vLLM sends to its stat loggers; vLLM 0.32 calls this only to
        send it (``Scheduler.make_stats``, stats on), so it also runs ``on_ship``."""
        if self.on_ship is not None:
            self.on_ship()
        return self.data

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> KvshmConnectorStats:
        """See :func:`aggregate_data`; a report of another connector (a
        MultiConnector's neighbour) contributes nothing."""
        if not isinstance(other, KvshmConnectorStats):
            return KvshmConnectorStats(data=dict(self.data), on_ship=self.on_ship)
        return KvshmConnectorStats(data=aggregate_data(self.data, other.data),
                                   on_ship=self.on_ship or other.on_ship)

    def reduce(self) -> dict[str, int | float]:
        """The interval's values of :data:`REDUCED` for vLLM's log line, and the CPU
        tier's occupancy."""
        counters = self.data.get("counters") or {}
        gauges = self.data.get("gauges") or {}
        out: dict[str, int | float] = {}
        for key in REDUCED:
            if key in counters:
                out[key[6:]] = int(counters[key])
            elif key in gauges:
                out[key[6:]] = int(gauges[key])
        if "kvshm_cpu_tier_occupancy" in gauges:
            out["cpu_tier_occupancy"] = round(float(gauges["kvshm_cpu_tier_occupancy"]), 4)
        return out


class StatsReporter:
    """The connector's ``get_kv_connector_stats``: the scheduler side's report (when one
    is due, :meth:`SchedulerSide.report`) as :class:`KvshmConnectorStats`, whose shipping
    tells the side (``mark_shipped``) that vLLM's front end logs its final statistics."""

    def report(self, side: Any) -> KvshmConnectorStats | None:
        """``side``: a bound :class:`~kvshm.integrations.vllm.scheduler.SchedulerSide`."""
        data = side.report()
        if data is None:
            return None
        return KvshmConnectorStats(data=data, on_ship=side.mark_shipped)


def engine_labels(vllm_config: Any, engine_indexes: list[int]) -> dict[int, str]:
    """The kvshm engine name of each of vLLM's engine indexes: the ``name`` of
    ``kv_connector_extra_config``, else ``kvshm-<engine_id>`` (with data parallelism
    each gets ``_dp<rank>``, as vLLM appends it to the id of each data-parallel engine:
    :func:`~kvshm.integrations.vllm.config.replica_name`); the index itself when vLLM's
    configuration has no KV transfer config."""
    kvt = getattr(vllm_config, "kv_transfer_config", None)
    if kvt is None:
        return {i: str(i) for i in engine_indexes}
    name = (getattr(kvt, "kv_connector_extra_config", None) or {}).get("name")
    par = getattr(vllm_config, "parallel_config", None)
    dp = int(getattr(par, "data_parallel_size", 1) or 1) > 1
    if isinstance(name, str) and name:
        return {i: f"{name}_dp{i}" if dp else name for i in engine_indexes}
    base = str(kvt.engine_id)
    return {i: engine_name(f"{base}_dp{i}" if dp else base) for i in engine_indexes}


def _unregister_stale() -> None:
    """Drop ``kvshm_*`` collectors a previous engine of this process left in the global
    registry (vLLM does the same for its ``vllm:*`` ones), so a second engine can
    register its series instead of failing on a duplicate name."""
    from prometheus_client import REGISTRY

    for collector, names in list(REGISTRY._collector_to_names.items()):
        if any(n.startswith("kvshm_") for n in names):
            REGISTRY.unregister(collector)


class KvshmPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc, unused-ignore]
    """kvshm's ``/metrics`` series (module docstring); built in vLLM's front end."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric],
                                                             type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        route_kvshm_logs()  # the front end's process: its final line goes to vLLM's log
        _unregister_stale()
        names = engine_labels(vllm_config, list(per_engine_labelvalues))
        self.engine_names = names
        where = (labelnames.index("engine") if "engine" in labelnames else None)
        self._values: dict[int, list[object]] = {}
        for idx, values in per_engine_labelvalues.items():
            mine = list(values)
            if where is not None:
                mine[where] = names[idx]
            self._values[idx] = mine
        extra = getattr(getattr(vllm_config, "kv_transfer_config", None),
                        "kv_connector_extra_config", None) or {}
        self.series = vllm_series(remote=bool(extra.get("remote_url")),
                                  disk=bool(extra.get("disk_path")))
        self._metrics: dict[str, Any] = {s.name: self._register(s) for s in self.series}
        self._frontend = FINAL_LINES
        self._frontend.arm()

    def _register(self, s: Series) -> Any:
        """Register ``s``; a series without labels of its own gets each engine's child
        now, so it reads 0 before the first report (rank and state children come with
        their first value)."""
        cls: Any = {Kind.COUNTER: self._counter_cls, Kind.GAUGE: self._gauge_cls,
                    Kind.HISTOGRAM: self._histogram_cls}[s.kind]
        kw: dict[str, Any] = {}
        if s.kind is Kind.HISTOGRAM:
            kw["buckets"] = list(ACK_BUCKETS_S)
        metric = cls(name=s.name, documentation=s.help,
                     labelnames=[*self._labelnames, *s.labels], **kw)
        if not s.labels:
            for values in self._values.values():
                metric.labels(*values)
        return metric

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add the counters' increments, set the gauges and the breaker state, replay the
        histogram increments (absent keys: untouched)."""
        data = transfer_stats_data
        labels = self._values.get(engine_idx, [])
        metrics = self._metrics
        for key, n in (data.get("counters") or {}).items():
            if key in metrics and int(n) > 0:
                metrics[key].labels(*labels).inc(int(n))
        for key, value in (data.get("gauges") or {}).items():
            if key in metrics:
                metrics[key].labels(*labels).set(float(value))
        state = data.get("breaker")
        if state is not None and "kvshm_remote_breaker_state" in metrics:
            gauge = metrics["kvshm_remote_breaker_state"]
            for s in BREAKER_STATES:
                gauge.labels(*labels, s).set(float(s == state))
        ack = metrics.get("kvshm_ack_latency_seconds")
        for rank, hist in (data.get("ack_latency") or {}).items():
            if ack is None:
                break
            child = ack.labels(*labels, str(rank))
            for value, times in replay_values(list(hist["counts"]), float(hist["sum_s"])):
                for _ in range(times):
                    child.observe(value)
        name = self.engine_names.get(engine_idx)
        if name is not None:
            self._frontend.observe(name, data)

