"""How far a ratio of two arms' TTFT statistics could move by chance: a paired bootstrap.

The end-to-end benchmark (:mod:`tools.bench_e2e`) sends every request to every arm, so
its arms' TTFT lists are *paired*: entry i of each is the same prompt. A ratio such as
vLLM's mean TTFT over kvshm's rests on a hundred-odd requests whose TTFTs span two
orders of magnitude; on this project's shared 2-core machines one slow request moves it
by a percent or more. :func:`paired_ratio_interval` redraws the requests with
replacement (the same draw for both arms, so the pairing holds) and reports the central
``level`` share of the redrawn ratios: a 0.98 whose interval is [0.95, 1.01] is parity,
not a loss.

Deterministic: the draws come from ``random.Random(seed)``, so a run's JSON repeats.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence

__all__ = ["paired_ratio_interval"]

Stat = Callable[[Sequence[float]], float]


def paired_ratio_interval(num: Sequence[float], den: Sequence[float], stat: Stat = statistics.fmean,
                          *, draws: int = 1000, level: float = 0.9,
                          seed: int = 0) -> tuple[float, float]:
    """``(lo, hi)``: the central ``level`` share of ``stat(num') / stat(den')`` over
    ``draws`` redraws of the request indices with replacement (``num'`` and ``den'``
    take the same indices). ``num`` and ``den`` are paired (same length, at least one
    entry); ``stat`` of a redrawn ``den`` must be positive."""
    n = len(num)
    if n == 0 or len(den) != n:
        raise ValueError(f"paired lists needed, got {n} and {len(den)} entries")
    if not 0 < level < 1 or draws < 1:
        raise ValueError(f"level must be in (0, 1) and draws >= 1: {level}, {draws}")
    rng = random.Random(seed)
    idx = range(n)
    ratios = sorted(stat([num[i] for i in pick]) / stat([den[i] for i in pick])
                    for pick in (rng.choices(idx, k=n) for _ in range(draws)))
    tail = (1 - level) / 2
    lo = ratios[int(tail * (draws - 1))]
    hi = ratios[int(round((1 - tail) * (draws - 1)))]
    return lo, hi
