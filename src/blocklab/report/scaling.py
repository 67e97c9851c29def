"""Does a small-scale verdict hold at scale? A power law per setting, its bootstrap, and the transfer verdict.

Input: for each setting, its ladder's rungs (`Rung`: the parameter count N and each seed's final loss), the rungs in
the same order for every setting. Pure functions over numbers; no file, no plot.

- `fit`: L(N) = E + A N^(-alpha) by variable projection (Golub & Pereyra 1973): for each alpha on a grid, E and A
  are a linear least-squares fit of L against N^(-alpha) (closed form); the alpha of least squared error is then
  refined on a finer grid around it (the form of Kaplan et al. 2020 and Hoffmann et al. 2022's per-axis laws;
  Choshen et al. 2025, "A Hitchhiker's Guide to Scaling Law Estimation", on fitting them from few models).
  alpha is searched in [ALPHA_LOW, ALPHA_HIGH], and E >= 0 (a loss has a floor at 0: where the rungs show no
  curvature, the unconstrained E runs to large negative values with alpha at its lower bound, which says nothing;
  with E = 0 the law is Kaplan et al.'s pure power law). A fit that ends at a bound says so (`at_bound`).
- `compare`: the bootstrap (RESAMPLES times, seeded). Each replicate draws, at every rung, seeds with replacement:
  the same seeds for every setting where the settings were trained on the same seeds (paired), else each setting's
  own; it then refits every setting. Percentile intervals on E and alpha, on the gap dL(N) = L_A(N) - L_B(N) at each
  measured N (the settings' geometric mean N at that rung) and at 10x and 100x the largest, and on the crossing
  point N_x, where the fitted gap changes sign.
- the transfer verdict (`Comparison.verdict`) on A against B (loss: lower is better), about the order the ladder
  measures, whichever setting a claim names (`Comparison.ahead`: who leads at the largest rung), in this order:
  1. "undetermined": the gap's interval at the largest rung contains 0 (or a fit had under 3 rungs);
  2. "reverses within the measured range": the gap's interval excludes 0 at both the smallest and the largest rung,
     with opposite signs;
  3. "holds and grows": the gap's interval excludes 0 at the largest rung, and the fitted gap at 10x the largest
     rung is at least as large, in the same direction (its trend favours the winner);
  4. "holds but shrinks: crosses near N_x (interval)": otherwise: the winner at the largest rung wins by less at
     10x. N_x is the first sign change of the fitted gap beyond the largest rung (up to CROSS_SPAN times it); where
     the point fit does not cross, "no crossing within CROSS_SPANx" is said instead.
- the axis (`Axis`): parameters N (a ladder of model sizes), or training tokens D (a token ladder: one model's wsd
  cooldown branches, blocklab/ladder.py), where the law reads L(D) = E + B D^(-beta) (Hoffmann et al. 2022's data
  term) and the verdict "as the budget grows"; the rungs of one seed there share their trunk, so the bootstrap draws
  whole seeds (the same at every rung) rather than seeds within each rung.
- `decision_accuracy`: the share of setting pairs whose order at the smallest rung agrees with their order at the
  largest, with its bootstrap interval (DataDecide, Magnusson et al. 2025: how often a small-scale decision is the
  one the large scale makes).
"""
import math
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np

RESAMPLES = 2000
CONFIDENCE = 0.95
ALPHA_LOW, ALPHA_HIGH, ALPHA_STEPS = 0.01, 2.0, 200  # the coarse grid of alpha
REFINE_STEPS = 41  # the fine grid spans one coarse step either side of the best coarse alpha
EXTRAPOLATE = (10, 100)  # the gap is also given at these multiples of the largest N
CROSS_SPAN = 1000  # a crossing beyond the largest rung is looked for up to this multiple of it
MIN_RUNGS = 3  # three parameters: fewer points than that and the law is not determined


GROWS, SHRINKS = "holds and grows", "holds but shrinks"
REVERSES, UNDETERMINED = "reverses within the measured range", "undetermined"
VERDICTS = (GROWS, SHRINKS, REVERSES, UNDETERMINED)


@dataclass(frozen=True)
class Axis:
    """What a ladder's rungs grow, as its page and verdict name it."""
    symbol: str  # N or D
    words: str  # what the symbol counts, for labels
    coefficient: str  # the law's A or B
    exponent: str  # its alpha or beta
    growing: str  # said after a verdict that holds ("": model size, the verdicts as they always read)
    whole_seeds: bool  # the rungs of one seed are one run's branches: the bootstrap draws a seed for every rung


PARAMS = Axis("N", "parameters", "A", "alpha", "", False)
TOKENS = Axis("D", "training tokens", "B", "beta", " as the budget grows", True)
AXES = {"params": PARAMS, "tokens": TOKENS}  # by blocklab.ladder.axis's name


