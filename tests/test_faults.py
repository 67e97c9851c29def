"""Property-based faults (issue 44): truncate or flip one bit of any file of a finished run folder, then run an
entry point on it (train's resume, generate, analyze, report). Every draw ends in the result the undamaged folder
gives, or in one clear line naming a file of the folder (exit 2); none in a traceback, and none rewrites
results.json. The checkpoint's zip checksums, and the digests it keeps of the run's other files, are what let a
flipped bit that leaves a file readable be caught rather than used."""
import contextlib
import io
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from blocklab.errors import ConfigError
from conftest import FAST, compose_config, run_in_process

FILES = ("results.json", "checkpoints/last.ckpt", ".hydra/config.yaml", "model.json", "tokenizer.json")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("faults") / "sweep" / "job"
    run_in_process(FAST, run_dir)
    return run_dir


def damage(path: Path, kind: str, where: float, bit: int) -> None:
    data = bytearray(path.read_bytes())
    offset = min(int(where * len(data)), len(data) - 1)
    if kind == "truncate":
        del data[offset:]
    else:
        data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def call(main, argv) -> tuple[int, str, str]:
    """An entry point's exit status, stdout and stderr, in this process."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
            if not isinstance(exit_.code, int) and exit_.code is not None:
                err.write(str(exit_.code) + "\n")
    return code, out.getvalue(), err.getvalue()


def resume(run_dir: Path) -> tuple[int, str, str]:
    """train's checks on a folder it would resume: its step, or the one-line refusal (the CLI prints it, exit 2)."""
    from blocklab.train.run import prepare

    try:
        return 0, str(prepare(compose_config(FAST, run_dir)).start_step), ""
    except ConfigError as err:
        return 2, "", f"error: {err}\n"


def generate(run_dir: Path):
    from blocklab.generate import main

    return call(main, [str(run_dir), "--prompt", "ab", "--max-new-tokens", "6", "--temperature", "0"])


def analyze(run_dir: Path):
    from blocklab.analyze import main

    code, out, err = call(main, [str(run_dir)])
    analysis = run_dir / "diagnostics" / "analysis.json"
    if code == 0:  # what it measured, without the paths it printed (the folder differs)
        stats = json.loads(analysis.read_text())
        out = json.dumps({k: v for k, v in stats.items() if k != "run_dir"}, sort_keys=True)
    return code, out, err


def report(run_dir: Path):
    from blocklab.report.__main__ import main

    code, out, err = call(main, [str(run_dir.parent)])
    return code, (out.split(" (")[-1] if code == 0 else out), err  # "wrote PATH (1 runs)": the count


ENTRIES = {"resume": resume, "generate": generate, "analyze": analyze, "report": report}


def fresh_copy(finished: Path, entry: str) -> Path:
    copy = Path(tempfile.mkdtemp(prefix="fault-")) / "sweep" / "job"
    shutil.copytree(finished, copy)
    if entry == "resume":
        (copy / "results.json").unlink()  # an interrupted run: what its own command resumes
    return copy


@pytest.fixture(scope="module")
def reference(finished) -> dict:
    """Each entry point's outcome on an undamaged copy."""
    outcomes = {}
    for entry, function in ENTRIES.items():
        copy = fresh_copy(finished, entry)
        outcomes[entry] = function(copy)
        assert outcomes[entry][0] == 0, outcomes[entry]
        shutil.rmtree(copy.parents[1])
    return outcomes


def check_draw(finished, reference, entry, name, kind, where, bit) -> None:
    copy = fresh_copy(finished, entry)
    try:
        target = copy / name
        if not target.exists():  # results.json of a resumed run: it has none to damage
            return
        damage(target, kind, where, bit)
        results_before = (copy / "results.json").read_bytes() if (copy / "results.json").exists() else None
        code, out, err = ENTRIES[entry](copy)
        results_after = (copy / "results.json").read_bytes() if (copy / "results.json").exists() else None
        assert results_after == results_before, "results.json was rewritten"
        event(f"{name}: {'same result' if code == 0 else 'one line'}")
        if code == 0:
            assert (code, out) == reference[entry][:2], (name, kind, err[-500:])
        else:
            lines = [line for line in err.splitlines() if line.strip()]
            assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err[-2000:])
            assert str(copy) in lines[0], lines[0]
    finally:
        shutil.rmtree(copy.parents[1], ignore_errors=True)


faults = dict(name=st.sampled_from(FILES), kind=st.sampled_from(["truncate", "flip"]),
              where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))


