"""The partial last block's key of a vLLM request, for P/D hand-offs.

vLLM hashes full blocks only; a P/D hand-off also carries the prompt's partial last
block (:mod:`kvshm.offload.pd`), keyed by :func:`kvshm.hashing.tail_hash` of the last
full block's vLLM hash and the remaining token ids -- the prefill side computes it when
the request finishes, the decode side when it looks the request up; both see the same
prompt, so both derive the same key. The parent hash already covers the prefix's extra
keys (LoRA, cache salt, earlier multimodal items); a request whose partial block may
hold multimodal or embedding inputs (which its token ids do not describe) gets no tail
key and recomputes that block.
"""

from __future__ import annotations

from typing import Any

from kvshm.errors import ConfigError
from kvshm.hashing import tail_hash

__all__ = ["request_tail_hash"]


def request_tail_hash(request: Any, num_tokens: int, block_size: int) -> bytes | None:
    """The key of ``request``'s partial block among its first ``num_tokens`` tokens, or
    None: the count ends on a block boundary, the full blocks before it are not all
    hashed yet, the block may hold inputs its token ids do not describe, or no key can
    carry its parent hash or token ids (never raises: vLLM's hooks must not)."""
    n_full, rest = divmod(num_tokens, block_size)
    hashes = request.block_hashes
    if rest == 0 or n_full == 0 or len(hashes) < n_full:
        return None
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds",
                                                         None) is not None:
        return None
    parent = hashes[n_full - 1]
    if type(parent) is not bytes:
        return None
    tokens = request.all_token_ids[n_full * block_size:num_tokens]
    try:
        return tail_hash(parent, tokens)
    except ConfigError:  # a hash or token id no key can carry: the block is recomputed
        return None
