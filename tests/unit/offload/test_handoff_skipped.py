"""The vLLM connector's P/D decode request that reads no cache (prompt logprobs: vLLM sets
``skip_reading_prefix_cache`` and ignores the connector's answer), on its scheduler side
(:class:`~kvshm.integrations.vllm.scheduler.SchedulerSide`, no vLLM needed) over a real
decode manager (the unit rig) and the real ``Runtime`` calls.

Hazard: *a hand-off skipped while the engine starts*. While the engine is STARTING
(ranks connecting) an ordinary P/D lookup asks again, but a skipped one is answered 0 at
once and ``Runtime.lookup_skipped`` ignores it before READY: its manifest was never read,
and it stayed on the server for the hold TTL although its request ended after READY. Now
the request's end calls ``lookup_skipped`` again (a no-op for a read begun): the read
goes as an orphan and collects the manifest (a review).
"""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

from manager_rig import REMOTE, Req
from test_handoff_reask import _publish
from test_handoff_tail import MANIFEST
from test_remote_book import HeldIndex, remote_rig

from kvshm.engine import EngineState
from kvshm.engine.runtime import Runtime
from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.scheduler import SchedulerSide
from kvshm.offload.pd.manifest import MANIFEST_PARAM
from kvshm.types import KVGroup, StoreMode


def test_a_handoff_skipped_while_the_engine_starts_is_collected_at_its_end() -> None:
    """R (prompt logprobs, P's hand-off params) is looked up while the engine is
    STARTING: 0 at once, no read (nothing can be read yet). The engine turns READY, R
    computes and ends: its ``finished`` reads the manifest first (one read, an orphan at
    once) and D's next step collects it -- deleted from the server, collected 1."""
    index = HeldIndex()
    d = remote_rig(index)
    _publish(index)
    client: Any = NS(state=EngineState.STARTING, _state=EngineState.STARTING, manager=d.m,
                     _admission=NS(pre_ready=set()), counters=NS(lookups_not_ready=0))
    for name in ("lookup", "lookup_skipped", "finished", "transfer_params"):
        setattr(client, name, getattr(Runtime, name).__get__(client))
    cfg = ConnectorConfig("unit", 1, 1, 4, (KVGroup.full(),), StoreMode.EAGER, None, 8,
                          None, 30.0, 5.0, 0, remote_url="valkey://unused:1")
    side = SchedulerSide(cfg)
    side.life.bound_client = client
    r = Req("r", 11, params=REMOTE)
    req = NS(request_id="r", block_hashes=r.h, num_tokens=11, num_computed_tokens=11,
             num_output_placeholders=0, skip_reading_prefix_cache=True,
             kv_transfer_params={"do_remote_prefill": True, MANIFEST_PARAM: MANIFEST},
             prompt_token_ids=r.toks, all_token_ids=r.toks)
    assert side.lookup(req, 0) == (0, False)
    assert index._values == []                       # not READY: nothing read
    client.state = client._state = EngineState.READY
    side.finished(req, [[]])
    d.step()
    assert MANIFEST not in index.kv                  # collected at R's end
    assert d.m.remote is not None and d.m.remote.pd is not None
    assert d.m.remote.pd.counters.collected == 1
