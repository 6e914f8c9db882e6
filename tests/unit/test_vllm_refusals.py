"""``Refusals`` alone: the vLLM requests kvshm refused a call for."""

from __future__ import annotations

import logging

import pytest

from kvshm.errors import InvalidRequest
from kvshm.integrations.vllm.records import SchedulerCounters
from kvshm.integrations.vllm.refusals import Refusals


def test_a_refusal_is_counted_each_time_and_logged_once_per_kind(
        caplog: pytest.LogCaptureFixture) -> None:
    counters = SchedulerCounters()
    r = Refusals(counters)
    with caplog.at_level(logging.ERROR, logger="kvshm.vllm"):
        r.refuse("a", InvalidRequest("allocated", "a", "gpu_block_ids[0]", "repeated id"))
        r.refuse("b", InvalidRequest("allocated", "b", "gpu_block_ids[1]", "repeated id"))
        r.refuse("c", InvalidRequest("lookup", "c", "block_hashes", "not bytes"))
    assert counters.requests_refused == 3 and r.ids == {"a", "b", "c"}
    assert len([m for m in caplog.messages if "kvshm refused" in m]) == 2
    r.forget("a")
    assert r.ids == {"b", "c"}


def test_refused_loads_fail_once_in_the_next_metadata() -> None:
    r = Refusals(SchedulerCounters())
    r.refuse_load("a", (4, 5))
    assert r.take_loads() == {"a": (4, 5)} and r.take_loads() == {}
