"""Command-line inputs at the edges (issue 53, item 8): a sweep whose override only some swept options have, and
the cases tests/test_bad_input_list.py runs as commands, checked here in-process where that is faster."""
import pytest

from blocklab.errors import ConfigError


def test_a_key_only_some_swept_options_have_is_one_line_and_plus_plus_records_those_jobs_invalid(tmp_path, capsys):
    """Hydra composes every job before the first starts and stops the sweep at one it cannot (mha has no
    attn.gate_rank): refused in one line naming the key, the jobs and ++ as the fix. With ++ every job composes,
    and the mha job is listed invalid (recorded so when its turn comes), as docs/running.md says."""
    from blocklab.train.sweep import check_sweep_jobs

    sweep = tmp_path / "sweep"
    with pytest.raises(ConfigError) as refused:
        check_sweep_jobs(["attn=gla,mha", "attn.gate_rank=8", f"hydra.sweep.dir={sweep}"])
    line = str(refused.value)
    assert len(line.splitlines()) == 1
    assert "attn.gate_rank=8 cannot be set in 1 of 2 jobs (attn=mha)" in line and "++attn.gate_rank=8" in line
    assert check_sweep_jobs(["attn=gla,mha", "++attn.gate_rank=8", f"hydra.sweep.dir={sweep}"]) == 2
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("warning: job attn=mha,++attn.gate_rank=8 is invalid")
    assert not sweep.exists()


def test_an_option_after_the_overrides_is_one_line_with_the_command_in_order():
    from blocklab.overrides import command_line_error

    error = command_line_error(["seed=0,1", "-m", "logger=none", "--cfg", "job"])
    start, _, command = error.partition("; run: ")
    assert start == "-m --cfg must come before the overrides (Hydra reads no option after them)"
    assert command.endswith((" train.py -m --cfg job seed=0,1 logger=none", " blocklab.train -m --cfg job seed=0,1 "
                                                                            "logger=none"))
    assert command_line_error(["-m", "seed=0,1", "logger=none"]) is None


def test_an_integer_too_long_for_python_and_an_empty_or_too_long_folder_are_one_line(tmp_path):
    from blocklab.overrides import command_line_error

    error = command_line_error([f"model.d_model={'1' * 5000}"])
    assert error.startswith("model.d_model=<an integer of 5000 digits> is longer than the 4300 digits")
    assert command_line_error(["hydra.run.dir="]).startswith("hydra.run.dir is empty, and Hydra would write into")
    assert command_line_error(["-m", "seed=0,1", "hydra.sweep.dir="]).startswith("hydra.sweep.dir is empty")
    long = command_line_error([f"hydra.run.dir={tmp_path / ('a' * 300) / 'run'}"])
    assert "hydra.run.dir=" in long and "a name in it is 300 bytes" in long and "\n" not in long
    assert len(long) < 300  # the folder is shortened, not printed whole
    assert command_line_error(["hydra.run.dir=."]) is None  # the current folder, when it is asked for


def test_a_short_conv_wider_than_64_and_an_original_context_below_1_are_refused():
    from blocklab.model.position import RoPE, scaling_errors
    from blocklab.schema import SHORT_CONV_MAX, group_errors

    assert group_errors("attn", {"short_conv": SHORT_CONV_MAX}) == []
    assert group_errors("attn", {"short_conv": 1000}) == [
        "attn.short_conv=1000 must be an integer in [0, 64] (width of the causal convolution on q, k and v; 0: none; "
        "the papers use 3 or 4)"]
    for scaling in ("none", "yarn"):  # one line, whatever the scaling (YaRN checks it too)
        errors = scaling_errors(RoPE, {"scaling": scaling, "scaling_factor": 2.0, "original_context": 0})
        assert len(errors) == 1 and errors[0].startswith("pos.original_context=0 must be null"), errors
    assert scaling_errors(RoPE, {"original_context": None}) == [] and scaling_errors(RoPE, {"original_context": 8}) == []


def test_control_characters_in_an_error_line_are_escaped(tmp_path):
    import subprocess
    import sys

    from blocklab.errors import printable

    assert printable("a\x1b[31mb\r\x7f\x9b\u202ec é") == "a\\x1b[31mb\\r\\x7f\\x9b\\u202ec é"
    folder = tmp_path / "x\x1b[2J\x1b]0;title\x07"
    proc = subprocess.run([sys.executable, "-m", "blocklab.report", str(folder)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr and "x\\x1b[2J\\x1b]0;title\\x07" in proc.stderr


def test_a_study_scale_that_is_not_a_number_is_one_line_before_any_findings_file():
    from blocklab.report.findings import studies_error

    rows = [{"study": "s", "run": "/sweep/job"}]
    assert studies_error(rows, {"s": {"scale": 4}}) is None
    assert studies_error(rows, {"s": {"scale": "abc"}}) == (
        "study.scale='abc' of study s (in /sweep/job/.hydra/config.yaml) must be a positive number (1: the sweep "
        "file's size), or no findings page can be named for it; fix the value or move that run away")
    assert studies_error(rows, {"s": {"scale": True}}) is not None and studies_error(rows, {"s": {"scale": 0}})


@pytest.mark.parametrize("saved", ["- a\n- b\n", "just text\n", "a: [\n"], ids=["list", "scalar", "not yaml"])
def test_a_sweep_relaunch_refuses_a_saved_job_config_that_is_not_a_mapping_in_one_line(saved, tmp_path):
    from blocklab.errors import RunFolderError
    from blocklab.results import CHECKPOINT
    from blocklab.train.sweep import check_sweep_jobs

    job = tmp_path / "sweep" / "attn.causal=True,seed=0"  # the folder Hydra names this job
    (job / CHECKPOINT).parent.mkdir(parents=True)
    (job / CHECKPOINT).write_bytes(b"")  # an interrupted job: its saved config is compared with this launch's
    (job / ".hydra").mkdir()
    (job / ".hydra" / "config.yaml").write_text(saved)
    with pytest.raises(RunFolderError) as refused:
        check_sweep_jobs(["sweep=causal_mask", "seed=0", "attn.causal=True", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert str(refused.value).startswith(f"{job / '.hydra' / 'config.yaml'} is damaged (")
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_a_finished_run_refuses_a_prompt_past_its_length_and_a_study_scale_findings_cannot_name(tmp_path):
    """generate: a 100,000-character prompt is one line, at once (it generated for a minute). The report: a job
    config whose study.scale is 'abc' is one line with --findings, and neither the report nor OUT is written."""
    import re
    import subprocess
    import sys
    import time

    from conftest import FAST, run_in_process

    run_dir = tmp_path / "sweep" / "job"
    run_in_process([*FAST, "study={name:tiny,scale:1,compare:[seed],metrics:[final_train_loss]}"], run_dir)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "blocklab.generate", str(run_dir), "--prompt", "a" * 100_000],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and time.monotonic() - start < 60
    assert re.fullmatch(r"error: --prompt is 100000 tokens, longer than the \d+ this run's model takes .*\n",
                        proc.stderr), proc.stderr

    saved = run_dir / ".hydra" / "config.yaml"
    saved.write_text(saved.read_text().replace("\n  scale: 1\n", "\n  scale: abc\n", 1))
    out = tmp_path / "findings"
    proc = subprocess.run([sys.executable, "-m", "blocklab.report", str(tmp_path / "sweep"), "--findings", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: study.scale='abc' of study tiny (in "), proc.stderr
    assert proc.stderr.count("\n") == 1
    assert not out.exists() and not (tmp_path / "sweep" / "report").exists()
