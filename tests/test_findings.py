"""Findings pages (blocklab.report.findings): every committed page is what its data renders, every sweep has one,
the index names every exercise, untrusted text stays text, and the verdict follows the intervals."""
import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest

from blocklab.report import findings, stats

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "findings"


def test_every_committed_page_is_what_its_data_renders():
    """A page, the index, or an unmeasured sweep's page that differs from its re-rendering fails: no page drifts
    from its jsonl, and no number on it is typed by hand."""
    drift = [str(p.relative_to(ROOT)) for p, text in findings.expected(PAGES).items()
             if not p.exists() or p.read_text(encoding="utf-8") != text]
    assert not drift, f"re-render with python -m blocklab.report --findings docs/findings --rerender: {drift}"


def test_every_figure_is_small_and_is_what_its_data_draws():
    for data in sorted(PAGES.glob("*.jsonl")):
        meta, jobs = findings.read_jsonl(data)
        png = data.with_suffix(".png")
        drawn = findings.draw(meta, jobs)
        assert (drawn is None) == (not png.exists()), png
        if drawn is not None:
            assert png.stat().st_size <= findings.MAX_PNG_BYTES
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            if meta["matplotlib"] == matplotlib.__version__:  # another version may draw other bytes
                assert png.read_bytes() == drawn, png


def test_every_sweep_has_a_page_and_the_index_every_exercise_but_the_proof():
    sweeps = {p.stem for p in (ROOT / "sweeps").glob("*.yaml")}
    assert sweeps and all((PAGES / f"{name}.md").is_file() for name in sweeps)
    index = (PAGES / "README.md").read_text(encoding="utf-8")
    for name in sweeps:
        assert f"]({name}.md)" in index
    first_column = {m for line in index.splitlines() if line.startswith("| 1.")
                    for m in re.findall(r"1\.\d+", line.split("|")[1])}
    assert {f"1.{i}" for i in range(1, 15)} - {"1.6"} <= first_column
    for name in sweeps - {p.stem for p in PAGES.glob("*.jsonl")}:  # no data: the first line says so
        first = (PAGES / f"{name}.md").read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("Not measured yet at this commit: run `python train.py -m sweep=" + name + "`")
        assert f"| not measured | – | [{name}]({name}.md) |" in index


def test_the_readme_shows_the_index_first_rows_and_links_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = [line for line in (PAGES / "README.md").read_text(encoding="utf-8").splitlines() if line.startswith("| 1.")]
    assert "(docs/findings/README.md)" in readme
    for row in rows[:3]:
        assert row.replace("](", "](docs/findings/") in readme


def test_untrusted_text_stays_text():
    assert findings.md("a|b<script>*x*[l](u)`c`") == "a\\|b&lt;script&gt;\\*x\\*\\[l\\](u)\\`c\\`"
    assert findings.md("pe_copy _x_") == "pe_copy \\_x\\_"  # an intraword _ is not emphasis; a word's edge is
    assert findings.md("0.512 [0.400, 0.600]") == "0.512 [0.400, 0.600]"
    assert findings.code("a ``b`` c") == "```a ``b`` c```"


def _job(setting: dict, seed: int, value: float, learned: float | None = 1.0) -> dict:
    return {"job": f"{setting}-{seed}", "setting": setting, "seed": seed, "choices": {}, "status": "completed",
            "in_distribution_exact_match": learned, "metrics": {"exact_match_out": value}, "eval": []}


def _meta(**verdict) -> dict:
    return {"study": {"compare": ["pos"], "metrics": ["exact_match_out"], "paper": "P",
                      "verdict": {"metric": "exact_match_out", "better": {"pos": "a"}, "than": {"pos": "b"},
                                  "claim": "A beats B", "paper_scale": "1B", **verdict}}}


