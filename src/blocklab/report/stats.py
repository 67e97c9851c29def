"""Statistics over seeds: what a setting's mean is worth, and whether one setting beats another.

- `estimate`: a group's mean, standard deviation and 95% bootstrap confidence interval of the mean over its seeds
  (scipy.stats.bootstrap, percentile method, each group resampled on its own: stratified by group). With 2-3 seeds
  the interval is about the seeds' range: it says how far apart the seeds fell, not where the mean would settle.
- `common_language`: the Mann-Whitney common-language effect size (McGraw & Wong 1992): the share of (seed of A,
  seed of B) pairs in which A does better, ties counting a half, U / (n_A n_B). A description of two groups of
  seeds, not the probability that A is better and not a test.
- `verdict`: a winner is named only when the two intervals do not overlap; otherwise "not distinguishable at N
  seeds" (the HTML report's findings; a findings page's claims are judged by the paired test below).
- `paired_t`, `sign_flip_p`, `holm`, `detectable`: a claim compared seed by seed (the paired t-test and its
  interval, the exact sign-flip permutation p-value, Holm-Bonferroni step-down over a page's claims, the smallest
  difference a paired t-test detects at 80% power).

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


CL_FORMULA = ("CL = (#{(i, j): a_i better than b_j} + ½ #{(i, j): a_i = b_j}) / (n_A n_B) over every (seed of A, "
              "seed of B) pair, the Mann-Whitney U over n_A n_B (the common-language effect size, McGraw & Wong "
              "1992): it describes the two groups of seeds; it is not the probability that A is better, nor a test")


def common_language(a, b, higher_is_better: bool = True) -> float | None:
    """The common-language effect size: the share of (seed of A, seed of B) pairs in which A does better, a tie
    counting 1/2: 1 when every A beats every B, 0.5 for identical groups. None when either has no value."""
    xs, ys = finite(a), finite(b)
    if not xs or not ys:
        return None
    if not higher_is_better:
        xs, ys = [-x for x in xs], [-y for y in ys]
    u = stats.mannwhitneyu(xs, ys, alternative="two-sided").statistic  # pairs x > y, plus half the ties
    return float(u) / (len(xs) * len(ys))


ALPHA = 0.05  # a page's family-wise error rate over its claims (Holm)
POWER = 0.8
MIN_FLIP_PAIRS = 6  # below 6 pairs the exact sign-flip p is at least 2 / 2^5 = 0.0625: it cannot reach 0.05
MAX_FLIP_PAIRS = 20  # 2^20 sign assignments, enumerated


@dataclass(frozen=True)
class Paired:
    """A paired comparison: the per-seed differences (A - B), their mean and standard deviation, and the two-sided
    paired t-test's p-value (n - 1 degrees of freedom)."""

    diffs: tuple[float, ...]
    mean: float
    sd: float
    p: float

    @property
    def n(self) -> int:
        return len(self.diffs)

    def interval(self, alpha: float = ALPHA) -> tuple[float, float]:
        """The paired t-interval of the mean difference at confidence 1 - alpha: mean ± t_{1-alpha/2,n-1} sd/sqrt(n)
        (excludes 0 exactly when p < alpha)."""
        half = float(stats.t.ppf(1 - alpha / 2, self.n - 1)) * self.sd / math.sqrt(self.n)
        return self.mean - half, self.mean + half


def paired_t(diffs) -> Paired | None:
    """The paired t-test on per-seed differences; None below 2 pairs (no spread to test against). Every difference
    the same: p = 1 when they are all 0 (nothing differs), 0 otherwise (no seed noise at all)."""
    ds = [float(d) for d in diffs]
    n = len(ds)
    if n < 2:
        return None
    mean = sum(ds) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in ds) / (n - 1))
    if sd <= 1e-12 * max(1.0, abs(mean)):
        return Paired(tuple(ds), mean, 0.0, 1.0 if mean == 0 else 0.0)
    t = mean / (sd / math.sqrt(n))
    return Paired(tuple(ds), mean, sd, float(2 * stats.t.sf(abs(t), n - 1)))


