"""Statistics records of a running engine and their Prometheus text exposition.

``EngineStats`` is plain data (JSON-able through ``as_dict``): it is what
``Engine.statistics()`` returns, what ``kvshm stats --name`` prints (it travels in a
``Stats`` message) and what the vLLM adapter writes to ``stats_path`` at shutdown.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

#: Upper bounds (µs) of the ack-latency histogram buckets (+Inf follows).
LATENCY_BUCKETS_US: Final = (10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1e3, 2.5e3, 5e3, 1e4,
                             2.5e4, 5e4, 1e5, 2.5e5, 1e6)
#: What ``kvshm stats --prometheus`` says when prometheus-client is missing.
PROMETHEUS_MISSING: Final = ("the Prometheus exposition needs prometheus-client: "
                             "pip install 'kvshm[prometheus]'")


class LatencyWindow:
    """The last ``size`` latencies of one rank, for p50 / p99 / max without unbounded growth."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._ring: list[float] = []
        self._next = 0
        self.count = 0
        self._sum_s = 0.0
        self._buckets = [0] * (len(LATENCY_BUCKETS_US) + 1)  # the last one is +Inf

    def add(self, seconds: float) -> None:
        """Record one latency (the window, and the histogram of every latency ever)."""
        self.count += 1
        self._sum_s += seconds
        self._buckets[bisect.bisect_left(LATENCY_BUCKETS_US, seconds * 1e6)] += 1
        if len(self._ring) < self._size:
            self._ring.append(seconds)
        else:
            self._ring[self._next] = seconds
            self._next = (self._next + 1) % self._size

    def histogram(self) -> dict[str, Any]:
        """Every latency since the start, bucketed: ``le_us`` (upper bounds, the last
        ``inf``), ``counts`` (per bucket, not cumulative), ``sum_s``, ``count``."""
        return {"le_us": [*LATENCY_BUCKETS_US, float("inf")], "counts": list(self._buckets),
                "sum_s": self._sum_s, "count": self.count}

    def summary_us(self) -> dict[str, float]:
        """p50, p99, p99.9 and max of the window, in microseconds (zeros when empty)."""
        if not self._ring:
            return {"p50": 0.0, "p99": 0.0, "p999": 0.0, "max": 0.0, "count": 0.0}
        ordered = sorted(self._ring)

        def pick(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return {"p50": pick(0.5) * 1e6, "p99": pick(0.99) * 1e6, "p999": pick(0.999) * 1e6,
                "max": ordered[-1] * 1e6, "count": float(self.count)}


@dataclass
class RankStats:
    """What the scheduler knows of one worker rank."""

    rank: int
    pid: int = 0
    connected: bool = False
    alive: bool = True
    fenced: bool = False  # declared dead and proven unable to touch a block any more
    embedded: bool = False
    #: left when the engine closed (a clean end, not a failure); ``why`` says how it
    #: ended (a death's cause, or the detach)
    detached: bool = False
    why: str = ""
    acks: int = 0
    failed_acks: int = 0
    ack_latency_us: dict[str, float] = field(default_factory=dict)
    channel: dict[str, Any] = field(default_factory=dict)
    #: :meth:`LatencyWindow.histogram` of every ack (empty from an older engine)
    ack_latency_hist: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineStats:
    """One snapshot of an engine: lifecycle, manager counters, pins, ranks."""

    name: str
    state: str
    world_size: int
    num_cpu_blocks: int = 0
    cpu_blocks_cached: int = 0
    #: the CPU tier's size: num_cpu_blocks x the bytes of one block over every rank
    cpu_tier_bytes: int = 0
    pins_held: int = 0
    jobs_in_flight: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    #: blocks pinned only because a rank declared dead is not fenced yet (see core.py)
    quarantined_gpu_blocks: int = 0
    quarantined_cpu_blocks: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    ranks: list[RankStats] = field(default_factory=list)
    #: seconds since the engine opened its rendezvous; pid of the engine's process
    uptime_s: float = 0.0
    pid: int = 0
    #: the CPU tier's eviction order (``EngineConfig.eviction``'s value); the pool's
    #: ``evictions``: cached blocks it reused
    eviction: str = ""
    evictions: int = 0
    #: the remote tier ({} without one): its URL and mode, the scheduler's counters
    #: (queries, hits, GET / PUT jobs and blocks, failures), hit and put bytes, and the
    #: readiness index's counters and breaker state (``index_*``)
    remote: dict[str, Any] = field(default_factory=dict)
    #: the local disk tier ({} without one): its directory, I/O mode, slots (total,
    #: used, pinned, quarantined), the disk book's counters (reads, writes, failures,
    #: declined write-backs, warm slots) and read / write bytes
    disk: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """CPU-tier hit tokens over the tokens looked up beyond the GPU's own hit (0..1;
        0 before any lookup)."""
        asked = self.counters.get("lookup_tokens", 0)
        return self.counters.get("lookup_hit_tokens", 0) / asked if asked else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineStats:
        """The inverse of :meth:`as_dict` (unknown keys, from a newer engine, are dropped)."""
        known = {f.name for f in dataclasses.fields(cls)}
        rank_keys = {f.name for f in dataclasses.fields(RankStats)}
        kw = {k: v for k, v in data.items() if k in known and k != "ranks"}
        ranks = [RankStats(**{k: v for k, v in r.items() if k in rank_keys})
                 for r in data.get("ranks", [])]
        return cls(**kw, ranks=ranks)


def _families(stats: EngineStats) -> Iterator[Any]:
    """The metric families of one snapshot (prometheus-client imported by the caller):
    every scalar series of :func:`kvshm.series.scalars`, the hit rate, uptime and state,
    and the per-rank families; names, types and HELP from :data:`kvshm.series.SERIES`."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from kvshm.series import help_of, scalars

    eng = [stats.name]
    snap = stats.as_dict()
    snap.pop("remote", None)  # the remote section: kvshm.cli_ls.remote_prometheus
    counters, gauges = scalars(snap)
    for name, value in gauges.items():
        g = GaugeMetricFamily(name, help_of(name), labels=["engine"])
        g.add_metric(eng, value)
        yield g
    for name, n in sorted(counters.items()):
        c = CounterMetricFamily(name, help_of(name), labels=["engine"])
        c.add_metric(eng, float(n))
        yield c
    for name, value in (("kvshm_hit_rate", stats.hit_rate),
                        ("kvshm_uptime_seconds", stats.uptime_s)):
        g = GaugeMetricFamily(name, help_of(name), labels=["engine"])
        g.add_metric(eng, float(value))
        yield g
    state = GaugeMetricFamily("kvshm_state", help_of("kvshm_state"),
                              labels=["engine", "state"])
    state.add_metric([stats.name, stats.state], 1.0)
    yield state
    yield from _rank_families(stats)


def _rank_families(stats: EngineStats) -> Iterator[Any]:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    from kvshm.series import help_of

    labels = ["engine", "rank"]
    alive = GaugeMetricFamily("kvshm_rank_alive", help_of("kvshm_rank_alive"),
                              labels=labels)
    acks = CounterMetricFamily("kvshm_rank_acks", help_of("kvshm_rank_acks"),
                               labels=labels)
    bad = CounterMetricFamily("kvshm_rank_failed_acks", help_of("kvshm_rank_failed_acks"),
                              labels=labels)
    lat = HistogramMetricFamily("kvshm_ack_latency_seconds",
                                help_of("kvshm_ack_latency_seconds"), labels=labels)
    for r in stats.ranks:
        values = [stats.name, str(r.rank)]
        alive.add_metric(values, float(r.alive))
        acks.add_metric(values, float(r.acks))
        bad.add_metric(values, float(r.failed_acks))
        hist = r.ack_latency_hist
        if hist:
            running, buckets = 0, []
            for le_us, n in zip(hist["le_us"], hist["counts"]):
                running += n
                le = "+Inf" if math.isinf(le_us) else repr(le_us / 1e6)
                buckets.append((le, float(running)))
            lat.add_metric(values, buckets, float(hist["sum_s"]))
    yield from (alive, acks, bad, lat)


def to_prometheus(stats: EngineStats) -> bytes:
    """Prometheus text exposition of ``stats``: levels as gauges, every counter as a
    counter (``_total``), per-rank ack latency as a histogram (seconds), a hit-rate
    and an uptime series, HELP from :mod:`kvshm.series` (the remote section:
    :func:`kvshm.cli_ls.remote_prometheus`). Raises ``ImportError`` naming
    ``pip install 'kvshm[prometheus]'`` without prometheus-client."""
    try:
        from prometheus_client import CollectorRegistry, generate_latest
    except ImportError as exc:
        raise ImportError(PROMETHEUS_MISSING) from exc

    class _Snapshot:
        def collect(self) -> Iterator[Any]:
            return _families(stats)

    reg = CollectorRegistry()
    reg.register(_Snapshot())
    out: bytes = generate_latest(reg)
    return out
