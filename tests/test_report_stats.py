"""Statistics a reader can trust: bootstrap intervals over seeds, the common-language effect size, a winner named
only where the intervals are apart, the paired comparison a findings page decides its claims by (paired t-interval,
exact sign-flip p, Holm, the detectable difference) checked against textbook cases computed by hand, degenerate
cases as sentences, the study's own metrics in the table (all columns in the CSV), the Narang et al. 2021 summary,
budgets read from the runs, and what results.json records for them (the training-loss curve, forward FLOPs per
token)."""
import base64
import csv
import io
import json
import re

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image

from blocklab.errors import ConfigError
from blocklab.report import stats
from blocklab.report.build import budget, build_report, findings, metrics_spec, section
from blocklab.report.collect import METRICS, collect, early_loss, study_specs
from blocklab.schema import schema_errors
from conftest import CONF, FAST, compose_config, run_in_process

# ---------------------------------------------------------------------------------------------- the statistics


def test_the_interval_contains_the_mean_and_shrinks_with_more_seeds():
    """The same three values, seen k times over: the mean and spread stay, the mean's interval narrows about as
    1/sqrt(n) (normal approximation at 100 seeds: mean ± 1.96 sd / sqrt(n))."""
    widths = []
    for k in (1, 4, 33):
        values = [0.4, 0.5, 0.6] * k
        e = stats.estimate(values)
        assert e.n == 3 * k and e.mean == pytest.approx(0.5) and e.sd == pytest.approx(np.std(values, ddof=1))
        assert e.low < e.mean < e.high
        widths.append(e.high - e.low)
    assert widths[0] > widths[1] > widths[2]
    assert widths[2] == pytest.approx(2 * 1.96 * np.std([0.4, 0.5, 0.6]) / np.sqrt(99), rel=0.1)
    rng = np.random.default_rng(1)  # and for seeds drawn at random: the interval holds the mean
    for n in (3, 10, 100):
        e = stats.estimate(list(rng.normal(0.5, 0.1, n)))
        assert e.low < e.mean < e.high


def test_degenerate_groups_have_the_obvious_interval():
    assert stats.estimate([0.0, 0.0, 0.0]) == stats.Estimate((0.0, 0.0, 0.0), 0.0, 0.0, 0.0, 0.0)
    one = stats.estimate([0.7])
    assert one.mean == 0.7 and not one.has_interval and stats.interval(one) == "– (1 seed)"
    assert stats.estimate([None, float("nan")]) is None  # a diverged run has no loss to average
    assert stats.estimate([1.0, None, 3.0]).values == (1.0, 3.0)


def test_the_common_language_effect_size_counts_seed_pairs():
    assert stats.common_language([0.9, 0.8, 0.95], [0.1, 0.2, 0.3]) == 1.0  # every A seed beats every B seed
    assert stats.common_language([0.1, 0.2, 0.3], [0.9, 0.8, 0.95]) == 0.0
    assert stats.common_language([0.1, 0.5, 0.9], [0.1, 0.5, 0.9]) == 0.5  # identical groups
    assert stats.common_language([1.0, 1.0], [1.0, 1.0]) == 0.5  # all ties count a half
    # 2 of the 4 pairs won (3>2, 3>1), one tie (1=1) and one lost (1<2): (2 + 0.5) / 4.
    assert stats.common_language([3, 1], [2, 1]) == 0.625
    # A loss: lower is better, so the lower group improves on the higher one.
    assert stats.common_language([0.1, 0.2], [0.5, 0.6], higher_is_better=False) == 1.0
    assert "Mann-Whitney" in stats.CL_FORMULA and "not the probability" in stats.CL_FORMULA


# ------------------------------------------------------------------- the paired comparison, against textbook cases

# Student (1908)'s sleep data (Cushny & Peebles): extra hours of sleep under drug 2 minus drug 1, for 10 patients.
SLEEP = [1.2, 2.4, 1.3, 1.3, 0.0, 1.0, 1.8, 0.8, 4.6, 1.4]


