"""Statistics over seeds: what a setting's mean is worth, and whether one setting beats another.

- `estimate`: a group's mean, standard deviation and 95% bootstrap confidence interval of the mean over its seeds
  (scipy.stats.bootstrap, percentile method, each group resampled on its own: stratified by group). With 2-3 seeds
  the interval is about the seeds' range: it says how far apart the seeds fell, not where the mean would settle.
- `prob_improvement`: P(A better than B) over every (seed of A, seed of B) pair, ties counting a half (Agarwal et
  al. 2021's probability of improvement; the Mann-Whitney U statistic over n_A n_B).
- `verdict`: a winner is named only when the two intervals do not overlap; otherwise "not distinguishable at N
  seeds".

No report module or plotting library is imported here."""
import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
RESAMPLES = 9999


@dataclass(frozen=True)
class Estimate:
    """A group's finite values (one per seed), their mean, sd and the bootstrap interval of the mean (low and
    high are None for a single seed: one value has no spread to resample)."""

    values: tuple[float, ...]
    mean: float
    sd: float
    low: float | None
    high: float | None

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def has_interval(self) -> bool:
        return self.low is not None


def finite(values) -> list[float]:
    """The numbers among `values` (None, NaN and infinities dropped: a diverged run has no loss to average)."""
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def estimate(values, confidence: float = CONFIDENCE, seed: int = 0) -> Estimate | None:
    """None when no value is a number. The resampling is seeded, so a report is the same every time it is built."""
    xs = finite(values)
    if not xs:
        return None
    mean = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    if len(xs) == 1:
        return Estimate(tuple(xs), mean, sd, None, None)
    if min(xs) == max(xs):  # every seed the same: the interval is that value (bootstrap would warn)
        return Estimate(tuple(xs), mean, sd, mean, mean)
    ci = stats.bootstrap((np.asarray(xs),), np.mean, confidence_level=confidence, n_resamples=RESAMPLES,
                         method="percentile", rng=np.random.default_rng(seed)).confidence_interval
    return Estimate(tuple(xs), mean, sd, float(ci.low), float(ci.high))


def prob_improvement(a, b, higher_is_better: bool = True) -> float | None:
    """P(a seed of A does better than a seed of B) over all pairs, a tie counting 1/2: 1 when every A beats every
    B, 0.5 for identical groups. None when either has no value."""
    xs, ys = finite(a), finite(b)
    if not xs or not ys:
        return None
    if not higher_is_better:
        xs, ys = [-x for x in xs], [-y for y in ys]
    u = stats.mannwhitneyu(xs, ys, alternative="two-sided").statistic  # pairs x > y, plus half the ties
    return float(u) / (len(xs) * len(ys))


def overlap(a: Estimate, b: Estimate) -> bool:
    """Whether the two intervals share a point; a group without an interval (one seed) overlaps everything."""
    if not (a.has_interval and b.has_interval):
        return True
    return a.low <= b.high and b.low <= a.high


def seeds_phrase(a: Estimate, b: Estimate) -> str:
    return f"{a.n} seeds" if a.n == b.n else f"{a.n} and {b.n} seeds"


def verdict(best: Estimate, other: Estimate, better: str = "better") -> str:
    """"better" (or the given word) when the intervals are apart, else "not distinguishable at N seeds"."""
    return better if not overlap(best, other) else f"not distinguishable at {seeds_phrase(best, other)}"


def fmt(x: float | None, like: float | None = None) -> str:
    """Three decimals for scores and losses, whole numbers from 1000 up (params, bytes, tokens/s), three
    significant figures below 0.01 (so two small, different values never both read 0.000); `like`: the value
    whose size decides (a spread is written as its mean is)."""
    if x is None:
        return "–"
    size = abs(x if like is None else like)
    if size >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}" if 0 < size < 0.01 else f"{x:.3f}"


def interval(e: Estimate | None) -> str:
    """"[low, high]", or why there is none."""
    if e is None:
        return "–"
    if not e.has_interval:
        return "– (1 seed)"
    return f"[{fmt(e.low, e.mean)}, {fmt(e.high, e.mean)}]"


def mean_interval(e: Estimate | None) -> str:
    return "–" if e is None else f"{fmt(e.mean)} {interval(e)}"


def mean_sd(e: Estimate | None) -> str:
    if e is None:
        return "–"
    return fmt(e.mean) + (f" ± {fmt(e.sd, e.mean)}" if e.n > 1 else "")