def draws(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def fault_test(entry: str, n: int):
    @draws(n)
    @given(**faults)
    def test(finished, reference, name, kind, where, bit):
        check_draw(finished, reference, entry, name, kind, where, bit)

    return test


# 200 draws in the default run: the cheap entry points take most of them.
test_resume_of_a_damaged_folder = fault_test("resume", 90)
test_generate_from_a_damaged_folder = fault_test("generate", 80)
test_analyze_a_damaged_folder = fault_test("analyze", 15)
test_report_on_a_damaged_folder = fault_test("report", 15)


# What a crafted folder can put in place of a file: a link to a file outside it, a named pipe (a read would block
# forever), a link to /dev/zero (endless), a 3 GB sparse file.
SPECIAL = ("link_outside", "fifo", "dev_zero", "oversize")


def replace(path: Path, kind: str, outside: Path) -> None:
    path.unlink()
    if kind == "link_outside":
        outside.write_bytes(b"precious")
        os.symlink(outside, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    else:
        with open(path, "wb") as file:
            file.truncate(3 * 2**30)


@contextlib.contextmanager
def hang_guard(seconds: int):
    """Fails the test, rather than the whole run, where an entry blocks (a read of a named pipe waits forever)."""
    def hung(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def check_special(finished, reference, entry, name, kind) -> None:
    """One line naming the file, exit 2, or the undamaged folder's result where the entry never reads that file (a
    resume rewrites model.json from its config; the report reads no checkpoint), within seconds; the file outside
    and results.json unchanged."""
    copy = fresh_copy(finished, entry)
    outside = copy.parents[1] / "outside"
    try:
        target = copy / name
        if not target.exists():
            return
        replace(target, kind, outside)
        results_before = (copy / "results.json").read_bytes() \
            if (copy / "results.json").is_file() and not (copy / "results.json").is_symlink() else None
        start = time.monotonic()
        with hang_guard(120):
            code, out, err = ENTRIES[entry](copy)
        assert time.monotonic() - start < 30
        lines = [line for line in err.splitlines() if line.strip()]
        if code == 0:  # an entry that never reads that file (the report: the checkpoint) gives the correct result
            assert (code, out) == reference[entry][:2]
        else:
            assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err[-2000:])
            assert str(copy) in lines[0], lines[0]
        if kind == "link_outside":
            assert outside.read_bytes() == b"precious"
        if results_before is not None:
            assert (copy / "results.json").read_bytes() == results_before
    finally:
        shutil.rmtree(copy.parents[1], ignore_errors=True)


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("entry", ["resume", *(pytest.param(e, marks=pytest.mark.slow)
                                               for e in ("generate", "analyze", "report"))])
def test_a_special_file_in_place_of_a_run_file_is_one_line(finished, reference, entry, name, kind):
    check_special(finished, reference, entry, name, kind)


@pytest.mark.slow
@settings(max_examples=800, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(entry=st.sampled_from(list(ENTRIES)), **faults)
def test_many_faults_slow(finished, reference, entry, name, kind, where, bit):
    check_draw(finished, reference, entry, name, kind, where, bit)


def snapshot(where: Path) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(where.rglob("*")) if p.is_file()}


def test_a_folder_of_links_changes_nothing_outside_it(finished, tmp_path):
    """Every file of a finished run replaced by a link to a copy outside it: resume, generate, analyze,
    eval-scaling, the report and --findings each refuse in one line or write only their declared outputs (--out,
    --findings OUT); no file outside changes."""
    from blocklab.analyze import main as analyze_main
    from blocklab.report.__main__ import main as report_main

    outside, run = tmp_path / "outside", tmp_path / "sweep" / "job"
    shutil.copytree(finished, outside)
    shutil.copytree(finished, run)
    for path in sorted(run.rglob("*")):
        if path.is_file():
            path.unlink()
            os.symlink(outside / path.relative_to(run), path)
    before = snapshot(outside)
    findings = tmp_path / "findings"
    calls = {"resume": lambda: resume(run), "generate": lambda: generate(run), "analyze": lambda: analyze(run),
             "eval-scaling": lambda: call(analyze_main, [str(run), "--eval-scaling", "none"]),
             "report": lambda: call(report_main, [str(run.parent), "--out", str(tmp_path / "report")]),
             "findings": lambda: call(report_main, [str(run.parent), "--out", str(tmp_path / "report"),
                                                    "--findings", str(findings)])}
    for entry, function in calls.items():
        with hang_guard(120):
            code, out, err = function()
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "is a link" in lines[0], (entry, code, err[-1000:])
        assert snapshot(outside) == before, entry


# Issue 53's writers, each given a folder with a link planted where it writes: (entry, the planted path).
PLANTED = [("resume", "model.json"), ("resume", "tokenizer.json"), ("resume", ".hydra"),
           ("resume", "results.json.tmp"), ("resume", "checkpoints/last.ckpt.partial"), ("resume", ".lock"),
           ("analyze", "diagnostics/analysis.json"), ("eval-scaling", "eval_scaling_none_1.json.tmp"),
           ("eval-scaling", "eval_scaling_none_1.json"), ("report", "../report"), ("report", "../report/index.html")]


@pytest.mark.parametrize("entry, planted", PLANTED)
def test_a_link_planted_where_a_writer_writes_is_refused(finished, tmp_path, entry, planted):
    """The writer refuses in one line naming the link, and the file the link points to is unchanged (before, a
    results.json.tmp link made the atomic results write land on its target)."""
    from blocklab.analyze import main as analyze_main
    from blocklab.report.__main__ import main as report_main

    run = fresh_copy(finished, "resume" if entry == "resume" else "analyze")
    try:
        target = tmp_path / "precious"
        target.write_text("precious\n")
        link = run / planted
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)
        else:
            link.unlink(missing_ok=True)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, link)
        function = {"resume": lambda: resume(run), "analyze": lambda: analyze(run),
                    "eval-scaling": lambda: call(analyze_main, [str(run), "--eval-scaling", "none"]),
                    "report": lambda: call(report_main, [str(run.parent)])}[entry]
        with hang_guard(120):
            code, out, err = function()
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "is a link" in lines[0], (code, err[-1000:])
        assert target.read_text() == "precious\n"
    finally:
        shutil.rmtree(run.parents[1], ignore_errors=True)
