"""Checkpoints, interruption and resume: an interrupted run, resumed, ends exactly where an
uninterrupted one does; bad checkpoints are clear errors, never a silent restart."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

import blocklab.train.run as run_module
from blocklab.errors import ConfigError
from blocklab.results import read_results
from blocklab.train.run import prepare
from conftest import FAST, ROOT, compose_config, run_cli, run_in_process
from helpers import wait_until

ARGS = ["logger=none", "trainer.max_steps=120", "trainer.val_check_interval=60", "checkpoint_every=10",
        "task.eval_examples=16", "diagnostics.every_n_steps=40"]


def comparable(results: dict) -> dict:
    keep = ("final_train_loss", "final_val_loss", "steps", "eval", "params", "status", "steps_to_target_loss",
            "train_loss_curve")  # a resume keeps the point at its checkpoint's step
    return {k: results[k] for k in keep} | {"diag_end": results["diagnostics"]["end"]["layers"]}


def test_sigterm_saves_and_rerun_resumes_to_identical_results(tmp_path):
    interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
    cmd = [sys.executable, str(ROOT / "train.py"), *ARGS, f"hydra.run.dir={interrupted}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: (interrupted / "checkpoints" / "last.ckpt").exists(), proc, timeout=300)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143 and "Run the same command again to resume" in err
    assert not (interrupted / "results.json").exists()

    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stdout
    run_in_process(ARGS, straight)
    assert comparable(read_results(interrupted)) == comparable(read_results(straight))


@pytest.fixture
def unfinished_run(tmp_path):
    """A run directory with a config and a checkpoint but no results: what an interruption leaves."""
    run_dir = tmp_path / "run"
    run_in_process(FAST, run_dir)
    (run_dir / "results.json").unlink()
    return run_dir


def test_resume_is_picked_up_from_the_checkpoint(unfinished_run):
    start_step = prepare(compose_config(FAST, unfinished_run)).start_step
    assert start_step == 20


def test_corrupt_checkpoint_is_an_error_naming_the_file(unfinished_run):
    ckpt = unfinished_run / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match=f"checkpoint {ckpt} is unreadable"):
        prepare(compose_config(FAST, unfinished_run))
    assert ckpt.read_bytes() == b"not a checkpoint"  # left for the user to inspect


def test_checkpoint_from_another_config_is_an_error_naming_the_key(unfinished_run):
    with pytest.raises(ConfigError, match=r"different config \(optim.lr: 0.003 -> 0.01\)"):
        prepare(compose_config([*FAST, "optim.lr=0.01"], unfinished_run))


def test_resume_false_starts_afresh_and_keeps_old_checkpoints(unfinished_run):
    run_in_process([*FAST, "resume=false", "optim.lr=0.01"], unfinished_run)
    assert read_results(unfinished_run)["status"] == "completed"
    assert len(list(unfinished_run.glob("checkpoints.old-*/last.ckpt"))) == 1


def test_every_result_changing_difference_is_named_and_nothing_else(unfinished_run):
    with pytest.raises(ConfigError) as refused:
        prepare(compose_config([*FAST, "optim.lr=0.01", "model.dropout=0.1", "logger=csv"], unfinished_run))
    listed = re.search(r"different config \((.*)\); ", str(refused.value)).group(1)
    assert listed.split("; ") == ["model.dropout: 0.0 -> 0.1", "optim.lr: 0.003 -> 0.01"]


def test_a_key_added_since_the_run_started_resumes_at_its_default(unfinished_run):
    """A run saved before trainer.compile existed resumes; only setting the new key on the command line is a
    change of config."""
    saved = unfinished_run / ".hydra" / "config.yaml"
    config = OmegaConf.load(saved)
    del config.trainer["compile"]
    OmegaConf.save(config, saved)
    assert prepare(compose_config(FAST, unfinished_run)).start_step == 20
    refused = run_cli([*FAST, "trainer.compile=true", f"hydra.run.dir={unfinished_run}"], timeout=120)
    assert refused.returncode == 2 and "different config (trainer.compile: None -> True)" in refused.stderr


STEP_CALLBACKS = run_module.step_callbacks


def with_callbacks(monkeypatch, *extra: Callback) -> None:
    """Runs started in this process get `extra` callbacks besides their own (replacing earlier extras)."""
    monkeypatch.setattr(run_module, "step_callbacks", lambda *args, **kwargs: [*STEP_CALLBACKS(*args, **kwargs), *extra])


class InterruptAt(Callback):
    """Stops the run after `step` as Ctrl-C or SIGTERM would: it raises the flag Lightning checks after each step."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer._signal_connector.received_sigterm = True


class StallAt(Callback):
    """Spends `seconds` inside training step `step` (before its optimizer step): a known least amount of training
    time."""

    def __init__(self, step: int, seconds: float):
        self.step, self.seconds = step, seconds

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            time.sleep(self.seconds)


