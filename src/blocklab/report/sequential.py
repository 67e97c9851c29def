"""Seeds added until a claim is decided, without the false positives of looking again: a group-sequential design
with O'Brien-Fleming-type alpha spending, and Holm's step-down over a page's claims.

- `spent(t, alpha)`: the Lan-DeMets O'Brien-Fleming-type spending function, two-sided and symmetric: each side spends
  2 - 2 Phi(z_{1-alpha/4} / sqrt(t)) of its alpha/2 by information fraction t (Lan & DeMets 1983, Biometrika 70:659;
  the convention of R gsDesign's sfLDOF with test.type=2 and one-sided alpha/2, and of rpact's typeOfDesign="asOF").
  All of alpha is spent at t = 1; almost none early.
- `boundaries(fractions, alpha)`: the z boundaries c_1..c_k at the looks made so far, at information fractions
  t_j = n_j / max (n_j: the pairs at look j, max: the sweep's study.seeds.max), each found so that, with no true
  difference, the chance of first crossing at look j is spent(t_j) - spent(t_{j-1}). The crossing probabilities are
  integrated numerically over the continuation region, look by look (Armitage, McPherson & Rowe 1969; Jennison &
  Turnbull 2000, Group Sequential Methods, ch. 19), with Simpson's rule. The looks need not be planned ahead.
- The statistic is the paired t of the per-seed differences. A z boundary c becomes the nominal two-sided level
  2 (1 - Phi(c)), and the paired t-test's p-value is held to it (Jennison & Turnbull 2000, section 3.8: group
  sequential t-tests by their significance levels). The repeated confidence interval at a look is the paired
  t-interval at that nominal level (J&T ch. 9). J&T note this conversion runs a little above alpha with few
  pairs: with the t-test's own noise in its sd, looks at 3..10 pairs reject 5.6% of the time at alpha 0.05. So the
  spending level is `calibrated`: lowered until a simulation of the t-tests under no difference (CALIBRATION
  sequences of normal differences, fixed seed; the t statistic's law under no difference does not depend on the
  sd) rejects at alpha over the planned looks n_min..n_max.
- `look`: Holm's procedure over the page's claims, each tested with its own boundaries at its current local level
  alpha / (claims not yet rejected); a rejection passes its alpha on, and the others are tested again at the larger
  level (the group-sequential Holm procedure: Ye et al. 2013, Stat Med 32:1112; Maurer & Bretz 2013, Stat Biopharm
  Res 5:311). A claim stops when rejected, when its repeated interval lies inside +-min_effect (no difference that
  matters), or at max seeds.

Pure functions of numbers: no run folder, no report module."""
import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from scipy import optimize, special, stats

from blocklab.report.stats import paired_t

ALPHA = 0.05
GRID = 801  # Simpson points per look (odd): crossing probabilities to about 1e-7
CALIBRATION = 100_000  # simulated sequences: the calibrated rate's standard error is about 0.0007 at 0.05
DESIGN = ("group-sequential paired t-test with O'Brien-Fleming-type alpha spending (Lan & DeMets 1983) over "
          "information fraction n / max seeds, its boundaries calibrated to the t-test by simulation, and Holm's "
          "step-down over the claims (Ye et al. 2013)")


def spent(t: float, alpha: float = ALPHA) -> float:
    """Two-sided alpha spent by information fraction t (0 < t <= 1): 2 sides x (2 - 2 Phi(z_{1-alpha/4} / sqrt t))."""
    if t <= 0:
        return 0.0
    t = min(t, 1.0)
    return float(4 * stats.norm.sf(stats.norm.isf(alpha / 4) / math.sqrt(t)))


def _simpson(lo: float, hi: float, points: int = GRID) -> tuple[np.ndarray, np.ndarray]:
    x = np.linspace(lo, hi, points)
    w = np.ones(points)
    w[1:-1:2], w[2:-1:2] = 4, 2
    return x, w * (hi - lo) / (3 * (points - 1))