@pytest.mark.parametrize("a, b, outcome", [
    ([0.9, 0.8, 0.85], [0.1, 0.2, 0.15], "yes"),   # intervals apart, the claimed one better
    ([0.1, 0.2, 0.15], [0.9, 0.8, 0.85], "no"),    # apart the other way
    ([0.1, 0.9, 0.5], [0.2, 0.8, 0.4], "scale"),   # overlapping
])
def test_the_verdict_follows_the_intervals(a, b, outcome):
    jobs = [_job({"pos": "a"}, s, v) for s, v in enumerate(a)] + [_job({"pos": "b"}, s, v) for s, v in enumerate(b)]
    got, sentence = findings.judge(_meta(), jobs)
    assert got == outcome
    ea, eb = stats.estimate(a), stats.estimate(b)
    assert stats.mean_interval(ea) in sentence and stats.mean_interval(eb) in sentence  # numbers from the data
    assert f"P(pos=a better) = {stats.prob_improvement(a, b):.2f}" in sentence


@pytest.mark.parametrize("a, learned", [([0.1, 0.9, 0.5], 1.0), ([0.9, 0.9, 0.9], 0.4)])  # overlap; never learned
def test_a_verdict_that_does_not_show_carries_what_the_sweep_found_about_why(a, learned):
    jobs = [_job({"pos": "a"}, s, v, learned) for s, v in enumerate(a)] + \
        [_job({"pos": "b"}, s, v) for s, v in enumerate([0.2, 0.8, 0.4])]
    outcome, sentence = findings.judge(_meta(why="the budget is too small"), jobs)
    assert outcome == "scale" and sentence.endswith("(the budget is too small).")


def _write(path, meta: dict, jobs: list[dict]) -> None:
    path.write_text("".join(json.dumps(x) + "\n" for x in [meta, *jobs]), encoding="utf-8")


def test_a_page_gives_the_verdict_at_each_other_scale_it_was_run_at(tmp_path):
    setup = {"format": findings.FORMAT, "jobs": 6, "seeds": [0, 1, 2], "task": ["copy"], "d_model": [64],
             "n_layers": [2], "n_heads": [4], "train_time_s": 1.0, "commit": None, "commit_recorded": False,
             "date": "d", "command": "c", "report": "r"}
    overlapping = [_job({"pos": p}, s, v) for p, vals in (("a", [0.1, 0.9, 0.5]), ("b", [0.2, 0.8, 0.4]))
                   for s, v in enumerate(vals)]
    apart = [_job({"pos": p}, s, v) for p, vals in (("a", [0.9, 0.8, 0.85]), ("b", [0.1, 0.2, 0.15]))
             for s, v in enumerate(vals)]
    _write(tmp_path / "x.jsonl", {**_meta(), **setup, "sweep": "x", "scale": 1, "steps": [10],
                                  "machines": {"CPU": 6}}, overlapping)
    _write(tmp_path / "x-scale4.jsonl", {**_meta(), **setup, "sweep": "x-scale4", "scale": 4, "steps": [40],
                                         "machines": {"GPU": 6}}, apart)
    _write(tmp_path / "x-scaled.jsonl", {**_meta(), **setup, "sweep": "x-scaled", "scale": 1, "steps": [10],
                                         "machines": {"CPU": 6}}, apart)  # another sweep, named alike
    findings.write_page(tmp_path / "x.jsonl")
    page = (tmp_path / "x.md").read_text(encoding="utf-8")
    row = next(line for line in page.splitlines() if line.startswith("| [4](x-scale4.md)"))
    said = stats.mean_interval(stats.estimate([0.9, 0.8, 0.85])).replace("[", "\\[").replace("]", "\\]")
    assert "| GPU | 40 | yes |" in row and said in row  # the scaled data's numbers, escaped in a sentence
    assert "| 1 (this page) | CPU | 10 | not at this scale |" in page and "x-scaled" not in page
    assert "At other scales" not in findings.render_page(*findings.read_jsonl(tmp_path / "x-scale4.jsonl"), None)


