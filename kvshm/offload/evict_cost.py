"""What a cached block saves: the prefill compute of its tokens at their positions.

Model: recomputing the token at position ``p`` costs ``a + b * p`` -- ``a`` the
projections and the MLP (the same for every token), ``b * p`` attention over the ``p``
tokens before it. In units of ``a``, a token costs ``1 + p / half`` with
``half = a / b``, the position at which attention costs as much as everything else,
and a block of ``bs`` tokens at chain position ``d`` (tokens ``d * bs .. d * bs + bs -
1``) costs :func:`block_cost` ``= bs * (1 + (d * bs + (bs - 1) / 2) / half)``.

Measured (``tools/prefill_cost.py``: one prefill chunk of ``C`` tokens after ``s``
cached tokens, several ``s`` from 0 to 30,720, median of 7 timed runs, the line through
``T(s) = C * a + b * C * (s + (C - 1) / 2)``), random-weight decoder layers, bfloat16,
torch 2.11 SDPA with a lower-right causal mask, one NVIDIA H200:

=========================  =======  ==========  ===============  ============
layer shape                chunk C  a us/token  b ns/token/pos   half (a / b)
=========================  =======  ==========  ===============  ============
Llama-3-8B (4 layers)      512      3.22        0.329            9,785
Llama-3-8B (4 layers)      2048     2.97        0.209            14,191
TinyLlama-1.1B (4 layers)  2048     0.85        0.110            7,724
Llama-3-70B (2 layers)     2048     5.14        0.211            24,392
=========================  =======  ==========  ===============  ============

(worst residual of each line 3-10 %). :data:`ATTN_HALF_TOKENS` takes the Llama-3-8B
512-token fit, rounded: a token 10k positions deep costs twice one at the start. The
demo's toy model (``--backend toy``: 4 layers of 512, paged gather, float32, one CPU
thread) is far more attention-bound, ``half`` about 600 on a loaded 2-core machine; pass
another ``half`` where the engine is known.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ATTN_HALF_TOKENS", "block_cost"]

ATTN_HALF_TOKENS: Final = 10_000
"""``a / b`` of the module docstring's model: Llama-3-8B's layer on an H200."""


def block_cost(depth: int, block_size: int, half: float = ATTN_HALF_TOKENS) -> float:
    """The prefill compute a block at chain position ``depth`` saves, in units of one
    token's non-attention compute (module docstring)."""
    return block_size * (1.0 + (depth * block_size + (block_size - 1) / 2) / half)