def test_the_paired_t_interval_of_students_sleep_data():
    """By hand: mean d = 15.8 / 10 = 1.58. Deviations -0.38, 0.82, -0.28, -0.28, -1.58, -0.58, 0.22, -0.78, 3.02,
    -0.18; their squares sum to 13.616, so sd = sqrt(13.616 / 9) = 1.22999 and se = 1.22999 / sqrt(10) = 0.388959;
    t = 1.58 / 0.388959 = 4.0621 on 9 degrees of freedom, two-sided p = 0.002833. From a t table, t_(0.975, 9) =
    2.262157: 1.58 ± 0.879886 = [0.700114, 2.459886], the interval R's own example gives
    (t.test(extra ~ group, data = sleep, paired = TRUE): -2.4598858 to -0.7001142 for drug 1 minus drug 2).
    At 99%, t_(0.995, 9) = 3.249836: 1.58 ± 1.264046 = [0.315954, 2.844046]."""
    p = stats.paired_t(SLEEP)
    assert p.n == 10 and p.mean == pytest.approx(1.58) and p.sd == pytest.approx(1.229995, abs=1e-6)
    assert p.p == pytest.approx(0.002833, abs=1e-6)
    assert p.interval(0.05) == pytest.approx((0.7001142, 2.4598858), abs=1e-6)
    assert p.interval(0.01) == pytest.approx((0.315954, 2.844046), abs=1e-5)
    flipped = stats.paired_t([-d for d in SLEEP])  # drug 1 minus drug 2: the same test, the interval mirrored
    assert flipped.interval() == pytest.approx((-2.4598858, -0.7001142), abs=1e-6) and flipped.p == pytest.approx(p.p)


def test_a_paired_t_on_three_seeds_has_the_closed_form_of_two_degrees_of_freedom():
    """Differences 0.8, 0.55, 0.7: mean 0.68333; deviations 0.11667, -0.13333, 0.01667, squares summing to 0.031667;
    sd = sqrt(0.031667 / 2) = 0.125831, se = 0.072648, t = 9.4061. With 2 degrees of freedom the t distribution has
    a closed form: two-sided p = 1 - |t| / sqrt(t^2 + 2) = 1 - 9.4061 / 9.5118 = 0.01111. t_(0.975, 2) = 4.302653:
    0.68333 ± 0.312578 = [0.370755, 0.995911]."""
    p = stats.paired_t([0.8, 0.55, 0.7])
    assert p.p == pytest.approx(0.01111, abs=2e-5)
    assert p.interval() == pytest.approx((0.370755, 0.995911), abs=2e-5)


def test_runs_pair_by_seed_and_a_seed_without_two_finite_values_is_left_out():
    """Seeds 0-2 differ by 0.8, 0.55, 0.7 (the closed-form case above, listed out of order); seed 3 has no partner,
    seed 4 diverged on one side (NaN): neither enters the pairs."""
    a = [{"seed": 2, "x": 1.7}, {"seed": 0, "x": 1.8}, {"seed": 1, "x": 1.55}, {"seed": 3, "x": 9.0},
         {"seed": 4, "x": float("nan")}]
    b = [{"seed": 0, "x": 1.0}, {"seed": 1, "x": 1.0}, {"seed": 2, "x": 1.0}, {"seed": 4, "x": 1.0}]
    p = stats.paired_by_seed(a, b, lambda r: r["x"])
    assert p.diffs == pytest.approx((0.8, 0.55, 0.7)) and p.p == pytest.approx(0.01111, abs=2e-5)
    assert stats.paired_by_seed(a[:1], b, lambda r: r["x"]) is None  # one shared seed: nothing to test


def test_degenerate_pairs():
    assert stats.paired_t([0.3]) is None  # one pair: no spread to test against
    same = stats.paired_t([0.2, 0.2, 0.2])  # no seed noise at all: decided, the interval the point
    assert same.p == 0.0 and same.interval() == pytest.approx((0.2, 0.2))
    assert stats.paired_t([0.0, 0.0]).p == 1.0  # nothing differs