def test_a_setting_that_did_not_learn_is_not_judged_beyond_training_and_is_flagged_first():
    jobs = [_job({"pos": "a"}, s, 0.9, learned=0.4) for s in range(3)] + [_job({"pos": "b"}, s, 0.0) for s in range(3)]
    outcome, sentence = findings.judge(_meta(), jobs)
    assert outcome == "scale" and "pos=a did not learn its training lengths" in sentence
    meta = {**_meta(), "sweep": "x", "jobs": 6, "seeds": [0, 1, 2], "task": ["copy"], "d_model": [64],
            "n_layers": [2], "n_heads": [4], "steps": [10], "scale": 1, "machines": {}, "train_time_s": 1.0,
            "commit": None, "commit_recorded": False, "date": "d", "command": "python train.py -m sweep=x",
            "report": "r"}
    page = findings.render_page(meta, jobs, None)
    assert page.index("did not learn in distribution: pos=a") < page.index("**Verdict")


def test_further_claims_are_judged_as_the_first_each_against_its_own_paper():
    jobs = ([_job({"pos": "a"}, s, v) for s, v in enumerate([0.9, 0.8, 0.85])]
            + [_job({"pos": "b"}, s, v) for s, v in enumerate([0.1, 0.2, 0.15])]
            + [_job({"pos": "c"}, s, v) for s, v in enumerate([0.1, 0.9, 0.5])])
    meta = _meta(also=[{"claim": "C beats B", "metric": "exact_match_out", "better": {"pos": "c"},
                        "than": {"pos": "b"}, "paper": "Q"},
                       {"claim": "B beats A", "metric": "exact_match_out", "better": {"pos": "b"},
                        "than": {"pos": "a"}}])
    (o1, s1), (o2, s2) = findings.also(meta, jobs)
    assert o1 == "scale" and "(Q saw it at a larger scale)" in s1  # overlapping; no paper_scale of its own
    assert o2 == "no" and "contradicts P" in s2  # no paper of its own: the study's
    assert findings.judge(meta, jobs)[0] == "yes"  # the first claim is unchanged by the others


def test_the_working_range_of_a_metric_better_lower_is_within_best_over_fraction():
    from blocklab.report.recall import AtChoice, working

    options = [AtChoice(1, [1.0], []), AtChoice(2, [1.1], []), AtChoice(3, [1.2], [])]  # best 1.0; bound 1/0.9 = 1.111
    assert [c.value for c in working(options, 0.9, higher=False)] == [1, 2]
    assert [c.value for c in working(options, 0.9)] == [2, 3]  # better higher: best 1.2, bound 1.08


def test_a_partial_modifications_table_names_what_it_lacks():
    """_planned: every modification that applies (the baseline too) without a completed run is named on the page."""
    from blocklab.modifications import plan

    jobs_planned = ["baseline", *plan().jobs]
    extra = findings._planned(jobs_planned[:-2])
    assert extra["not_run"] == jobs_planned[-2:] and extra["left_out"]
    meta = {**_meta(), "sweep": "x", "jobs": 3, "seeds": [0, 1, 2], "task": ["lm"], "d_model": [64], "n_layers": [2],
            "n_heads": [4], "steps": [10], "scale": 1, "machines": {}, "train_time_s": 1.0, "commit": None,
            "commit_recorded": False, "date": "d", "command": "c", "report": "r", **extra}
    page = findings.render_page(meta, [_job({"pos": "a"}, s, 0.5) for s in range(3)], None)
    assert "Not run yet (2: " in page and all(f"`{m}`" in page for m in jobs_planned[-2:])