def interrupt(monkeypatch, overrides: list[str], run_dir, step: int, *extra: Callback) -> None:
    with_callbacks(monkeypatch, InterruptAt(step), *extra)
    with pytest.raises(SystemExit, match="143"):
        run_in_process(overrides, run_dir)
    assert not (run_dir / "results.json").exists()


def test_logger_diagnostics_and_checkpoint_schedule_may_change_on_resume(tmp_path, monkeypatch):
    """None of them changes results (diagnostics measure in eval mode and leave the random state alone)."""
    interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
    before = [*FAST, "diagnostics.every_n_steps=5", "checkpoint_every=5"]
    interrupt(monkeypatch, before, interrupted, step=12)
    with_callbacks(monkeypatch)
    run_in_process([*FAST, "logger=csv", "diagnostics.every_n_steps=3", "diagnostics.attention_maps=none",
                    "checkpoint_every=7"], interrupted)
    run_in_process(before, straight)
    assert comparable(read_results(interrupted)) == comparable(read_results(straight))


def test_train_time_and_throughput_count_the_part_before_the_interrupt(tmp_path, monkeypatch):
    run_dir, before, after = tmp_path / "run", 3.0, 1.0
    interrupt(monkeypatch, FAST, run_dir, 12, StallAt(5, before))
    with_callbacks(monkeypatch, StallAt(15, after))
    run_in_process(FAST, run_dir)
    results = read_results(run_dir)
    assert results["train_time_s"] >= before + after
    assert results["ms_per_step"] * results["steps"] / 1000 >= before + after


class KeepCheckpointAt(Callback):
    """Copies last.ckpt aside after step `step`: restoring the copy after an interruption is a resume from a
    process killed outright (no checkpoint saved at the interrupt, only the periodic one before it)."""

    def __init__(self, step: int, run_dir, copy):
        self.step, self.run_dir, self.copy = step, run_dir, copy

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            shutil.copy(self.run_dir / "checkpoints" / "last.ckpt", self.copy)


def final_weights(run_dir) -> dict:
    """Read as generate and analyze read them: torch's weights-only loader."""
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.parametrize("killed", [False, True])
def test_dropout_resume_is_bit_identical(tmp_path, monkeypatch, killed):
    """Dropout draws from the global random state, which the checkpoint carries. Killed: the resume starts from
    the periodic step-10 checkpoint, saved before that step's validation."""
    interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
    overrides = [*FAST, "model.dropout=0.3", "checkpoint_every=5"]
    interrupt(monkeypatch, overrides, interrupted, 12, KeepCheckpointAt(12, interrupted, tmp_path / "step10.ckpt"))
    if killed:
        shutil.copy(tmp_path / "step10.ckpt", interrupted / "checkpoints" / "last.ckpt")
    with_callbacks(monkeypatch)
    run_in_process(overrides, interrupted)
    run_in_process(overrides, straight)
    assert comparable(read_results(interrupted)) == comparable(read_results(straight))
    resumed_weights, straight_weights = final_weights(interrupted), final_weights(straight)
    assert all(torch.equal(resumed_weights[name], straight_weights[name]) for name in straight_weights)


def test_diagnostics_first_enabled_at_resume_measure_at_the_resumed_step(tmp_path, monkeypatch):
    """The model resumes at step 12: its first measurement says so, and nothing claims to be the init."""
    run_dir = tmp_path / "run"
    interrupt(monkeypatch, [*FAST, "diagnostics=none"], run_dir, 12)
    with_callbacks(monkeypatch)
    run_in_process([*FAST, "diagnostics.every_n_steps=5"], run_dir)
    history = json.loads((run_dir / "diagnostics" / "history.json").read_text())
    assert [(h["tag"], h["step"]) for h in history] == [("resume", 12), ("step15", 15), ("end", 20)]
    assert "init" not in read_results(run_dir)["diagnostics"]
    assert not list(run_dir.glob("diagnostics/*init*"))


def test_the_last_checkpoint_is_the_end_whatever_the_schedule(run_dir):
    run_in_process([*FAST, "checkpoint_every=7"], run_dir)  # 20 steps: periodic checkpoints at 7 and 14 only
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 20


def test_resume_with_another_checkpoint_schedule_in_a_moved_directory_is_quiet(tmp_path, monkeypatch):
    """checkpoint_every and the run directory may change at a resume (they change no result): no warning about
    the checkpoint callback, no restore chatter; the console says it resumes, and its bar counts the whole run.
    The resumed run goes on writing last.ckpt, the file a second resume reads."""
    run_dir = tmp_path / "run"
    interrupt(monkeypatch, [*FAST, "checkpoint_every=5"], tmp_path / "first", 12)
    (tmp_path / "first").rename(run_dir)
    resumed = run_cli([*FAST, "checkpoint_every=7", f"hydra.run.dir={run_dir}"])
    assert resumed.returncode == 0 and resumed.stderr == ""
    assert f"resuming {run_dir} from step 12" in resumed.stdout and "20/20" in resumed.stdout
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["last.ckpt"]  # not a last-v1.ckpt beside it
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 20