def test_the_exact_sign_flip_p_on_5_and_on_6_pairs():
    """2^n sign assignments. d = 1..5, all positive: only all-plus and all-minus reach |sum| 15, so p = 2/32 =
    0.0625: 5 pairs can never reach 0.05. d = 1, 2, 3, 4, -5: |sum| = 5. A sign pattern that makes the magnitudes in
    a set N negative sums to 15 - 2 sum(N); |15 - 2 sum(N)| >= 5 when sum(N) <= 5 or >= 10. Subsets of {1..5} with
    sum <= 5: {} ; {1} {2} {3} {4} {5} ; {1,2} {1,3} {1,4} {2,3}: 10, and by complement 10 with sum >= 10: p =
    20/32 = 0.625. d = 1..6, all positive: p = 2/64 = 0.03125, the first n that can reach 0.05. d = 1..5, -6:
    |sum| = 9 = |21 - 2 sum(N)| when sum(N) <= 6 or >= 15: {} ; six singles ; {1,2} {1,3} {1,4} {1,5} {2,3} {2,4} ;
    {1,2,3}: 14, and 14 by complement: p = 28/64 = 0.4375."""
    assert stats.sign_flip_p([1, 2, 3, 4, 5]) == 2 / 32
    assert stats.sign_flip_p([1, 2, 3, 4, -5]) == 20 / 32
    assert stats.sign_flip_p([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]) == 2 / 64
    assert stats.sign_flip_p([1, 2, 3, 4, 5, -6]) == 28 / 64
    assert stats.MIN_FLIP_PAIRS == 6 and 2 / 2 ** (stats.MIN_FLIP_PAIRS - 1) > 0.05 >= 2 / 2 ** stats.MIN_FLIP_PAIRS


def test_holm_on_three_p_values():
    """Holm at 0.05 over p = 0.01, 0.04, 0.03. Sorted: 0.01 <= 0.05/3 = 0.0167, rejected; 0.03 > 0.05/2 = 0.025,
    so the step-down stops: 0.03 and 0.04 stand. Adjusted: 3 x 0.01 = 0.03; max(0.03, 2 x 0.03) = 0.06;
    max(0.06, 1 x 0.04) = 0.06. Levels: 0.05/3 for the first; from the failed step on, its level 0.025 (so 0.04's
    interval at 97.5% holds 0, as Holm decides, though 0.04 < 0.05). Bonferroni would give the same here; with
    p = 0.01, 0.02, 0.04 Holm rejects all three (0.01 <= 0.0167, 0.02 <= 0.025, 0.04 <= 0.05; adjusted 0.03, 0.04,
    0.04) where Bonferroni (3 x 0.02 = 0.06) keeps two."""
    h = stats.holm([0.01, 0.04, 0.03])
    assert [x.rejected for x in h] == [True, False, False]
    assert [x.adjusted for x in h] == pytest.approx([0.03, 0.06, 0.06])
    assert [x.level for x in h] == pytest.approx([0.05 / 3, 0.025, 0.025])
    h = stats.holm([0.01, 0.02, 0.04])
    assert [x.rejected for x in h] == [True, True, True]
    assert [x.adjusted for x in h] == pytest.approx([0.03, 0.04, 0.04])
    assert [x.level for x in h] == pytest.approx([0.05 / 3, 0.025, 0.05])
    # A claim not tested counts in m and is never decided: m = 3, 0.001 <= 0.05/3, then 0.02 <= 0.05/2.
    h = stats.holm([0.02, None, 0.001])
    assert [x.rejected for x in h] == [True, False, True] and h[1].adjusted is None
    assert h[0].adjusted == pytest.approx(0.04) and h[2].adjusted == pytest.approx(0.003)
    assert [x.rejected for x in stats.holm([0.02, None, None])] == [False, False, False]  # 0.02 > 0.05/3


def test_the_smallest_difference_detectable_at_80_percent_power():
    """sd of the differences 1, 10 pairs, alpha 0.05: from a t table t_(0.975, 9) = 2.262157 and t_(0.80, 9) =
    0.883404, so (2.262157 + 0.883404) x 1 / sqrt(10) = 3.145561 / 3.162278 = 0.994714."""
    assert stats.detectable(1.0, 10) == pytest.approx(0.994714, abs=1e-6)
    assert stats.detectable(2.0, 10) == pytest.approx(2 * 0.994714, abs=2e-6)
    assert stats.detectable(1.0, 1) is None


def test_a_confidence_near_100_percent_keeps_the_digits_that_tell_it_from_100():
    assert stats.confidence(0.05) == "95%" and stats.confidence(0.0167) == "98.3%"
    # muon_lr's first group-sequential look tests at 0.000112: its interval is 99.99% (99.9888), not "100%"
    assert stats.confidence(0.000112) == "99.99%" and stats.confidence(0.00229) == "99.8%"


