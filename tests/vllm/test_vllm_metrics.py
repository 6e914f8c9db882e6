"""kvshm's counters in vLLM's KV-connector statistics (issue 14, point 2; issue 28): the
stats object aggregates and reduces as vLLM uses it, reports carry increments (at most
once a second while busy, once on going idle), the Prometheus hook registers the
series of kvshm.series with its HELP, labelled by the kvshm engine's name, and the
front end logs each engine's final-statistics line once."""

from __future__ import annotations

import bisect
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
    reason="vLLM is not installed (see tools/vllm_install.sh)",
)

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvshm.integrations.vllm.connector import KvshmConnector
from kvshm.integrations.vllm.final_stats import FinalLines
from kvshm.integrations.vllm.metrics import (
    ACK_BUCKETS_S,
    KvshmConnectorStats,
    KvshmPromMetrics,
    engine_labels,
    replay_values,
)
from kvshm.integrations.vllm.reports import ReportBuilder, ReportClock
from kvshm.series import SERIES, vllm_series


def _snapshot(hit: int, stored: int, cached: int, pins: int = 0) -> dict[str, Any]:
    """The parts of ``SchedulerSide.statistics()`` a report reads."""
    return {"counters": {"hit_tokens": hit, "lookup_hit_tokens": 10 * hit,
                         "stored_blocks": stored, "loaded_blocks": 1, "jobs_failed": 0,
                         "loads_failed": 0, "ranks_failed": 0},
            "stored_bytes": stored * 100, "loaded_bytes": 100, "pins_held": pins,
            "cpu_blocks_cached": cached, "num_cpu_blocks": 8, "jobs_in_flight": 0}


def test_reports_carry_increments_and_gauge_levels() -> None:
    """The first report carries the totals so far, the next one the increments; gauges
    are levels; only vLLM's /metrics series travel (lookup_hit_tokens does not)."""
    rep = ReportBuilder()
    first = rep.build(_snapshot(hit=64, stored=3, cached=3, pins=2))
    assert first["counters"]["kvshm_hit_tokens"] == 64
    assert first["counters"]["kvshm_stored_bytes"] == 300
    assert "kvshm_lookup_hit_tokens" not in first["counters"]
    assert first["gauges"]["kvshm_pins_held"] == 2
    assert first["gauges"]["kvshm_cpu_tier_occupancy"] == 3 / 8
    assert "breaker" not in first
    second = rep.build(_snapshot(hit=96, stored=4, cached=4))
    assert (second["counters"]["kvshm_hit_tokens"], second["counters"]["kvshm_stored_blocks"],
            second["counters"]["kvshm_loaded_blocks"],
            second["gauges"]["kvshm_cpu_blocks_cached"]) == (32, 1, 0, 4)


def test_report_clock_once_a_period_while_busy_and_once_on_going_idle() -> None:
    clock = ReportClock(period_s=1.0)
    assert clock.should_report(0.0, idle=False, activity=1)
    clock.reported(0.0, idle=False, activity=1)
    assert not clock.should_report(0.5, idle=False, activity=2)
    assert clock.should_report(0.6, idle=True, activity=3)  # gone idle: at once, not in 0.4 s
    clock.reported(0.6, idle=True, activity=3)
    assert not clock.should_report(5.0, idle=True, activity=3)  # nothing new while idle
    assert not clock.should_report(1.2, idle=False, activity=4)  # busy again, period not over
    assert clock.should_report(1.3, idle=True, activity=5)  # ... and idle again: its last state
    clock.reported(1.3, idle=True, activity=5)
    # busy again long after: the first busy report a period later, not in the step
    # that schedules the first request (the idle report holds the state until then)
    assert not clock.should_report(10.0, idle=False, activity=6)
    assert not clock.should_report(10.9, idle=False, activity=7)
    assert clock.should_report(11.0, idle=False, activity=8)


