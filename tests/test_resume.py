"""Checkpoints, interruption and resume: an interrupted run, resumed, ends exactly where an
uninterrupted one does; bad checkpoints are clear errors, never a silent restart."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from blocklab.errors import ConfigError
from blocklab.results import read_results
from blocklab.train.run import prepare
from conftest import FAST, ROOT, compose_config, run_in_process

ARGS = ["logger=none", "trainer.max_steps=120", "trainer.val_check_interval=60", "checkpoint_every=10",
        "task.eval_examples=16", "diagnostics.every_n_steps=40"]


def comparable(results: dict) -> dict:
    keep = ("final_train_loss", "final_val_loss", "steps", "eval", "params", "status", "steps_to_target_loss")
    return {k: results[k] for k in keep} | {"diag_end": results["diagnostics"]["end"]["layers"]}


def test_sigterm_saves_and_rerun_resumes_to_identical_results(tmp_path):
    interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
    cmd = [sys.executable, str(ROOT / "train.py"), *ARGS, f"hydra.run.dir={interrupted}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (interrupted / "checkpoints" / "last.ckpt").exists() and time.time() < deadline:
        time.sleep(0.2)
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
