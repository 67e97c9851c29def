"""report/scaling.py against synthetic ladders built from known laws L(N) = E + A N^-alpha: the fit recovers the
law it was built from (and agrees with scipy's nonlinear least squares, an independent fit), the crossing is where
the two built laws cross (solved by hand below), each transfer verdict is reached by a case built for it, and
decision accuracy counts agreeing pairs as DataDecide (Magnusson et al. 2025) defines it."""
import math

import numpy as np
import pytest
from scipy.optimize import curve_fit

from blocklab.report import scaling
from blocklab.report.scaling import Rung

NS = [1e4, 3e4, 1e5, 3e5, 1e6]
SEEDS = (0, 1, 2)


def law(e, a, alpha):
    return lambda n: e + a * n ** -alpha


def ladder(curve, noise: float, rng, ns=NS) -> list[Rung]:
    return [Rung(n, {s: float(curve(n) + rng.normal(0, noise)) for s in SEEDS}) for n in ns]


def test_fit_recovers_a_known_law():
    rng = np.random.default_rng(0)
    rungs = ladder(law(2.0, 40.0, 0.35), 0.002, rng)
    ns, means = [r.n for r in rungs], [r.mean for r in rungs]
    got = scaling.fit(ns, means)
    assert got.alpha == pytest.approx(0.35, abs=0.03)
    assert got.e == pytest.approx(2.0, abs=0.03)
    assert math.log(got.a) == pytest.approx(math.log(40.0), abs=0.35)
    assert not got.at_bound
    # scipy's Levenberg-Marquardt on the same means, started elsewhere, lands on the same least squares
    (e, a, alpha), _ = curve_fit(lambda n, e, a, alpha: e + a * n ** -alpha, np.array(ns), np.array(means),
                                 p0=(1.5, 10.0, 0.5), maxfev=20000)
    assert got.alpha == pytest.approx(alpha, abs=2e-3)
    assert got.e == pytest.approx(e, abs=5e-3)


def test_fit_without_noise_is_exact():
    got = scaling.fit(NS, [law(1.5, 12.0, 0.6)(n) for n in NS])
    assert (got.e, got.a, got.alpha) == pytest.approx((1.5, 12.0, 0.6), rel=2e-3)


def test_bootstrap_interval_covers_the_true_exponent():
    rng = np.random.default_rng(1)
    settings = {"x": ladder(law(2.0, 40.0, 0.35), 0.004, rng)}
    point, boot = scaling.fits(settings, resamples=500)["x"]
    alpha = scaling.parameter_intervals(point, boot)["alpha"]
    assert alpha.low < 0.35 < alpha.high
    assert alpha.high - alpha.low < 0.3


def test_a_fit_needs_three_rungs():
    with pytest.raises(ValueError, match="at least 3 rungs"):
        scaling.fit([1e4, 1e5], [3.0, 2.5])


# Two laws that cross at N = 1e5: B = 2.0 + 25 N^-0.35, A = 1.8 + A_A N^-0.5 with A_A solved from A(1e5) = B(1e5).
CROSS_AT = 1e5
A_CROSS = (2.0 - 1.8 + 25 * CROSS_AT ** -0.35) * CROSS_AT ** 0.5
B_LAW = law(2.0, 25.0, 0.35)


def test_crossing_of_two_known_laws():
    assert scaling.crossing(scaling.Fit(1.8, A_CROSS, 0.5, 0.0), scaling.Fit(2.0, 25.0, 0.35, 0.0),
                            1e4, 1e6) == pytest.approx(CROSS_AT, rel=0.01)
    rng = np.random.default_rng(2)
    settings = {"a": ladder(law(1.8, A_CROSS, 0.5), 0.002, rng), "b": ladder(B_LAW, 0.002, rng)}
    got = scaling.compare(settings, "a", "b", resamples=400)
    assert got.crossing_within.value == pytest.approx(CROSS_AT, rel=0.1)
    assert got.crossing_within.low < CROSS_AT < got.crossing_within.high
    assert got.kind == scaling.REVERSES
    assert got.verdict.startswith("reverses within the measured range: crosses near N_x = 9.9")


def verdict_case(curve_a, noise=0.002, seed=3):
    rng = np.random.default_rng(seed)
    settings = {"a": ladder(curve_a, noise, rng), "b": ladder(B_LAW, noise, rng)}
    return scaling.compare(settings, "a", "b", resamples=400)


def test_holds_and_grows():
    # A_A set so that A leads by 0.05 at 1e4; its lower E makes the lead grow towards 0.3 (0.19 at 1e6, 0.23 at 1e7)
    a_a = (-0.05 + 0.3 + 25 * 1e4 ** -0.35) * 1e4 ** 0.3
    got = verdict_case(law(1.7, a_a, 0.3))
    assert got.kind == scaling.GROWS, got.verdict
    assert all(gap.high < 0 for gap in got.gaps.values())


