"""kvshm's counters in vLLM's KV-connector statistics (issue 14, point 2): the stats
object aggregates and reduces as vLLM uses it, the reporter turns snapshots into
increments, and the Prometheus hook registers and fills ``kvshm_*`` series."""

from __future__ import annotations

import bisect
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
    reason="vLLM is not installed (see tools/vllm_install.sh)",
)

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvshm.integrations.vllm.connector import KvshmConnector
from kvshm.integrations.vllm.metrics import (
    ACK_BUCKETS_S,
    KvshmConnectorStats,
    KvshmPromMetrics,
    StatsReporter,
    replay_values,
)


def _snapshot(hit: int, stored: int, cached: int, pins: int = 0) -> dict[str, Any]:
    """The parts of ``SchedulerSide.statistics()`` the reporter reads."""
    return {"counters": {"lookup_hit_tokens": hit, "stored_blocks": stored,
                         "loaded_blocks": 1, "jobs_failed": 0, "loads_failed": 0,
                         "ranks_failed": 0},
            "stored_bytes": stored * 100, "loaded_bytes": 100, "pins_held": pins,
            "cpu_blocks_cached": cached, "num_cpu_blocks": 8, "jobs_in_flight": 0}


def test_reporter_sends_increments_and_gauge_levels() -> None:
    rep = StatsReporter(period_s=1.0)
    assert rep.due(now=0.0)
    first = rep.report(_snapshot(hit=64, stored=3, cached=3, pins=2), now=0.0)
    assert first.data == {"hit_tokens": 64, "stored_blocks": 3, "loaded_blocks": 1,
                          "stored_bytes": 300, "loaded_bytes": 100, "jobs_failed": 0,
                          "loads_failed": 0, "ranks_failed": 0, "ranks_left": 0,
                          "pins_held": 2,
                          "cpu_blocks_cached": 3, "num_cpu_blocks": 8,
                          "jobs_in_flight": 0}
    assert not rep.due(now=0.5) and rep.due(now=1.0)
    second = rep.report(_snapshot(hit=96, stored=4, cached=4), now=1.0)
    assert (second.data["hit_tokens"], second.data["stored_blocks"],
            second.data["loaded_blocks"], second.data["cpu_blocks_cached"]) == (32, 1, 0, 4)


def test_stats_aggregate_sum_counters_keep_latest_gauges_and_reduce() -> None:
    a = KvshmConnectorStats(data={"hit_tokens": 64, "stored_blocks": 3, "pins_held": 2,
                                  "cpu_blocks_cached": 3, "num_cpu_blocks": 8})
    b = KvshmConnectorStats(data={"hit_tokens": 32, "stored_blocks": 1, "pins_held": 0,
                                  "cpu_blocks_cached": 4, "num_cpu_blocks": 8})
    both = a.aggregate(b)
    assert both.data == {"hit_tokens": 96, "stored_blocks": 4, "pins_held": 0,
                         "cpu_blocks_cached": 4, "num_cpu_blocks": 8}
    assert a.data["hit_tokens"] == 64  # aggregate builds a new object
    assert both.reduce() == {"hit_tokens": 96, "stored_blocks": 4, "pins_held": 0,
                             "cpu_blocks_cached": 4, "num_cpu_blocks": 8,
                             "cpu_tier_occupancy": 0.5}
    other = KVConnectorStats(data={"hit_tokens": 1000})  # another connector's report
    assert a.aggregate(other).data == a.data
    assert not both.is_empty()
    both.reset()
    assert both.is_empty() and both.reduce() == {}


def test_the_connector_class_builds_its_stats_and_prom_metrics() -> None:
    stats = KvshmConnector.build_kv_connector_stats({"hit_tokens": 5})
    assert isinstance(stats, KvshmConnectorStats) and stats.data == {"hit_tokens": 5}
    empty = KvshmConnector.build_kv_connector_stats(None)
    assert isinstance(empty, KvshmConnectorStats) and empty.is_empty()