@lru_cache(maxsize=4096)
def _boundaries(fractions: tuple[float, ...], alpha: float) -> tuple[float, ...]:
    bounds, previous = [], 0.0
    s = w = f = None  # the continuation region's grid, Simpson weights, and the sub-density of S_{k-1} on it
    for k, t in enumerate(fractions):
        target = spent(t, alpha) - spent(previous, alpha)
        if k == 0:
            c = float(stats.norm.isf(target / 2)) if target > 0 else math.inf
            sd = math.sqrt(t)
            half = (c if math.isfinite(c) else 12.0) * sd
            s, w = _simpson(-half, half)
            f = stats.norm.pdf(s, scale=sd)
        else:
            step = math.sqrt(t - previous)
            root = math.sqrt(t)
            mass = f * w

            def crossing(c):  # P(S_{k-1} continued, |S_k| >= c sqrt(t))
                b = c * root
                return float(mass @ (stats.norm.cdf((-b - s) / step) + stats.norm.sf((b - s) / step)))

            if target <= 0 or crossing(40.0) >= target:
                c = math.inf
            else:
                c = float(optimize.brentq(lambda c: crossing(c) - target, 1e-9, 40.0, xtol=1e-10))
            half = (c if math.isfinite(c) else 12.0) * root
            u, wu = _simpson(-half, half)
            f = stats.norm.pdf((u[:, None] - s[None, :]) / step) @ mass / step
            s, w = u, wu
        bounds.append(c)
        previous = t
    return tuple(bounds)


def boundaries(fractions, alpha: float = ALPHA) -> list[float]:
    """The two-sided z boundaries at looks with these increasing information fractions (each in (0, 1]); inf
    where a look has no alpha left to spend."""
    fractions = tuple(round(float(t), 12) for t in fractions)
    if any(b <= a for a, b in zip(fractions, fractions[1:])) or not all(0 < t <= 1 for t in fractions):
        raise ValueError(f"information fractions must increase within (0, 1]: {fractions}")
    return list(_boundaries(fractions, float(alpha)))


def exit_probability(bounds, fractions) -> float:
    """P(|Z_j| >= c_j at some look j) with no true difference, for given z boundaries: the check of a design
    (O'Brien & Fleming's classical constants, Jennison & Turnbull 2000, Table 2.3, must give alpha)."""
    total, previous, s = 0.0, 0.0, None
    for k, (c, t) in enumerate(zip(bounds, fractions)):
        half = c * math.sqrt(t)
        if k == 0:
            total += 2 * float(stats.norm.sf(c))
            s, w = _simpson(-half, half)
            f = stats.norm.pdf(s, scale=math.sqrt(t))
        else:
            step, mass = math.sqrt(t - previous), f * w
            total += float(mass @ (stats.norm.cdf((-half - s) / step) + stats.norm.sf((half - s) / step)))
            u, wu = _simpson(-half, half)
            f = stats.norm.pdf((u[:, None] - s[None, :]) / step) @ mass / step
            s, w = u, wu
        previous = t
    return total


@lru_cache(maxsize=16)
def _t_pvalues(n_min: int, n_max: int) -> np.ndarray:
    """Two-sided paired-t p-values at each of the looks n_min..n_max of simulated sequences with no difference."""
    d = np.random.default_rng(0).standard_normal((CALIBRATION, n_max))
    n = np.arange(1, n_max + 1)
    total, squares = np.cumsum(d, 1), np.cumsum(d * d, 1)
    mean = total / n
    sd = np.sqrt(np.maximum(squares - n * mean ** 2, 0) / np.maximum(n - 1, 1))
    looks = slice(n_min - 1, n_max)
    tstat = np.abs(mean[:, looks]) / (sd[:, looks] / np.sqrt(n[looks]))
    return 2 * stats.t.sf(tstat, n[looks] - 1)


def t_rate(level: float, n_min: int, n_max: int) -> float:
    """The simulated chance, with no true difference, that paired t-tests at looks n_min..n_max, held to the
    nominal levels of `level`'s boundaries, reject at some look."""
    ps = _t_pvalues(n_min, n_max)
    levels = np.array([nominal(c) for c in boundaries([n / n_max for n in range(n_min, n_max + 1)], level)])
    return float((ps <= levels).any(axis=1).mean())


@lru_cache(maxsize=256)
def calibrated(level: float, n_min: int, n_max: int) -> float:
    """The spending level whose boundaries make the t-tests at looks n_min..n_max reject at `level` (simulated)."""
    if n_min >= n_max:
        return level  # one look: the fixed-sample t-test, exact
    if t_rate(level, n_min, n_max) <= level:
        return level
    return float(optimize.brentq(lambda a: t_rate(a, n_min, n_max) - level, level / 4, level, xtol=level * 1e-4))


