"""Confidence intervals for measured figures, so that two recipes are compared with their noise.

    lo, hi = ratio_interval(accepted, steps, offset=1.0)  # 1 + sum(a)/sum(s), prompts resampled
    group = replicates(values)       # seeds as replicates: mean, sd, interval of the mean
    overlap((lo1, hi1), (lo2, hi2))  # True: the difference is inside the noise
    d, lo, hi = paired_ratio_difference(a1, s1, a2, s2)  # two drafts on the same prompts

Prompts are the unit of a bootstrap (scipy.stats.bootstrap, percentile method, fixed seed): an
acceptance length is a ratio of sums over prompts, so resampling prompts and recomputing that
ratio gives an interval for the very figure reported. Seeds are replicates of a whole run: their
mean gets a Student-t interval (n is 3 to 5, too few to bootstrap).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

LEVEL = 0.95
RESAMPLES = 2000


def ratio_interval(
    num: Sequence[float], den: Sequence[float], offset: float = 0.0, level: float = LEVEL
) -> tuple[float, float]:
    """`level` interval of offset + sum(num)/sum(den), resampling the (num, den) pairs."""
    import numpy as np

    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if len(a) < 2 or b.sum() <= 0:
        value = offset + (a.sum() / b.sum() if b.sum() > 0 else math.nan)
        return value, value

    def stat(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        total = y.sum(axis=axis)
        return offset + x.sum(axis=axis) / np.where(total > 0, total, np.nan)

    return _paired_bootstrap((a, b), stat, level)


def _paired_bootstrap(arrays: Sequence[Any], stat: Any, level: float) -> tuple[float, float]:
    """The `level` percentile interval of `stat` over prompts resampled together across
    `arrays` (a fixed seed: the same data give the same interval)."""
    import numpy as np
    from scipy.stats import bootstrap

    res = bootstrap(
        tuple(arrays),
        stat,
        paired=True,
        vectorized=True,
        n_resamples=RESAMPLES,
        confidence_level=level,
        method="percentile",
        rng=np.random.default_rng(0),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


@dataclass(frozen=True)
class Replicates:
    n: int
    mean: float
    sd: float
    lo: float
    hi: float


def replicates(values: Sequence[float], level: float = LEVEL) -> Replicates:
    """Mean of replicate runs (seeds) with the sample sd and a Student-t interval of the mean."""
    from scipy.stats import t

    vals = [float(v) for v in values]
    n = len(vals)
    mean = sum(vals) / n
    if n < 2:
        return Replicates(n, mean, math.nan, math.nan, math.nan)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    half = float(t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return Replicates(n, mean, sd, mean - half, mean + half)


def paired_ratio_difference(
    num_a: Sequence[float],
    den_a: Sequence[float],
    num_b: Sequence[float],
    den_b: Sequence[float],
    level: float = LEVEL,
) -> tuple[float, float, float]:
    """sum(num_a)/sum(den_a) - sum(num_b)/sum(den_b) and its `level` interval, each resample
    taking the same prompts for both (two drafts served the same prompts: what one prompt makes
    easy for one it makes easy for the other, and pairing removes that from the noise)."""
    import numpy as np

    arrays = [np.asarray(x, dtype=float) for x in (num_a, den_a, num_b, den_b)]
    value = arrays[0].sum() / arrays[1].sum() - arrays[2].sum() / arrays[3].sum()
    if len(arrays[0]) < 2:
        return float(value), float(value), float(value)

    def stat(a, b, c, d, axis: int = -1):
        return a.sum(axis=axis) / b.sum(axis=axis) - c.sum(axis=axis) / d.sum(axis=axis)

    lo, hi = _paired_bootstrap(arrays, stat, level)
    return float(value), lo, hi


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two intervals share a point: their difference is not shown to be real."""
    return a[0] <= b[1] and b[0] <= a[1]
