"""Statistics records of a running engine and their Prometheus text exposition.

``EngineStats`` is plain data (JSON-able through ``as_dict``): it is what
``Engine.statistics()`` returns, what ``kvshm stats --name`` prints (it travels in a
``Stats`` message) and what the vLLM adapter writes to ``stats_path`` at shutdown.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class LatencyWindow:
    """The last ``size`` latencies of one rank, for p50 / p99 / max without unbounded growth."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._ring: list[float] = []
        self._next = 0
        self.count = 0

    def add(self, seconds: float) -> None:
        """Record one latency."""
        self.count += 1
        if len(self._ring) < self._size:
            self._ring.append(seconds)
        else:
            self._ring[self._next] = seconds
            self._next = (self._next + 1) % self._size

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
    acks: int = 0
    failed_acks: int = 0
    ack_latency_us: dict[str, float] = field(default_factory=dict)
    channel: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineStats:
    """One snapshot of an engine: lifecycle, manager counters, pins, ranks."""

    name: str
    state: str
    world_size: int
    num_cpu_blocks: int = 0
    cpu_blocks_cached: int = 0
    pins_held: int = 0
    jobs_in_flight: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    #: blocks pinned only because a rank declared dead is not fenced yet (see core.py)
    quarantined_gpu_blocks: int = 0
    quarantined_cpu_blocks: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    ranks: list[RankStats] = field(default_factory=list)

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


def to_prometheus(stats: EngineStats) -> bytes:
    """Prometheus text exposition of ``stats`` (needs the optional prometheus-client)."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    reg = CollectorRegistry()
    labels = ["engine"]
    plain = {
        "num_cpu_blocks": stats.num_cpu_blocks, "cpu_blocks_cached": stats.cpu_blocks_cached,
        "pins_held": stats.pins_held, "jobs_in_flight": stats.jobs_in_flight,
        "stored_bytes": stats.stored_bytes, "loaded_bytes": stats.loaded_bytes,
        "quarantined_gpu_blocks": stats.quarantined_gpu_blocks,
        "quarantined_cpu_blocks": stats.quarantined_cpu_blocks,
    }
    for key, value in plain.items():
        Gauge(f"kvshm_{key}", key.replace("_", " "), labels, registry=reg).labels(
            stats.name).set(value)
    counter = Gauge("kvshm_counter", "manager counters", ["engine", "name"], registry=reg)
    for key, value in sorted(stats.counters.items()):
        counter.labels(stats.name, key).set(value)
    lat = Gauge("kvshm_ack_latency_us", "per-rank ack latency", ["engine", "rank", "q"],
                registry=reg)
    for r in stats.ranks:
        for q, lat_us in r.ack_latency_us.items():
            lat.labels(stats.name, str(r.rank), q).set(lat_us)
    out: bytes = generate_latest(reg)
    return out