def _metric_types(reg: CollectorRegistry) -> dict[type[Any], type[Any]]:
    """vLLM's metric classes, registering in ``reg`` instead of the global registry."""
    def bound(cls: type[Any]) -> type[Any]:
        class Bound(cls):  # type: ignore[misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=reg, **kwargs)
        return Bound
    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def _series(reg: CollectorRegistry) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in generate_latest(reg).decode().splitlines():
        if line.startswith("kvshm_") and not line.split("{")[0].endswith("_created"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_prom_metrics_register_kvshm_series_and_observe_per_engine() -> None:
    reg = CollectorRegistry()
    labels: dict[int, list[object]] = {0: ["m", "0"], 1: ["m", "1"]}
    vllm_config = SimpleNamespace(kv_transfer_config=None)  # all the base class reads
    prom = KvshmConnector.build_prom_metrics(vllm_config,  # type: ignore[arg-type]
                                             _metric_types(reg), ["model_name", "engine"],
                                             labels)
    assert isinstance(prom, KvshmPromMetrics)
    first = {"hit_tokens": 64, "stored_blocks": 3, "stored_bytes": 300, "jobs_failed": 0,
             "pins_held": 2, "cpu_blocks_cached": 3, "num_cpu_blocks": 8}
    prom.observe(first, engine_idx=0)
    prom.observe({"hit_tokens": 32, "pins_held": 0, "cpu_blocks_cached": 4,
                  "num_cpu_blocks": 8}, engine_idx=0)
    prom.observe({"hit_tokens": 7}, engine_idx=1)
    got = _series(reg)
    e0, e1 = '{engine="0",model_name="m"}', '{engine="1",model_name="m"}'
    assert got[f"kvshm_hit_tokens_total{e0}"] == 96.0
    assert got[f"kvshm_hit_tokens_total{e1}"] == 7.0
    assert got[f"kvshm_stored_blocks_total{e0}"] == 3.0
    assert got[f"kvshm_stored_bytes_total{e0}"] == 300.0
    assert got[f"kvshm_jobs_failed_total{e0}"] == 0.0
    assert got[f"kvshm_pins_held{e0}"] == 0.0
    assert got[f"kvshm_cpu_blocks_cached{e0}"] == 4.0
    assert got[f"kvshm_cpu_tier_occupancy{e0}"] == 0.5
    assert got[f"kvshm_cpu_tier_occupancy{e1}"] == 0.0  # engine 1 reported no gauge
    names = {k.split("{")[0] for k in got}
    assert {"kvshm_loaded_blocks_total", "kvshm_loaded_bytes_total",
            "kvshm_loads_failed_total", "kvshm_ranks_failed_total",
            "kvshm_num_cpu_blocks", "kvshm_jobs_in_flight"} <= names


def _hist(counts: dict[int, int], sum_s: float) -> dict[str, Any]:
    """A rank's ``ack_latency_hist`` as the engine reports it (16 buckets, +Inf last)."""
    out = [0] * (len(ACK_BUCKETS_S) + 1)
    for i, n in counts.items():
        out[i] = n
    return {"le_us": [], "counts": out, "sum_s": sum_s, "count": sum(out)}


def test_reporter_sends_each_ranks_ack_latency_increments() -> None:
    """Per rank, the bucket counts and the sum since the last report; a rank with no new
    ack is left out, and so is the key when no rank acked."""
    rep = StatsReporter(period_s=0.0)
    snap = _snapshot(hit=0, stored=0, cached=0)
    snap["ranks"] = [{"rank": 0, "ack_latency_hist": _hist({2: 3}, 120e-6)},
                     {"rank": 1, "ack_latency_hist": _hist({}, 0.0)}]
    first = rep.report(snap, now=0.0).data["ack_latency"]
    assert list(first) == ["0"] and first["0"]["counts"][2] == 3
    assert first["0"]["sum_s"] == pytest.approx(120e-6)
    snap["ranks"] = [{"rank": 0, "ack_latency_hist": _hist({2: 3, 4: 1}, 320e-6)},
                     {"rank": 1, "ack_latency_hist": _hist({0: 2}, 10e-6)}]
    second = rep.report(snap, now=1.0).data["ack_latency"]
    assert second["0"]["counts"] == [0, 0, 0, 0, 1] + [0] * 11
    assert second["0"]["sum_s"] == pytest.approx(200e-6)
    assert second["1"]["counts"][0] == 2
    assert "ack_latency" not in rep.report(snap, now=2.0).data
    both = KvshmConnectorStats(data={"ack_latency": first}).aggregate(
        KvshmConnectorStats(data={"ack_latency": second}))
    assert both.data["ack_latency"]["0"]["counts"][2] == 3
    assert both.data["ack_latency"]["0"]["counts"][4] == 1
    assert both.data["ack_latency"]["0"]["sum_s"] == pytest.approx(320e-6)
    assert both.data["ack_latency"]["1"]["counts"][0] == 2


def test_prom_ack_latency_histogram_per_rank_has_exact_buckets() -> None:
    """``kvshm_ack_latency_seconds{rank=...}`` on kvshm's bounds: cumulative bucket
    counts and _count exact; _sum exact for an interval within one bucket."""
    reg = CollectorRegistry()
    prom = KvshmConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        _metric_types(reg), ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"ack_latency": {"1": _hist({2: 3}, 3 * 40e-6)}}, engine_idx=0)
    prom.observe({"ack_latency": {"1": _hist({0: 1, 15: 2}, 5e-6 + 6.0)}}, engine_idx=0)
    got = _series(reg)
    def bucket(le: str) -> float:
        return got[f'kvshm_ack_latency_seconds_bucket{{engine="0",le="{le}",model_name="m",'
                   'rank="1"}']

    assert (bucket("1e-05"), bucket("2.5e-05"), bucket("5e-05"), bucket("1.0"),
            bucket("+Inf")) == (1.0, 1.0, 4.0, 4.0, 6.0)
    lab = 'engine="0",model_name="m",rank="1"'
    assert got[f"kvshm_ack_latency_seconds_count{{{lab}}}"] == 6.0
    # one bucket: the interval's own sum; +Inf holds 2 of 3 samples at >= 1 s
    assert got[f"kvshm_ack_latency_seconds_sum{{{lab}}}"] >= 3 * 40e-6 + 2.0


@given(st.lists(st.integers(0, 50), min_size=16, max_size=16),
       st.floats(0.0, 10.0, allow_nan=False))
def test_replayed_values_land_in_their_own_buckets(counts: list[int], mean: float) -> None:
    """Whatever the interval's mean, each replayed value falls in the bucket it stands
    for (Prometheus' le is inclusive, as kvshm's bisect_left), so counts stay exact."""
    total = sum(counts)
    pairs = replay_values(counts, mean * total)
    assert sum(n for _, n in pairs) == total
    nonempty = [i for i, n in enumerate(counts) if n > 0]
    for (value, n), i in zip(pairs, nonempty):
        assert bisect.bisect_left(ACK_BUCKETS_S, value) == i and n == counts[i]
