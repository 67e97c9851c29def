"""Zero-shot context extension as a continued run of 0 steps, and the context_extension sweep's jobs: a 0-step
continuation evaluates its source's weights under its own config (pos.scaling), as `analyze --eval-scaling` does."""
import json

import pytest
from hydra import compose, initialize_config_dir

from blocklab.analyze import main as analyze_main
from blocklab.paths import CONF_DIR
from blocklab.results import CHECKPOINT, read_results
from conftest import run_cli, run_in_process
from test_context_extension import folder_digest, trained_lm

SCORES = ("length", "loss", "token_acc", "n", "bits_per_char")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return trained_lm(tmp_path_factory.mktemp("zero_shot"))


def scores(rows):
    return [{k: row[k] for k in SCORES} for row in rows]


def test_max_steps_0_without_resume_from_is_one_line_exit_2(tmp_path):
    done = run_cli(["task=lm", "trainer.max_steps=0", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "trainer.max_steps=0" in lines[0] and "needs trainer.resume_from" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_the_sweep_before_its_base_runs_is_refused_at_launch_in_one_line(tmp_path):
    """study.scale=3: pe_lm-scale3's runs, which no one trains; every job's source is missing, so nothing starts."""
    done = run_cli(["-m", "sweep=context_extension", "study.scale=3", "logger=none",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == ["error: trainer.resume_from continues runs in outputs/sweeps/pe_lm-scale3, which does not exist; "
                     "train them first (another sweep's runs: python train.py -m sweep=ITS_NAME, at the same "
                     "study.scale)"]
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("method", ["pi", "ntk", "yarn"])
def test_a_0_step_continuation_evaluates_as_eval_scaling_does(base, tmp_path, method):
    source, overrides = base
    before = folder_digest(source)
    run_in_process([*overrides, f"trainer.resume_from={source}", "trainer.max_steps=0", f"pos.scaling={method}",
                    "pos.scaling_factor=4"], tmp_path / "zero")
    analyze_main([str(source), "--eval-scaling", f"{method}:4"])
    scaled = json.loads((source / f"eval_scaling_{method}_4.json").read_text())
    (source / f"eval_scaling_{method}_4.json").unlink()
    assert folder_digest(source) == before  # the source is only read
    results = read_results(tmp_path / "zero")
    assert results["eval"] == scaled["eval"]  # same weights, same scaling, same windows: the same numbers
    assert scores(results["eval"]) != scores(read_results(source)["eval"])  # and the scaling was applied
    # Nothing trained: no step, no training loss or rate, no checkpoint of weights it did not make.
    assert results["steps"] == 0 and results["train_loss_curve"] == []
    assert results["final_train_loss"] is None and results["tokens_per_s"] is None and results["ms_per_step"] is None
    assert not (tmp_path / "zero" / CHECKPOINT).exists()
    assert json.loads((tmp_path / "zero" / "model.json").read_text())["pos"]["options"]["original_context"] == 16


def test_a_0_step_continuation_without_scaling_repeats_its_sources_rows(base, tmp_path):
    source, overrides = base
    run_in_process([*overrides, f"trainer.resume_from={source}", "trainer.max_steps=0"], tmp_path / "zero")
    assert read_results(tmp_path / "zero")["eval"] == read_results(source)["eval"]


def test_the_sweeps_jobs_continue_pe_lms_job_of_their_scheme_and_seed():
    """trainer.resume_from names the folder Hydra gives pe_lm's job (override_dirname), at this study's scale."""
    from blocklab.overrides import job_dirname, sweep_jobs

    pe_lm = sweep_jobs(["sweep=pe_lm"])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        naming = compose("config", [*pe_lm[0], "run_dir=unused"], return_hydra_config=True).hydra.job.config
        folders = {job_dirname(job, naming.override_dirname) for job in pe_lm}
        for job, scale in ((["method=rope_yarn", "seed=2"], 1), (["method=learned_pi", "seed=0"], 4),
                           (["method=fire", "seed=1", "study.continuation=fine_tune"], 1)):
            cfg = compose("config", ["sweep=context_extension", *job, f"study.scale={scale}", "run_dir=unused"])
            prefix, _, folder = cfg.trainer.resume_from.rpartition("/")
            assert prefix == ("outputs/sweeps/pe_lm" if scale == 1 else "outputs/sweeps/pe_lm-scale4")
            assert folder in folders and folder == f"pos={cfg.pos.name},seed={cfg.seed}"


def test_sweep_jobs_score_the_bases_lengths_zero_shot_and_fine_tuned(tmp_path):
    """A pe_lm-shaped base (debug-sized), then the sweep's own jobs from it: yarn zero-shot, rope zero-shot and a
    short yarn fine-tune at 4x the context, each scored at the base's lengths; unscaled zero-shot is the base."""
    shared = ["logger=none", "diagnostics=none", "task.eval_max_tokens=2048", "model.n_layers=1"]
    base = tmp_path / "base"
    run_in_process(["task=lm", "init=xavier", "pos=rope", "trainer=debug", "trainer.max_steps=4", *shared], base)
    jobs = {"rope": ["method=rope"], "yarn": ["method=rope_yarn"],
            "tuned": ["method=rope_yarn", "study.continuation=fine_tune", "study.steps.fine_tune=3"]}
    for name, job in jobs.items():
        run_in_process(["sweep=context_extension", *job, f"trainer.resume_from={base}", *shared], tmp_path / name)
    source = read_results(base)
    runs = {name: read_results(tmp_path / name) for name in jobs}
    lengths = [row["length"] for row in source["eval"]]
    assert lengths == [64, 128, 256, 512]
    for results in runs.values():
        assert [row["length"] for row in results["eval"]] == lengths
        assert [row["length"] for row in results["eval"] if row["in_distribution"]] == [256]  # 4x: the new context
    assert scores(runs["rope"]["eval"]) == scores(source["eval"])
    assert scores(runs["yarn"]["eval"]) != scores(source["eval"])
    assert runs["yarn"]["steps"] == 0 and runs["tuned"]["steps"] == 3 and runs["tuned"]["train_lengths"] == [256, 256]