def test_numbers_keep_their_difference_when_written():
    assert stats.fmt(0.8514) == "0.851" and stats.fmt(123456.7) == "123,457"
    # Two small, different values (a rare-event rate, a tiny gradient) must not both read 0.000.
    assert stats.fmt(0.00031) == "0.00031" and stats.fmt(0.00042) != stats.fmt(0.00031)
    assert stats.fmt(0.0) == "0.000"
    assert stats.mean_interval(stats.estimate([0.0003, 0.0004, 0.0005])).startswith("0.0004 [")


def row(setting, seed, **metrics) -> dict:
    return {"run": f"/sweep/{setting}-{seed}", "status": "completed", "setting": setting, "seed": seed,
            "diverged": 0.0, **metrics}


def test_findings_pair_by_seed_and_name_a_winner_only_where_holm_rejects():
    rows = [row("a", s, exact_match_in=v) for s, v in enumerate((0.90, 0.92, 0.94))]
    rows += [row("b", s, exact_match_in=v) for s, v in enumerate((0.50, 0.52, 0.54))]
    rows += [row("c", s, exact_match_in=v) for s, v in enumerate((0.91, 0.80, 0.93))]
    (apart,) = findings([r for r in rows if r["setting"] != "c"], ["setting"], "exact_match_in")
    assert apart.text.startswith("exact_match_in (higher is better): setting=a is best, 0.920 [0.900, 0.940]")
    assert "its paired difference from every other setting excludes 0 (Holm)" in apart.text
    # a - b is 0.40 on every seed: no seed noise at all, p = 0.
    assert apart.details == ["setting=b: 0.520 [0.500, 0.540]; best − it, paired over 3 seeds: +0.400 [0.400, 0.400] "
                             "(95%, Holm), p < 0.001 (Holm); the best is better."]
    (mixed,) = findings(rows, ["setting"], "exact_match_in")
    assert "better than 1 of 2 other settings (paired, Holm), not distinguishable from the rest" in mixed.text
    # a - c by seed: -0.01, +0.12, +0.01. Mean 0.04, sd sqrt((0.05² + 0.08² + 0.03²) / 2) = 0.07, t = 0.04 / (0.07 /
    # sqrt 3) = 0.9897 at 2 df, two-sided p = 1 - t / sqrt(2 + t²) = 0.427. Holm: b (p 0) is rejected at 0.025, so c
    # is tested at 0.05, adjusted p = 1 x 0.427; its 95% interval is 0.04 ± 4.303 x 0.07 / sqrt 3 = [-0.134, +0.214].
    assert mixed.details[0] == ("setting=c: 0.880 [0.800, 0.930]; best − it, paired over 3 seeds: +0.040 "
                                "[-0.134, 0.214] (95%, Holm), p = 0.427 (Holm); not distinguishable at 3 paired seeds.")
    (close,) = findings([r for r in rows if r["setting"] != "b"], ["setting"], "exact_match_in")
    assert close.text == ("exact_match_in (higher is better): not distinguishable at 3 seeds: the best mean is setting=a "
                          "0.920 [0.900, 0.940], and no paired difference from it clears Holm's correction, so no winner "
                          "is named.")


def test_findings_pair_only_the_seeds_both_settings_ran():
    rows = [row("a", s, exact_match_in=v) for s, v in enumerate((0.90, 0.92, 0.94, 0.99))]
    rows += [row("b", s, exact_match_in=v) for s, v in ((0, 0.50), (2, 0.58))]
    (finding,) = findings(rows, ["setting"], "exact_match_in")
    assert "paired over 2 seeds: +0.380" in finding.details[0]  # seeds 0 and 2: 0.40 and 0.36
    single = rows[:4] + [row("b", 0, exact_match_in=0.5), row("b", 7, exact_match_in=0.6)]
    (lone,) = findings(single, ["setting"], "exact_match_in")
    assert lone.details[0].endswith("fewer than 2 seeds shared with the best, so not tested.")
    assert "not distinguishable" in lone.text


def test_settings_tied_with_the_best_on_every_seed_share_one_line():
    rows = [row(name, s, diverged=0.0) for name in "abc" for s in range(3)]
    rows += [row("d", s, diverged=1.0) for s in range(3)]
    (finding,) = findings(rows, ["setting"], "diverged")
    assert finding.details[0] == ("2 other settings score exactly as the best does on every seed (0.000): "
                                  "setting=b; setting=c.")
    assert len(finding.details) == 2 and finding.details[1].startswith("setting=d: 1.000")


