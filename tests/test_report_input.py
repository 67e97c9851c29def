"""The report on bad input (issue 44, items 7 and 8): one line on stderr naming the problem and the fix, exit 2,
before any file is written; a damaged results.json or saved config in a sweep folder is such a line, never a
traceback (Hypothesis truncates and flips bits of each); a `/` in a study name renders in one report folder.
Issue 53: a folder from anyone (links, special files, NaN, YAML aliases, a held lock, --out), at the end."""
import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from omegaconf import OmegaConf

from blocklab.errors import ConfigError
from blocklab.report.__main__ import main
from blocklab.report.build import build_report
from blocklab.report.collect import collect, study_specs

STUDY = {"name": "s", "question": "q?", "compare": ["pos"], "metrics": ["exact_match_in", "exact_match_out"]}


def fabricate(root: Path, study: dict = STUDY) -> Path:
    for pos in ("rope", "alibi"):
        for seed in (0, 1):
            run_dir = root / f"pos={pos},seed={seed}"
            (run_dir / ".hydra").mkdir(parents=True)
            OmegaConf.save(OmegaConf.create({"study": study, "seed": seed, "pos": pos, "task": {"name": "copy"}}),
                           run_dir / ".hydra" / "config.yaml")
            results = {"status": "completed", "task": "copy", "study": study["name"], "choices": {"pos": pos},
                       "overrides": [f"pos={pos}", f"seed={seed}"], "params": 5000, "steps": 100,
                       "tokens_per_s": 1000.0, "final_train_loss": 0.1, "final_val_loss": 0.2,
                       "train_lengths": [1, 8], "train_loss_curve": [[50, 1.0], [100, 0.5]],
                       "eval": [{"length": n, "in_distribution": n <= 8, "exact_match": 0.95 - 0.1 * seed,
                                 "loss": 0.2, "token_acc": 0.9, "token_acc_by_position": [0.9, 0.8]}
                                for n in (4, 8, 16)]}
            (run_dir / "results.json").write_text(json.dumps(results))
    return root