def paired_by_seed(a: list[dict], b: list[dict], value_of) -> Paired | None:
    """A - B on `value_of(run)`, seed by seed: seed s fixes the data order of every setting of a task, so the runs of
    one seed form a pair. Seeds either side lacks, or where either value is not a finite number, are left out (the
    claims' judge, judge.py, counts such a seed as the worst value instead). None below 2 pairs."""
    def by_seed(runs):
        return {r.get("seed"): v for r in runs if r.get("seed") is not None and finite([v := value_of(r)])}
    x, y = by_seed(a), by_seed(b)
    shared = sorted(set(x) & set(y), key=lambda s: (0, s, "") if isinstance(s, (int, float)) else (1, 0, str(s)))
    return paired_t([x[s] - y[s] for s in shared])


def sign_flip_p(diffs) -> float | None:
    """The exact two-sided sign-flip permutation p-value of the mean difference: the share of the 2^n ways of
    flipping the differences' signs whose |sum| is at least the observed |sum| (the observed one counts). None
    above MAX_FLIP_PAIRS pairs."""
    ds = np.asarray([float(d) for d in diffs])
    n = len(ds)
    if n == 0 or n > MAX_FLIP_PAIRS:
        return None
    signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)  # every sign pattern, one per row
    sums = np.abs(signs @ ds)
    observed = abs(ds.sum())
    return float(np.count_nonzero(sums >= observed - 1e-9 * max(1.0, np.abs(ds).sum())) / 2 ** n)


@dataclass(frozen=True)
class Holm:
    """One claim's place in a page's Holm-Bonferroni step-down: its adjusted p-value, the level its interval is
    drawn at, and whether the step-down rejects "no difference"."""

    adjusted: float | None
    level: float
    rejected: bool


def holm(ps, alpha: float = ALPHA) -> list[Holm]:
    """Holm's step-down over m claims: sorted p_(1) <= ... <= p_(m), p_(k) is rejected while every p_(j), j <= k,
    is at most alpha / (m - j + 1); the adjusted p_(k) = max_{j<=k} min(1, (m - j + 1) p_(j)), at most alpha exactly
    when rejected. A claim's level is alpha / (m - k + 1), or, from the first step that fails on, that step's level,
    so its (1 - level) interval excludes 0 exactly when it is rejected. A claim without a p-value (None: not
    tested) counts in m and is never rejected."""
    m = len(ps)
    order = sorted(range(m), key=lambda i: (ps[i] is None, ps[i] or 0.0))
    out: list[Holm | None] = [None] * m
    running, failed = 0.0, None
    for rank, i in enumerate(order):
        if ps[i] is None:
            out[i] = Holm(None, alpha / (m - (rank if failed is None else failed)), False)
            continue
        running = max(running, min(1.0, (m - rank) * ps[i]))
        if failed is None and ps[i] > alpha / (m - rank):
            failed = rank
        out[i] = Holm(running, alpha / (m - (rank if failed is None else failed)), failed is None)
    return out


def detectable(sd_diff: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """The smallest true mean difference a two-sided paired t-test at level alpha detects with the given power
    from n pairs whose differences have standard deviation sd_diff: (t_{1-alpha/2,n-1} + t_{power,n-1}) sd / sqrt(n)
    (the usual approximation, with the t quantiles). None below 2 pairs."""
    if n < 2:
        return None
    return (float(stats.t.ppf(1 - alpha / 2, n - 1)) + float(stats.t.ppf(power, n - 1))) * sd_diff / math.sqrt(n)


def signed(x: float | None, like: float | None = None) -> str:
    """fmt with its sign: +0.012, -0.300."""
    return "–" if x is None else ("+" if x > 0 else "") + fmt(x, like)


def fmt_p(p: float | None) -> str:
    return "–" if p is None else "< 0.001" if p < 0.001 else f"{p:.3f}"


def p_is(p: float) -> str:
    """"= 0.012", or "< 0.001"."""
    return "< 0.001" if p < 0.001 else f"= {p:.3f}"


def confidence(level: float) -> str:
    """The confidence 1 - level as a percentage: 95%, 98.3%, 99.2%; a level near 0 keeps the digits that tell it
    from 100% (99.99%, a group-sequential first look's)."""
    digits = 3
    while digits < 12 and level > 0 and f"{100 * (1 - level):.{digits}g}" == "100":
        digits += 1
    return f"{100 * (1 - level):.{digits}g}%"


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