def test_a_loss_is_better_lower_and_a_diagnostic_has_no_winner_word():
    rows = [row("a", s, final_val_loss=v, head_similarity=v) for s, v in enumerate((0.1, 0.11, 0.12))]
    rows += [row("b", s, final_val_loss=v, head_similarity=v) for s, v in enumerate((0.5, 0.51, 0.52))]
    assert findings(rows, ["setting"], "final_val_loss")[0].text.startswith(
        "final_val_loss (lower is better): setting=a is best, 0.110")
    similarity = findings(rows, ["setting"], "head_similarity")[0]
    assert similarity.text.startswith("head_similarity (no better direction): setting=b is highest, 0.510")
    assert similarity.details[0].endswith("paired over 3 seeds: +0.400 [0.400, 0.400] (95%, Holm), p < 0.001 (Holm); "
                                          "the highest is higher.")


def test_degenerate_metrics_read_as_sentences():
    rows = [row(k, s, exact_match_out=0.0, exact_match_in=v) for k, v in (("a", 0.5), ("b", 0.7)) for s in (0, 1)]
    (zero,) = findings(rows, ["setting"], "exact_match_out")
    assert zero.text == "every setting scores 0.000 on exact_match_out (4 runs): it does not tell the settings apart."
    single = [row(k, 0, exact_match_in=v) for k, v in (("a", 0.5), ("b", 0.7))]
    (one,) = findings(single, ["setting"], "exact_match_in")
    assert "one run each, so the seed spread is unknown and no winner is named" in one.text
    assert findings(rows, ["setting"], "tokens_per_s") == []  # a metric no run records says nothing


# ------------------------------------------------------------------------------------- study.metrics, checked

def test_study_metrics_are_checked_by_the_schema_and_by_the_report():
    config = {"seed": 0, "study": {"name": "s", "metrics": "exact_match_in"}}
    assert ("study.metrics='exact_match_in' must be a non-empty list of result columns, e.g. [exact_match_in, "
            "final_val_loss]") in schema_errors_top(config)
    assert not any("study" in e for e in schema_errors_top({"seed": 0, "study": {"metrics": ["exact_match_in"]}}))
    assert not any("study" in e for e in schema_errors_top({"seed": 0, "study": None}))
    assert metrics_spec(["exact_match_in", "costs.decode_state_bytes"]) == ["exact_match_in", "costs.decode_state_bytes"]
    with pytest.raises(ConfigError, match=r"study.metrics: 'exact_match_inn' is not a report column; did you mean "
                                          r"exact_match_in\?"):
        metrics_spec(["exact_match_inn"])
    # No study.metrics: the losses and exact match the runs record.
    assert metrics_spec(None, [{"final_val_loss": 1.0, "exact_match_in": None}]) == ["final_val_loss"]


def schema_errors_top(top: dict) -> list[str]:
    """The schema's lines for the top-level keys (the groups composed from the defaults)."""
    config = OmegaConf.to_container(compose_config([]), resolve=True)
    return schema_errors({**config, **top})


def test_every_sweep_names_metrics_the_report_has():
    for path in sorted((CONF / "sweep").glob("*.yaml")):
        study = OmegaConf.load(path).get("study") or {}
        if "metrics" not in study:
            continue
        assert metrics_spec(list(study["metrics"])), path.name
        assert all(m in METRICS or "." in m for m in study["metrics"]), path.name


# ------------------------------------------------------------------------- a fabricated sweep, built end to end

STUDY = {"name": "fmt", "question": "Does reversing the answer make addition learnable?",
         "compare": ["task.reverse_answer"], "metrics": ["exact_match_in", "exact_match_out"],
         "plots": [{"kind": "by_length", "metric": "exact_match", "by": "task.reverse_answer"},
                   {"kind": "bar", "metric": "exact_match_in", "by": ["task.reverse_answer"]}]}
# reverse_answer -> in-distribution exact match per seed (lengths 1-3; 4-6 all score 0)
SCORES = {True: (0.95, 0.97, 0.99), False: (0.40, 0.45, 0.50)}


