"""The decide loop's sequential design (issue 55 item 1): the O'Brien-Fleming-type spending boundaries against
published values and an independent integration, and the loop itself simulated with a fake runner (a metric per
seed): no true difference -> at most 5% of runs declare one; a large one -> it stops early; only open claims get
seeds. The end-to-end run on real tiny jobs is marked slow."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from blocklab.decide import decide, seeds_error, table
from blocklab.report import sequential
from conftest import ROOT

# R gsDesign (Anderson, CRAN; gsDesign(k=K, test.type=2, alpha=0.025, sfu=sfLDOF)$upper$bound), the same as rpact's
# getDesignGroupSequential(kMax=K, alpha=0.05, sided=2, typeOfDesign="asOF")$criticalValues: two-sided alpha 0.05,
# O'Brien-Fleming-type Lan-DeMets spending, K equally spaced looks, to 3 decimals.
GSDESIGN_LDOF = {2: [2.963, 1.969], 3: [3.710, 2.511, 1.993], 4: [4.333, 2.963, 2.359, 2.014],
                 5: [4.877, 3.357, 2.680, 2.290, 2.031]}
# Jennison & Turnbull 2000, Group Sequential Methods with Applications to Clinical Trials, Table 2.3: O'Brien &
# Fleming's classical constants C_B(K, alpha=0.05); the boundaries C_B sqrt(K/k) exit with probability 0.05.
JT_OBF = {2: 1.977, 3: 2.004, 4: 2.024, 5: 2.040}


@pytest.mark.parametrize("k", sorted(GSDESIGN_LDOF))
def test_spending_boundaries_match_the_published_ones(k):
    fractions = [j / k for j in range(1, k + 1)]
    assert sequential.boundaries(fractions) == pytest.approx(GSDESIGN_LDOF[k], abs=6e-4)


@pytest.mark.parametrize("k", sorted(JT_OBF))
def test_the_integration_gives_alpha_for_the_classical_obrien_fleming_boundaries(k):
    bounds = [JT_OBF[k] * math.sqrt(k / j) for j in range(1, k + 1)]
    assert sequential.exit_probability(bounds, [j / k for j in range(1, k + 1)]) == pytest.approx(0.05, abs=1e-4)


def test_the_spending_function_by_hand():
    """2 sides x (2 - 2 Phi(z_{1-alpha/4} / sqrt t)): z_0.9875 = 2.2414; at t = 1/2, 2.2414 sqrt 2 = 3.1698, whose
    upper tail is 0.000762: 4 x 0.000762 = 0.00305. All of alpha at t = 1."""
    assert sequential.spent(1.0) == pytest.approx(0.05, rel=1e-9)
    assert sequential.spent(0.5) == pytest.approx(0.00305, abs=1e-5)
    assert sequential.spent(0.0) == 0.0


def test_unequal_looks_agree_with_an_independent_multivariate_normal_integration():
    """Looks at 3, 5 and 10 of 10 pairs: with no difference, the chance of staying inside every boundary is
    1 - alpha, computed here by scipy's multivariate normal CDF (Genz) with corr(Z_i, Z_j) = sqrt(t_i / t_j)."""
    t = np.array([0.3, 0.5, 1.0])
    c = np.array(sequential.boundaries(t))
    cov = np.sqrt(np.minimum.outer(t, t) / np.maximum.outer(t, t))
    inside = stats.multivariate_normal(mean=np.zeros(3), cov=cov).cdf(c, lower_limit=-c, rng=np.random.default_rng(0))
    assert inside == pytest.approx(0.95, abs=5e-4)
    first = 2 * stats.norm.sf(c[0])  # the first look spends exactly spent(0.3)
    assert first == pytest.approx(sequential.spent(0.3), rel=1e-6)


class Fake:
    """A fake sweep: claim i's per-seed difference is effect[i] + noise, drawn when its seed is trained."""

    def __init__(self, effects, rng, sd=1.0):
        self.effects, self.rng, self.sd = effects, rng, sd
        self.trained = [dict() for _ in effects]
        self.calls = []

    def run(self, numbers, seeds):
        self.calls.append((numbers, list(seeds)))
        for i in range(len(self.effects)) if numbers is None else numbers:
            for s in seeds:
                assert s not in self.trained[i], "a finished job was trained again"
                self.trained[i][s] = self.effects[i] + self.sd * self.rng.standard_normal()

    def observe(self, limit):
        return [[d for s, d in sorted(t.items()) if s < limit] for t in self.trained]


