"""The layers one vLLM lookup passes through, pinned (``docs/design.md``, "The
scheduler-side contract": each layer does one thing a reader can name).

``KvshmConnector.get_num_new_matched_tokens`` is called, as vLLM calls it, for a fresh
request on the benchmark's lockstep rig (:mod:`tools.vs_vllm_rig`: vLLM's real
``KVCacheManager`` and ``Request``, kvshm's scheduler side over a real ``SyncClient``
with one embedded worker); the Python frames between the hook and the hash index's
``cached_run`` (where a lookup of one full-attention group reads the CPU tier, the
whole run in one call) must be exactly the documented path. A layer added or removed
fails here, naming the frames."""

from __future__ import annotations

import sys
from types import SimpleNamespace as NS
from typing import Any

import pytest

pytest.importorskip("vllm.v1.simple_kv_offload.manager")

pytestmark = pytest.mark.vllm

#: The documented path, hook first (co_qualname of each frame).
PATH = [
    "KvshmConnector.get_num_new_matched_tokens",  # the vLLM hook: the scheduler role's side
    "guarded.<locals>.wrapper",  # lock: the hook guard against the service thread
    "SchedulerSide.lookup",  # translate a vLLM Request into a RequestView
    "Facade.lookup",  # state guard: StateError once closing
    "Runtime.lookup",  # 0 before READY or for a request kept out (admission)
    "OffloadManager.lookup",  # validate the view
    "OffloadManager._lookup",  # the hit: search, pin, record
    "find_hit",  # the longest hit in the CPU tier
    "HashIndex.cached_run",  # the index probes, the whole run in one call
]


def test_a_lookup_passes_exactly_the_documented_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshm.integrations.vllm.connector import KvshmConnector
    from kvshm.offload.pool_index import HashIndex
    from tools.vs_vllm_rig import Rig

    seen: list[list[str]] = []
    real = HashIndex.cached_run
    hook = KvshmConnector.get_num_new_matched_tokens.__code__

    def spy(self: HashIndex, *args: Any) -> list[int]:
        names: list[str] = []
        f = sys._getframe(0)
        while f is not None and f.f_code is not hook:
            names.append(f.f_code.co_qualname)
            f = f.f_back  # type: ignore[assignment]
        assert f is not None, f"cached_run reached without the hook: {names}"
        names.append(f.f_code.co_qualname)
        names[0] = "HashIndex.cached_run"  # this spy stands in for it
        seen.append(names[::-1])
        return real(self, *args)

    rig = Rig(gpu_blocks=64, cpu_blocks=64)
    try:
        monkeypatch.setattr(HashIndex, "cached_run", spy)
        r = rig.request("r0", list(range(4 * 16 + 1)))
        rig.side.on_new_request(r)
        # the hook's own code, its connector holding only what it reads
        hit = KvshmConnector.get_num_new_matched_tokens(
            NS(scheduler_side=rig.side), r, 0)  # type: ignore[arg-type]
    finally:
        monkeypatch.undo()
        rig.close()
    assert hit == (0, False)  # nothing stored yet: a miss, after the whole path
    assert seen == [PATH]  # one call for the whole run
