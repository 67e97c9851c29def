"""The report on bad input (issue 44, items 7 and 8): one line on stderr naming the problem and the fix, exit 2,
before any file is written; a damaged results.json or saved config in a sweep folder is such a line, never a
traceback (Hypothesis truncates and flips bits of each); a `/` in a study name renders in one report folder."""
import json
import random
import shutil
import tempfile
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
