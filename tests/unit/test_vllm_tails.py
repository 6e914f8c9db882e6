"""The vLLM adapter's tail keys (``kvshm.integrations.vllm.tails``): derived from the
request's own tokens, never raising out of a vLLM hook."""

from __future__ import annotations

from types import SimpleNamespace as NS

from kvshm.hashing import chain_hashes, chain_tail
from kvshm.integrations.vllm.tails import request_tail_hash

BS = 4


def request(toks: list[int], hashes: list[bytes], **extra: object) -> NS:
    return NS(block_hashes=hashes, all_token_ids=toks, **extra)


def test_the_tail_key_is_the_one_the_asyncio_api_derives() -> None:
    """11 tokens: the key of tokens 8..10 after the second block's hash, as
    ``chain_tail`` gives an API user (both sides of a hand-off must agree)."""
    toks = list(range(11))
    hashes = chain_hashes(toks, BS)
    assert request_tail_hash(request(toks, hashes), 11, BS) == chain_tail(toks, BS, hashes)


def test_no_tail_key_where_none_can_be_trusted_or_built() -> None:
    """A count on a block boundary, no full block before the tail, hashes not yet
    computed, multimodal or embedding inputs, and a token id or parent hash no key
    can carry (it would have raised out of vLLM's hook): None, the block recomputed."""
    toks = list(range(11))
    hashes = chain_hashes(toks, BS)
    assert request_tail_hash(request(toks, hashes), 8, BS) is None
    assert request_tail_hash(request(toks[:3], []), 3, BS) is None
    assert request_tail_hash(request(toks, hashes[:1]), 11, BS) is None
    assert request_tail_hash(request(toks, hashes, mm_features=[object()]), 11, BS) is None
    assert request_tail_hash(request(toks, hashes, prompt_embeds=object()), 11, BS) is None
    assert request_tail_hash(request([*toks[:8], 2**33, 1, 2], hashes), 11, BS) is None
    assert request_tail_hash(request(toks, [b"x" * 300, b"y" * 300]), 11, BS) is None
