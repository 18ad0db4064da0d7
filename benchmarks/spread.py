"""Side-by-side figures with their spread: a ratio's interval and a permutation p-value.

Benchmarks that compare two arms measured interleaved (vs_default.py, loaded_sweep.py) report
the ratio of their means with a 95% bootstrap interval (each arm resampled on its own) and the
exact two-sided permutation p-value of the difference in means (every split of the pooled
runs, or a seeded sample of them when there are too many).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics


def ratio_interval(treated: list[float], baseline: list[float], level: float = 0.95,
                   draws: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """mean(treated) / mean(baseline), and its bootstrap percentile interval."""
    rng = random.Random(seed)
    ratio = statistics.fmean(treated) / statistics.fmean(baseline)
    samples = sorted(
        statistics.fmean(rng.choices(treated, k=len(treated))) /
        statistics.fmean(rng.choices(baseline, k=len(baseline))) for _ in range(draws))
    tail = (1 - level) / 2
    return ratio, samples[int(tail * draws)], samples[min(draws - 1, int((1 - tail) * draws))]


def permutation_p(a: list[float], b: list[float], max_splits: int = 100_000,
                  seed: int = 0) -> float:
    """Two-sided p-value of mean(a) - mean(b) against every relabelling of the pooled runs."""
    pooled, n = [*a, *b], len(a)
    observed = abs(statistics.fmean(a) - statistics.fmean(b))
    total = sum(pooled)
    if math.comb(len(pooled), n) <= max_splits:
        splits = itertools.combinations(range(len(pooled)), n)
    else:
        rng = random.Random(seed)
        splits = (rng.sample(range(len(pooled)), n) for _ in range(max_splits))
    extreme = count = 0
    for chosen in splits:
        first = sum(pooled[i] for i in chosen)
        diff = abs(first / n - (total - first) / (len(pooled) - n))
        extreme += diff >= observed - 1e-12
        count += 1
    return extreme / count
