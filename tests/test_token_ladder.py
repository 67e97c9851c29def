"""Token ladders (blocklab/ladder.py, rule wsd_branches): one model's training budgets as the cooldown branches of one
wsd trunk per setting and seed. The rungs' budgets by hand (Hägele et al. 2024's cooldown: the last 20% of a
branch's own steps, decayed as OLMo-core's WSD); the launch refusing rungs that differ in anything but the budget
keys, and branches whose trunks have not run; a branch rung finding its own trunk beside it and starting from the
trunk's kept state; the page's fit in tokens D on synthetic laws L(D) = E + B D^-beta (test_scaling.py's), its
labels, its verdict "as the budget grows", and a bootstrap that draws whole seeds (a seed's rungs are one run's)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import initialize_config_dir

from blocklab import ladder
from blocklab.errors import ConfigError
from blocklab.overrides import compose_job, sweep_jobs
from blocklab.paths import CONF_DIR
from blocklab.report import findings, ladder_page, page_text, scaling
from blocklab.schedule import schedule
from conftest import CONF, FAST
from test_ladder_page import SETUP
from test_scaling import B_LAW, law
from test_schedule import _linear_decay

SWEEP = ["sweep=activations_tokens"]
# The trunk: 2,621,440 tokens / (32 x 64 a step) = 1,280 steps; branch points 1/16..1 of them; each branch S / 0.8
BRANCHES = {"t1": (80, 100), "t2": (160, 200), "t3": (320, 400), "t4": (640, 800), "t5": (1280, 1600)}


def test_the_sweep_is_a_trunk_and_five_branches_per_setting_and_seed(tmp_path):
    jobs = sweep_jobs([*SWEEP, f"hydra.sweep.dir={tmp_path}"])
    named = {tuple(sorted(o for o in job if not o.startswith(("sweep=", "hydra.")))) for job in jobs}
    assert len(jobs) == len(named) == 2 * 6 * 3
    assert {o for job in named for o in job if o.startswith("study.rung=")} == {
        f"study.rung={r}" for r in ("trunk", *BRANCHES)}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        trunk = compose_job([*SWEEP, "act=gelu", "study.rung=trunk", "seed=1", "run_dir=unused"])
        assert (trunk.model.d_model, trunk.param.name, trunk.optim.schedule) == (64, "mup", "wsd")
        assert trunk.trainer.max_steps == 2621440 // (32 * 64) == 1280
        assert list(trunk.optim.branch_points) == [1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0]
        assert trunk.optim.branch_from is None and trunk.optim.branch_step is None
        assert schedule(trunk.optim, 1280)(1279) == 1.0  # a trunk never decays
        for rung, (start, total) in BRANCHES.items():
            branch = compose_job([*SWEEP, "act=gelu", f"study.rung={rung}", "seed=1", "run_dir=unused"])
            assert (branch.optim.branch_from, branch.optim.branch_step) == ("rung:trunk", start)
            assert branch.trainer.max_steps == total and branch.trainer.val_check_interval == total // 8
            assert (total - start) / total == pytest.approx(0.2)  # the cooldown: the last 20% of its own steps
            factor = schedule(branch.optim, total)
            ratio = branch.optim.min_lr / branch.optim.lr
            for step in range(start, total + 1):  # OLMo-core's linear decay over [S, total]
                assert factor(step) == pytest.approx(_linear_decay(1.0, total - step, total - start, ratio))


def test_a_branch_finds_its_trunk_beside_it():
    run_dir = Path("out/sweeps/x/act=gelu,optim.betas=[0.9,0.95],seed=2,study.rung=t3")
    assert ladder.trunk_folder(run_dir, "t3") == Path("out/sweeps/x/act=gelu,optim.betas=[0.9,0.95],seed=2,"
                                                      "study.rung=trunk")
    with pytest.raises(ValueError, match="study.rung=t3"):
        ladder.trunk_folder(Path("runs/2026-11-28/x"), "t3")


RUNGS = {"a1": 0.0625, "a2": 0.125, "a3": 0.25, "a4": 0.5, "a5": 1.0}
# by hand: 64 x 256 tokens = 64 trunk steps; branch points 4, 8, 16, 32, 64; each / 0.8; 4 validations a run
BY_HAND = {"trunk": (64, 16, [*RUNGS.values()], None, None), "a1": (5, 1, [], "rung:trunk", 4),
           "a2": (10, 2, [], "rung:trunk", 8), "a3": (20, 5, [], "rung:trunk", 16),
           "a4": (40, 10, [], "rung:trunk", 32), "a5": (80, 20, [], "rung:trunk", 64)}


def token_configs(**change) -> tuple[list[list[str]], list[dict]]:
    """A token ladder's six jobs of one setting and seed, resolved by hand, as the launch hands them to ladder_error;
    `change`: {rung: {dotted key: value}} set on top."""
    budget = {"rule": "wsd_branches", "tokens": 64 * 256, "evals": 4, "tokens_per_step": 256}
    jobs, configs = [], []
    for rung, (steps, every, points, source, start) in BY_HAND.items():
        config = {"study": {"name": "x", "scale": 1, "rung": rung, "ladder": {"rungs": dict(RUNGS), "budget": budget}},
                  "task": {"batch_size": 4, "block_size": 64},
                  "optim": {"schedule": "wsd", "cooldown": 0.2, "warmup_steps": 2, "branch_points": points,
                            "branch_from": source, "branch_step": start},
                  "trainer": {"max_steps": steps, "val_check_interval": every}}
        for key, value in change.get(rung, {}).items():
            group, name = key.split(".")
            config[group][name] = value
        configs.append(config)
        jobs.append(["act=gelu", f"study.rung={rung}", "seed=0"])
    return jobs, configs


def test_ladder_error_passes_a_sound_token_ladder_and_refuses_every_drift():
    assert ladder.ladder_error(*token_configs()) is None
    for change, message in (
            ({"a3": {"optim.warmup_steps": 3}}, "rungs trunk and a3 differ in optim.warmup_steps (2 against 3), "
                                                "which is not a budget key"),
            ({"a2": {"optim.branch_step": 7}}, "optim.branch_step is 7 in rung a2, but the ladder gives 8"),
            ({"trunk": {"trainer.max_steps": 60}}, "trainer.max_steps is 60 in rung trunk, but the ladder's budget"),
            ({"a1": {"optim.schedule": "cosine"}}, "a wsd_branches ladder's rungs need optim.schedule: wsd"),
            ({"a1": {"task.batch_size": 8}}, "tokens_per_step is 256 but a step takes 512 tokens"),
            ({r: {"optim.warmup_steps": 4} for r in BY_HAND}, "rung a1 branches at step 4, within optim.warmup_steps")):
        assert ladder.ladder_error(*token_configs(**change)).startswith(message) or \
            message in ladder.ladder_error(*token_configs(**change)), change


def test_a_malformed_token_ladder_is_refused():
    budget = {"rule": "wsd_branches", "tokens": 100, "tokens_per_step": 10}
    for rungs, extra, message in (
            ({k: v for k, v in RUNGS.items() if k != "a5"}, {}, "study.ladder has 4 rungs; a fit of E + B D^-beta"),
            ({**RUNGS, "a5": 0.4}, {}, "branch points [0.0625, 0.125, 0.25, 0.5, 0.4] must increase"),
            ({**RUNGS, "a5": 1.5}, {}, "rung a5=1.5 must be a branch point"),
            ({**RUNGS, "trunk": 1.0}, {}, "not trunk (the trunk's rung)"),
            (RUNGS, {"sizes": ["model.d_model"]}, "remove study.ladder.sizes")):
        assert ladder.shape_error({"rungs": rungs, "budget": budget, **extra}).startswith(message) or \
            message in ladder.shape_error({"rungs": rungs, "budget": budget, **extra}), message
    no_step = {"rule": "wsd_branches", "tokens": 100}
    assert "tokens_per_step must be" in ladder.shape_error({"rungs": RUNGS, "budget": no_step})


@pytest.mark.slow
def test_the_launch_refuses_branches_before_their_trunks(tmp_path):
    from blocklab.train.sweep import check_sweep_jobs

    sweep, one = tmp_path / "sweep", ["seed=0", "act=gelu"]  # one setting and seed: the check composes each job
    with pytest.raises(ConfigError, match=r"5 branches' trunks have not kept their checkpoints yet .*study.rung="
                                          r"trunk/checkpoints/step-80.ckpt .*python train.py -m sweep="
                                          r"activations_tokens study.rung=trunk"):
        check_sweep_jobs([*SWEEP, *one, f"hydra.sweep.dir={sweep}"])
    assert not sweep.exists()
    assert check_sweep_jobs([*SWEEP, *one, "study.rung=trunk", f"hydra.sweep.dir={sweep}"]) == 1  # the trunk's launch
    with pytest.raises(ConfigError, match=r"rungs trunk and t1 differ in optim.warmup_steps \(160 against 12\)"):
        check_sweep_jobs([*SWEEP, *one, "optim.warmup_steps=${trainer.val_check_interval}", f"hydra.sweep.dir={sweep}"])


# A token ladder small enough to train here: 16 trunk steps of 4 x 64 tokens, branch points 1, 2, 4, 8, 16
TINY = [*SWEEP, *(o for o in FAST if not o.startswith("task.")), "act=gelu", "seed=0", "task.batch_size=4",
        "task.eval_max_tokens=512", "optim.warmup_steps=0", "study.ladder.budget.tokens=4096"]


def run_job(overrides: list[str], run_dir: Path):
    """One job in a folder named as a sweep names it (quoted: its name holds = and ,)."""
    from hydra import compose

    from blocklab.train.run import run

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return run(compose(config_name="config", overrides=[*overrides, f"run_dir='{run_dir}'"]))


@pytest.mark.slow
def test_a_branch_rung_starts_from_its_own_trunk_s_kept_state(tmp_path, monkeypatch):
    from blocklab.train.module import LitTransformer

    trunk = tmp_path / "act=gelu,seed=0,study.rung=trunk"
    run_job([*TINY, "study.rung=trunk"], trunk)
    kept = torch.load(trunk / "checkpoints" / "step-4.ckpt", weights_only=True)
    seen = {}

    def on_train_start(self):
        seen["step"] = self.global_step
        seen["weights"] = {k: v.clone() for k, v in self.state_dict().items()}

    monkeypatch.setattr(LitTransformer, "on_train_start", on_train_start, raising=False)
    branch = tmp_path / "act=gelu,seed=0,study.rung=t3"
    run_job([*TINY, "study.rung=t3"], branch)
    assert seen["step"] == 4 and seen["weights"].keys() == kept["state_dict"].keys()
    assert all(torch.equal(seen["weights"][k], v) for k, v in kept["state_dict"].items())
    assert json.loads((branch / "results.json").read_text())["steps"] == 5  # 4 / 0.8
    with pytest.raises(ConfigError, match="no kept checkpoint at step 4"):  # another seed: no trunk of its own
        run_job([*[o if o != "seed=0" else "seed=1" for o in TINY], "study.rung=t3"],
                       tmp_path / "act=gelu,seed=1,study.rung=t3")


# ---------------------------------------------------------------- the page, on synthetic laws in D
PER_STEP = 100
STEPS = {"t1": 100, "t2": 300, "t3": 1000, "t4": 3000, "t5": 10000}  # D = 1e4 ... 1e6 tokens
GROWING = law(1.7, (-0.05 + 0.3 + 25 * 1e4 ** -0.35) * 1e4 ** 0.3, 0.3)  # test_ladder_page's "holds and grows"


def token_study() -> dict:
    return {"name": "x_tokens", "compare": ["act", "study.rung"], "metrics": ["final_val_loss"], "question": "Q?",
            "ladder": {"rungs": {r: 0.1 for r in STEPS},
                       "budget": {"rule": "wsd_branches", "tokens": 1, "tokens_per_step": PER_STEP}},
            "verdict": {"claim": "a beats b", "metric": "final_val_loss", "better": {"act": "a"}, "than": {"act": "b"}}}


def token_jobs(laws: dict) -> list[dict]:
    rng = np.random.default_rng(5)
    jobs = [{"job": f"{act}-{rung}-{s}", "setting": {"act": act, "study.rung": rung}, "seed": s, "status": "completed",
             "choices": {"param": "mup"}, "params": 50000, "steps": steps, "eval": [], "metrics": {},
             "final_val_loss": float(curve(steps * PER_STEP) + rng.normal(0, 0.002))}
            for act, curve in laws.items() for rung, steps in STEPS.items() for s in range(3)]
    # the trunks: no cooldown, so out of the fit (a loss far off the laws would pull it)
    return jobs + [{**jobs[0], "job": f"{act}-trunk-{s}", "setting": {"act": act, "study.rung": "trunk"}, "seed": s,
                    "steps": 8000, "final_val_loss": 0.1} for act in laws for s in range(3)]


def test_a_token_ladder_page_fits_its_laws_in_tokens(tmp_path):
    data = tmp_path / "x_tokens.jsonl"
    jobs = token_jobs({"a": GROWING, "b": B_LAW})
    meta = {**SETUP, "sweep": "x_tokens", "jobs": len(jobs), "study": token_study()}
    data.write_text("".join(json.dumps(x) + "\n" for x in [meta, *jobs]), encoding="utf-8")
    findings.write_page(data)
    page = (tmp_path / "x_tokens.md").read_text(encoding="utf-8")
    section = page[page.index("### Does it hold at scale?"):page.index("**Question.**")]
    assert "L(D) = E + B D^-beta per setting" in section and "whole seeds resampled, the same at every rung" in section
    assert "| setting | E | beta | B | rungs |" in section and "| D | gap |" in section
    assert "D is a run's steps x 100 tokens" in section
    assert "**Transfer verdict: holds and grows as the budget grows** (a ahead at the largest rung)" in section
    assert "| 1,000,000 | " in section and "| 10,000,000 (extrapolated) | " in section  # D, not N
    fitted = ladder_page.analysis(ladder_page.rows_of(jobs), token_study(), resamples=100)[1]
    assert all(len(boot) == 100 for _, boot in fitted.values())
    point = fitted["b"][0]  # B_LAW = 2.0 + 25 D^-0.35, the trunks left out
    assert (point.e, point.alpha) == pytest.approx((2.0, 0.35), abs=0.05)
    assert "![loss against training tokens](x_tokens.ladder.png)" in section
    assert (tmp_path / "x_tokens.ladder.png").read_bytes()[:4] == b"\x89PNG"
    assert page == page_text.page_text(data)


def test_a_token_ladder_s_bootstrap_draws_whole_seeds():
    """Loss = 10 x seed + rung: with whole seeds drawn, every replicate's mean at rung r is its mean at rung 0 plus
    r, exactly; drawn within rungs, the means move apart."""
    settings = {"x": [scaling.Rung(float(10 ** r), {s: 10.0 * s + r for s in range(3)}) for r in range(5)]}
    whole = scaling.resample_means(settings, 200, whole_seeds=True)["x"]
    assert np.allclose(whole - whole[:, :1], np.arange(5)[None, :])
    apart = scaling.resample_means(settings, 200)["x"]
    assert not np.allclose(apart - apart[:, :1], np.arange(5)[None, :])


def test_the_committed_token_ladder_page_has_its_section():
    """docs/findings/activations_tokens.md (test_findings re-renders it byte for byte): its section in tokens, its
    trunks' launch before the sweep's, and the activations page and the index carry its verdict."""
    root = Path(__file__).resolve().parents[1] / "docs/findings"
    page = (root / "activations_tokens.md").read_text(encoding="utf-8")
    meta, jobs = findings.read_jsonl(root / "activations_tokens.jsonl")
    for part in ("L(D) = E + B D^-beta", "| swiglu | ", "| gelu | ", "| D | gap |", "**Transfer verdict: ",
                 "![loss against training tokens](activations_tokens.ladder.png)",
                 "Reproduce: `python train.py -m sweep=activations_tokens act=gelu,swiglu study.rung=trunk seed=0,1,2"):
        assert part in page, part
    holds = ladder_page.holds(meta, jobs)
    assert holds.split(":")[0] in ("yes", "no") and "budget grows" in holds or holds == scaling.UNDETERMINED
    assert f"[activations_tokens](activations_tokens.md#does-it-hold-at-scale): {holds}." in \
        (root / "activations.md").read_text(encoding="utf-8")
    assert f"[{holds}](activations_tokens.md#does-it-hold-at-scale)" in (root / "README.md").read_text(encoding="utf-8")