def refused(capsys, argv: list[str]) -> str:
    """main(argv) exits 2 with exactly one line on stderr, which it returns."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_a_missing_or_empty_folder_is_one_line_and_exit_2(tmp_path, capsys):
    assert "is not a directory" in refused(capsys, [str(tmp_path / "nope")])
    assert "no results.json under" in refused(capsys, [str(tmp_path)])


@pytest.mark.parametrize("damage, why", [
    (lambda text: text[:100], "JSONDecodeError"),  # truncated
    (lambda text: text.replace('"status"', '"stbtus"'), "status None is not one of"),  # a bit flip in a key
    (lambda text: text.replace('"length": 4', '"length": "4"'), "an eval row lacks its length"),
    (lambda text: text.replace('"train_lengths": [1, 8]', '"train_lengths": 8'), "train_lengths is not a pair"),
    (lambda text: "[]", "not a JSON object"),
    (lambda text: text.encode("utf-8")[:50] + b"\xff\xfe", "UnicodeDecodeError"),
])
def test_an_unreadable_results_json_names_the_file_and_the_fix(tmp_path, capsys, damage, why):
    root = fabricate(tmp_path / "sweep")
    path = root / "pos=rope,seed=1" / "results.json"
    damaged = damage(path.read_text())
    path.write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode())
    line = refused(capsys, [str(root)])
    assert line.startswith(f"error: {path}: unreadable (") and why in line
    assert line.endswith("delete it and rerun the sweep's command to re-evaluate that run, or move the run's folder "
                         "out of the sweep folder")
    assert not (root / "report").exists()


def test_an_unreadable_saved_config_or_bench_file_is_one_line(tmp_path, capsys):
    root = fabricate(tmp_path / "sweep")
    config = root / "pos=alibi,seed=0" / ".hydra" / "config.yaml"
    good = config.read_text()
    config.write_text("study: [unclosed\n  name: s")
    assert refused(capsys, [str(root)]).startswith(f"error: {config}: unreadable (")
    config.write_text(good.replace("compare:", "compare: 5\n  was:"))  # a study block the report cannot read
    assert "study.compare=5 must be a key or a list of keys" in refused(capsys, [str(root)])
    config.write_text(good.replace("metrics:", "bench: activations\n  metrics:"))
    bench = tmp_path / "bench.json"
    bench.write_text('{"benchmarks": {"activations": ')
    line = refused(capsys, [str(root), "--bench", str(bench)])
    assert line.startswith(f"error: {bench}: unreadable benchmark results (JSONDecodeError")
    assert not (root / "report").exists()
    bench.write_text(json.dumps({"benchmarks": {"activations": {"rows": [{"act": "relu"}]}}}))  # a field missing
    main([str(root), "--bench", str(bench)])
    assert "The activations benchmark results do not have the fields this section reads (KeyError: &#39;ms&#39;)" in \
        (root / "report" / "index.html").read_text()


def test_a_slash_in_the_study_name_renders_in_one_report_folder(tmp_path):
    """`study.name=exercise/1.7` once split its figure's path into a folder that does not exist."""
    study = {**STUDY, "name": "exercise/1.7", "plots": [{"kind": "bar", "metric": "exact_match_in", "by": "pos"}]}
    root = fabricate(tmp_path / "sweep", study)
    rows = collect(root)
    index = build_report(root, rows, study_specs(root, rows))
    page = index.read_text()
    assert "<section id='exercise/1.7'><h2>exercise/1.7</h2>" in page
    files = sorted(p.relative_to(index.parent) for p in index.parent.rglob("*"))
    assert all(p.parent == Path(".") for p in files), files  # no folder made of the name
    figure = [p.name for p in files if p.suffix == ".png"]
    assert len(figure) == 1 and figure[0].startswith("exercise_1.7-") and figure[0].endswith("_0_exact_match_in.png")
    assert f"<figcaption>{figure[0]}</figcaption>" in page


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    return fabricate(tmp_path_factory.mktemp("faults") / "sweep")


FILES = ["pos=rope,seed=0/results.json", "pos=alibi,seed=1/.hydra/config.yaml"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(FILES), truncate=st.booleans(), where=st.floats(0, 1, exclude_max=True),
       seed=st.integers(0, 2 ** 16))
