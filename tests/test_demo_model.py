"""The demo's toy model (paged attention over sharded block KV) and its chat trace."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from kvshm.demo.model import ToyConfig, ToyModel, greedy
from kvshm.demo.trace import QUICK, ChatTrace, TurnRef, make_trace
from kvshm.errors import ConfigError

NUM_BLOCKS = 24
BS = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Bitwise comparisons assume one fixed thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> ToyModel:
    return ToyModel()


def tokens(count: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1024, (count,), generator=gen).tolist()


def test_config_and_shard_layout(model: ToyModel) -> None:
    c = model.config
    assert (c.num_layers, c.hidden, c.num_heads, c.head_dim, c.block_size, c.vocab_size) == (
        4, 512, 8, 64, 16, 1024)
    shards = model.make_kv_shards(3)
    assert [tuple(s.shape) for s in shards] == [(3, 4, 2, 16, 4, 64)] * 2
    assert all(s.dtype == torch.float32 and s.is_contiguous() for s in shards)
    assert c.bytes_per_block == 128 * 1024 == shards[0][0].numel() * 4
    calls: list[tuple[int, ...]] = []

    def alloc(shape: tuple[int, ...], *, dtype: torch.dtype) -> torch.Tensor:
        calls.append(shape)
        return torch.zeros(shape, dtype=dtype)

    model.make_kv_shards(5, alloc)
    assert calls == [c.shard_shape(5)] * 2


def test_weights_depend_only_on_seed() -> None:
    a, b, other = ToyModel(seed=0), ToyModel(seed=0), ToyModel(seed=1)
    assert torch.equal(a.layers[2].wqkv, b.layers[2].wqkv)
    assert torch.equal(a.lm_head, b.lm_head)
    assert not torch.equal(a.layers[2].wqkv, other.layers[2].wqkv)


def test_chunked_prefill_matches_single_chunk(model: ToyModel) -> None:
    toks = tokens(200)  # ends inside a block
    table = list(range(13))
    whole, chunked = model.make_kv_shards(NUM_BLOCKS), model.make_kv_shards(NUM_BLOCKS)
    ref = model.prefill(whole, toks, table, chunk_tokens=256)
    got = model.prefill(chunked, toks, table, chunk_tokens=64)
    assert ref.shape == (1024,)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert greedy(got) == greedy(ref)


def test_same_boundaries_are_bitwise_identical_whatever_the_block_ids(model: ToyModel) -> None:
    toks = tokens(150)
    first, second = model.make_kv_shards(NUM_BLOCKS), model.make_kv_shards(NUM_BLOCKS)
    table_a = list(range(10))
    table_b = [17, 3, 22, 8, 0, 11, 5, 19, 2, 14]
    logits_a = model.prefill(first, toks, table_a, chunk_tokens=48)
    logits_b = model.prefill(second, toks, table_b, chunk_tokens=48)
    assert torch.equal(logits_a, logits_b)
    again = model.make_kv_shards(NUM_BLOCKS)
    assert torch.equal(model.prefill(again, toks, table_a, chunk_tokens=48), logits_a)
    for shard_a, shard_b in zip(first, second):
        assert torch.equal(shard_a[table_a], shard_b[table_b])


def _rope_reference(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = pos * freq
    cos, sin = angle.cos().float(), angle.sin().float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)


def test_kv_lands_at_block_and_slot_of_a_noncontiguous_table(model: ToyModel) -> None:
    c = model.config
    toks = tokens(50)  # blocks 9, 3, 6 full; block 0 holds positions 48, 49
    table = [9, 3, 6, 0]
    shards = model.make_kv_shards(NUM_BLOCKS)
    model.prefill(shards, toks, table, chunk_tokens=32)
    layer = model.layers[0]
    h = model.embedding[torch.tensor(toks)]
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + c.norm_eps) * layer.attn_norm
    q_k_v = (x @ layer.wqkv.T).view(50, 3, c.num_heads, c.head_dim)
    for pos in range(50):
        block, slot = table[pos // BS], pos % BS
        k = _rope_reference(q_k_v[pos, 1], pos, c.rope_theta)
        v = q_k_v[pos, 2]
        for s, shard in enumerate(shards):
            heads = slice(s * c.heads_per_shard, (s + 1) * c.heads_per_shard)
            torch.testing.assert_close(shard[block, 0, 0, slot], k[heads], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(shard[block, 0, 1, slot], v[heads], rtol=1e-4, atol=1e-4)
    # Nothing written outside the table's slots for positions [0, 50).
    for shard in shards:
        assert bool(shard[[9, 3, 6]].abs().amax(dim=(1, 2, 4, 5)).gt(0).all())
        assert bool(shard[0, :, :, :2].ne(0).any()) and not bool(shard[0, :, :, 2:].any())
        unused = [b for b in range(NUM_BLOCKS) if b not in table]
        assert not bool(shard[unused].any())
    # Every layer lands at the same (block, slot) as with a contiguous table.
    contiguous = model.make_kv_shards(NUM_BLOCKS)
    model.prefill(contiguous, toks, [0, 1, 2, 3], chunk_tokens=32)
    for shard, ref in zip(shards, contiguous):
        assert torch.equal(shard[table], ref[[0, 1, 2, 3]])


def _copy_blocks(src: list[torch.Tensor], dst: list[torch.Tensor], src_ids: list[int],
                 dst_ids: list[int]) -> None:
    """What an offload followed by a load does: opaque rows through a CPU buffer."""
    for s, d in zip(src, dst):
        host = s[src_ids].clone()
        d[dst_ids] = host


def test_loaded_prefix_gives_bitwise_identical_continuation(model: ToyModel) -> None:
    prefix, suffix = tokens(80), tokens(40, seed=2)  # prefix = 5 full blocks
    original = model.make_kv_shards(NUM_BLOCKS)
    table_a = [0, 1, 2, 3, 4, 5, 6, 7]
    model.prefill(original, prefix, table_a, chunk_tokens=64)
    loaded = model.make_kv_shards(NUM_BLOCKS)
    table_b = [7, 2, 9, 4, 15, 20, 1, 3]
    _copy_blocks(original, loaded, table_a[:5], table_b[:5])

    ref = model.forward_chunk(original, suffix, 80, table_a, all_logits=True)
    got = model.forward_chunk(loaded, suffix, 80, table_b, all_logits=True)
    assert ref.shape == (40, 1024)
    assert torch.equal(got, ref)
    # Decoding on from there stays identical too.
    tok_a = tok_b = greedy(ref[-1])
    for pos in range(120, 124):
        tok_a = model.decode_step(original, tok_a, pos, table_a)
        tok_b = model.decode_step(loaded, tok_b, pos, table_b)
        assert tok_a == tok_b

    # Zeroing one loaded block must change the result (the prefix is read from the shards).
    for shard in loaded:
        shard[table_b[1]] = 0
    broken = model.forward_chunk(loaded, suffix, 80, table_b, all_logits=True)
    assert (broken - ref).abs().max().item() > 1e-3


def test_decode_matches_prefill_of_the_same_tokens(model: ToyModel) -> None:
    prompt = tokens(37)
    stepped = model.make_kv_shards(NUM_BLOCKS)
    table = [5, 11, 2, 8]
    next_token = greedy(model.prefill(stepped, prompt, table))
    seq = list(prompt)
    for _ in range(5):
        seq.append(next_token)
        logits = model.forward_chunk(stepped, [next_token], len(seq) - 1, table)
        next_token = greedy(logits)
    # decode_step is the greedy choice of the same computation (rewriting the same KV).
    assert model.decode_step(stepped, seq[-1], len(seq) - 1, table) == next_token
    fresh = model.make_kv_shards(NUM_BLOCKS)
    whole = model.prefill(fresh, seq, [0, 1, 2, 3])
    torch.testing.assert_close(logits, whole, rtol=1e-4, atol=1e-4)


def test_prefill_chunks_are_measured_from_start_pos(model: ToyModel) -> None:
    toks = tokens(100)
    table = list(range(8))
    a, b = model.make_kv_shards(NUM_BLOCKS), model.make_kv_shards(NUM_BLOCKS)
    model.prefill(a, toks[:32], table)
    model.prefill(b, toks[:32], table)
    via_prefill = model.prefill(a, toks[32:], table, start_pos=32, chunk_tokens=32)
    for start in range(32, 100, 32):
        via_chunks = model.forward_chunk(b, toks[start:start + 32], start, table)
    assert torch.equal(via_prefill, via_chunks)


def test_bad_input_is_a_config_error(model: ToyModel) -> None:
    shards = model.make_kv_shards(4)
    with pytest.raises(ConfigError):
        model.prefill(shards, tokens(10), [0], chunk_tokens=20)  # not a block multiple
    with pytest.raises(ConfigError):
        model.forward_chunk(shards, tokens(40), 0, [0, 1])  # table too short
    with pytest.raises(ConfigError):
        model.forward_chunk(shards, tokens(20), 0, [0, 4])  # block id out of range
    with pytest.raises(ConfigError):
        model.forward_chunk(shards, tokens(20), 0, [1, 1])  # aliased blocks
    with pytest.raises(ConfigError):
        model.forward_chunk(shards, [1024], 0, [0])  # token out of vocab
    with pytest.raises(ConfigError):
        model.forward_chunk(shards, [], 0, [0])
    with pytest.raises(ConfigError):
        model.forward_chunk(shards[:1], [1], 0, [0])  # one shard missing
    with pytest.raises(ConfigError):
        model.forward_chunk([s.double() for s in shards], [1], 0, [0])
    with pytest.raises(ConfigError):
        ToyConfig(num_heads=6, head_dim=64)


# ----------------------------------------------------------------- trace


def _digest(trace: ChatTrace) -> str:
    h = hashlib.sha256(repr((trace.system_prompt, trace.conversations, trace.order)).encode())
    return h.hexdigest()


def test_trace_is_deterministic_across_processes() -> None:
    here = _digest(make_trace())
    code = ("from kvshm.demo.trace import make_trace; import hashlib; t = make_trace(); "
            "print(hashlib.sha256(repr((t.system_prompt, t.conversations, t.order))"
            ".encode()).hexdigest())")
    there = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True, env={"PYTHONHASHSEED": "123"}).stdout.strip()
    assert here == there == _digest(make_trace(seed=0))
    assert _digest(make_trace(seed=1)) != here


def test_full_trace_sizes_and_order() -> None:
    trace = make_trace()
    assert len(trace.system_prompt) == 256 and trace.reply_tokens == 32
    assert len(trace.conversations) == 16
    for conv in trace.conversations:
        assert conv.num_turns == 4
        assert 512 <= len(conv.user_turns[0]) <= 1024
        assert all(64 <= len(turn) <= 256 for turn in conv.user_turns[1:])
        assert all(0 <= t < 1024 for turn in conv.user_turns for t in turn)
    lengths = [len(c.user_turns[0]) for c in trace.conversations]
    assert len(set(lengths)) > 8  # really drawn, not constant
    assert list(trace)[:17] == [TurnRef(c, 0) for c in range(16)] + [TurnRef(0, 1)]
    assert sorted(trace.order) == sorted({TurnRef(c, t) for c in range(16) for t in range(4)})
    assert 70_000 <= trace.total_prompt_tokens() <= 95_000
    ref = TurnRef(3, 2)
    conv = trace.conversations[3]
    assert trace.prompt_length(ref) == (256 + len(conv.user_turns[0]) + len(conv.user_turns[1])
                                        + len(conv.user_turns[2]) + 2 * 32)
    blocks = trace.distinct_blocks(16)
    assert 16 + 16 * 70 < blocks < 16 + 16 * 130


def test_quick_trace_and_overrides() -> None:
    quick = make_trace(quick=True)
    assert len(quick.conversations) == QUICK.conversations == 4
    assert all(c.num_turns == 3 for c in quick.conversations)
    assert len(quick.order) == 12
    assert quick.total_prompt_tokens() < 4_000
    small = make_trace(conversations=2, turns=2)
    assert len(small.order) == 4 and small.system_prompt == make_trace().system_prompt
    with pytest.raises(ConfigError):
        make_trace(conversations=0)