def fabricate(root, study=STUDY, scores=SCORES, curve=True):
    for reverse, per_seed in scores.items():
        for seed, em in enumerate(per_seed):
            run_dir = root / f"task.reverse_answer={reverse},seed={seed}"
            (run_dir / ".hydra").mkdir(parents=True)
            config = {"study": study, "seed": seed, "task": {"name": "addition", "reverse_answer": reverse},
                      "trainer": {"max_steps": 100}, "optim": {"lr": 0.001, "warmup_steps": 10},
                      "model": {"d_model": 64}}
            OmegaConf.save(OmegaConf.create(config), run_dir / ".hydra" / "config.yaml")
            results = {
                "status": "completed", "task": "addition", "study": study["name"], "choices": {"seed": seed},
                "params": 5000, "steps": 100, "train_time_s": 1.0, "tokens_per_s": 1000.0 + 100 * seed,
                "final_train_loss": 0.1, "final_val_loss": 1 - em, "diverged_at_step": None, "train_lengths": [1, 3],
                "overrides": [f"task.reverse_answer={reverse}", f"seed={seed}"],
                "eval": [{"length": n, "in_distribution": n <= 3, "exact_match": em if n <= 3 else 0.0,
                          "token_acc": em, "loss": 1 - em, "n": 64} for n in range(1, 7)],
                "decode": {"kv_cache_bytes_per_token": 1024, "tokens_per_s": 500.0},
                "costs": {"forward_flops_per_token": 12000.0, "decode_state_bytes": 2048},
            }
            if curve:  # a point every 5 steps; the early loss (25% of 100 steps) is step 25's: 2 + seed
                results["train_loss_curve"] = [[step, 2.0 + seed if step == 25 else 3.0] for step in range(5, 101, 5)]
            (run_dir / "results.json").write_text(json.dumps(results))
    return collect(root)


def cells_of(page: str, cls: str) -> tuple[list[str], list[list[str]]]:
    body = re.search(rf"<table class='{cls}'>(.*?)</table>", page, re.DOTALL).group(1)
    header = re.findall(r"<th>(.*?)</th>", body)
    rows = [re.findall(r"<td>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", body)]
    return header, [r for r in rows if r]


def test_the_report_tables_show_the_study_metrics_with_intervals_and_the_csv_keeps_everything(tmp_path):
    root = tmp_path / "fmt"
    rows = fabricate(root)
    page = build_report(root, rows, study_specs(root, rows)).read_text()
    header, body = cells_of(page, "metrics")
    assert header == ["task.reverse_answer", "seeds", "exact_match_in (mean)", "exact_match_in 95% CI",
                      "exact_match_out (mean)", "exact_match_out 95% CI", "learned (seeds that clear their task&#39;s bar)"]
    assert body[0][:4] == ["False", "3", "0.450", "[0.400, 0.500]"]
    assert body[1][:4] == ["True", "3", "0.970", "[0.950, 0.990]"]
    assert body[1][4:6] == ["0.000", "[0.000, 0.000]"]
    # Every seed of reverse_answer=False is below 0.9 on its training lengths: its row says so.
    assert [row[-1] for row in body] == ["0/3 seeds, not learned", "3/3 seeds"]
    for other in ("kv_cache_bytes_per_token", "head_similarity", "final_train_loss", "decode_tokens_per_s"):
        assert other not in header
    with open(root / "report" / "summary.csv") as f:
        columns = next(csv.reader(f))
    assert {"kv_cache_bytes_per_token", "decode_tokens_per_s", "final_train_loss", "exact_match_in", "early_loss",
            "flops_per_token", "tokens_per_s", "params", "steps"} <= set(columns)
    # The findings answer with the study's metrics, on every one only the setting that learned (reverse_answer=False
    # never learned), and say so: its exact match in distribution, the all-zero sentence beyond.
    assert ("Among the settings that learned in distribution (left out as not learned: reverse_answer=False): "
            "exact_match_in: reverse_answer=True 0.970 [0.950, 0.990] over 3 seeds.") in page
    assert ("Among the settings that learned in distribution (left out as not learned: reverse_answer=False): every "
            "run scores 0.000 on exact_match_out (3 runs): it does not tell the settings apart.") in page
    assert "no setting generalizes beyond the training length: no seed reaches exact_match ≥ 0.9" in page
    assert "final_val_loss" not in re.search(r"What the numbers show.*?</ul>", page, re.DOTALL).group(0)