def _claims(n, **extra):
    return [{"claim": f"claim {i}", "metric": "score", **extra} for i in range(n)]


def test_with_no_true_difference_at_most_five_percent_declare_one():
    """1,000 simulated decide runs (3 to 10 seeds, a look after each): the share that declares a difference stays
    within 5% plus 2.33 binomial standard errors (a plain paired t-test at every look would declare one 17% of the
    time)."""
    rng = np.random.default_rng(2026)
    declared, runs = 0, 1000
    for _ in range(runs):
        fake = Fake([0.0], rng)
        record = decide(_claims(1), 3, 10, fake.run, fake.observe)
        declared += record["claims"][0]["state"] == "rejected"
    assert declared / runs <= 0.05 + 2.33 * math.sqrt(0.05 * 0.95 / runs)


def test_a_large_difference_stops_early_and_only_open_claims_get_seeds():
    """Claim 1 differs by 4 sd, claim 2 not at all: claim 1 is decided (yes: higher is better for this metric)
    well before 10 seeds, and every round after that trains claim 2's settings only."""
    stops = []
    for seed in range(20):
        fake = Fake([4.0, 0.0], np.random.default_rng(seed))
        record = decide(_claims(2), 3, 10, fake.run, fake.observe)
        first, second = record["claims"]
        assert first["state"] == "rejected" and first["outcome"] == "yes"
        stops.append(first["pairs"])
        assert len(fake.trained[0]) == first["pairs"]  # no seed beyond the deciding look
        assert fake.calls[0] == (None, [0, 1, 2])
        assert all(numbers == [1] for numbers, _ in fake.calls[1 + first["pairs"] - 3:])
    assert np.mean(stops) <= 6 and max(stops) < 10


def test_a_difference_inside_min_effect_stops_as_one_that_does_not_matter():
    fake = Fake([0.0], np.random.default_rng(0), sd=0.01)
    record = decide(_claims(1, min_effect=0.5), 3, 10, fake.run, fake.observe)
    claim = record["claims"][0]
    assert claim["outcome"] == "no difference that matters" and claim["pairs"] < 10
    low, high = claim["interval"]
    assert -0.5 <= low and high <= 0.5
    decided = decide(_claims(1, min_effect=0.5), 3, 10, *_runner(Fake([0.1], np.random.default_rng(0), sd=0.001)))
    claim = decided["claims"][0]  # decided, by 0.1: less than matters, as the page's own rule words it
    assert claim["state"] == "rejected" and claim["outcome"] == "no difference that matters"


def _runner(fake):
    return fake.run, fake.observe


def test_a_claim_that_cannot_be_tested_stops_and_counts_in_holm():
    fake = Fake([0.0, 0.0], np.random.default_rng(0))
    observe = fake.observe
    fake.observe = lambda limit: ["constant metric", observe(limit)[1]]
    record = decide(_claims(2), 3, 4, fake.run, fake.observe)
    untestable, other = record["claims"]
    assert untestable["outcome"] == "not testable" and untestable["why"] == "constant metric"
    assert other["holm_level"] == pytest.approx(0.025)  # alpha / 2: the untestable claim is one of m
    assert "seeds 3-4" in table(record) and "group-sequential" in record["design"]


def test_study_seeds_must_be_a_range_of_whole_numbers():
    assert seeds_error({"min": 3, "max": 10}) is None
    assert "declares no study.seeds" in seeds_error(None)
    for bad in ({"min": 1, "max": 5}, {"min": 5, "max": 3}, {"min": 3}, {"min": 3.0, "max": 5}, [3, 10]):
        assert seeds_error(bad).startswith("study.seeds="), bad


