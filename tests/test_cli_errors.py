"""Hydra's own refusals (a misspelled key, an unknown option, a malformed override) are one line naming the
fix, exit 2, before any run directory exists and before torch is imported; HYDRA_FULL_ERROR=1 keeps Hydra's."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blocklab.overrides import command_line_error, output_dir_error
from conftest import CONF, ROOT, run_cli

BAD = {
    "misspelled key": (["model.dmodel=64"], "error: model.dmodel is not a key of model; did you mean model.d_model?"),
    "misspelled group": (["nrom=pre_ln"], "error: nrom is not a key of the config; did you mean norm?"),
    "unknown option": (["norm=post_layernorm"], "error: norm=post_layernorm is not an option of group norm; "
                       "did you mean post_ln or post_rms? options: "
                       + " ".join(sorted(p.stem for p in (CONF / "norm").glob("*.yaml")))),
    "unknown swept option": (["-m", "norm=pre_ln,post_layernorm"], "error: norm=post_layernorm is not an option"),
    "glob matching nothing": (["-m", "pos=glob(xx*)"], "error: pos=glob(xx*) matches no option of group pos"),
    "misspelled key in a sweep": (["-m", "pos=rope,alibi", "model.dmodel=64"], "error: model.dmodel is not a key"),
    "unknown launcher": (["hydra/launcher=jobib"], "error: hydra/launcher=jobib is not an option of group "
                         "hydra/launcher; did you mean joblib?"),
    "append under a misspelled key": (["+modle.foo=1"], "error: +modle.foo=1: modle is not a key of the config; "
                                      "did you mean model?"),
    "append to an existing key": (["+model.d_model=32"], "error: +model.d_model=32: model.d_model already exists; "
                                  "set it without the +: model.d_model=32"),
    "delete a missing key": (["~model.dmodel"], "error: ~model.dmodel: model.dmodel is not a key of model; "
                             "did you mean model.d_model?"),
    "sweep without -m": (["seed=0,1"], "error: seed=0,1 is a sweep: add -m (--multirun)"),
    "malformed list": (["model.d_model=[1,"], "error: cannot parse override 'model.d_model=[1,'"),
    "no value": (["model.d_model"], "error: cannot parse override 'model.d_model': missing EQUAL"),
    # Hydra kept the last value of a key set twice, without a word.
    "key set twice": (["optim.lr=1", "optim.lr=2"], "error: optim.lr is set 2 times (optim.lr=1 optim.lr=2); "
                      "Hydra would keep the last without a word: keep one"),
    # Without -m, Hydra trained the sweep's first job alone; the multirun command is spelled out instead.
    "sweep without -m": (["sweep=causal_mask", "logger=none"], "error: sweep=causal_mask names a sweep, which runs "
                         "as a multirun only (without -m it would train its first job alone, which is refused); "
                         "run: python train.py -m sweep=causal_mask logger=none"),
    "unset environment variable": (["model.d_model=${oc.env:BLOCKLAB_UNSET_VARIABLE}"],
                                   "error: model.d_model=${oc.env:BLOCKLAB_UNSET_VARIABLE} cannot be resolved: "
                                   "KeyError: \"Environment variable 'BLOCKLAB_UNSET_VARIABLE' not found\""),
    "study scale not a number": (["-m", "sweep=causal_mask", "study.scale=abc"],
                                 "error: trainer.max_steps=${mul:800,${study.scale}} cannot be resolved "
                                 "(study.scale='abc'): ValueError: mul needs two numbers, got 800 and 'abc'"),
}


@pytest.mark.parametrize("args, expected", BAD.values(), ids=BAD.keys())
def test_hydra_refusal_is_one_line_exit_2_and_creates_nothing(args, expected, tmp_path):
    run_dir, sweep_dir = tmp_path / "run", tmp_path / "sweep"
    proc = run_cli([*args, f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={sweep_dir}"], timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(expected), proc.stderr
    assert "+model.dmodel" not in proc.stderr and "search path" not in proc.stderr
    assert not run_dir.exists() and not sweep_dir.exists()


def test_full_error_keeps_hydras_own_message(tmp_path):
    proc = run_cli(["norm=post_layernorm", f"hydra.run.dir={tmp_path / 'run'}"], timeout=60,
                   env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1
    assert "Could not find 'norm/post_layernorm'" in proc.stderr and "Config search path" in proc.stderr
    assert "Traceback" in proc.stderr


def test_refusal_comes_before_torch():
    code = ("import sys; sys.argv = ['train.py', 'norm=post_layernorm']\n"
            "from blocklab.cli import main\n"
            "try:\n    main()\nexcept SystemExit as exit:\n    print(exit.code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr


@pytest.mark.parametrize("args", [
    ["--cfg", "job", "norm=post_ln"],
    ["--cfg", "job", "hydra/launcher=joblib", "+model.extra=1", "++logger.mode=online", "~model.dropout"],
    ["--help"],
], ids=["run", "launcher and +/++/~", "help"])
def test_good_commands_still_work(args):
    proc = run_cli(args, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "error:" not in proc.stderr


@pytest.mark.parametrize("args", [
    ["-m", "sweep=pe_copy", "logger=none"],
    ["-m", "hydra/launcher=joblib", "norm=glob(*)", "seed=range(0,3)", "hydra.sweep.dir=/tmp/unused"],
    ["-m", "pos=rope,learned", "pos.max_len=64"],  # a key of one swept option: the sweep's job check decides
    ["-m", "experiment=nanogpt_baby,nanogpt_baby_modern", "model.n_layers=2"],
])
def test_good_sweeps_pass_the_check(args):
    assert command_line_error(args) is None


@pytest.mark.parametrize("tool, args, expected", [
    ("blocklab.analyze", ["no_such_run"], "error: no_such_run is not a finished BlockLab run (missing model.json, "
                                          "tokenizer.json, checkpoints/last.ckpt, .hydra/config.yaml)"),
    ("blocklab.report.__main__", ["no_such_sweep"], "error: no_such_sweep is not a directory"),
], ids=["analyze", "report"])
def test_a_tool_refuses_a_missing_directory_before_torch(tool, args, expected, tmp_path):
    code = (f"import sys\nfrom {tool} import main\n"
            f"try:\n    main({args!r})\nexcept SystemExit as exit:\n"
            "    if isinstance(exit.code, str):  # sys.exit(message): what the interpreter would print, exit 1\n"
            "        print(exit.code, file=sys.stderr)\n"
            "    print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["False"], proc.stdout + proc.stderr
    assert proc.stderr.strip().startswith(expected), proc.stderr


@pytest.mark.parametrize("parent", ["file", "read-only"])
@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_a_run_folder_that_cannot_be_created_is_one_line_before_hydra_makes_it(key, parent, tmp_path):
    """Hydra creates the folder before any of BlockLab's code runs, and its failure was a traceback."""
    if parent == "file":
        blocker = tmp_path / "a_file"
        blocker.write_text("not a folder")
    else:
        blocker = tmp_path / "read_only"
        blocker.mkdir(mode=0o555)
        if os.access(blocker, os.W_OK):
            pytest.skip("this user (root) writes to a mode-555 folder: nothing to refuse")
    folder = blocker / "run"
    args = ["-m", "seed=0,1"] if key == "hydra.sweep.dir" else []
    proc = run_cli([*args, "logger=none", f"{key}={folder}"], timeout=60)
    assert proc.returncode == 2, proc.stderr
    why = "is a file, not a folder" if parent == "file" else "is not writable"
    assert proc.stderr.splitlines() == [f"error: {key}={folder} cannot be created: {blocker} {why}; "
                                        f"choose another {key}"]


def test_a_read_only_parent_is_refused_as_the_os_reports_it(tmp_path, monkeypatch):
    """The same check where the OS says the folder is not writable (a read-only mount, or a user who is not root)."""
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    assert output_dir_error([f"hydra.run.dir={tmp_path / 'run'}"], multirun=False) == (
        f"hydra.run.dir={tmp_path / 'run'} cannot be created: {tmp_path} is not writable (permissions, or a "
        "read-only file system); choose another hydra.run.dir")
    (tmp_path / "writable").mkdir()
    assert output_dir_error([f"hydra.run.dir={tmp_path / 'writable' / 'run'}"], multirun=False) is None


def test_printing_a_sweep_files_config_needs_no_multirun():
    assert command_line_error(["--cfg", "job", "sweep=causal_mask"]) is None
