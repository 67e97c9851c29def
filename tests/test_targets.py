"""Steps to a target loss read off recorded validation curves (report/targets.py), and claims judged with each
side at its own best learning rate (page_runs.at_best_lr): issue 57's Muon claim, on hand-computed cases."""
import json

import pytest

from blocklab.report import findings
from blocklab.report.judge import differences
from blocklab.report.targets import apply, steps_to


def test_steps_to_interpolates_between_the_validations_around_the_crossing():
    """Curve (25, 3.0), (50, 2.5), (75, 2.0), target 2.2: crossed between 50 and 75, 0.3 of the 0.5 drop after
    50, so 50 + 25 * 0.3 / 0.5 = 65. Already below at the first point: that point's step. Never: None."""
    curve = [[25, 3.0], [50, 2.5], [75, 2.0]]
    assert steps_to(curve, 2.2) == pytest.approx(65.0)
    assert steps_to(curve, 2.5) == 50.0  # reached exactly at a validation
    assert steps_to(curve, 3.5) == 25.0
    assert steps_to(curve, 1.9) is None
    assert steps_to([], 2.0) is None and steps_to(None, 2.0) is None


def _job(opt, lr, seed, final, curve):
    return {"job": f"{opt}-{lr}-{seed}", "setting": {"modification": opt, "optim.lr": lr}, "seed": seed,
            "choices": {}, "status": "completed", "in_distribution_exact_match": None,
            "metrics": {"final_val_loss": final}, "eval": [], "val_loss_curve": curve}


# AdamW (baseline) best at lr 0.004 (mean final 2.1 over seeds 2.0 and 2.2); Muon best at 0.032 (mean 1.95).
JOBS = [
    _job("baseline", 0.002, 0, 2.4, [[100, 2.6], [200, 2.4]]), _job("baseline", 0.002, 1, 2.4, [[100, 2.6], [200, 2.4]]),
    _job("baseline", 0.004, 0, 2.0, [[100, 2.5], [200, 2.0]]), _job("baseline", 0.004, 1, 2.2, [[100, 2.4], [200, 2.2]]),
    _job("baseline", 0.008, 0, 2.3, [[100, 2.5], [200, 2.3]]), _job("baseline", 0.008, 1, 2.3, [[100, 2.5], [200, 2.3]]),
    _job("optim-muon", 0.016, 0, 2.05, [[100, 2.3], [200, 2.05]]),
    _job("optim-muon", 0.016, 1, 2.05, [[100, 2.3], [200, 2.05]]),
    _job("optim-muon", 0.032, 0, 1.9, [[100, 2.2], [200, 1.9]]), _job("optim-muon", 0.032, 1, 2.0, [[100, 2.1], [200, 2.0]]),
    _job("optim-muon", 0.064, 0, 2.1, [[100, 2.3], [200, 2.1]]), _job("optim-muon", 0.064, 1, 2.1, [[100, 2.3], [200, 2.1]]),
]
META = {"study": {"compare": ["modification", "optim.lr"], "metrics": ["final_val_loss", "steps_to_target"],
                  "target": {"metric": "final_val_loss", "of": {"modification": "baseline"}},
                  "verdict": {"metric": "final_val_loss", "at_best": True, "better": {"modification": "optim-muon"},
                              "than": {"modification": "baseline"},
                              "also": [{"metric": "steps_to_target", "at_best": True,
                                        "better": {"modification": "optim-muon"},
                                        "than": {"modification": "baseline"}}]}}}


PAGE = {"format": 2, "sweep": "x", "jobs": 12, "seeds": [0, 1], "task": ["lm"], "d_model": [64], "n_layers": [2],
        "n_heads": [4], "steps": [200], "scale": 1, "machines": {}, "train_time_s": 1.0, "commit": None,
        "commit_recorded": False, "date": "d", "command": "python train.py -m sweep=x", "report": "r"}


def test_the_target_is_the_baseline_at_its_best_lr_and_each_run_gets_its_steps():
    """Target = mean final loss of AdamW at 0.004 = (2.0 + 2.2) / 2 = 2.1. AdamW 0.004 seed 0: 2.5 -> 2.0 crosses
    2.1 at 100 + 100 * 0.4 / 0.5 = 180; seed 1 ends at 2.2: never. Muon 0.032 seed 0: 2.2 -> 1.9 at
    100 + 100 * 0.1 / 0.3 = 133.33; seed 1 already at 100 (2.1 <= 2.1): 100."""
    meta, jobs = json.loads(json.dumps(META)), json.loads(json.dumps(JOBS))
    apply(meta, jobs)
    got = {(j["setting"]["modification"], j["setting"]["optim.lr"], j["seed"]): j["metrics"]["steps_to_target"]
           for j in jobs}
    assert got[("baseline", 0.004, 0)] == 180.0 and got[("baseline", 0.004, 1)] is None
    assert round(got[("optim-muon", 0.032, 0)], 6) == 133.333333 and got[("optim-muon", 0.032, 1)] == 100.0
    assert got[("baseline", 0.002, 0)] is None
    assert "2.1000" in meta["target_note"] and "0.004" in meta["target_note"]


def test_at_best_claims_pair_each_optimizer_at_its_own_best_lr_by_seed():
    """Final loss at each best (Muon 0.032 against AdamW 0.004), by seed: 1.9 - 2.0 = -0.1, 2.0 - 2.2 = -0.2.
    Steps: seed 0 133.33 - 180 = -46.67; seed 1 AdamW never reaches it, so it counts as the page's worst
    steps_to_target (judge's rule for a lower-is-better metric): 200, Muon at 0.064 reaching 2.1 at its last
    validation, so 100 - 200 = -100."""
    meta, jobs = json.loads(json.dumps(META)), json.loads(json.dumps(JOBS))
    apply(meta, jobs)
    claims = [meta["study"]["verdict"], *meta["study"]["verdict"]["also"]]
    assert [round(d, 9) for d in differences(meta, jobs, claims[0])] == [-0.1, -0.2]
    assert [round(d, 2) for d in differences(meta, jobs, claims[1])] == [-46.67, -100.0]
    page = findings.render_page({**PAGE, **meta}, jobs, None)
    assert "| modification=optim-muon | 0.032 |" in page and "| modification=baseline | 0.004 |" in page
    assert meta["target_note"] in page
