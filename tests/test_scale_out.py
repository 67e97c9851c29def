"""Real distributed engines: Lightning DDP on CPU (gloo, 2 processes), DDP inside a Hydra multirun,
the default joblib launcher running jobs side by side, and the submitit launcher running jobs as separate
processes."""
import json
import os
import signal
import subprocess
import sys

import pytest
from joblib import cpu_count

from blocklab.train.job import share_of_cores
from conftest import ROOT
from helpers import assert_refused_cli, wait_until

TINY = ["trainer.max_steps=30", "trainer.val_check_interval=15", "logger=none", "task.eval_examples=16",
        "diagnostics=none"]


def train(args, timeout=600, threads: str | None = "1"):
    """train.py; `threads` is OMP_NUM_THREADS (None: unset, as a user's shell has it)."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads  # two processes on two cores: no thread oversubscription
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
    proc = train(["-m", "trainer=ddp", "seed=0,1", "hydra.launcher.n_jobs=1", *TINY,
                  f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert output.count("launching 2 jobs") == 1  # the child ranks did not re-run the sweep (hydra #2070)
    assert statuses(tmp_path / "sweep") == ["completed", "completed"]
    assert not list(tmp_path.glob("sweep/*/*/results.json"))  # no nested sweeps


def test_submitit_local_launcher_runs_jobs_in_their_own_processes(tmp_path):
    sweep = tmp_path / "submitit"
    proc = train(["-m", "hydra/launcher=submitit_local", "seed=0", *TINY, f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert statuses(sweep) == ["completed"]
    assert list(sweep.glob(".submitit/*/*_log.out"))  # submitit's own job logs: a separate process ran it


def test_multirun_jobs_run_side_by_side_on_their_share_of_the_cores(tmp_path):
    """The default launcher: joblib's workers, one job per core, each with cores // jobs threads, unless
    trainer.threads says otherwise; each job its own directory; no live progress bar to overwrite another's."""
    sweep = tmp_path / "joblib"
    proc = train(["-m", "trainer.threads=null,2", *TINY, f"hydra.sweep.dir={sweep}"], threads=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=-1" in proc.stdout + proc.stderr
    results = {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/results.json")}
    assert sorted(results) == ["0", "1"] and {r["status"] for r in results.values()} == {"completed"}
    # Two jobs at once split the cores joblib counts (affinity, cgroup quota); the key's value where it is set.
    assert results["0"]["threads"] == max(1, cpu_count() // 2) and results["1"]["threads"] == 2
    assert all(r["beside_other_jobs"] is True for r in results.values())  # the report's speed caveat reads it
    assert "\x1b[" not in proc.stdout


def test_an_interrupted_side_by_side_sweep_saves_every_running_job_and_resumes(tmp_path):
    """SIGTERM to the launching process alone: it passes the signal on to joblib's workers, each running job saves
    its checkpoint, the queued job does not start, exit 143; the same command resumes and finishes all three.
    Two workers (hydra.launcher.n_jobs=2), so two jobs run and one waits on any number of cores."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "seed=0,1,2", "trainer.max_steps=150", "checkpoint_every=5",
           "hydra.launcher.n_jobs=2", *TINY[1:], f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_until(lambda: len(list(sweep.glob("*/checkpoints/last.ckpt"))) >= 2, proc, timeout=120)
    os.kill(proc.pid, signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, output[-3000:]
    assert output.count("checkpoint saved in") == 2 and "sweep interrupted" in output
    assert "Traceback" not in output and not list(sweep.glob("*/results.json"))
    assert sorted(p.parent.parent.name for p in sweep.glob("*/checkpoints/last.ckpt")) == ["0", "1"]

    rerun = train(cmd[2:], threads=None)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert rerun.stdout.count("resuming") == 2
    assert statuses(sweep) == ["completed"] * 3
    assert all(json.loads(p.read_text())["steps"] == 150 for p in sweep.glob("*/results.json"))


@pytest.mark.parametrize("cores, n_jobs, jobs, threads", [
    (2, -1, 2, 1), (2, -1, 6, 1), (2, -1, 1, 2), (16, -1, 6, 2), (16, 4, 6, 4), (16, -2, 40, 1), (16, 4, None, 4),
    (8, 3, 2, 4), (1, -1, 3, 1),
])
def test_jobs_side_by_side_split_the_cores_evenly(cores, n_jobs, jobs, threads):
    assert share_of_cores(cores, n_jobs, jobs) == threads


def test_a_launch_of_fewer_jobs_than_cores_gives_each_more_threads(tmp_path):
    sweep = tmp_path / "one"
    proc = train(["-m", "seed=0", *TINY, f"hydra.sweep.dir={sweep}"], threads=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((sweep / "0" / "results.json").read_text())["threads"] == cpu_count()


def test_ddp_cannot_run_beside_other_jobs_and_is_refused_before_launch(tmp_path):
    proc = train(["-m", "seed=0,1", "trainer=ddp", *TINY, f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    line = assert_refused_cli(proc, "add hydra.launcher.n_jobs=1", tmp_path / "sweep")
    assert line.startswith("error: trainer.strategy=ddp")