def test_a_request_that_begins_and_ends_in_one_step_is_reported() -> None:
    """Hazard (an observability probe): a request with one output token and nothing to
    wait for begins and ends within one engine step, so the side is idle at every
    report call and was never seen busy; after one idle report nothing was reported
    again -- ``/metrics``, the live stats file and the front end's final line stayed
    behind for good (``kvshm_lookups_total`` 2 against the engine's 12). A lookup
    since the last report, found idle, is a report due; none (the empty step vLLM runs
    after a request ends), none (a review: counting steps reported twice a burst)."""
    clock = ReportClock(period_s=1.0)
    assert clock.should_report(0.0, idle=True, activity=0)  # the first report
    clock.reported(0.0, idle=True, activity=0)
    for n in range(1, 11):  # ten one-step requests, each seen only idle
        assert clock.should_report(0.1 * n, idle=True, activity=n)  # before: False
        clock.reported(0.1 * n, idle=True, activity=n)
        assert not clock.should_report(0.1 * n + 0.01, idle=True, activity=n)


def test_stats_aggregate_sum_counters_keep_latest_gauges_and_reduce() -> None:
    shipped: list[int] = []
    a = KvshmConnectorStats(data={"counters": {"kvshm_hit_tokens": 64,
                                               "kvshm_stored_blocks": 3},
                                  "gauges": {"kvshm_pins_held": 2,
                                             "kvshm_cpu_tier_occupancy": 0.375}},
                            on_ship=lambda: shipped.append(1))
    b = KvshmConnectorStats(data={"counters": {"kvshm_hit_tokens": 32,
                                               "kvshm_stored_blocks": 1},
                                  "gauges": {"kvshm_pins_held": 0,
                                             "kvshm_cpu_tier_occupancy": 0.5},
                                  "breaker": "open"})
    both = a.aggregate(b)
    assert both.data["counters"] == {"kvshm_hit_tokens": 96, "kvshm_stored_blocks": 4}
    assert both.data["gauges"] == {"kvshm_pins_held": 0, "kvshm_cpu_tier_occupancy": 0.5}
    assert both.data["breaker"] == "open"
    assert a.data["counters"]["kvshm_hit_tokens"] == 64  # aggregate builds a new object
    assert both.reduce() == {"hit_tokens": 96, "stored_blocks": 4, "pins_held": 0,
                             "cpu_tier_occupancy": 0.5}
    other = KVConnectorStats(data={"counters": {"kvshm_hit_tokens": 1000}})
    assert a.aggregate(other).data == a.data  # another connector's report
    assert both.to_dict() is both.data and shipped == [1]  # shipping tells the side
    assert not both.is_empty()
    both.reset()
    assert both.is_empty() and both.reduce() == {}


def test_the_connector_class_builds_its_stats_and_prom_metrics() -> None:
    stats = KvshmConnector.build_kv_connector_stats({"counters": {"kvshm_hit_tokens": 5}})
    assert isinstance(stats, KvshmConnectorStats)
    assert stats.data == {"counters": {"kvshm_hit_tokens": 5}}
    empty = KvshmConnector.build_kv_connector_stats(None)
    assert isinstance(empty, KvshmConnectorStats) and empty.is_empty()


def test_engine_labels_are_the_kvshm_engine_names() -> None:
    def cfg(extra: dict[str, Any], dp: int = 1) -> Any:
        kvt = SimpleNamespace(engine_id="abc", kv_connector_extra_config=extra)
        return SimpleNamespace(kv_transfer_config=kvt,
                               parallel_config=SimpleNamespace(data_parallel_size=dp))

    assert engine_labels(cfg({"name": "serve1"}), [0]) == {0: "serve1"}
    assert engine_labels(cfg({"name": "serve1"}, dp=2), [0, 1]) == {
        0: "serve1_dp0", 1: "serve1_dp1"}
    assert engine_labels(cfg({}), [0]) == {0: "kvshm-abc"}
    assert engine_labels(cfg({}, dp=2), [0, 1]) == {0: "kvshm-abc_dp0", 1: "kvshm-abc_dp1"}
    assert engine_labels(SimpleNamespace(kv_transfer_config=None), [3]) == {3: "3"}


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