@pytest.mark.slow
def test_decide_runs_a_tiny_sweep_end_to_end_and_trains_nothing_twice(tmp_path):
    """causal_mask at 20 steps, its claim judged on the training loss (seeing the future lowers it), 2 to 4 seeds:
    the claim and the seeds given on the command line are decide's, and name no job. 20 steps learn nothing, so the
    learned gate would make the claim not testable at once; the claim is declared cost_only (no gate) because this
    test is about the loop's rounds, not about learning."""
    out = tmp_path / "sweep"
    args = [sys.executable, "-m", "blocklab.decide", "sweep=causal_mask", "study.verdict.metric=final_train_loss",
            "study.verdict.better={attn.causal: false}", "study.verdict.than={attn.causal: true}",
            "+study.seeds={min: 2, max: 4}", "+study.verdict.cost_only=true", "trainer.max_steps=20", "trainer.val_check_interval=20",
            "task.eval_examples=8", f"hydra.sweep.dir={out}", "logger=none", "diagnostics=none",
            "hydra.launcher.n_jobs=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    first = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    record = json.loads((out / "decide.json").read_text())
    claim = record["claims"][0]
    runs = sorted(p.parent.name for p in out.glob("*/results.json"))
    assert len(runs) == 2 * record["seeds_run"]  # both settings, every seed the loop asked for, once
    assert all("study" not in name for name in runs)
    assert claim["pairs"] == record["seeds_run"] and 2 <= record["seeds_run"] <= 4
    assert claim["outcome"] in ("yes", "no", "not distinguishable") and claim["why"]
    assert "design:" in first.stdout and claim["claim"] in first.stdout
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/results.json")}
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/results.json")} == stamps  # nothing trained again
    assert json.loads((out / "decide.json").read_text())["claims"] == record["claims"]


def _page(diffs, claim):
    meta = {"study": {"compare": ["k"], "verdict": claim}}
    jobs = [{"setting": {"k": side}, "seed": s, "status": "completed", "choices": {},
             "metrics": {"score": (1.0 + d if side == "a" else 1.0) + 0.01 * s}}
            for s, d in enumerate(diffs) for side in ("a", "b")]
    return meta, jobs


def test_a_page_shows_the_sequential_decision_and_names_its_design():
    """The page's jsonl carries decide.json (findings_data): the claim decide decided reads its design's numbers and
    the page names the design; a record made for other claims (their fingerprint) is not applied."""
    from blocklab.report.claims import claims_hash
    from blocklab.report.judge import differences, judge_page, rule

    claim = {"claim": "A beats B", "metric": "score", "better": {"k": "a"}, "than": {"k": "b"}}
    meta, jobs = _page([0.3, 0.5, 0.4, 0.6], claim)
    assert differences(meta, jobs, claim) == pytest.approx([0.3, 0.5, 0.4, 0.6])
    fake = Fake([0.0], None)
    fake.observe = lambda limit: [differences(meta, [j for j in jobs if j["seed"] < limit], claim)]
    fake.run = lambda numbers, seeds: None
    record = decide([claim], 3, 4, fake.run, fake.observe)
    record["claims_hash"] = claims_hash(claim)
    fixed = judge_page(meta, jobs)[0]
    verdict = judge_page({**meta, "decide": record}, jobs)[0]
    c = record["claims"][0]
    assert verdict.outcome == {"rejected": "yes", "max": "nd"}[c["state"]]
    assert "Decided by the group-sequential design" in verdict.sentence and "(sequential)" in verdict.row[5]
    assert f"{c['pairs']} seeds" in verdict.sentence and "repeated" in verdict.sentence
    assert "last look's nominal level" in verdict.floor  # the page keeps its noise floor
    assert "O'Brien-Fleming" in rule({**meta, "decide": record}) and rule(meta) is None
    other = {**record, "claims_hash": claims_hash({**claim, "claim": "B beats A"})}
    assert judge_page({**meta, "decide": other}, jobs)[0].sentence == fixed.sentence


def test_the_command_reads_the_study_through_swept_overrides_and_passes_no_claim_to_the_jobs(capsys):
    """A launch's own sweep (k=1,4) composes no study, so the study is read without it; the claim and the seeds
    given on the command line are decide's and are not passed on (they would name every job's folder)."""
    from blocklab.decide import Sweep, main

    sweep = Sweep(["sweep=causal_mask", "attn.causal=true,false", "+study.seeds={min: 3, max: 5}",
                   "study.verdict.metric=final_train_loss", "trainer.max_steps=20"])
    assert sweep.name == "causal_mask" and sweep.study["seeds"] == {"min": 3, "max": 5}
    assert sweep.claims[0]["metric"] == "final_train_loss"
    assert sweep.passed == ["sweep=causal_mask", "attn.causal=true,false", "trainer.max_steps=20"]
    with pytest.raises(SystemExit) as refused:  # bad input: one line, exit 2, before any job
        main(["sweep=causal_mask", "hydra.sweep.dir=/nonexistent/never"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and len(err.strip().splitlines()) == 1 and "declares no study.seeds" in err


def test_a_sweep_of_modifications_composes_in_a_fresh_process():
    """muon_lr picks `modification=baseline`, an option the modifications module registers on import: decide must
    register it too (a fresh process, so no other test's import does it for it)."""
    import subprocess
    import sys

    code = ("from blocklab.decide import Sweep; s = Sweep(['sweep=muon_lr']); "
            "print(s.name, s.study['seeds']['max'], len(s.claims))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["muon_lr", "10", "2"]


def test_a_rounds_settings_launch_as_few_sweeps_as_give_exactly_them():
    from blocklab.decide import launches

    assert launches({("model.n_heads=1", "task=lm"), ("model.n_heads=4", "task=lm")}) == [
        ["model.n_heads=1,4", "task=lm"]]
    assert launches({("model.n_heads=1", "task=lm"), ("model.n_heads=4", "task=copy")}) == [
        ["model.n_heads=1", "task=lm"], ["model.n_heads=4", "task=copy"]]  # not a grid: 1/copy was not asked for
    assert launches({("a=1", "b=x"), ("a=2", "b=x"), ("a=1", "b=y"), ("a=2", "b=y"), ("c=[1,2]",)}) == [
        ["a=1,2", "b=x,y"], ["c=[1,2]"]]


def test_decide_reads_steps_to_target_off_the_curves_as_the_page_does(monkeypatch):
    """muon_lr's second claim is on steps_to_target, which no run records: the page reads it off each run's
    val_loss_curve (report/targets.py), and decide must too, or it calls the claim not testable."""
    import blocklab.report.collect as collect_module
    import blocklab.report.findings_data as findings_data
    from blocklab.decide import Sweep

    sweep = Sweep(["sweep=muon_lr"])

    def job(name: str, lr: float, seed: int, final: float) -> dict:
        curve = [[0, 3.0], [100, 2.5], [200, final + 0.2], [300, final]]
        return {"job": f"{name}-{lr}-{seed}", "setting": {"modification": name, "optim.lr": lr}, "seed": seed,
                "status": "completed", "choices": {}, "overrides": [f"modification={name}", f"optim.lr={lr}"],
                "metrics": {"final_val_loss": final}, "val_loss_curve": curve, "final_val_loss": final,
                "references": None, "eval": []}

    jobs = [job(name, lr, s, final + 0.01 * s) for name, lr, final in
            (("baseline", 0.004, 2.0), ("optim-muon", 0.032, 1.9)) for s in range(3)]
    monkeypatch.setattr(sweep, "dir", Path("."))
    monkeypatch.setattr(collect_module, "collect", lambda root: [{"study": "muon_lr", "seed": j["seed"]} for j in jobs])
    monkeypatch.setattr(findings_data, "records", lambda study, members, metrics: [dict(j, metrics=dict(j["metrics"]))
                                                                                    for j in jobs])
    steps = [j["metrics"]["steps_to_target"] for j in sweep.jobs()]
    # baseline's target is its own mean final loss, 2.01: its seeds reach it between steps 200 and 300 (2.2 -> 2.0:
    # at 295 for seed 0; 300 for seed 1; never for seed 2); Muon's 1.9-1.92 curves pass 2.01 between 200 and 300.
    assert steps[:2] == pytest.approx([295.0, 300.0]) and steps[2] is None
    assert all(isinstance(s, float) and 200 < s < 300 for s in steps[3:])
    assert isinstance(sweep.observe(3)[1], list)  # a paired difference per seed, not "not recorded"