@dataclass(frozen=True)
class Rung:
    """One rung of one setting: its parameter count and each seed's loss (seed -> loss)."""
    n: float
    losses: dict[int, float]

    @property
    def mean(self) -> float:
        return float(np.mean(list(self.losses.values())))


@dataclass(frozen=True)
class Fit:
    """L(N) = e + a N^(-alpha), the squared error of the fit, and whether alpha or E ended at a bound."""
    e: float
    a: float
    alpha: float
    sse: float
    at_bound: bool = False

    def __call__(self, n):
        return self.e + self.a * np.power(np.asarray(n, dtype=float), -self.alpha)


def _grid_fit(x_log: np.ndarray, y: np.ndarray, alphas: np.ndarray):
    """The least-squares E >= 0 and A of y ~ E + A exp(-alpha x_log) for each alpha (x_log: log N over its smallest,
    so the regressor stays near 1). y: (B, R) replicates; returns sse, e, a' of shape (B, G); a' is A N0^(-alpha).
    Where the unconstrained E is negative, the constrained optimum is on E = 0: A by least squares through 0."""
    x = np.exp(-alphas[:, None] * x_log[None, :])  # (G, R)
    xc = x - x.mean(axis=1, keepdims=True)
    yc = y - y.mean(axis=1, keepdims=True)  # (B, R)
    a = (yc @ xc.T) / (xc * xc).sum(axis=1)[None, :]  # (B, G)
    e = y.mean(axis=1, keepdims=True) - a * x.mean(axis=1)[None, :]
    negative = e < 0
    through_zero = (y @ x.T) / (x * x).sum(axis=1)[None, :]
    e, a = np.where(negative, 0.0, e), np.where(negative, through_zero, a)
    resid = y[:, None, :] - e[:, :, None] - a[:, :, None] * x[None, :, :]
    return (resid ** 2).sum(axis=2), e, a


def fit_many(ns, ys) -> list[Fit]:
    """Variable projection for B replicates at once: `ns` the R parameter counts, `ys` (B, R) losses."""
    ns, ys = np.asarray(ns, dtype=float), np.atleast_2d(np.asarray(ys, dtype=float))
    if len(ns) < MIN_RUNGS or ys.shape[1] != len(ns):
        raise ValueError(f"a fit of E + A N^-alpha needs at least {MIN_RUNGS} rungs, got {len(ns)}")
    n0 = ns.min()
    x_log = np.log(ns / n0)
    coarse = np.linspace(ALPHA_LOW, ALPHA_HIGH, ALPHA_STEPS)
    step = coarse[1] - coarse[0]
    sse, _, _ = _grid_fit(x_log, ys, coarse)
    best = coarse[sse.argmin(axis=1)]  # (B,)
    offsets = np.linspace(-step, step, REFINE_STEPS)
    fits = []
    for b, center in enumerate(best):
        fine = np.clip(center + offsets, ALPHA_LOW, ALPHA_HIGH)
        s, e, a = _grid_fit(x_log, ys[b:b + 1], fine)
        i = int(s[0].argmin())
        alpha = float(fine[i])
        at_bound = alpha <= ALPHA_LOW + 1e-12 or alpha >= ALPHA_HIGH - 1e-12 or e[0, i] == 0
        fits.append(Fit(float(e[0, i]), float(a[0, i] * n0 ** alpha), alpha, float(s[0, i]), at_bound))
    return fits


def fit(ns, losses) -> Fit:
    """The one fit of L(N) = E + A N^(-alpha) to the rungs' losses (their means over seeds)."""
    return fit_many(ns, [losses])[0]


def crossings(fa: list[Fit], fb: list[Fit], low: float, high: float, points: int = 2000) -> list[float | None]:
    """For each pair of fits, the smallest N in [low, high] where fa(N) - fb(N) changes sign, else None: the first
    sign change on a log grid of `points` N, placed by linear interpolation of the gap in log N (a grid step over
    a 1000x window is 0.35% of N)."""
    grid = np.log(np.geomspace(low, high, points))
    e, a, alpha = (np.asarray([[getattr(f, k) for f in fits_] for fits_ in (fa, fb)]) for k in ("e", "a", "alpha"))
    gap = (e[0][:, None] + a[0][:, None] * np.exp(-alpha[0][:, None] * grid)
           - e[1][:, None] - a[1][:, None] * np.exp(-alpha[1][:, None] * grid))  # (B, points)
    change = (np.sign(gap[:, :-1]) != np.sign(gap[:, 1:])) | (gap[:, :-1] == 0)
    out = []
    for row, hits in zip(gap, change):
        where = np.flatnonzero(hits)
        if not len(where):
            out.append(None)
            continue
        i = where[0]
        t = 0.0 if row[i] == 0 else row[i] / (row[i] - row[i + 1])
        out.append(float(np.exp(grid[i] + t * (grid[i + 1] - grid[i]))))
    return out