def _prom(reg: CollectorRegistry, names: dict[int, str],
          remote: bool = False) -> KvshmPromMetrics:
    """KvshmPromMetrics as vLLM's front end builds it, for engines ``names`` (index ->
    kvshm name), registering in ``reg``."""
    extra = {"remote_url": "valkey://127.0.0.1:1"} if remote else {}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        engine_id="x", kv_connector_extra_config={"name": "unused", **extra}),
        parallel_config=SimpleNamespace(data_parallel_size=len(names)))
    labels: dict[int, list[object]] = {i: ["m", str(i)] for i in names}
    prom = KvshmConnector.build_prom_metrics(vllm_config,  # type: ignore[arg-type]
                                             _metric_types(reg), ["model_name", "engine"],
                                             labels)
    assert isinstance(prom, KvshmPromMetrics)
    prom.engine_names = dict(names)
    prom._values = {i: ["m", n] for i, n in names.items()}
    prom._frontend = FinalLines()
    return prom


def test_prom_metrics_register_kvshm_series_and_observe_per_engine() -> None:
    """The series of kvshm.series.vllm_series, with the table's HELP, labelled by the
    kvshm engine's name; counters add the increments, gauges take the last level."""
    reg = CollectorRegistry()
    labels: dict[int, list[object]] = {0: ["m", "0"]}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        engine_id="x", kv_connector_extra_config={"name": "serve1"}),
        parallel_config=SimpleNamespace(data_parallel_size=1))
    prom = KvshmConnector.build_prom_metrics(vllm_config,  # type: ignore[arg-type]
                                             _metric_types(reg), ["model_name", "engine"],
                                             labels)
    assert isinstance(prom, KvshmPromMetrics) and prom.engine_names == {0: "serve1"}
    prom._frontend = FinalLines()
    prom.observe({"counters": {"kvshm_hit_tokens": 64, "kvshm_stored_blocks": 3,
                               "kvshm_stored_bytes": 300, "kvshm_jobs_failed": 0},
                  "gauges": {"kvshm_pins_held": 2, "kvshm_cpu_blocks_cached": 3,
                             "kvshm_cpu_tier_occupancy": 0.375}}, engine_idx=0)
    prom.observe({"counters": {"kvshm_hit_tokens": 32},
                  "gauges": {"kvshm_pins_held": 0, "kvshm_cpu_tier_occupancy": 0.5}},
                 engine_idx=0)
    got = _series(reg)
    e0 = '{engine="serve1",model_name="m"}'
    assert got[f"kvshm_hit_tokens_total{e0}"] == 96.0
    assert got[f"kvshm_stored_blocks_total{e0}"] == 3.0
    assert got[f"kvshm_stored_bytes_total{e0}"] == 300.0
    assert got[f"kvshm_pins_held{e0}"] == 0.0
    assert got[f"kvshm_cpu_blocks_cached{e0}"] == 3.0
    assert got[f"kvshm_cpu_tier_occupancy{e0}"] == 0.5
    assert "kvshm_remote_breaker_state" not in {k.split("{")[0] for k in got}
    text = generate_latest(reg).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)
            if f.name.startswith("kvshm_") and not f.name.endswith("_created")}
    assert set(fams) == {s.name for s in vllm_series(remote=False)}
    for f in fams.values():  # the table's HELP, not "kvshm counter X"
        assert f.documentation == SERIES[f.name].help, f.name


def test_prom_metrics_per_engine_and_the_remote_breaker() -> None:
    reg = CollectorRegistry()
    prom = _prom(reg, {0: "a", 1: "b"}, remote=True)
    prom.observe({"counters": {"kvshm_hit_tokens": 7, "kvshm_remote_hit_blocks": 2},
                  "breaker": "open"}, engine_idx=1)
    got = _series(reg)
    assert got['kvshm_hit_tokens_total{engine="b",model_name="m"}'] == 7.0
    assert got['kvshm_remote_hit_blocks_total{engine="b",model_name="m"}'] == 2.0
    assert got['kvshm_remote_breaker_state{engine="b",model_name="m",state="open"}'] == 1
    assert got['kvshm_remote_breaker_state{engine="b",model_name="m",state="closed"}'] == 0


