"""Deterministic serving workloads: token-id prompts per request, in arrival order.

One module for every benchmark that needs the same traffic: ``tools.bench_evict``
replays these through the CPU tier, and an end-to-end benchmark can feed the same
prompts to a serving engine (``prompt`` as token ids, ``len(answer)`` as the number of
tokens to generate). Every workload is a pure function of its parameters and ``seed``
(``random.Random(seed)``; token ids in ``[4, vocab)``), so two runs, or two processes,
build the same requests. A request is a :class:`tools.chat_trace.Turn`: ``req_id``,
``conversation`` (its session: a conversation, an agent run, or the request itself),
``turn`` (its step in that session), ``prompt``, ``answer`` (the tokens the trace says
the model answered; a later request of the session starts with ``prompt + answer``).

The workloads (:data:`WORKLOADS`, each ``name -> generator``; defaults below, ``scale``
multiplies the request or session counts, for quick tests):

* ``chat``: multi-turn conversations. Conversations open as a Poisson process (mean
  gap 1); each has a geometric number of turns (mean 5, at most 16: a conversation goes
  on with probability 0.8 after each turn, so a long history says nothing about the
  end); one of two system prompts (384 tokens); user messages 16-256 tokens, answers
  32-512; exponential think time (mean 48) between turns. 128 conversations.
* ``chat_sync``: the regime ``depth_aged`` was tuned in (issue 15; the trace of
  :func:`tools.chat_trace.chat_trace`'s defaults, drawn here): 64 conversations opening
  one per time unit, so all are open at once, exactly 6 turns each, one 512-token
  system prompt, user messages 32-256, answers 64-384, gamma think time (mean 64, shape
  8: regular), so a conversation comes back after about 64 other turns.
* ``rag``: retrieval-augmented questions over a shared corpus of 128 documents
  (256-1536 tokens), popularity Zipf(1.1) by rank. A prompt is a system prompt (128
  tokens), one document, a second one with probability 0.3 (drawn the same way), and a
  question (24-128 tokens); the answer is 32-256 tokens. Only a prefix repeats: the same
  first document (and the same second one after it). 640 requests, Poisson arrivals.
* ``agentic``: agent sessions with long tool outputs. Three agent types, each with its
  own system prompt and tool descriptions (1024-2048 tokens); a session's task is
  64-384 tokens; each step the model emits an action (32-192 tokens) and the tool
  answers with a lognormal output (median 384, sigma 0.9, 32-4096 tokens) appended to
  the next prompt; a session goes on with probability 0.85 per step (at most 16 steps)
  and stops once its context would pass 12k tokens; steps of one session come an
  exponential time apart (mean 8, the tool's latency). 40 sessions, opening with mean
  gap 4.
* ``fewshot``: few-shot classification. 24 templates (an instruction of 64-192 tokens
  and 8-24 worked examples of 48-192 tokens each), popularity Zipf(0.9); a query of
  16-192 tokens and an answer of 4-48. 900 requests, Poisson arrivals.
* ``scan``: ``fewshot`` with three bursts of 16 one-off long prompts each (documents of
  1536-6144 tokens never seen again, answers 16-64 tokens) at 25 %, 50 % and 75 % of the
  trace: a scan the tier should not let flush the templates.

Arrival times (``Workload.arrivals``) are in abstract units (the Poisson gaps above);
the CPU-tier bench uses only their order, an end-to-end driver may scale them to
seconds.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from tools.chat_trace import Turn

__all__ = ["WORKLOADS", "Workload", "agentic", "chat", "chat_sync", "fewshot", "make", "rag",
           "scan"]

VOCAB = 32000


@dataclass(frozen=True, eq=False)
class Workload:
    """A named, seeded request list in arrival order (``arrivals[i]`` is the time of
    ``requests[i]``; non-decreasing) and the parameters that built it."""

    name: str
    seed: int
    params: dict[str, object]
    requests: list[Turn]
    arrivals: list[float] = field(repr=False)

    def describe(self) -> dict[str, object]:
        """Name, seed, parameters and sizes (requests, prompt tokens): for a JSON report."""
        return {"name": self.name, "seed": self.seed, "params": self.params,
                "requests": len(self.requests),
                "prompt_tokens": sum(len(r.prompt) for r in self.requests),
                "max_tokens": max(len(r.tokens) for r in self.requests)}


class _Gen:
    """The random source of one workload: token runs and the distributions used."""

    def __init__(self, seed: int, vocab: int) -> None:
        if vocab <= 4:
            raise ValueError(f"vocab must be > 4, got {vocab}")
        self.rng = random.Random(seed)
        self.vocab = vocab

    def words(self, lo: int, hi: int | None = None) -> tuple[int, ...]:
        """A fresh run of ``lo`` tokens (uniform in ``[lo, hi]`` when ``hi`` is given)."""
        n = lo if hi is None else self.rng.randint(lo, hi)
        r = self.rng.randrange
        return tuple(r(4, self.vocab) for _ in range(n))

    def zipf_weights(self, n: int, s: float) -> list[float]:
        return [1.0 / (k + 1) ** s for k in range(n)]

    def pick(self, weights: list[float]) -> int:
        return self.rng.choices(range(len(weights)), weights)[0]

    def gap(self, mean: float) -> float:
        return self.rng.expovariate(1.0 / mean) if mean > 0 else 0.0


def _scaled(n: int, scale: float) -> int:
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    return max(2, round(n * scale))


def _ordered(name: str, seed: int, params: dict[str, object],
             timed: list[tuple[float, int, int, Turn]]) -> Workload:
    timed.sort(key=lambda x: (x[0], x[1], x[2]))
    return Workload(name, seed, params, [x[3] for x in timed], [x[0] for x in timed])


def _chat(name: str, seed: int, n_conv: int, block_size: int, vocab: int, *,
          systems: int, system_tokens: int, p_continue: float, max_turns: int,
          user: tuple[int, int], answer: tuple[int, int], think: float,
          think_shape: float, arrival_gap: float, poisson: bool) -> Workload:
    params: dict[str, object] = {
        "conversations": n_conv, "systems": systems, "system_tokens": system_tokens,
        "p_continue": p_continue, "max_turns": max_turns, "user_tokens": list(user),
        "answer_tokens": list(answer), "think_mean": think, "think_shape": think_shape,
        "arrival_gap": arrival_gap, "poisson_arrivals": poisson}
    g = _Gen(seed, vocab)
    prompts = [g.words(system_tokens) for _ in range(systems)]
    timed: list[tuple[float, int, int, Turn]] = []
    t_open = 0.0
    for c in range(n_conv):
        t_open = t_open + g.gap(arrival_gap) if poisson else c * arrival_gap
        history = prompts[g.rng.randrange(systems)]
        at = t_open
        for t in range(max_turns):
            if t:
                if g.rng.random() >= p_continue:
                    break
                at += g.rng.gammavariate(think_shape, think / think_shape)
            prompt = history + g.words(*user)
            ans = g.words(*answer)
            timed.append((at, c, t, Turn(f"{name}{c:04d}t{t:02d}", c, t, prompt, ans,
                                         block_size)))
            history = prompt + ans
    return _ordered(name, seed, params, timed)


def chat(seed: int = 0, *, scale: float = 1.0, block_size: int = 16,
         vocab: int = VOCAB) -> Workload:
    """Multi-turn chat, conversations opening and ending all along (module docstring)."""
    return _chat("chat", seed, _scaled(128, scale), block_size, vocab, systems=2,
                 system_tokens=384, p_continue=0.8, max_turns=16, user=(16, 256),
                 answer=(32, 512), think=48.0, think_shape=1.0, arrival_gap=1.0,
                 poisson=True)


def chat_sync(seed: int = 0, *, scale: float = 1.0, block_size: int = 16,
              vocab: int = VOCAB) -> Workload:
    """Multi-turn chat with every conversation open at once (module docstring)."""
    return _chat("chat_sync", seed, _scaled(64, scale), block_size, vocab, systems=1,
                 system_tokens=512, p_continue=1.0, max_turns=6, user=(32, 256),
                 answer=(64, 384), think=64.0, think_shape=8.0, arrival_gap=1.0,
                 poisson=False)


def rag(seed: int = 0, *, scale: float = 1.0, block_size: int = 16,
        vocab: int = VOCAB) -> Workload:
    """RAG over shared documents with Zipf popularity (module docstring)."""
    n_req = _scaled(640, scale)
    params: dict[str, object] = {
        "requests": n_req, "documents": 128, "doc_tokens": [256, 1536], "zipf_s": 1.1,
        "p_second_doc": 0.3, "system_tokens": 128, "question_tokens": [24, 128],
        "answer_tokens": [32, 256], "arrival_gap_mean": 1.0}
    g = _Gen(seed, vocab)
    system = g.words(128)
    docs = [g.words(256, 1536) for _ in range(128)]
    w = g.zipf_weights(128, 1.1)
    timed: list[tuple[float, int, int, Turn]] = []
    at = 0.0
    for i in range(n_req):
        at += g.gap(1.0)
        prompt = system + docs[g.pick(w)]
        if g.rng.random() < 0.3:
            prompt += docs[g.pick(w)]
        prompt += g.words(24, 128)
        timed.append((at, i, 0, Turn(f"rag{i:05d}", i, 0, prompt, g.words(32, 256),
                                     block_size)))
    return _ordered("rag", seed, params, timed)


def agentic(seed: int = 0, *, scale: float = 1.0, block_size: int = 16,
            vocab: int = VOCAB) -> Workload:
    """Agent sessions with long tool outputs (module docstring)."""
    n_sess = _scaled(40, scale)
    max_ctx = 12288
    params: dict[str, object] = {
        "sessions": n_sess, "agent_types": 3, "system_tokens": [1024, 2048],
        "task_tokens": [64, 384], "action_tokens": [32, 192],
        "tool_tokens_lognormal": {"median": 384, "sigma": 0.9, "min": 32, "max": 4096},
        "p_continue": 0.85, "max_steps": 16, "max_context": max_ctx, "step_gap_mean": 8.0,
        "session_gap_mean": 4.0}
    g = _Gen(seed, vocab)
    systems = [g.words(1024, 2048) for _ in range(3)]
    timed: list[tuple[float, int, int, Turn]] = []
    t_open = 0.0
    for s in range(n_sess):
        t_open += g.gap(4.0)
        prompt = systems[g.rng.randrange(3)] + g.words(64, 384)
        at = t_open
        for step in range(16):
            action = g.words(32, 192)
            timed.append((at, s, step, Turn(f"agent{s:03d}s{step:02d}", s, step, prompt,
                                            action, block_size)))
            tool_n = min(4096, max(32, round(384 * math.exp(g.rng.gauss(0.0, 0.9)))))
            nxt = prompt + action + g.words(tool_n)
            if g.rng.random() >= 0.85 or len(nxt) + 192 > max_ctx:
                break
            prompt = nxt
            at += g.gap(8.0)
    return _ordered("agentic", seed, params, timed)


def _fewshot_parts(g: _Gen) -> tuple[list[tuple[int, ...]], list[float]]:
    templates = []
    for _ in range(24):
        t = g.words(64, 192)
        for _ in range(g.rng.randint(8, 24)):
            t += g.words(48, 192)
        templates.append(t)
    return templates, g.zipf_weights(24, 0.9)


_FEWSHOT_PARAMS: dict[str, object] = {
    "templates": 24, "instruction_tokens": [64, 192], "examples": [8, 24],
    "example_tokens": [48, 192], "zipf_s": 0.9, "query_tokens": [16, 192],
    "answer_tokens": [4, 48], "arrival_gap_mean": 1.0}


def fewshot(seed: int = 0, *, scale: float = 1.0, block_size: int = 16,
            vocab: int = VOCAB) -> Workload:
    """Few-shot prompts over shared templates (module docstring)."""
    n_req = _scaled(900, scale)
    g = _Gen(seed, vocab)
    templates, w = _fewshot_parts(g)
    timed: list[tuple[float, int, int, Turn]] = []
    at = 0.0
    for i in range(n_req):
        at += g.gap(1.0)
        prompt = templates[g.pick(w)] + g.words(16, 192)
        timed.append((at, i, 0, Turn(f"fs{i:05d}", i, 0, prompt, g.words(4, 48),
                                     block_size)))
    return _ordered("fewshot", seed, {"requests": n_req, **_FEWSHOT_PARAMS}, timed)


def scan(seed: int = 0, *, scale: float = 1.0, block_size: int = 16,
         vocab: int = VOCAB) -> Workload:
    """``fewshot`` with bursts of one-off long prompts (module docstring)."""
    n_req = _scaled(900, scale)
    burst = _scaled(16, scale)
    g = _Gen(seed, vocab)
    templates, w = _fewshot_parts(g)
    timed: list[tuple[float, int, int, Turn]] = []
    at = 0.0
    starts = {n_req * k // 4 for k in (1, 2, 3)}
    n_scan = 0
    for i in range(n_req):
        if i in starts:
            for _ in range(burst):
                at += g.gap(0.25)
                sid = n_req + n_scan
                timed.append((at, sid, 0, Turn(f"scan{n_scan:04d}", sid, 0,
                                               g.words(1536, 6144), g.words(16, 64),
                                               block_size)))
                n_scan += 1
        at += g.gap(1.0)
        prompt = templates[g.pick(w)] + g.words(16, 192)
        timed.append((at, i, 0, Turn(f"fs{i:05d}", i, 0, prompt, g.words(4, 48),
                                     block_size)))
    params: dict[str, object] = {"requests": n_req, **_FEWSHOT_PARAMS, "bursts": 3,
                                 "burst_prompts": burst, "scan_tokens": [1536, 6144],
                                 "scan_answer_tokens": [16, 64], "scan_gap_mean": 0.25}
    return _ordered("scan", seed, params, timed)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "chat": chat, "chat_sync": chat_sync, "rag": rag, "agentic": agentic, "fewshot": fewshot,
    "scan": scan}
"""Every workload by name, in the order the bench reports them."""


def make(name: str, seed: int = 0, *, scale: float = 1.0, block_size: int = 16,
         vocab: int = VOCAB) -> Workload:
    """The workload ``name`` (:data:`WORKLOADS`); ValueError for an unknown name."""
    try:
        gen = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}") from None
    return gen(seed, scale=scale, block_size=block_size, vocab=vocab)
