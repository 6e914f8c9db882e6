"""tools/chat_trace: the trace's shape, and Belady and the unbounded tier on tiny cases."""

from __future__ import annotations

from tools.chat_trace import (
    CpuAccess,
    belady_hit_fraction,
    belady_hit_tokens,
    chat_trace,
    distinct_blocks,
    gpu_accesses,
    hit_fraction,
    unbounded_hit_tokens,
)


def test_trace_is_deterministic_and_each_turn_extends_the_last() -> None:
    a = chat_trace(conversations=4, turns=3, seed=1)
    b = chat_trace(conversations=4, turns=3, seed=1)
    assert [(t.req_id, t.prompt, t.answer) for t in a] == [
        (t.req_id, t.prompt, t.answer) for t in b]
    assert len(a) == 12 and len({t.req_id for t in a}) == 12
    by = {(t.conversation, t.turn): t for t in a}
    for (c, t), turn in by.items():
        assert turn.prompt[:512] == a[0].prompt[:512]  # the shared system prompt
        if t:
            prev = by[(c, t - 1)]
            assert turn.prompt[:len(prev.tokens)] == prev.tokens
            assert turn.block_hashes[:len(prev.block_hashes)] == prev.block_hashes
    # a conversation's turns keep their order in the trace
    for c in range(4):
        assert [t.turn for t in a if t.conversation == c] == [0, 1, 2]
    assert distinct_blocks(a) == len({h for t in a for h in t.block_hashes})


def h(i: int) -> bytes:
    return i.to_bytes(8, "little")


def test_belady_keeps_the_block_used_soonest_and_admits_nothing_unused() -> None:
    # capacity 1: 1 and 2 are offered; 2 is used next, 1 later, 3 never
    acc = [CpuAccess("r0", (), (h(1), h(2), h(3))),
           CpuAccess("r1", (h(2),), ()),
           CpuAccess("r2", (h(1),), ())]
    assert unbounded_hit_tokens(acc, 16) == 32
    assert belady_hit_tokens(acc, 1, 16) == 16
    assert belady_hit_tokens(acc, 2, 16) == 32
    # a hit is a prefix: once the first asked hash misses, nothing after it counts
    acc2 = [CpuAccess("r0", (), (h(2),)), CpuAccess("r1", (h(1), h(2)), ())]
    assert unbounded_hit_tokens(acc2, 16) == 0
    assert belady_hit_tokens(acc2, 4, 16) == 0


def test_gpu_model_and_fractions_on_a_small_trace() -> None:
    tr = chat_trace(conversations=8, turns=3, seed=2)
    acc = gpu_accesses(tr, 256)
    assert [a.req_id for a in acc] == [t.req_id for t in tr]
    ub = unbounded_hit_tokens(acc, 16)
    assert ub > 0
    d = distinct_blocks(tr)
    assert belady_hit_tokens(acc, d, 16) == ub
    small = belady_hit_fraction(tr, gpu_blocks=256, cpu_blocks=d // 8)
    assert 0 < small <= belady_hit_fraction(tr, gpu_blocks=256, cpu_blocks=d // 2) <= 1
    assert hit_fraction(0, 0) == 1.0
