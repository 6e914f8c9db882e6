"""The demo's bit-exact check: a CPU-served turn against a recompute with the same chunks.

The toy model is deterministic for a fixed chunking (see :mod:`kvshm.demo.model`), so a
turn whose history KV was restored from the CPU tier must produce exactly the logits of
a recompute that runs the conversation's own ``forward_chunk`` calls again, in order,
into fresh shards: the same computations over the same inputs. The system prompt is
computed canonically (a chunk of its own from position 0), so its KV is the same
whichever conversation computed it; the replay prepends that chunk when the
conversation's own calls start after it.

A turn is *checkable* when no earlier call of its conversation recomputed a position of
a block that was already full: such a block exists in two versions (the caches keep the
first, a replay keeps the last), and the comparison would be meaningless.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvshm.demo.model import ToyModel
from kvshm.demo.server import ChunkCall

__all__ = ["is_clean", "replay_logits", "with_system_chunk"]


def with_system_chunk(system_prompt: Sequence[int], calls: Sequence[ChunkCall],
                      ) -> list[ChunkCall]:
    """``calls`` preceded by the canonical system chunk when they start past position 0
    (the history they read then came from whoever computed the system prompt)."""
    out = list(calls)
    if out and out[0].start > 0:
        out.insert(0, ChunkCall(0, tuple(system_prompt)))
    return out


def is_clean(calls: Sequence[ChunkCall], block_size: int) -> bool:
    """True when no call rewrites a position inside an earlier full block."""
    computed_end = 0
    for call in calls:
        full_end = computed_end // block_size * block_size
        if call.start < full_end:
            return False
        computed_end = max(computed_end, call.start + len(call.tokens))
    return True


def replay_logits(model: ToyModel, todo: Sequence[ChunkCall]) -> torch.Tensor:
    """Run ``todo`` (see :func:`with_system_chunk`) into fresh shards with an identity
    block table; the last call's logits."""
    bs = model.config.block_size
    end = max(c.start + len(c.tokens) for c in todo)
    blocks = -(-end // bs)
    shards = model.make_kv_shards(blocks)
    table = list(range(blocks))
    logits = torch.empty(0)
    for call in todo:
        logits = model.forward_chunk(shards, call.tokens, call.start, table)
    return logits
