"""Failure paths a new user meets (issue 21): every failure recorded, never a traceback for a measurement."""
import json

import pytest

from blocklab.results import read_results
from conftest import run_in_process

DIVERGING = ["norm=none", "model.n_layers=8", "optim.lr=10", "optim.warmup_steps=0", "trainer.gradient_clip_val=null",
             "trainer.max_steps=200"]


@pytest.mark.parametrize("diagnostics", ["none", "basic", "full"])
def test_divergence_is_recorded_under_every_diagnostics_setting(diagnostics, run_dir):
    run_in_process(["logger=none", "task.eval_examples=16", f"diagnostics={diagnostics}", *DIVERGING], run_dir)
    results = read_results(run_dir)
    assert results["status"] == "diverged" and results["diverged_at_step"] < 200
    if diagnostics != "none":
        end = results["diagnostics"]["end"]
        assert end["layers"] is None and "not finite" in end["skipped"]
        history = json.loads((run_dir / "diagnostics" / "history.json").read_text())
        assert history[0]["tag"] == "init" and history[0]["layers"]  # measured while the weights were finite


def test_a_measurement_that_cannot_be_taken_is_recorded_not_raised(run_dir):
    """Weights so large that activations overflow at init: the probe's SVD cannot run on them."""
    run_in_process(["logger=none", "task.eval_examples=16", "init.std=1e30", "trainer=debug"], run_dir)
    results = read_results(run_dir)
    assert results["status"] in ("completed", "diverged")
    init = results["diagnostics"]["init"]
    assert init["layers"] is None and init["skipped"]


@pytest.mark.parametrize("override, message", [
    ("norm.eps=-1", "norm.eps=-1 must be a positive number (it keeps the norm's division finite)"),
    ("+model.foo=1", "model.foo is not a key of model; its keys are "),
    ("+model.dmodel=64", "model.dmodel is not a key of model; did you mean model.d_model? its keys are "),
    ("+norm.epsilon=1", "norm.epsilon is not a key of norm; did you mean norm.eps? its keys are "),
])
def test_bad_model_keys_are_one_line_errors_before_any_work(override, message, run_dir):
    from blocklab.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        run_in_process(["logger=none", override], run_dir)
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and lines[0].startswith(message)
    assert not run_dir.exists()


def test_a_bad_override_common_to_every_sweep_job_is_one_line_and_creates_nothing(tmp_path):
    from conftest import run_cli

    sweep_dir = tmp_path / "sweep"
    proc = run_cli(["-m", "sweep=addition_format", "model.d_model=0", f"hydra.sweep.dir={sweep_dir}"])
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: model.d_model=0 must be a positive integer"]
    assert not sweep_dir.exists()


def test_a_job_folder_name_too_long_for_the_file_system_is_one_line_and_creates_nothing(tmp_path):
    from conftest import run_cli

    sweep_dir = tmp_path / "sweep"
    many = [f"model.{key}={value}" for key, value in (("d_model", 512), ("n_heads", 4), ("d_ff", 2048),
                                                       ("n_layers", 1), ("dropout", 0.0), ("bias", "false"))]
    many += ["optim.lr=0.0001", "optim.min_lr=0.00001", "optim.weight_decay=0", "optim.warmup_steps=10",
             "task.batch_size=1000", "task.eval_examples=8", "task.eval_lengths=[5,10]", "trainer.max_steps=3",
             "trainer.val_check_interval=3", "act=geglu", "norm=sandwich_ln", "init=xavier"]
    proc = run_cli(["-m", "sweep=addition_format", *many, f"hydra.sweep.dir={sweep_dir}"])
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "-byte limit" in lines[0] and "experiment=NAME" in lines[0], lines
    assert not sweep_dir.exists()


def test_an_impossible_sweep_job_is_listed_before_launch_recorded_invalid_and_never_retried(tmp_path):
    from conftest import run_cli

    sweep_dir = tmp_path / "sweep"
    command = ["-m", "model.n_heads=3,4", "trainer=debug", "logger=none", "diagnostics=none", "task.eval_examples=8",
               f"hydra.sweep.dir={sweep_dir}"]
    first = run_cli(command)
    assert first.returncode == 0, first.stderr
    # the check of every job, before launch, lists it; then the job itself records why it did not run
    assert ("warning: job model.n_heads=3,trainer=debug,task.eval_examples=8 is invalid and will be recorded as such, "
            "not run: model.n_heads=3 does not divide model.d_model=64") in first.stderr
    invalid, valid = (read_results(sweep_dir / job) for job in ("0", "1"))
    assert invalid["status"] == "invalid" and "model.n_heads=3 does not divide" in invalid["error"]
    assert valid["status"] == "completed"
    again = run_cli(command)
    assert again.returncode == 0 and "is invalid:" not in again.stderr
    assert f"skip {sweep_dir / '0'}: already invalid" in again.stdout
    assert list((sweep_dir / "0").glob("results.failed-*")) == []


def test_a_debug_run_prints_at_most_16_lines_with_the_default_logger(tmp_path):
    """Progress, one line about where W&B wrote, the result table and a status line: nothing else."""
    from conftest import run_cli

    proc = run_cli(["trainer=debug", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 0, proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) <= 16, "\n".join(lines)  # 15, plus the warning that a 20-step model has not learned copy
    assert sum(line.startswith("W&B offline run:") for line in lines) == 1
    assert not any(line.startswith("wandb:") or "available:" in line or "Warning" in line for line in lines)
    status = lines[-2] if lines[-1].startswith("warning: in-distribution exact match") else lines[-1]
    assert status.startswith("status: completed") and status.endswith("results.json")
