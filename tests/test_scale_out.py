"""Real distributed engines: Lightning DDP on CPU (gloo, 2 processes), DDP inside a Hydra multirun,
and the submitit launcher running jobs as separate processes."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

TINY = ["trainer.max_steps=30", "trainer.val_check_interval=15", "logger=none", "task.eval_examples=16",
        "diagnostics=none"]


def train(args, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes on two cores: no thread oversubscription
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def statuses(root):
    return sorted(json.loads(p.read_text())["status"] for p in root.rglob("results.json"))


def test_ddp_trains_with_two_processes(tmp_path):
    proc = train(["trainer=ddp", *TINY, f"hydra.run.dir={tmp_path / 'ddp'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MEMBER: 2/2" in proc.stdout + proc.stderr  # a second rank joined
    results = json.loads((tmp_path / "ddp" / "results.json").read_text())
    assert results["status"] == "completed" and results["steps"] == 30
    assert statuses(tmp_path) == ["completed"]  # only rank 0 writes results


@pytest.mark.slow  # 24 s; test_ddp_trains_with_two_processes covers DDP in the default run
def test_ddp_inside_multirun_runs_each_job_once(tmp_path):
    proc = train(["-m", "trainer=ddp", "seed=0,1", *TINY, f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert output.count("Launching 2 jobs") == 1  # the child ranks did not re-run the sweep (hydra #2070)
    assert statuses(tmp_path / "sweep") == ["completed", "completed"]
    assert not list(tmp_path.glob("sweep/*/*/results.json"))  # no nested sweeps


def test_submitit_local_launcher_runs_jobs_in_their_own_processes(tmp_path):
    sweep = tmp_path / "submitit"
    proc = train(["-m", "hydra/launcher=submitit_local", "seed=0", *TINY, f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert statuses(sweep) == ["completed"]
    assert list(sweep.glob(".submitit/*/*_log.out"))  # submitit's own job logs: a separate process ran it


def test_joblib_launcher_runs_jobs_in_parallel(tmp_path):
    sweep = tmp_path / "joblib"
    proc = train(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1", *TINY,
                  f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Joblib.Parallel" in proc.stdout + proc.stderr
    assert statuses(sweep) == ["completed", "completed"]