def test_a_sweep_over_learning_rates_judges_each_setting_at_its_best_and_counts_its_working_range():
    """Zoology reports each model at its best learning rate; a rate "works" when its mean reaches 0.9 of that best.
    kind a: best at 0.01 (0.95); 0.001 (0.90 >= 0.855) works, 0.0001 (0.30) does not. kind b never learns (its
    exact match stays 0.2), so its range is not counted and it alone is flagged, at its best rate."""
    scores = {("a", 0.0001): 0.30, ("a", 0.001): 0.90, ("a", 0.01): 0.95, ("b", 0.0001): 0.25, ("b", 0.001): 0.20,
              ("b", 0.01): 0.26}
    jobs = [{**_job({"attn": k, "optim.lr": lr}, s, v + s / 1000, learned=0.2 if k == "b" else v),
             "metrics": {"token_acc_in": v + s / 1000}} for (k, lr), v in scores.items() for s in range(2)]
    meta = {**_meta(), "sweep": "x", "jobs": 12, "seeds": [0, 1], "task": ["mqar"], "d_model": [64], "n_layers": [2],
            "n_heads": [1], "steps": [10], "scale": 1, "machines": {}, "train_time_s": 1.0, "commit": None,
            "commit_recorded": False, "date": "d", "command": "python train.py -m sweep=x", "report": "r"}
    meta["study"] = {"compare": ["attn", "optim.lr"], "metrics": ["token_acc_in"],
                     "verdict": {"metric": "token_acc_in", "better": {"attn": "a"}, "than": {"attn": "b"}}}
    groups = findings._groups(meta, jobs)
    best = findings.tuned(meta, groups)
    assert {rest: [c.value for c in tried] for rest, tried in best.items()} == {
        ("a",): [0.0001, 0.001, 0.01], ("b",): [0.0001, 0.001, 0.01]}
    assert set(findings.at_best(meta, groups, best)) == {("a", 0.01), ("b", 0.01)}
    page = findings.render_page(meta, jobs, None)
    row_a = next(line for line in page.splitlines() if line.startswith("| attn=a |"))
    assert "| 0.01 |" in row_a and "2 of 3 (0.001, 0.01)" in row_a
    row_b = next(line for line in page.splitlines() if line.startswith("| attn=b |"))
    assert "not learned at any" in row_b
    flag = page[:page.index("**Verdict")]
    assert "attn=b, lr=0.01" in flag and "attn=a" not in flag and "1 of 2 settings" in flag


@pytest.mark.slow
def test_a_real_tiny_sweep_end_to_end(tmp_path):
    """Train a cheap sweep for a few steps, write its findings, and re-render them unchanged."""
    sweep, out = tmp_path / "sweep", tmp_path / "findings"
    run = lambda *args: subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,  # noqa: E731
                                       timeout=600)
    done = run("train.py", "-m", "sweep=causal_mask", "seed=0,1", "trainer.max_steps=5", "logger=none",
               "diagnostics=none", f"hydra.sweep.dir={sweep}", "hydra.launcher.n_jobs=1")
    assert done.returncode == 0, done.stderr[-2000:]
    done = run("-m", "blocklab.report", str(sweep), "--findings", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    meta, jobs = findings.read_jsonl(out / "causal_mask.jsonl")
    assert len(jobs) == 4 and meta["seeds"] == [0, 1] and meta["steps"] == [5]
    assert not any("checkpoint" in json.dumps(j) or "train_loss_curve" in j for j in jobs)
    assert (out / "causal_mask.png").stat().st_size <= findings.MAX_PNG_BYTES
    page = (out / "causal_mask.md").read_text()
    assert "sweep=causal_mask attn.causal=False,True seed=0,1 trainer.max_steps=5" in page
    assert findings.rerender(out) == []
    done = run("-m", "blocklab.report", "--findings", str(out), "--rerender")
    assert done.returncode == 0 and "0 file(s) changed" in done.stdout


def test_bad_findings_input_is_one_line(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text("{not json\n")
    done = subprocess.run([sys.executable, "-m", "blocklab.report", "--findings", str(tmp_path), "--rerender"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "x.jsonl" in done.stderr