def crossing(fa: Fit, fb: Fit, low: float, high: float) -> float | None:
    """The smallest N in [low, high] where fa(N) - fb(N) changes sign, else None."""
    return crossings([fa], [fb], low, high)[0]


@dataclass(frozen=True)
class Interval:
    value: float | None  # the point estimate (from the data as measured)
    low: float | None
    high: float | None

    def excludes_zero(self) -> bool:
        return self.low is not None and (self.low > 0 or self.high < 0)


def _interval(value, samples, confidence: float = CONFIDENCE) -> Interval:
    xs = np.asarray([s for s in samples if s is not None], dtype=float)
    if value is None or not len(xs):
        return Interval(value, None, None)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(xs, [tail, 100 - tail], method="inverted_cdf")  # no interpolation with inf
    return Interval(float(value), float(low), float(high))


@dataclass
class Comparison:
    """Setting A against setting B over the ladder (gap = A - B; negative: A's loss is lower)."""
    a: str
    b: str
    fit_a: Fit
    fit_b: Fit
    gaps: dict[float, Interval]  # N (measured rungs, then 10x and 100x the largest) -> fitted gap
    crossing: Interval  # N_x beyond the largest rung (an upper bound of inf: some replicates do not cross)
    crossing_share: float  # the share of replicates that cross beyond the largest rung
    crossing_within: Interval  # the first sign change of the fitted gap between the smallest and largest rung
    measured: list[float] = field(default_factory=list)  # the measured rungs' N, smallest first
    axis: Axis = PARAMS

    @property
    def kind(self) -> str:
        """The transfer verdict's kind, one of VERDICTS (the rules are the module docstring's)."""
        if len(self.measured) < MIN_RUNGS:
            return UNDETERMINED
        small, large = self.gaps[self.measured[0]], self.gaps[self.measured[-1]]
        if not large.excludes_zero():
            return UNDETERMINED
        if small.excludes_zero() and (small.value < 0) != (large.value < 0):
            return REVERSES
        ahead = self.gaps[self.measured[-1] * EXTRAPOLATE[0]].value
        return GROWS if (ahead < 0) == (large.value < 0) and abs(ahead) >= abs(large.value) else SHRINKS

    @property
    def verdict(self) -> str:
        """The transfer verdict as a page states it: its kind, and where the settings cross."""
        kind, x = self.kind, self.axis.symbol
        said = f"{kind}{self.axis.growing}" if kind in (GROWS, SHRINKS) else kind
        if kind == SHRINKS:
            if self.crossing.value is None:
                return f"{said}: no crossing within {CROSS_SPAN}x the largest rung"
            return f"{said}: crosses near {x}_x = {_n(self.crossing.value)} ({_span(self.crossing)})"
        if kind == REVERSES and self.crossing_within.value is not None:
            return f"{said}: crosses near {x}_x = {_n(self.crossing_within.value)} ({_span(self.crossing_within)})"
        return said

    @property
    def ahead(self) -> str | None:
        """The setting with the lower fitted loss at the largest rung (None: the gap's interval holds 0 there)."""
        large = self.gaps[self.measured[-1]]
        return None if not large.excludes_zero() else (self.a if large.value < 0 else self.b)


def _n(n: float) -> str:
    return "inf" if n is None or not math.isfinite(n) else f"{n:.3g}"


def _span(interval: Interval) -> str:
    return f"{_n(interval.low)}-{_n(interval.high)}" if interval.low is not None else "no interval"


def _check(settings: dict[str, list[Rung]]) -> int:
    lengths = {len(rungs) for rungs in settings.values()}
    if len(lengths) != 1:
        raise ValueError(f"every setting needs the same rungs, got {sorted(lengths)} rungs")
    return lengths.pop()


def resample_means(settings: dict[str, list[Rung]], resamples: int = RESAMPLES, seed: int = 0,
                   whole_seeds: bool = False) -> dict[str, np.ndarray]:
    """Each setting's rung means over seeds drawn with replacement within each rung, (resamples, rungs) per setting.
    Settings trained on the same seeds at a rung are drawn the same seeds there (a paired bootstrap). `whole_seeds`
    (where every rung has the same seeds): one draw serves every rung, as the rungs of a seed are one run's."""
    rung_count = _check(settings)
    rng = np.random.default_rng(seed)
    out = {name: np.empty((resamples, rung_count)) for name in settings}
    seed_sets = {tuple(sorted(rung.losses)) for rungs in settings.values() for rung in rungs}
    whole = None
    if whole_seeds and len(seed_sets) == 1:
        count = len(next(iter(seed_sets)))
        whole = rng.integers(0, count, size=(resamples, count))
    for r in range(rung_count):
        seed_sets = {name: sorted(rungs[r].losses) for name, rungs in settings.items()}
        shared = whole
        if shared is None and len({tuple(s) for s in seed_sets.values()}) == 1:
            count = len(next(iter(seed_sets.values())))
            shared = rng.integers(0, count, size=(resamples, count))
        for name, rungs in settings.items():
            values = np.asarray([rungs[r].losses[s] for s in seed_sets[name]], dtype=float)
            draw = shared if shared is not None else rng.integers(0, len(values), size=(resamples, len(values)))
            out[name][:, r] = values[draw].mean(axis=1)
    return out