def test_holds_but_shrinks_and_crosses_at_ten_times_the_largest():
    # the same exponent, a higher E: A leads at every rung, by less each time, until the laws meet at 1e7
    a_a = 25.0 - 0.05 * 1e7 ** 0.35
    got = verdict_case(law(2.05, a_a, 0.35))
    assert got.kind == scaling.SHRINKS, got.verdict
    assert got.crossing.value == pytest.approx(1e7, rel=0.5)
    assert got.crossing.low < 1e7 < got.crossing.high
    assert got.verdict.startswith("holds but shrinks: crosses near N_x = ")


def test_undetermined_when_the_settings_are_one_law():
    got = verdict_case(B_LAW, noise=0.01)
    assert got.kind == scaling.UNDETERMINED
    assert got.verdict == "undetermined"


def test_order_agreement_by_hand():
    # pairs (a, b) and (a, c) keep their order, (b, c) swaps: 2 of 3
    assert scaling.order_agreement({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 3, "c": 2}) == pytest.approx(2 / 3)
    assert scaling.order_agreement({"a": 1}, {"a": 1}) is None


def test_decision_accuracy_of_a_ladder_that_reverses():
    rng = np.random.default_rng(4)
    settings = {"a": ladder(law(1.8, A_CROSS, 0.5), 0.002, rng), "b": ladder(B_LAW, 0.002, rng),
                "c": ladder(law(4.0, 25.0, 0.35), 0.002, rng)}
    got = scaling.decision_accuracy(settings, resamples=300)
    assert got.value == pytest.approx(2 / 3)  # a-b reverses; c is worst at both ends
    assert got.low == pytest.approx(2 / 3) and got.high == pytest.approx(2 / 3)  # noise far below every gap


def test_paired_seeds_draw_the_same_seeds():
    rungs = [Rung(n, {0: 1.0, 1: 2.0, 2: 3.0}) for n in NS]
    means = scaling.resample_means({"a": rungs, "b": rungs}, resamples=50)
    assert np.array_equal(means["a"], means["b"])


def test_ladder_section_from_rows():
    """report/ladder_page.py on rows as collect.py makes them: the reversing pair above, as a sweep of act=a,b."""
    from blocklab.report.ladder_page import ladder_rungs, ladder_section

    rng = np.random.default_rng(5)
    laws = {"a": law(1.8, A_CROSS, 0.5), "b": B_LAW}
    rungs = {f"r{i}": n for i, n in enumerate(NS)}
    rows = [{"status": "completed", "act": act, "seed": seed, "study.rung": rung, "params": int(n),
             "final_val_loss": float(curve(n) + rng.normal(0, 0.002))}
            for act, curve in laws.items() for rung, n in rungs.items() for seed in SEEDS]
    rows.append({"status": "failed", "act": "a", "seed": 0, "study.rung": "r0"})
    study = {"compare": ["act"], "ladder": {"rungs": dict.fromkeys(rungs, {})},
             "verdict": {"claim": "a beats b", "better": {"act": "a"}, "than": {"act": "b"}}}
    settings = ladder_rungs(rows, study)
    assert list(settings) == ["a", "b"] and [r.n for r in settings["a"]] == NS
    text, png = ladder_section(rows, study, figure="ladder.png", resamples=200)
    assert "**Transfer verdict: reverses within the measured range: crosses near N_x = 1.01e+05" in text
    assert "Decision accuracy, smallest against largest rung" in text and "0.00 [0.00, 0.00]" in text
    assert png.startswith(b"\x89PNG") and ladder_section(rows, study, figure="ladder.png", resamples=200)[1] == png


def test_a_law_without_curvature_is_fitted_with_its_floor_at_zero():
    """Losses straight in log N (as a short budget's ladder measured them): no curvature, so the unconstrained least
    squares would run E below 0. The fit keeps E >= 0 and agrees with scipy's bounded least squares (E in
    [0, inf), alpha in the grid's range), an independent solver of the same problem."""
    from scipy.optimize import least_squares

    ns = np.array(NS)
    ys = 4.0 - 0.25 * np.log10(ns)
    got = scaling.fit(ns, ys)
    oracle = least_squares(lambda p: p[0] + p[1] * ns ** -p[2] - ys, x0=(0.5, 5.0, 0.3),
                           bounds=([0, -np.inf, scaling.ALPHA_LOW], [np.inf, np.inf, scaling.ALPHA_HIGH]),
                           xtol=1e-14, ftol=1e-14, gtol=1e-14)
    assert got.e >= 0
    assert got.sse == pytest.approx(2 * oracle.cost, rel=0.01)  # least_squares' cost is half the squared error
    assert (got.e, got.alpha) == pytest.approx((oracle.x[0], oracle.x[2]), abs=3e-3)