def test_the_front_end_logs_each_engines_final_line_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """The front end sums the reports it received and, at its exit, logs one
    final-statistics line per engine that reported (the engine core may be SIGKILLed
    by then)."""
    final = FinalLines()
    final.observe("e1", {"counters": {"kvshm_hit_tokens": 64, "kvshm_lookups": 3},
                         "gauges": {"kvshm_pins_held": 5}})
    final.observe("e1", {"counters": {"kvshm_hit_tokens": 32},
                         "gauges": {"kvshm_pins_held": 0, "kvshm_jobs_in_flight": 0}})
    with caplog.at_level(logging.INFO, logger="kvshm.vllm"):
        final.at_exit()
        final.at_exit()  # a second call: still one line
        # the engine core's close, in another process, with its reports shipped: the
        # front end logs; in this process (in-process vLLM) it logs once, exactly
        assert not final.at_close("e2", {"counters": {"hit_tokens": 1}}, shipped=True)
        assert final.at_close("e3", {"counters": {"hit_tokens": 2}}, shipped=False)
        final.observe("e4", {"counters": {"kvshm_hit_tokens": 4}})
        assert final.at_close("e4", {"counters": {"hit_tokens": 5}}, shipped=True)
        final.at_exit()
    lines = [r.getMessage() for r in caplog.records if "final statistics" in r.getMessage()]
    assert len(lines) == 3, lines
    assert lines[0].startswith("kvshm: engine 'e1' final statistics (vLLM's front end")
    assert lines[0].endswith("hit_tokens=96 lookups=3 pins_held=0 jobs_in_flight=0")
    assert lines[1].startswith("kvshm: engine 'e3' final statistics (at its close): "
                               "hit_tokens=2 ")
    assert lines[2].startswith("kvshm: engine 'e4' final statistics (at its close): "
                               "hit_tokens=5 ")


def _hist(counts: dict[int, int], sum_s: float) -> dict[str, Any]:
    """A rank's ``ack_latency_hist`` as the engine reports it (16 buckets, +Inf last)."""
    out = [0] * (len(ACK_BUCKETS_S) + 1)
    for i, n in counts.items():
        out[i] = n
    return {"le_us": [], "counts": out, "sum_s": sum_s, "count": sum(out)}


def test_reporter_sends_each_ranks_ack_latency_increments() -> None:
    """Per rank, the bucket counts and the sum since the last report; a rank with no new
    ack is left out, and so is the key when no rank acked."""
    rep = ReportBuilder()
    snap = _snapshot(hit=0, stored=0, cached=0)
    snap["ranks"] = [{"rank": 0, "ack_latency_hist": _hist({2: 3}, 120e-6)},
                     {"rank": 1, "ack_latency_hist": _hist({}, 0.0)}]
    first = rep.build(snap)["ack_latency"]
    assert list(first) == ["0"] and first["0"]["counts"][2] == 3
    assert first["0"]["sum_s"] == pytest.approx(120e-6)
    snap["ranks"] = [{"rank": 0, "ack_latency_hist": _hist({2: 3, 4: 1}, 320e-6)},
                     {"rank": 1, "ack_latency_hist": _hist({0: 2}, 10e-6)}]
    second = rep.build(snap)["ack_latency"]
    assert second["0"]["counts"] == [0, 0, 0, 0, 1] + [0] * 11
    assert second["0"]["sum_s"] == pytest.approx(200e-6)
    assert second["1"]["counts"][0] == 2
    assert "ack_latency" not in rep.build(snap)
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
    prom = _prom(reg, {0: "0"})
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


@settings(deadline=None)  # a stalled example on a loaded machine is not a failure
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
