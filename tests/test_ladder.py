"""Ladders (blocklab/ladder.py): the launch expands study.ladder into one job per setting, rung and seed, each
named by its rung and composed at its rung's sizes and budget; a ladder whose rungs drift in anything else, or that
is malformed, is refused in one line before any job runs."""
import math

import pytest
from hydra import initialize_config_dir

from blocklab import ladder
from blocklab.errors import ConfigError
from blocklab.overrides import compose_job, sweep_jobs
from blocklab.paths import CONF_DIR
from blocklab.results import val_loss_curve
from conftest import run_cli

SWEEP = ["sweep=activations_ladder"]
RUNGS = {"d16": (16, 2), "d24": (24, 3), "d32": (32, 4), "d48": (48, 6), "d64": (64, 8)}


def test_the_launch_expands_a_ladder_into_one_job_per_setting_rung_and_seed(tmp_path):
    jobs = sweep_jobs([*SWEEP, f"hydra.sweep.dir={tmp_path}"])
    named = {tuple(sorted(o for o in job if not o.startswith(("sweep=", "hydra.")))) for job in jobs}
    assert len(jobs) == len(named) == 3 * 5 * 3
    assert named == {tuple(sorted((f"act={a}", f"study.rung={r}", f"seed={s}")))
                     for a in ("relu", "gelu", "swiglu") for r in RUNGS for s in range(3)}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        for rung, (width, heads) in RUNGS.items():
            config = compose_job([*SWEEP, "act=gelu", f"study.rung={rung}", "seed=1", "run_dir=unused"])
            assert (config.model.d_model, config.model.n_heads) == (width, heads)
            # a fixed budget of 614,400 tokens, 32 x 64 a step: 300 steps, validated 8 times
            assert config.trainer.max_steps == math.ceil(614400 / (32 * 64)) == 300
            assert config.trainer.val_check_interval == 300 // 8


def test_budget_rules_by_hand():
    study = {"scale": 2, "rung": "b", "ladder": {"rungs": {"a": {"model.d_model": 32}, "b": {"model.d_model": 64}},
                                                  "budget": {"rule": "tokens_per_param", "ratio": 20, "evals": 6}}}
    config = {"study": study, "task": {"batch_size": 8, "block_size": 64}, "model": {"n_layers": 2}}
    # 20 tokens a parameter, N = 12 * 2 * 64^2 = 98,304: 1,966,080 tokens, twice (study.scale), 512 a step
    assert ladder.max_steps(config) == 2 * 1966080 // 512 == 7680
    assert ladder.eval_every(config) == 7680 // 6
    study["ladder"]["budget"] = {"rule": "tokens", "tokens": 1000}
    assert ladder.max_steps(config) == math.ceil(2000 / 512)


