"""Trust boundaries of a run folder (issue 44): a folder may come from anyone, so nothing in it is unpickled, one
process owns it while it runs, and damage is refused in one line, never repaired behind the user's back."""
import fcntl
import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

from blocklab.errors import ConfigError
from blocklab.results import read_results
from blocklab.folder import LOCK_FILE
from conftest import FAST, ROOT, run_cli, run_in_process

TIMING = ("train_time_s", "tokens_per_s", "ms_per_step", "decode", "costs", "machine", "step_time_s")


class WritesMarker:
    """Unpickling this runs `open(marker, "w")`: what a crafted checkpoint would do with os.system."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@contextmanager
def held(lock_path):
    """The run folder's lock, held by this process as a running owner holds it (an exclusive flock)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trust") / "run"
    run_in_process(FAST, run_dir)
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr[-2000:]
    return lines[0]


def test_a_crafted_checkpoint_runs_nothing_on_resume_generate_or_analyze(run_copy, tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"state_dict": {}, "global_step": 1, "payload": WritesMarker(marker)},
               run_copy / "checkpoints" / "last.ckpt")
    (run_copy / "results.json").unlink()  # an unfinished run: the documented way on is its own command again
    before = sorted(p.name for p in run_copy.rglob("*"))
    commands = [
        [sys.executable, str(ROOT / "train.py"), *FAST, f"hydra.run.dir={run_copy}"],
        [sys.executable, "-m", "blocklab.generate", str(run_copy), "--prompt", "ab"],
        [sys.executable, "-m", "blocklab.analyze", str(run_copy)],
    ]
    for command in commands:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert not marker.exists(), command
        assert done.returncode == 2, (command, done.stderr[-2000:])
        assert "last.ckpt" in one_error_line(done.stderr)
    assert sorted(p.name for p in run_copy.rglob("*")) == before


def test_a_second_command_on_a_folder_in_use_is_refused_and_writes_nothing(run_copy):
    (run_copy / "results.json").unlink()
    before = {p: p.stat().st_mtime_ns for p in run_copy.rglob("*") if p.name != LOCK_FILE}
    with held(run_copy / LOCK_FILE):  # as the running owner holds it
        refused = run_cli([*FAST, f"hydra.run.dir={run_copy}"])
    assert refused.returncode == 2
    assert str(run_copy) in one_error_line(refused.stderr) and "in use" in refused.stderr
    assert {p: p.stat().st_mtime_ns for p in run_copy.rglob("*") if p.name != LOCK_FILE} == before


def test_a_lock_left_by_a_killed_process_never_blocks(run_copy):
    (run_copy / "results.json").unlink()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, time; "
                               f"fd = os.open({str(run_copy / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    resumed = run_cli([*FAST, f"hydra.run.dir={run_copy}"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert read_results(run_copy)["status"] == "completed"


@pytest.mark.parametrize("damage", ["truncate", "not_json", "unknown_status", "not_an_object"])
def test_damaged_results_are_refused_not_regenerated(run_copy, damage):
    path = run_copy / "results.json"
    text = path.read_text()
    damaged = {"truncate": text[:100], "not_json": "\x00\xff" + text, "not_an_object": "[1, 2]",
               "unknown_status": text.replace('"completed"', '"complfted"', 1)}[damage]
    path.write_text(damaged, errors="surrogateescape")
    refused = run_cli([*FAST, f"hydra.run.dir={run_copy}"])
    assert refused.returncode == 2
    line = one_error_line(refused.stderr)
    assert str(path) in line and "delete it" in line and "new hydra.run.dir" in line
    assert path.read_text(errors="surrogateescape") == damaged