def nominal(c: float) -> float:
    """The two-sided nominal significance level of a z boundary: 2 (1 - Phi(c))."""
    return 2 * float(special.ndtr(-c)) if math.isfinite(c) else 0.0


@dataclass(frozen=True)
class Paired:
    """A claim's per-seed differences A - B at one look: mean, sd and the paired t-test's two-sided p."""

    n: int
    mean: float
    sd: float
    p: float

    @classmethod
    def of(cls, diffs) -> "Paired | None":
        """The page's paired t-test (report.stats.paired_t), kept as its size and summary."""
        test = paired_t(diffs)
        return None if test is None else cls(len(test.diffs), test.mean, test.sd, test.p)

    def interval(self, level: float) -> tuple[float, float]:
        """The paired t-interval at confidence 1 - level (the repeated confidence interval at a look's nominal
        level): excludes 0 exactly when p <= level."""
        if level <= 0:
            return -math.inf, math.inf
        half = float(special.stdtrit(self.n - 1, 1 - level / 2)) * self.sd / math.sqrt(self.n)
        return self.mean - half, self.mean + half


@dataclass
class Claim:
    """One registered claim through the looks: the pairs at each look with new pairs (`history`), its state
    ('open', or why it stopped: 'rejected', 'trivial', 'max', 'untestable') and its last look's numbers."""

    min_effect: float | None = None
    history: list[int] = field(default_factory=list)
    state: str = "open"
    paired: Paired | None = None
    level: float | None = None  # its local Holm alpha at the last look
    spending: float | None = None  # the alpha its boundaries spend there (calibrated to the t-test)
    bound: float | None = None  # the z boundary there
    nominal: float | None = None  # that boundary's nominal two-sided level
    interval: tuple[float, float] | None = None
    why: str = ""


def look(claims: list[Claim], observed: list, n_min: int, n_max: int, alpha: float = ALPHA,
         last: bool = False) -> None:
    """One look at every open claim, in place. `observed[i]`: claim i's per-seed differences now (a list), or a
    string saying why it cannot be tested. Holm over all claims (an untestable one counts and is never rejected):
    the open ones are tested at alpha / (m - rejected), again after each rejection. `last`: no seed can be added
    after this look (every open claim stops at max). n_min..n_max: the planned looks, one seed a round."""
    m = len(claims)
    for claim, seen in zip(claims, observed):
        if claim.state != "open":
            continue
        if isinstance(seen, str):
            claim.state, claim.why, claim.paired = "untestable", seen, None
            continue
        claim.paired = Paired.of(seen)
        if claim.paired is not None and (not claim.history or claim.paired.n > claim.history[-1]):
            claim.history.append(min(claim.paired.n, n_max))
    while any(c.state == "open" and c.paired is not None for c in claims):
        level = alpha / (m - sum(c.state == "rejected" for c in claims))
        newly = False
        for claim in claims:
            if claim.state != "open" or claim.paired is None:
                continue
            spending = calibrated(level, n_min, n_max)
            bound = boundaries([n / n_max for n in claim.history], spending)[-1]
            claim.level, claim.spending, claim.bound, claim.nominal = level, spending, bound, nominal(bound)
            claim.interval = claim.paired.interval(claim.nominal)
            if claim.paired.p <= claim.nominal:
                claim.state, newly = "rejected", True
                claim.why = (f"p {claim.paired.p:.3g} at or below the boundary's nominal level {claim.nominal:.3g} "
                             f"(|z| >= {bound:.3f}, local alpha {level:.3g}) at {claim.paired.n} pairs")
        if not newly:
            break
    for claim in claims:
        if claim.state != "open" or claim.paired is None:
            if claim.state == "open" and last:
                claim.state, claim.why = "max", "fewer than 2 complete pairs at the last seed"
            continue
        low, high = claim.interval
        if claim.min_effect is not None and -claim.min_effect <= low and high <= claim.min_effect:
            claim.state = "trivial"
            claim.why = (f"its repeated interval [{low:.4g}, {high:.4g}] lies inside ±{claim.min_effect:g} (the "
                         f"claim's min_effect) at {claim.paired.n} pairs")
        elif last or claim.history[-1] >= n_max:
            claim.state = "max"
            claim.why = (f"not distinguishable at {claim.paired.n} pairs, the most study.seeds.max allows (p "
                         f"{claim.paired.p:.3g} above the nominal level {claim.nominal:.3g})")