def check(tmp_path, *extra: str) -> int:
    from blocklab.train.sweep import check_sweep_jobs

    return check_sweep_jobs([*SWEEP, "act=relu", "seed=0", f"hydra.sweep.dir={tmp_path / 'sweep'}", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    (["optim.warmup_steps=${model.d_model}"],
     r"rungs d16 and d24 differ in optim.warmup_steps \(16 against 24\), which is not a declared size key"),
    (["study.ladder.sizes=[model.d_model]"], "rung d16 sets model.n_heads, which study.ladder.sizes does not declare"),
    (["model.d_model=64"], r"model.d_model is 64 in rung d16, whose value is 16: set model.d_model: \$\{ladder"),
    (["trainer.max_steps=50"], "trainer.max_steps is 50 in rung d16, but the ladder's budget rule gives 300"),
    (["~study.ladder.rungs.d64"], r"study.ladder has 4 rungs; a fit of E \+ A N\^-alpha per setting needs at least 5"),
])
def test_the_launch_refuses_a_ladder_that_drifts(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        check(tmp_path, *extra)
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_a_sound_ladder_passes(tmp_path):
    assert check(tmp_path) == 5


def rung_configs(warmups: list[int]) -> tuple[list[list[str]], list[dict]]:
    """Five rungs' resolved configs, by hand, as the launch hands them to ladder_error."""
    rungs = {f"w{w}": {"model.d_model": w} for w in (16, 24, 32, 48, 64)}
    budget = {"rule": "tokens", "tokens": 4096, "evals": 4}
    jobs, configs = [], []
    for (name, sizes), warmup in zip(rungs.items(), warmups):
        study = {"name": "x", "scale": 1, "rung": name, "ladder": {"sizes": ["model.d_model"], "rungs": rungs,
                                                                   "budget": budget}}
        configs.append({"study": study, "task": {"batch_size": 4, "block_size": 64},
                        "model": {"d_model": sizes["model.d_model"]}, "optim": {"warmup_steps": warmup},
                        "trainer": {"max_steps": 16, "val_check_interval": 4}})
        jobs.append(["act=gelu", f"study.rung={name}", "seed=0"])
    return jobs, configs


def test_ladder_error_by_hand():
    assert ladder.ladder_error(*rung_configs([10] * 5)) is None
    error = ladder.ladder_error(*rung_configs([10, 10, 10, 10, 20]))
    assert error.startswith("rungs w16 and w64 differ in optim.warmup_steps (10 against 20)")


def test_ladder_error_is_none_without_a_ladder():
    assert ladder.ladder_error([["seed=0"]], [{"study": None}]) is None
    assert ladder.shape_error({"sizes": ["model.d_model"], "rungs": {f"r{i}": {"model.d_model": i} for i in range(5)},
                               "budget": {"rule": "flops"}}).startswith("study.ladder.budget.rule must be one of")


@pytest.mark.slow
def test_the_command_refuses_a_drifting_ladder_in_one_line(tmp_path):
    result = run_cli(["-m", *SWEEP, "optim.warmup_steps=${model.d_model}", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "differ in optim.warmup_steps" in result.stderr
    assert not (tmp_path / "sweep").exists()


def test_val_loss_curve_of_old_and_new_results():
    assert val_loss_curve({"status": "completed"}) == []  # a folder from before the field
    assert val_loss_curve({"val_loss_curve": [[10, 2.5], [20, None], [30, 2.1]]}) == [(10, 2.5), (30, 2.1)]


def test_a_run_records_its_validation_curve(default_run):
    """trainer=debug validates every 10 of its 20 steps: results.json val_loss_curve has both, as a fit reads them."""
    curve = val_loss_curve(default_run)
    assert [step for step, _ in curve] == [10, 20] and all(0 < loss < 10 for _, loss in curve)


@pytest.mark.slow
def test_the_head_count_ladder_runs_under_mup_at_a_base_width_every_rung_allows(tmp_path):
    """head_count_ladder: one head against four under param=mup. µP reads its base shapes at a fixed d_head
    (model/param.py), and one head's d_head is the whole width, so the base width must be a multiple of every rung's
    width: 16, 24, 32, 48 and 64 all divide 192 (= 3 x 64), the least such (at base 64, d48 with one head would
    need 64 / 48 heads)."""
    jobs = sweep_jobs(["sweep=head_count_ladder", f"hydra.sweep.dir={tmp_path}"])
    assert len(jobs) == 2 * 5 * 3
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        for rung, width in {"d16": 16, "d24": 24, "d32": 32, "d48": 48, "d64": 64}.items():
            for heads in (1, 4):
                config = compose_job(["sweep=head_count_ladder", f"model.n_heads={heads}", f"study.rung={rung}",
                                      "seed=0", "run_dir=unused"])
                assert (config.param.name, config.param.base_width) == ("mup", 192)
                assert (config.model.d_model, config.model.n_heads, config.trainer.max_steps) == (width, heads, 300)
                assert 192 % (width // heads) == 0


@pytest.mark.slow
def test_the_moe_ladder_pairs_four_experts_with_a_dense_ffn_of_equal_active_size_at_every_rung(tmp_path):
    """moe_ladder: at each rung the two settings differ in the ffn group only, each expert the dense FFN's size
    (d_ff null: 4 d_model, conf/model/tiny.yaml) with top-1 routing, so a token meets the same FFN parameters in
    both (Fedus et al. 2021's equal-compute comparison, the 1x moe claim's)."""
    assert len(sweep_jobs(["sweep=moe_ladder", f"hydra.sweep.dir={tmp_path}"])) == 2 * 5 * 3
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        for rung, (width, heads) in RUNGS.items():
            dense, moe = (compose_job(["sweep=moe_ladder", f"ffn={ffn}", f"study.rung={rung}", "seed=0",
                                       "run_dir=unused"]) for ffn in ("dense", "moe"))
            assert (moe.ffn.experts, moe.ffn.top_k, moe.model.d_ff) == (4, 1, None) and dense.ffn.name == "dense"
            assert (moe.model.d_model, moe.model.n_heads, moe.trainer.max_steps, moe.param.name) == \
                (width, heads, 300, "mup")
            assert {k: v for k, v in dense.items() if k != "ffn"} == {k: v for k, v in moe.items() if k != "ffn"}


@pytest.mark.slow
def test_the_recipe_ladder_s_two_settings_are_the_recipe_sweep_s_corners():
    """recipe_ladder compares experiment=llama_recipe and gpt2_recipe: each must compose the norm, act and pos the
    1x recipe sweep's claim names (LLaMA: pre_rms, swiglu, rope; GPT-2: pre_ln, gelu, learned), and only those."""
    corners = {"llama_recipe": ["norm=pre_rms", "act=swiglu", "pos=rope"],
               "gpt2_recipe": ["norm=pre_ln", "act=gelu", "pos=learned"]}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        for name, groups in corners.items():
            one_x = compose_job(["sweep=recipe", *groups, "seed=0", "run_dir=unused"])
            ladder_job = compose_job(["sweep=recipe_ladder", f"experiment={name}", "study.rung=d64", "seed=0",
                                      "run_dir=unused"])
            for group in ("norm", "act", "pos"):
                assert ladder_job[group] == one_x[group], (name, group)
            alone = compose_job([f"experiment={name}", "run_dir=unused"])
            plain = compose_job([*groups, "run_dir=unused"])
            assert {k: v for k, v in alone.items() if k != "experiment"} == \
                {k: v for k, v in plain.items() if k != "experiment"}
