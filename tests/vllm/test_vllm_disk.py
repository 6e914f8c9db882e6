"""kvshm's local disk tier under a real vLLM engine (CPU, tiny random Llama).

The CPU tier holds 4 blocks; each prompt has 3 full blocks, so a prompt is evicted from
it by the next two, and written to the disk tier before it goes. The check that
matters: a prompt, two others, ``reset_prefix_cache()`` (vLLM's own cache is gone, and
kvshm's CPU tier lost the prompt), the same prompt again -> its first lookup asks again
while the disk reads it, vLLM reports the prefix cached, and the logprobs are *bitwise*
equal to the cold run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed (see tools/vllm_install.sh)",
)

from test_vllm_connector import (
    BLOCK,
    CONNECTOR,
    MODULE,
    PROMPT_TOKENS,
    Engine,
    LLMFactory,
    _prompt,
    _signature,
)


@pytest.fixture(scope="module")
def eng(make_llm: LLMFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    tmp = tmp_path_factory.mktemp("disk")
    stats_path = tmp / "kvshm-stats.json"
    with make_llm(CONNECTOR, module=MODULE, num_cpu_blocks=4, disk_path=str(tmp),
                  disk_bytes_per_rank=32 << 20, stats_path=str(stats_path)) as llm:
        yield Engine(llm, stats_path, True)
    final = json.loads(stats_path.read_text())
    assert final["pins_held"] == 0 and final["jobs_in_flight"] == 0, final
    assert final["disk"]["slots_pinned"] == 0, final["disk"]


def test_a_prompt_evicted_to_disk_is_restored_bitwise_exact(eng: Engine) -> None:
    prompt = _prompt(PROMPT_TOKENS, 50)
    cold = eng.generate([prompt])[0]
    assert not cold.num_cached_tokens
    for start in (150, 250):
        eng.generate([_prompt(PROMPT_TOKENS, start)])
    disk: dict[str, Any] = eng.stats()["disk"]
    assert disk["written_blocks"] >= 3, disk
    eng.reset_device_cache()
    hot = eng.generate([prompt])[0]
    assert hot.num_cached_tokens == 3 * BLOCK, hot.num_cached_tokens
    assert _signature(hot) == _signature(cold)
    disk = eng.stats()["disk"]
    assert disk["hit_blocks"] >= 3 and disk["get_failed_jobs"] == 0, disk


def test_the_disk_tier_is_in_the_statistics(eng: Engine, tmp_path: Path) -> None:
    disk = eng.stats()["disk"]
    assert disk["io"] == "direct" and disk["slots"] > 0
    assert disk["slots_used"] >= 3
