"""The fixed, seeded multi-turn chat trace that ``kvshm demo`` replays.

A trace holds only what users type: a system prompt shared by every conversation and
each conversation's user turns. Replies (``reply_tokens`` each) are generated greedily by
the model at replay time and appended by the driver, so the prompt of turn ``t`` is::

    system_prompt + user[0] + reply[0] + user[1] + reply[1] + ... + user[t]

Replay order (``ChatTrace.order``) is round-robin, turn by turn: turn 0 of every
conversation, then turn 1 of every conversation, and so on. Between two turns of one
conversation every other conversation runs a turn, so a device pool holding a fraction
of the trace's blocks has evicted a conversation's history by the time it comes back:
the CPU tier decides whether that history is loaded or recomputed.

Determinism: tokens come only from ``random.Random(seed).random()``, whose sequence
Python guarantees across versions and platforms; this module does not import torch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from kvshm.errors import ConfigError

__all__ = ["ChatTrace", "Conversation", "TraceShape", "TurnRef", "FULL", "QUICK",
           "make_trace"]


@dataclass(frozen=True)
class TraceShape:
    """Token counts of a trace; ranges are inclusive ``(low, high)``."""

    conversations: int
    turns: int
    system_tokens: int
    first_user: tuple[int, int]
    later_user: tuple[int, int]
    reply_tokens: int

    def validate(self) -> None:
        """Raise ``ConfigError`` unless every count is sensible."""
        if self.conversations <= 0 or self.turns <= 0:
            raise ConfigError("a trace needs at least one conversation and one turn")
        if self.system_tokens < 0 or self.reply_tokens < 0:
            raise ConfigError("system_tokens and reply_tokens must be >= 0")
        for low, high in (self.first_user, self.later_user):
            if not 1 <= low <= high:
                raise ConfigError(f"user turn range ({low}, {high}) must satisfy 1 <= low <= high")


FULL = TraceShape(conversations=16, turns=4, system_tokens=256, first_user=(512, 1024),
                  later_user=(64, 256), reply_tokens=32)
"""The demo's trace: about 84k prompt tokens when every turn recomputes its history."""

QUICK = TraceShape(conversations=4, turns=3, system_tokens=64, first_user=(96, 160),
                   later_user=(24, 48), reply_tokens=8)
"""A short trace for tests and ``kvshm demo --quick``."""


class TurnRef(NamedTuple):
    """One step of the replay: turn ``turn`` of conversation ``conversation``."""

    conversation: int
    turn: int


@dataclass(frozen=True)
class Conversation:
    """One conversation: its index in the trace and its user turns' token ids."""

    index: int
    user_turns: tuple[tuple[int, ...], ...]

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)


@dataclass(frozen=True)
class ChatTrace:
    """A whole trace. ``order`` lists every ``(conversation, turn)`` exactly once, and
    turn ``t`` of a conversation always comes after its turn ``t - 1``."""

    seed: int
    shape: TraceShape
    vocab_size: int
    system_prompt: tuple[int, ...]
    conversations: tuple[Conversation, ...]
    order: tuple[TurnRef, ...]

    @property
    def reply_tokens(self) -> int:
        return self.shape.reply_tokens

    def prompt_length(self, ref: TurnRef) -> int:
        """Tokens in the prompt of ``ref`` (system prompt, earlier turns and replies,
        this user turn), the replies counted at ``reply_tokens`` each."""
        conv = self.conversations[ref.conversation]
        earlier = sum(len(conv.user_turns[t]) for t in range(ref.turn))
        return (len(self.system_prompt) + earlier + ref.turn * self.reply_tokens
                + len(conv.user_turns[ref.turn]))

    def total_prompt_tokens(self) -> int:
        """Prompt tokens over the whole replay if every turn recomputed its history
        (the work of a run without any prefix cache; a progress-bar total)."""
        return sum(self.prompt_length(ref) for ref in self.order)

    def final_length(self, conversation: int) -> int:
        """Tokens of a conversation after its last reply."""
        conv = self.conversations[conversation]
        return self.prompt_length(TurnRef(conversation, conv.num_turns - 1)) + self.reply_tokens

    def distinct_blocks(self, block_size: int) -> int:
        """Full blocks the whole trace fills, the system prompt's full blocks counted
        once (they are shared); for sizing a device pool as a fraction of the trace."""
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        shared = len(self.system_prompt) // block_size
        return shared + sum(self.final_length(c.index) // block_size - shared
                            for c in self.conversations)

    def __iter__(self) -> Iterator[TurnRef]:
        return iter(self.order)


def _uniform(rng: random.Random, low: int, high: int) -> int:
    """An int in ``[low, high]`` from ``rng.random()`` alone (stable across versions)."""
    return min(high, low + int(rng.random() * (high - low + 1)))


def _tokens(rng: random.Random, count: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(min(vocab_size - 1, int(rng.random() * vocab_size)) for _ in range(count))


def round_robin(conversations: int, turns: int) -> tuple[TurnRef, ...]:
    """Turn 0 of every conversation, then turn 1 of every conversation, ..."""
    return tuple(TurnRef(c, t) for t in range(turns) for c in range(conversations))


def make_trace(seed: int = 0, *, conversations: int | None = None, turns: int | None = None,
               quick: bool = False, vocab_size: int = 1024) -> ChatTrace:
    """Build the trace. ``quick`` selects :data:`QUICK` instead of :data:`FULL`;
    ``conversations`` / ``turns`` override the shape's counts. The same arguments always
    give the same trace; draws happen in a fixed order (system prompt, then each
    conversation's turns in order)."""
    base = QUICK if quick else FULL
    shape = TraceShape(
        conversations=base.conversations if conversations is None else conversations,
        turns=base.turns if turns is None else turns,
        system_tokens=base.system_tokens, first_user=base.first_user,
        later_user=base.later_user, reply_tokens=base.reply_tokens)
    shape.validate()
    if vocab_size <= 0:
        raise ConfigError(f"vocab_size must be positive, got {vocab_size}")
    rng = random.Random(seed)
    system_prompt = _tokens(rng, shape.system_tokens, vocab_size)
    convs = []
    for index in range(shape.conversations):
        user_turns = []
        for turn in range(shape.turns):
            low, high = shape.first_user if turn == 0 else shape.later_user
            user_turns.append(_tokens(rng, _uniform(rng, low, high), vocab_size))
        convs.append(Conversation(index=index, user_turns=tuple(user_turns)))
    return ChatTrace(seed=seed, shape=shape, vocab_size=vocab_size,
                     system_prompt=system_prompt, conversations=tuple(convs),
                     order=round_robin(shape.conversations, shape.turns))