def fits(settings: dict[str, list[Rung]], resamples: int = RESAMPLES, seed: int = 0, axis: Axis = PARAMS):
    """Each setting's point fit and its bootstrap fits: {name: (Fit, [Fit] * resamples)}."""
    means = resample_means(settings, resamples, seed, axis.whole_seeds)
    out = {}
    for name, rungs in settings.items():
        ns = [rung.n for rung in rungs]
        out[name] = (fit(ns, [rung.mean for rung in rungs]), fit_many(ns, means[name]))
    return out


def parameter_intervals(point: Fit, boot: list[Fit]) -> dict[str, Interval]:
    """Percentile intervals of E, alpha and A over the bootstrap fits."""
    return {key: _interval(getattr(point, key), [getattr(f, key) for f in boot]) for key in ("e", "alpha", "a")}


def compare(settings: dict[str, list[Rung]], a: str, b: str, fitted=None, resamples: int = RESAMPLES,
            seed: int = 0, axis: Axis = PARAMS) -> Comparison:
    """A against B: the fitted gap at the measured rungs and beyond, N_x, and through them the verdict.
    `fitted`: `fits(settings)` when already computed (the same bootstrap for every pair of a page)."""
    fitted = fitted or fits({a: settings[a], b: settings[b]}, resamples, seed, axis)
    (pa, ba), (pb, bb) = fitted[a], fitted[b]
    measured = [math.sqrt(ra.n * rb.n) for ra, rb in zip(settings[a], settings[b])]
    largest = measured[-1]
    where = measured + [largest * k for k in EXTRAPOLATE]
    gaps = {n: _interval(float(pa(n) - pb(n)), [float(fa(n) - fb(n)) for fa, fb in zip(ba, bb)]) for n in where}
    beyond, share = _crossings(pa, pb, ba, bb, largest, largest * CROSS_SPAN)
    within, _ = _crossings(pa, pb, ba, bb, measured[0], largest)
    return Comparison(a, b, pa, pb, gaps, beyond, share, within, measured, axis)


def _crossings(pa: Fit, pb: Fit, ba: list[Fit], bb: list[Fit], low: float, high: float) -> tuple[Interval, float]:
    """The point fits' crossing in [low, high] with its bootstrap interval, and the share of replicates crossing
    there. A replicate that does not cross counts as crossing beyond `high` (inf), so an infinite upper bound says
    that over 2.5% of the replicates do not cross in the window."""
    point = crossing(pa, pb, low, high)
    boot = crossings(ba, bb, low, high)
    share = sum(n is not None for n in boot) / len(boot)
    if point is None:
        return Interval(None, None, None), share
    return _interval(point, [math.inf if n is None else n for n in boot]), share


def order_agreement(small: dict[str, float], large: dict[str, float]) -> float | None:
    """The share of setting pairs ordered the same way by their losses at the small and at the large rung (a tie
    at either counts a half); None with fewer than two settings."""
    pairs = list(combinations(sorted(small), 2))
    if not pairs:
        return None
    score = 0.0
    for s, t in pairs:
        a, b = np.sign(small[s] - small[t]), np.sign(large[s] - large[t])
        score += 0.5 if a == 0 or b == 0 else float(a == b)
    return score / len(pairs)


def decision_accuracy(settings: dict[str, list[Rung]], resamples: int = RESAMPLES, seed: int = 0,
                      axis: Axis = PARAMS) -> Interval:
    """How often the smallest rung's order of two settings is the largest rung's (DataDecide's decision accuracy),
    with its bootstrap interval over seeds resampled within rungs."""
    if len(settings) < 2:
        return Interval(None, None, None)
    rung_count = _check(settings)
    point = order_agreement({k: r[0].mean for k, r in settings.items()}, {k: r[-1].mean for k, r in settings.items()})
    means = resample_means(settings, resamples, seed, axis.whole_seeds)
    boot = [order_agreement({k: m[i, 0] for k, m in means.items()}, {k: m[i, rung_count - 1] for k, m in means.items()})
            for i in range(resamples)]
    return _interval(point, boot)