def test_the_summary_has_the_narang_layout_with_hand_computed_cells(tmp_path):
    root = tmp_path / "fmt"
    rows = fabricate(root)
    header, body = cells_of(section("fmt", STUDY, rows, tmp_path), "summary")
    assert header == ["task.reverse_answer", "seeds", "params", "FLOPs/token (forward)", "tokens/s (training)",
                      "early train loss (25% of steps, mean ± sd)", "final val loss [95% CI]",
                      "exact match in distribution [95% CI]", "exact match beyond training [95% CI]"]
    # tokens/s 1000, 1100, 1200: mean 1100, sd 100; early loss 2, 3, 4: mean 3, sd 1; val loss 1 - exact match.
    assert body[1] == ["True", "3", "5,000", "12,000", "1,100 ± 100", "3.000 ± 1.000", "0.030 [0.010, 0.050]",
                       "0.970 [0.950, 0.990]", "0.000 [0.000, 0.000]"]
    old = fabricate(tmp_path / "old", curve=False)  # runs from before train_loss_curve
    page = section("fmt", STUDY, old, tmp_path)
    assert "early train loss" not in cells_of(page, "summary")[0]
    assert "Not recorded by these runs, so not shown: early train loss (25% of steps, mean ± sd)" in page


def test_the_budget_is_read_from_the_runs(tmp_path):
    page = section("fmt", STUDY, fabricate(tmp_path / "fmt"), tmp_path)
    assert ("<b>Budget.</b> 100 training steps per run; 3 seeds per setting (2 settings; seeds 0, 1, 2); one value "
            "for every setting, not tuned per setting: optim.lr=0.001, optim.warmup_steps=10, model.d_model=64.") in page


def test_a_run_is_short_only_of_its_own_planned_steps():
    """With trainer.max_steps swept, 500-step runs beside 1500-step runs finished; one that stopped at 300 of its
    500 (diverged) did not."""
    runs = [{"seed": s, "method": "a", "trainer.max_steps": planned, "steps": planned}
            for s in (0, 1) for planned in (500, 1500)]
    compare = ["method", "trainer.max_steps"]  # as the report compares them (pooled: the swept key split out)
    assert "500/1500 training steps per run; 2 seeds per setting (2 settings; seeds 0, 1)" in budget(runs, compare)
    assert "stopped early" not in budget(runs, compare)
    runs.append({"seed": 2, "method": "a", "trainer.max_steps": 500, "steps": 300})
    assert "(1 of 5 runs stopped early, at 300 steps or more)" in budget(runs, compare)
    assert "(1 setting;" in budget(runs[:2], ["method"])


def test_seeds_reaching_the_threshold_at_each_length(tmp_path):
    scores = {True: (0.95, 0.85, 0.99), False: (0.40, 0.45, 0.50)}
    page = section("fmt", STUDY, fabricate(tmp_path / "fmt", scores=scores), tmp_path)
    header, body = cells_of(page, "reach")
    assert header == ["task.reverse_answer", "1", "2", "3", "4", "5", "6"]
    assert body == [["False", "0/3", "0/3", "0/3", "0/3", "0/3", "0/3"],
                    ["True", "2/3", "2/3", "2/3", "0/3", "0/3", "0/3"]]


def test_every_image_of_the_report_decodes(tmp_path):
    root = tmp_path / "fmt"
    rows = fabricate(root)
    page = build_report(root, rows, study_specs(root, rows)).read_text()
    images = re.findall(r"<img alt='[^']*' src='data:image/png;base64,([^']+)'>", page)
    assert len(images) == len(STUDY["plots"]) == page.count("<img")
    for data in images:
        image = Image.open(io.BytesIO(base64.b64decode(data)))
        image.load()
        assert image.format == "PNG" and image.width > 300 and image.height > 200


def test_a_bad_metric_name_fails_before_anything_is_written(tmp_path):
    root = tmp_path / "fmt"
    rows = fabricate(root, study={**STUDY, "metrics": ["exact_mach_in"]})
    with pytest.raises(ConfigError, match="did you mean exact_match_in"):
        build_report(root, rows, study_specs(root, rows))
    assert not (root / "report").exists()


# ------------------------------------------------------------------------------------ what results.json records

def test_the_early_loss_is_the_curve_point_at_a_quarter_of_training():
    curve = [[step, step / 100] for step in range(10, 101, 10)]
    assert early_loss(curve, 100) == 0.2  # 25 is as near 20 as 30: the first of them
    assert early_loss(curve, 200) == 0.5
    assert early_loss([[10, 3.0], [20, None]], 100) is None  # stopped (diverged) long before step 25
    assert early_loss(None, 100) is None