def test_reevaluating_a_finished_run_from_its_final_checkpoint_reproduces_its_results(run_copy):
    """Deleting results.json is the documented way to evaluate again: every field but the timings comes back the
    same, the loss curve and the final training loss included (the last step is in the final checkpoint)."""
    original = read_results(run_copy)
    (run_copy / "results.json").unlink()
    run_in_process(FAST, run_copy)
    again = read_results(run_copy)
    assert {k: v for k, v in again.items() if k not in TIMING} == {k: v for k, v in original.items() if k not in TIMING}
    assert original["train_loss_curve"][-1][0] == original["steps"]


def test_resume_without_the_saved_config_checks_against_the_checkpoints_own(run_copy):
    (run_copy / "results.json").unlink()
    (run_copy / ".hydra" / "config.yaml").unlink()
    refused = run_cli([*FAST, "optim.lr=0.5", f"hydra.run.dir={run_copy}"])
    assert refused.returncode == 2 and "optim.lr" in one_error_line(refused.stderr)
    run_in_process(FAST, run_copy)  # the same config resumes (and re-evaluates) from it
    assert read_results(run_copy)["status"] == "completed"


def test_a_damaged_saved_config_is_one_line_naming_it(run_copy):
    (run_copy / "results.json").unlink()
    (run_copy / ".hydra" / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"config\.yaml is unreadable"):
        from blocklab.train.run import prepare
        from conftest import compose_config
        prepare(compose_config(FAST, run_copy))


def test_a_flipped_bit_in_a_weight_is_caught_by_the_archives_checksum(run_copy):
    """torch writes CRC-32s into the checkpoint's zip but does not check them on reading: BlockLab does."""
    path = run_copy / "checkpoints" / "last.ckpt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    from blocklab.experiment import Setup

    with pytest.raises(ConfigError, match="fails its checksum"):
        Setup.from_run_dir(run_copy).trained_model()


def test_a_sweep_skips_a_job_folder_in_use_and_writes_nothing_there(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = ["-m", *FAST, "seed=0,1", "hydra/launcher=basic", f"hydra.sweep.dir={sweep_dir}",
            "hydra.sweep.subdir=${seed}"]
    (sweep_dir / "1").mkdir(parents=True)
    with held(sweep_dir / "1" / LOCK_FILE):
        done = run_cli(args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "error: job skipped" in done.stderr and "in use" in done.stderr
    assert read_results(sweep_dir / "0")["status"] == "completed"
    assert not (sweep_dir / "1" / "results.json").exists()


def test_a_full_disk_while_checkpointing_is_one_line_and_the_run_resumes_once_space_is_freed(tmp_path, monkeypatch):
    """The disk fills during the step-10 checkpoint, after half of it is written: the step-5 checkpoint stays whole,
    the run stops with one line, and the same command later resumes to the results of a run never interrupted."""
    from blocklab import folder
    from blocklab.errors import RunFolderError
    from blocklab.checkpoint import load_checkpoint

    run_dir, straight, overrides = tmp_path / "run", tmp_path / "straight", [*FAST, "checkpoint_every=5"]
    saves, fsync = [], folder.os.fsync

    def fills_the_disk_on_the_second_save(fd):  # only checkpoints are written durably
        saves.append(fd)
        if len(saves) == 2:  # the temporary holds the whole checkpoint's bytes, not yet on the disk
            raise OSError(28, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(folder.os, "fsync", fills_the_disk_on_the_second_save)
    with pytest.raises(RunFolderError, match=r"^no space left on the disk of .*last\.ckpt.*previous checkpoint is kept"):
        run_in_process(overrides, run_dir)
    assert load_checkpoint(run_dir, "checkpoints/last.ckpt", None)["global_step"] == 5
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.ckpt"]
    assert not (run_dir / "results.json").exists()
    monkeypatch.undo()
    run_in_process(overrides, run_dir)
    run_in_process(overrides, straight)
    resumed, uninterrupted = read_results(run_dir), read_results(straight)
    assert {k: v for k, v in resumed.items() if k not in TIMING} == \
        {k: v for k, v in uninterrupted.items() if k not in TIMING}
