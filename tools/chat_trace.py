"""A deterministic multi-turn chat trace, and the offline limits of a CPU tier on it.

The trace (:func:`chat_trace`): ``conversations`` conversations of ``turns`` turns each.
Every conversation starts with one shared system prompt (``system_tokens`` tokens, the
same in every conversation). A turn's prompt is the conversation's whole history -- the
system prompt, every earlier user message and every earlier answer -- plus a new user
message of ``user_tokens`` tokens (uniform in the closed range); its answer is
``answer_tokens`` tokens (uniform). Tokens are ids in ``[4, vocab)`` drawn from
``random.Random(seed)``, so two conversations share exactly the system prompt and a
conversation's turn ``t + 1`` starts with every token of its turn ``t`` (prompt and
answer): its full blocks repeat.

Interleaving: conversation ``c`` opens at time ``c * arrival_gap``; each later turn comes
a think time after the one before, gamma-distributed with mean ``think`` and shape
``think_shape`` (1 is exponential; larger is more regular: the coefficient of variation
is ``1 / sqrt(think_shape)``). The turns are sorted by time, so about
``think / arrival_gap`` other turns come between two turns of one conversation, spread
rather than a fixed round robin. One request at a time, in that order. Defaults: 64
conversations x 6 turns, 16-token blocks, system prompt 512 tokens, user messages 32-256,
answers 64-384, ``arrival_gap`` 1, ``think`` 64, ``think_shape`` 8: every conversation is
open at once, a conversation comes back after about 64 other turns (+-35 %); about 8.8k
distinct full blocks. With a 256-block GPU pool and a CPU tier of half the distinct
blocks, LRU keeps 0.47 of the unbounded tier's hit tokens and Belady 0.91 (the regime
issue 15 measured vLLM's CPU offload in: 0.466).

The offline model of the GPU side (:func:`gpu_accesses`): a vLLM-like GPU prefix cache of
``gpu_blocks`` blocks (a request's blocks are freed tail-first when it finishes and the
least recently freed are reused first; the GPU hit is the longest cached prefix, capped
so one prompt token is computed). It turns the trace into one :class:`CpuAccess` per
turn: the block hashes the CPU tier is asked for (after the GPU hit) and the ones the
turn then offers it (every full block of prompt and answer after the GPU hit).

``hit_fraction`` (:func:`hit_fraction`): the CPU-tier hit tokens of a run divided by the
CPU-tier hit tokens an *unbounded* CPU tier gets on the same trace with the same GPU pool
(:func:`unbounded_hit_tokens`). 1.0 is every reusable token kept; the offline optimum at
a given capacity is :func:`belady_hit_tokens` (Belady's MIN: on insertion into a full
tier, drop whichever of the cached blocks and the new one is next used furthest in the
future; a block never used again is not admitted). A hit is the longest run of the asked
hashes that the tier holds, from the first one, as in kvshm's and vLLM's lookups.

API (stable): :class:`Turn`, :func:`chat_trace`, :func:`distinct_blocks`,
:class:`CpuAccess`, :func:`gpu_accesses`, :func:`unbounded_hit_tokens`,
:func:`belady_hit_tokens`, :func:`belady_hit_fraction`, :func:`hit_fraction`.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from kvshm.hashing import BlockHash, chain_hashes

__all__ = ["CpuAccess", "Turn", "belady_hit_fraction", "belady_hit_tokens", "chat_trace",
           "distinct_blocks", "gpu_accesses", "hit_fraction", "unbounded_hit_tokens"]

_NEVER = 1 << 62


@dataclass(frozen=True, eq=False)
class Turn:
    """One request: ``prompt`` (history + new user message) and the ``answer`` it
    generates (the next turn's prompt starts with ``prompt + answer``)."""

    req_id: str
    conversation: int
    turn: int
    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    block_size: int = field(default=16, repr=False)

    @property
    def tokens(self) -> tuple[int, ...]:
        """Prompt then answer: every token whose KV the turn leaves behind."""
        return self.prompt + self.answer

    @cached_property
    def block_hashes(self) -> list[BlockHash]:
        """kvshm's chained hashes of every full block of :attr:`tokens`."""
        return chain_hashes(self.tokens, self.block_size)

    @property
    def prompt_blocks(self) -> int:
        """Full blocks of the prompt (its hashes are ``block_hashes[:prompt_blocks]``)."""
        return len(self.prompt) // self.block_size


def chat_trace(conversations: int = 64, turns: int = 6, block_size: int = 16, seed: int = 0,
               *, system_tokens: int = 512, user_tokens: tuple[int, int] = (32, 256),
               answer_tokens: tuple[int, int] = (64, 384), arrival_gap: float = 1.0,
               think: float = 64.0, think_shape: float = 8.0,
               vocab: int = 32000) -> list[Turn]:
    """The trace of the module docstring, in arrival order (deterministic in every
    argument)."""
    if conversations < 1 or turns < 1 or block_size < 1:
        raise ValueError("conversations, turns and block_size must be >= 1")
    rng = random.Random(seed)

    def words(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(4, vocab) for _ in range(n))

    system = words(system_tokens)
    timed: list[tuple[float, int, int, Turn]] = []
    for c in range(conversations):
        history = system
        t_at = c * arrival_gap
        for t in range(turns):
            if t:
                t_at += rng.gammavariate(think_shape, think / think_shape) if think > 0 else 0.0
            prompt = history + words(rng.randint(*user_tokens))
            answer = words(rng.randint(*answer_tokens))
            timed.append((t_at, c, t, Turn(f"c{c:03d}t{t}", c, t, prompt, answer, block_size)))
            history = prompt + answer
    timed.sort(key=lambda x: (x[0], x[1], x[2]))
    return [x[3] for x in timed]


def distinct_blocks(trace: Sequence[Turn]) -> int:
    """Distinct full blocks (hashes) over every turn's prompt and answer."""
    return len({h for t in trace for h in t.block_hashes})


@dataclass(frozen=True)
class CpuAccess:
    """One turn as the CPU tier sees it: ``lookup`` the hashes it is asked for in prefix
    order (after the GPU hit, up to the one-token cap), ``offered`` the hashes the turn
    then offers for storing (every full block after the GPU hit, answer included)."""

    req_id: str
    lookup: tuple[BlockHash, ...]
    offered: tuple[BlockHash, ...]


def gpu_accesses(trace: Sequence[Turn], gpu_blocks: int) -> list[CpuAccess]:
    """The trace through the module docstring's vLLM-like GPU prefix cache."""
    free: dict[BlockHash, None] = {}  # cached free blocks, least recently freed first
    n_uncached = gpu_blocks  # uncached free blocks: always reused before cached ones
    out: list[CpuAccess] = []
    for t in trace:
        hs = t.block_hashes
        cap = (len(t.prompt) - 1) // t.block_size
        g = 0
        while g < cap and hs[g] in free:
            g += 1
        for h in hs[:g]:  # the GPU hit: touched, out of the free queue while it runs
            del free[h]
        need = -(-len(t.tokens) // t.block_size) - g
        if need > n_uncached + len(free):
            raise ValueError(f"{t.req_id} needs {need + g} GPU blocks, pool has {gpu_blocks}")
        for _ in range(need):
            if n_uncached:
                n_uncached -= 1
            else:
                del free[next(iter(free))]
        out.append(CpuAccess(t.req_id, tuple(hs[g:cap]), tuple(hs[g:])))
        # finished: every block freed tail-first; a block whose hash another free block
        # already carries, and the partial last block, are uncached
        n_uncached += need + g
        for h in reversed(hs):
            if h in free:
                del free[h]
            else:
                n_uncached -= 1
            free[h] = None
        assert n_uncached + len(free) == gpu_blocks
    return out


def unbounded_hit_tokens(accesses: Sequence[CpuAccess], block_size: int) -> int:
    """CPU-tier hit tokens with a tier that never evicts."""
    held: set[BlockHash] = set()
    hits = 0
    for a in accesses:
        for h in a.lookup:
            if h not in held:
                break
            hits += 1
        held.update(a.offered)
    return hits * block_size


def belady_hit_tokens(accesses: Sequence[CpuAccess], capacity: int, block_size: int) -> int:
    """CPU-tier hit tokens of Belady's MIN with ``capacity`` blocks (module docstring).
    Ties on the next use evict the block offered latest (the deeper one)."""
    uses: dict[BlockHash, list[int]] = {}
    for i, a in enumerate(accesses):
        for h in a.lookup:
            uses.setdefault(h, []).append(i)
    ptr: dict[BlockHash, int] = {}

    def next_use(h: BlockHash, now: int) -> int:
        lst = uses.get(h)
        if not lst:
            return _NEVER
        k = ptr.get(h, 0)
        while k < len(lst) and lst[k] <= now:
            k += 1
        ptr[h] = k
        return lst[k] if k < len(lst) else _NEVER

    held: dict[BlockHash, int] = {}  # hash -> its next use as last pushed
    heap: list[tuple[int, int, BlockHash]] = []  # (-next use, -seq, hash), lazy
    seq = 0
    hits = 0
    for i, a in enumerate(accesses):
        n = 0
        for h in a.lookup:
            if h not in held:
                break
            n += 1
        hits += n
        for h in a.lookup[:n]:
            nu = next_use(h, i)
            held[h] = nu
            seq += 1
            heapq.heappush(heap, (-nu, -seq, h))
        for h in a.offered:
            if h in held:
                continue
            nu = next_use(h, i)
            if nu == _NEVER:
                continue
            if len(held) >= capacity:
                while True:
                    neg, _, victim = heap[0]
                    if held.get(victim) == -neg:
                        break
                    heapq.heappop(heap)
                if -neg <= nu:
                    continue  # the new block is the one used furthest: not admitted
                heapq.heappop(heap)
                del held[victim]
            held[h] = nu
            seq += 1
            heapq.heappush(heap, (-nu, -seq, h))
    return hits * block_size


def belady_hit_fraction(trace: Sequence[Turn], *, gpu_blocks: int, cpu_blocks: int) -> float:
    """Belady's hit tokens over the unbounded tier's, through :func:`gpu_accesses`."""
    acc = gpu_accesses(trace, gpu_blocks)
    bs = trace[0].block_size
    return hit_fraction(belady_hit_tokens(acc, cpu_blocks, bs), unbounded_hit_tokens(acc, bs))


def hit_fraction(hit_tokens: int, unbounded_tokens: int) -> float:
    """CPU-tier hit tokens over an unbounded CPU tier's on the same trace and GPU pool
    (1.0 when the unbounded tier hits nothing either)."""
    return hit_tokens / unbounded_tokens if unbounded_tokens else 1.0
