"""kvshm.series, the one table of kvshm's Prometheus series (issue 28, point 4): every
counter the engine, its remote book and hand-offs keep has a one-line HELP that says
what it counts and in which unit; what vLLM's ``/metrics`` carries is a part of it."""

from __future__ import annotations

from dataclasses import asdict, fields

import pytest

from kvshm.engine.snapshot import CoreCounters
from kvshm.offload.counters import ManagerCounters
from kvshm.offload.disk import DiskCounters
from kvshm.offload.pd.manifest import PdCounters
from kvshm.offload.remote_puts import RemoteCounters
from kvshm.series import (
    DISK_GAUGES,
    SERIES,
    Kind,
    help_of,
    scalars,
    series_names,
    vllm_series,
)


def test_every_counter_of_the_engine_and_remote_book_is_described() -> None:
    keys = [f"kvshm_{k}" for k in asdict(CoreCounters())]
    keys += [f"kvshm_{k}" for k in ManagerCounters().as_dict()]
    keys += [f"kvshm_remote_{f.name}" for f in fields(RemoteCounters)]
    keys += [f"kvshm_remote_{k}" for k in PdCounters().as_dict()]
    keys += [f"kvshm_disk_{k}" for k in DiskCounters().as_dict()]
    keys += [f"kvshm_disk_{k}" for k in ("slot_evictions", "read_bytes", "write_bytes",
                                         *DISK_GAUGES)]
    assert [k for k in keys if k not in SERIES] == []
    for s in SERIES.values():
        head, _, unit = s.help.rpartition("; ")
        assert head and unit and "\n" not in s.help, s.name  # "what; unit", one line
    assert "no description" in help_of("kvshm_from_a_newer_engine")


def test_vllm_series_are_a_part_and_remote_ones_only_with_a_remote_tier() -> None:
    local = vllm_series(remote=False)
    assert {s.name for s in local} >= {"kvshm_hit_tokens", "kvshm_lookups",
                                       "kvshm_stored_blocks", "kvshm_loaded_bytes",
                                       "kvshm_pins_held", "kvshm_jobs_in_flight",
                                       "kvshm_cpu_tier_occupancy",
                                       "kvshm_ack_latency_seconds"}
    assert not any(s.remote for s in local)
    both = vllm_series(remote=True)
    assert "kvshm_remote_breaker_state" in {s.name for s in both}
    names = series_names(local)
    assert {"kvshm_hit_tokens_total", "kvshm_ack_latency_seconds_bucket"} <= names
    assert SERIES["kvshm_hit_tokens"].kind is Kind.COUNTER


def test_scalars_flatten_a_snapshot_by_family_name() -> None:
    counters, gauges = scalars({"counters": {"hit_tokens": 64, "stored_blocks": 3},
                                "stored_bytes": 300, "num_cpu_blocks": 8,
                                "cpu_blocks_cached": 2, "pins_held": 1,
                                "remote": {"hit_blocks": 4, "url": "valkey://x",
                                           "index_breaker_state": "open"}})
    assert counters["kvshm_hit_tokens"] == 64 and counters["kvshm_stored_bytes"] == 300
    assert counters["kvshm_remote_hit_blocks"] == 4
    assert "kvshm_remote_url" not in counters
    assert gauges["kvshm_cpu_tier_occupancy"] == 0.25 and gauges["kvshm_pins_held"] == 1


def test_the_disk_section_flattens_to_counters_gauges_and_its_occupancy() -> None:
    """The disk tier's section: occupancy, slot gauges and counters under kvshm_disk_*;
    its text keys (path, I/O mode) are no series; vLLM carries its series only with a
    disk tier."""
    counters, gauges = scalars({"disk": {"path": "/x", "io": "direct", "slots": 8,
                                         "slots_used": 2, "slots_pinned": 1,
                                         "written_blocks": 5, "read_bytes": 1024,
                                         "warm_scan_ms": 250}})
    disk = {k: v for k, v in counters.items() if k.startswith("kvshm_disk_")}
    assert disk == {"kvshm_disk_written_blocks": 5, "kvshm_disk_read_bytes": 1024}
    # a duration, not a count: it was a counter (kvshm_disk_warm_scan_ms_total)
    assert gauges["kvshm_disk_warm_scan_ms"] == 250.0
    assert SERIES["kvshm_disk_warm_scan_ms"].kind is Kind.GAUGE
    assert gauges["kvshm_disk_occupancy"] == 0.25 and gauges["kvshm_disk_slots"] == 8.0
    assert gauges["kvshm_disk_slots_pinned"] == 1.0 and "kvshm_disk_path" not in gauges
    assert not any(s.disk for s in vllm_series(remote=True))
    assert "kvshm_disk_occupancy" in {s.name for s in vllm_series(remote=False, disk=True)}


def test_every_integer_counter_of_the_readiness_index_is_described() -> None:
    """The index's statistics reach ``kvshm stats`` as ``index_<key>`` (engine snapshot):
    each integer one needs a HELP line (a standalone and a cluster index; no server is
    contacted: the clients connect lazily and nothing is queued)."""
    pytest.importorskip("glide_sync")
    from kvshm.remote.tier import RemoteSpec
    from kvshm.remote.valkey_index import ValkeyReadyIndex

    for url in ("valkey://127.0.0.1:1", "valkey+cluster://127.0.0.1:1"):
        idx = ValkeyReadyIndex(RemoteSpec.parse(url))
        try:
            stats = idx.statistics()
        finally:
            idx.close()
        keys = [f"kvshm_remote_index_{k}" for k, v in stats.items()
                if isinstance(v, int) and not isinstance(v, bool)]
        assert [k for k in keys if k not in SERIES] == []