def test_a_damaged_file_is_one_line_or_a_correct_report_never_a_traceback(finished, which, truncate, where, seed):
    """A truncation, or 1-3 bit flips, anywhere in a run's results.json or saved config: the report either reads it
    (the damage kept it well formed) and writes its page, or refuses in one line naming the damaged file."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "sweep"
        shutil.copytree(finished, root)
        path = root / which
        data = bytearray(path.read_bytes())
        at = int(where * len(data))
        if truncate:
            del data[at:]
        else:
            rng = random.Random(seed)
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        try:
            rows = collect(root)
            index = build_report(root, rows, study_specs(root, rows))
        except ConfigError as err:  # the report's one-line refusal
            assert len(str(err).splitlines()) == 1 and str(err).strip()
            if str(path) not in str(err):  # a config that still parses: its study block is named instead
                assert str(err).startswith("study.") or "is not a" in str(err), str(err)
            return
        assert index.is_file() and "<h2>" in index.read_text()


# ---------------------------------------------------------------- issue 53: a folder from anyone
# Every file is read and written through blocklab.folder: a link, a special file, an oversize file, NaN, a YAML alias
# or an interpolation in a run folder is one line and exit 2 (or the documented skip), fast; nothing outside the
# folder changes; a run still training is shown as running, not read.
@contextlib.contextmanager
def deadline(seconds: float = 20):
    """A hang (a FIFO read, an alias expansion) fails the test instead of blocking the suite."""
    def expired(*_):
        raise TimeoutError(f"took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def tree(root: Path, skip: Path | None = None) -> dict:
    """Everything under root, as lstat sees it (no link followed, no FIFO opened): what each entry is, and a
    regular file's size, mtime and (if small) bytes."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if skip is not None and (path == skip or skip in path.parents):
                continue
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                found[path] = ("link", os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                found[path] = ("file", info.st_size, info.st_mtime_ns,
                               path.read_bytes() if info.st_size < 2**20 else None)
            else:
                found[path] = (stat.S_IFMT(info.st_mode),)
    return found


RUN = "pos=rope,seed=1"


@pytest.fixture
def planted(tmp_path):
    """A sweep folder, and beside it a folder of the user's files a planted link may point at."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("precious\n")
    (outside / "other.json").write_text(json.dumps({"status": "completed"}))
    return fabricate(tmp_path / "sweep"), outside


def _swap(path: Path, make) -> None:
    path.unlink()
    make(path)


SPECIAL = {
    "a link to /dev/zero": (lambda p: _swap(p, lambda q: os.symlink("/dev/zero", q)), "is a link, not a regular"),
    "a named pipe": (lambda p: _swap(p, os.mkfifo), "is a named pipe, not a regular file"),
    "a 3 GB sparse file": (lambda p: os.truncate(p, 3 * 2**30), "3,221,225,472 bytes, more than"),
    "a link to another file": (lambda p: _swap(p, lambda q: os.symlink(q.parents[2] / "outside" / "other.json", q)),
                               "is a link, not a regular"),
}


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("which", ["results.json", ".hydra/config.yaml"])
def test_a_special_file_in_a_run_folder_is_one_line_fast(planted, tmp_path, capsys, kind, which):
    root, _ = planted
    path = root / RUN / which
    SPECIAL[kind][0](path)
    before = tree(tmp_path)
    start = time.monotonic()
    with deadline():
        line = refused(capsys, [str(root)])
    assert time.monotonic() - start < 10
    assert line.startswith(f"error: {path} ") and SPECIAL[kind][1] in line, line
    assert tree(tmp_path) == before and not (root / "report").exists()


def test_nan_in_results_json_is_the_damaged_run_line_not_a_silent_gap(planted, capsys):
    root, _ = planted
    path = root / RUN / "results.json"
    path.write_text(path.read_text().replace('"final_val_loss": 0.2', '"final_val_loss": NaN'))
    line = refused(capsys, [str(root)])
    assert line.startswith(f"error: {path}: unreadable (ValueError: NaN is not JSON); delete it and rerun")


@pytest.mark.parametrize("config, why", [
    # four levels of ten aliases: expanded, 10^4 nodes per load and ten times more per level
    ("a: &a [x,x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\nstudy: {name: s}\n", "it uses a YAML alias"),
    ("study: {name: s, question: '${oc.env:HOME}'}\n", "holds an interpolation"),
    ("- a\n- list\n", "ValueError: not a mapping of config keys"),
    ("study: " + "[" * 5000 + "]" * 5000 + "\n", "config.yaml: unreadable ("),
])
def test_a_saved_config_is_read_as_data_one_line_fast(planted, capsys, config, why):
    root, _ = planted
    path = root / RUN / ".hydra" / "config.yaml"
    path.write_text(config)
    start = time.monotonic()
    with deadline():
        line = refused(capsys, [str(root)])
    assert time.monotonic() - start < 10
    assert line.startswith(f"error: {path}: unreadable (") and why in line, line
    assert os.environ["HOME"] not in line.replace(str(root), "")  # an interpolation is never resolved
    assert not (root / "report").exists()


@pytest.mark.parametrize("where", ["report", "report/index.html", "report/summary.csv", "report/s_0_bar.png"])
def test_a_link_planted_where_the_report_writes_is_refused_and_nothing_outside_changes(tmp_path, capsys, where):
    study = {**STUDY, "plots": [{"kind": "bar", "metric": "bar", "by": "pos"}]}
    root = fabricate(tmp_path / "sweep", study)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("precious\n")
    link = root / where
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside if where == "report" else outside / "precious.txt", link)
    before = tree(tmp_path, skip=root / "report")
    line = refused(capsys, [str(root)])
    assert line.startswith(f"error: {link} is a link") and line.endswith("or write the report elsewhere with --out DIR")
    assert tree(tmp_path, skip=root / "report") == before  # nothing outside the report folder, through no link
    assert (outside / "precious.txt").read_text() == "precious\n" and sorted(outside.iterdir()) == [
        outside / "precious.txt"]


def test_out_writes_the_report_elsewhere_and_leaves_the_sweep_folder_as_it_was(planted, tmp_path, capsys):
    root, _ = planted
    before = tree(root)
    main([str(root), "--out", str(tmp_path / "elsewhere" / "report")])
    assert tree(root) == before
    written = sorted(p.name for p in (tmp_path / "elsewhere" / "report").iterdir())
    assert written == ["index.html", "summary.csv"], written
    assert f"wrote {tmp_path / 'elsewhere' / 'report' / 'index.html'} (4 runs)" in capsys.readouterr().out
    (tmp_path / "file").write_text("x")
    assert "--out" in refused(capsys, [str(root), "--out", str(tmp_path / "file")])


def test_a_read_only_sweep_folder_is_one_line_that_suggests_out_before_any_work(planted, tmp_path, capsys,
                                                                                 monkeypatch):
    root, _ = planted
    if os.geteuid() == 0:  # root writes anywhere: stand in for a read-only mount
        real = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
            Path(path) != root and real(path, mode, **kw)) if mode & os.W_OK else real(path, mode, **kw))
    import blocklab.report.__main__ as cli

    def no_work(_):
        raise AssertionError("collected the runs before checking where the report goes")

    monkeypatch.setattr(cli, "collect", no_work)
    root.chmod(0o555)
    try:
        line = refused(capsys, [str(root)])
        assert line == (f"error: {root} is read-only, so the report cannot be written to {root / 'report'}; write it "
                        "elsewhere with --out DIR")
        monkeypatch.undo()
        if os.geteuid() == 0:
            monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
                Path(path) != root and real(path, mode, **kw)) if mode & os.W_OK else real(path, mode, **kw))
        main([str(root), "--out", str(tmp_path / "report")])
        assert (tmp_path / "report" / "index.html").is_file() and not (root / "report").exists()
    finally:
        root.chmod(0o755)


def _hold_lock(run_dir: Path) -> int:
    """What blocklab.train.checks.own_run_dir does while a run trains: an exclusive flock on run_dir/.lock."""
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_run_whose_lock_is_held_is_shown_as_running_not_read(planted, capsys):
    root, _ = planted
    training = root / "pos=alibi,seed=1"
    (training / "results.json").write_text('{"status": "comp')  # half-written: never read while the lock is held
    fresh = root / "pos=alibi,seed=2"  # started, no results yet: listed too
    shutil.copytree(training / ".hydra", fresh / ".hydra")
    stale = root / "pos=rope,seed=0" / ".lock"  # a killed run's lock file, held by nobody: the run reads as usual
    stale.write_text("")
    fds = [_hold_lock(training), _hold_lock(fresh)]
    try:
        before = tree(root)
        main([str(root)])
        page = (root / "report" / "index.html").read_text()
        assert "<b>Still running (their lock is held: not read; report again when they finish).</b>" in page
        assert "<li>pos=alibi,seed=1</li>" in page and "<li>pos=alibi,seed=2</li>" in page
        assert "5 runs (3 finished, 0 failed, 0 invalid configurations not run, 2 still running)" in page
        out = capsys.readouterr().out
        assert "2 run(s) still training (their lock is held), shown as running and not read: pos=alibi,seed=1, " \
               "pos=alibi,seed=2" in out
        assert tree(root, skip=root / "report") == before  # no lock file made, none taken away
        assert not (root / "pos=rope,seed=1" / ".lock").exists()
        csv_rows = (root / "report" / "summary.csv").read_text().splitlines()
        assert sum(",running," in row for row in csv_rows) == 2
    finally:
        for fd in fds:
            os.close(fd)
    line = refused(capsys, [str(root)])  # released: the half-written file is read, and refused
    assert line.startswith(f"error: {training / 'results.json'}: unreadable (JSONDecodeError")


def test_a_lock_file_that_is_a_link_or_a_pipe_is_no_lock_and_never_followed(planted, tmp_path, capsys):
    root, outside = planted
    os.symlink(outside / "precious.txt", root / RUN / ".lock")
    before = tree(tmp_path, skip=root / "report")
    with deadline():
        main([str(root)])
    assert "(4 runs)" in capsys.readouterr().out and "Still running" not in (root / "report" / "index.html").read_text()
    (root / RUN / ".lock").unlink()
    os.mkfifo(root / RUN / ".lock")
    with deadline():
        main([str(root)])
    assert "(4 runs)" in capsys.readouterr().out
    assert tree(tmp_path, skip=root / "report") == {**before, root / RUN / ".lock": (stat.S_IFIFO,)}


def _png(path: Path, colour: str) -> Path:
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1), dpi=20)
    fig.patch.set_facecolor(colour)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def test_attention_maps_are_taken_only_inside_the_run_folder_and_a_non_png_is_left_out(tmp_path, capsys):
    from blocklab.report.attention_maps import _maps

    study = {**STUDY, "plots": [{"kind": "attention_maps", "metric": "attention_maps", "by": "pos", "when": "end"}]}
    root = fabricate(tmp_path / "sweep", study)
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = _png(outside / "secret.png", "red")
    run = root / "pos=rope,seed=0"
    (run / "diagnostics").mkdir()
    os.symlink(secret, run / "diagnostics" / "linked.png")
    (run / "diagnostics" / "notes.png").write_text("not an image")
    recorded = [str(secret), "../../outside/secret.png", "diagnostics/linked.png", "diagnostics/notes.png", 5]
    results = json.loads((run / "results.json").read_text())
    (run / "results.json").write_text(json.dumps({**results, "diagnostics": {"end": {"attention_maps": recorded}}}))
    skipped = []
    assert _maps(str(run), "end", skipped) is None
    assert len(skipped) == 5 and "not a PNG" in skipped[3], skipped
    main([str(root)])
    page = (root / "report" / "index.html").read_text()
    assert "Left out, as results.json names them: pos=rope,seed=0: " in page and "not a PNG" in page
    # with a map of its own, the run's map is drawn: the first recorded that reads, never one outside
    own = _png(run / "diagnostics" / "attn_end.png", "blue")
    (run / "results.json").write_text(json.dumps({**results, "diagnostics": {"end": {"attention_maps": [
        str(secret), "diagnostics/notes.png", "diagnostics/attn_end.png"]}}}))
    image = _maps(str(run), "end", skipped := [])
    assert image is not None and image[0, 0, 2] == 1.0 and image[0, 0, 0] == 0.0  # blue, not the red secret
    assert len(skipped) == 2
    assert own.is_file()


def test_findings_write_into_out_through_no_planted_link(planted, tmp_path, capsys):
    root, outside = planted
    out = tmp_path / "findings"
    out.mkdir()
    os.symlink(outside / "precious.txt", out / "README.md")
    line = refused(capsys, [str(root), "--findings", str(out)])
    assert line.startswith(f"error: {out / 'README.md'} is a link")
    assert (outside / "precious.txt").read_text() == "precious\n"
    assert os.path.islink(out / "README.md")


def test_a_bad_study_scale_read_from_the_folder_is_one_line_with_findings(tmp_path, capsys):
    root = fabricate(tmp_path / "sweep", {**STUDY, "scale": "abc"})
    line = refused(capsys, [str(root), "--findings", str(tmp_path / "findings")])
    assert line.startswith("error: study.scale='abc' of study s (in ") and "must be a positive number" in line
    assert not (tmp_path / "findings").exists() or not any((tmp_path / "findings").iterdir())
