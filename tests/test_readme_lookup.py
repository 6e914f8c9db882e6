"""What docs/api.md (the Python API's page, which the README links) says about ``lookup``
holds on a real SPAWN engine: at least one prompt token is always computed, so the last
full block of a prompt that ends on a block boundary is never a hit (issue 14, point 8)."""

from __future__ import annotations

import os

from engine_rig import BS, Client, spawned_engine, tokens

from kvshm.hashing import chain_hashes
from kvshm.types import RequestView


async def test_last_full_block_of_a_block_aligned_prompt_is_never_a_hit() -> None:
    toks = tokens(4 * BS + 1, seed=5)  # four full blocks and one more token
    async with spawned_engine() as s:
        c = Client(s.eng, s.gpu)
        await c.store_only("a", toks)
        aligned = toks[:4 * BS]  # ends on a block boundary: the 4th block is recomputed
        hit = s.eng.lookup(RequestView("b", chain_hashes(aligned, BS), len(aligned)), 0)
        assert hit == 3 * BS
        s.eng.finished("b", 0, [[]])
        hit = s.eng.lookup(RequestView("c", chain_hashes(toks, BS), len(toks)), 0)
        assert hit == 4 * BS  # one token beyond the blocks: every full block hits
        s.eng.finished("c", 0, [[]])


def test_the_api_page_states_it_where_lookup_is_described() -> None:
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "api.md")) as f:
        page = f.read()
    calls = " ".join(page[page.index("## The calls, per step"):
                          page.index("## `SyncClient`")].split())
    assert "`lookup(req, num_local_tokens)`" in calls
    assert ("the last full block of a prompt that ends on a block boundary is never a hit"
            in calls)
    assert "A 64-token prompt with 16-token blocks, all four blocks cached: hit 48" in calls
