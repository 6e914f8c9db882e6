"""The lookups a vLLM engine with a lower tier asks again while it starts
(``kvshm.integrations.vllm.start_wait``): while its ranks connect, and while its disk
tier's start scan still runs after READY."""

from __future__ import annotations

import time

import pytest

from kvshm.engine import EngineState
from kvshm.integrations.vllm.start_wait import START_WAIT_S, StartWait


def test_a_ready_engine_whose_disk_warms_asks_again_within_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A review of the warm scan's move to a thread: the engine is READY before its
    disk tier's scan is applied, so the first lookup of a restarted vLLM engine no
    longer waited (the wait covered STARTING only) and recomputed what the slab held.
    Now READY-and-warming asks again too, within the same bound from the first lookup
    that waited; once the bound is spent, or the tier is warm, never again."""
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    w = StartWait()
    assert w.asks_again(EngineState.STARTING)
    now[0] += 1.0
    assert w.asks_again(EngineState.READY, warming=True)
    now[0] += START_WAIT_S
    assert not w.asks_again(EngineState.READY, warming=True) and w.over
    assert not w.asks_again(EngineState.STARTING)      # over for good

    warm = StartWait()
    assert not warm.asks_again(EngineState.READY, warming=False) and warm.over
    assert not warm.asks_again(EngineState.READY, warming=True)