def test_forward_flops_per_token_counts_the_matmuls_and_attention(run_dir):
    """2 FLOPs per multiply-add of every linear layer (the head included) per token, plus QK^T and AV: 2 x 2 x T x
    d_model per token per layer, over the full square (the causal mask is work the kernel still does)."""
    import torch

    from blocklab.model import build_model
    from blocklab.train.costs import forward_flops_per_token
    from blocklab.train.run import prepare

    setup = prepare(compose_config(["attn=mha"], run_dir))
    model = build_model(setup.model_cfg)
    batch = next(iter(setup.task.train_batches()))
    tokens = batch["input"].shape[1]
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = setup.model_cfg
    assert forward_flops_per_token(model, batch) == 2 * linear + 4 * cfg.n_layers * tokens * cfg.d_model


def test_a_run_records_its_training_loss_curve_and_flops(run_dir):
    run_in_process([*FAST, "trainer.max_steps=40", "trainer.val_check_interval=40"], run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    curve = results["train_loss_curve"]
    assert [step for step, _ in curve] == list(range(2, 41, 2))  # 40 // 20 = a point every 2 steps
    assert all(loss > 0 for _, loss in curve)
    assert results["costs"]["forward_flops_per_token"] > 2 * results["params"] * 0.5
    row = collect(run_dir.parent)[0]
    assert row["early_loss"] == curve[4][1]  # step 10 = 25% of 40


# ------------------------------------------------------------------------------------------------ the curves

def test_curves_carry_seed_bands_short_labels_and_a_legend_beside_the_axes():
    import matplotlib.pyplot as plt

    from blocklab.report.build import PLOTS

    rows = [{**row(task, seed, final_val_loss=base + heads / 10 + seed / 100), "task": task, "n_heads": heads,
             "layers_end": {"activation_rms": [1.0 + seed, 2.0 + seed]}, "model.n_layers": 2}
            for task, base in (("copy", 0.0), ("lm", 2.0)) for heads in (1, 2, 4) for seed in (0, 1, 2)]
    fig, ax = plt.subplots()
    PLOTS["by_choice"](ax, rows, {"x": "n_heads"}, "final_val_loss", ["task"])
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["copy", "lm"]  # the swept values; the legend's title names the key
    assert list(lines["copy"].get_ydata()) == pytest.approx([0.11, 0.21, 0.41])
    band = ax.collections[0].get_paths()[0].vertices  # seeds 0 and 2: the mean +- 0.01
    assert {(float(x), round(float(y), 6)) for x, y in band} >= {(1.0, 0.1), (1.0, 0.12), (4.0, 0.4), (4.0, 0.42)}
    legend = ax.get_legend()
    assert legend.get_title().get_text() == "task"
    fig.canvas.draw()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # beside the data, never over it
    plt.close(fig)
    fig, ax = plt.subplots()
    PLOTS["by_layer"](ax, rows, {"when": "end"}, "activation_rms", ["task"])
    assert [line.get_label() for line in ax.get_lines()] == ["copy, 2", "lm, 2"]
    assert list(ax.get_lines()[0].get_ydata()) == [2.0, 3.0] and len(ax.collections) == 2
    assert ax.get_legend().get_title().get_text() == "task, n_layers"
    plt.close(fig)


def test_a_curve_over_a_choice_reads_a_results_field_by_its_dotted_path(tmp_path):
    """attention_cost plots costs.step_peak_bytes, which is in results.json, not a report column."""
    import matplotlib.pyplot as plt

    from blocklab.report.build import PLOTS

    rows = []
    for block in (256, 512):
        for seed in (0, 1):
            run = tmp_path / f"b{block}-s{seed}"
            run.mkdir()
            (run / "results.json").write_text(json.dumps({"costs": {"step_peak_bytes": block * 1000 + seed}}))
            rows.append({**row("mha", seed), "run": str(run), "attn": "mha", "task.block_size": block})
    fig, ax = plt.subplots()
    assert PLOTS["by_choice"](ax, rows, {"x": "task.block_size"}, "costs.step_peak_bytes", ["attn"]) is None
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [256, 512] and list(line.get_ydata()) == [256000.5, 512000.5]
    plt.close(fig)
    fig, ax = plt.subplots()  # a field no run has: said on the axes, not a crash on the log axis
    assert "not recorded" in PLOTS["by_choice"](ax, rows, {"x": "task.block_size"}, "costs.missing", ["attn"])
    plt.close(fig)
