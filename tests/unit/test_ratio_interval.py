"""``tools.ratio_interval``: the paired bootstrap behind ``tools.bench_e2e``'s ratio
intervals. The pairing is the point: a kvshm TTFT 10 % under vLLM's on every request
is a ratio of exactly 1.1 however the requests are redrawn, although the TTFTs
themselves span 2 to 200 ms; resampling the two arms independently would report a wide
interval there (asserted below, so a broken pairing fails)."""

from __future__ import annotations

import random
import statistics

import pytest

from tools.ratio_interval import paired_ratio_interval


def _spread_ttfts(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(0.002, 0.2) for _ in range(n)]


def test_a_constant_per_request_ratio_has_a_point_interval_whatever_the_spread() -> None:
    kvshm = _spread_ttfts(128, 1)
    vllm = [t * 1.1 for t in kvshm]
    for stat in (statistics.fmean, statistics.median):
        lo, hi = paired_ratio_interval(vllm, kvshm, stat)
        assert lo == pytest.approx(1.1) and hi == pytest.approx(1.1)


def test_unpaired_redraws_of_the_same_lists_would_be_wide() -> None:
    """The contrast the module docstring draws: drawing each arm's requests on their own
    gives a wide interval for the same data (what the pairing removes)."""
    kvshm = _spread_ttfts(128, 1)
    vllm = [t * 1.1 for t in kvshm]
    rng = random.Random(0)
    ratios = sorted(statistics.fmean(rng.choices(vllm, k=128))
                    / statistics.fmean(rng.choices(kvshm, k=128)) for _ in range(1000))
    assert ratios[50] < 1.0 < 1.2 < ratios[950]


def test_a_noisy_ratio_brackets_its_point_estimate_and_repeats_with_the_seed() -> None:
    rng = random.Random(7)
    kvshm = _spread_ttfts(200, 2)
    vllm = [t * rng.uniform(0.8, 1.2) for t in kvshm]
    point = statistics.fmean(vllm) / statistics.fmean(kvshm)
    lo, hi = paired_ratio_interval(vllm, kvshm)
    assert lo < point < hi and hi - lo < 0.2
    assert paired_ratio_interval(vllm, kvshm) == (lo, hi)
    assert paired_ratio_interval(vllm, kvshm, seed=1) != (lo, hi)
    wider = paired_ratio_interval(vllm, kvshm, level=0.99)
    assert wider[0] <= lo and wider[1] >= hi


@pytest.mark.parametrize(("num", "den", "kw"), [
    ([], [], {}), ([1.0], [1.0, 2.0], {}), ([1.0], [1.0], {"level": 1.0}),
    ([1.0], [1.0], {"draws": 0}),
])
def test_bad_arguments_are_refused(num: list[float], den: list[float],
                                   kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        paired_ratio_interval(num, den, **kw)  # type: ignore[arg-type]
