"""Findings pages (blocklab.report.findings): every committed page is what its data renders, every sweep has one,
the index names every exercise, untrusted text stays text, and the verdict follows the paired test at the page's
Holm level (report/judge.py): hand-computed cases, the worst-value rule for a run that diverged or is missing, a
constant metric, a diverged setting kept on the page, min_effect."""
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
    """Each page draws one figure per plot its sweep's `plots:` names (<sweep>.png, <sweep>.1.png, ...), and a
    ladder's page its section's (<sweep>.ladder.png)."""
    for data in sorted(PAGES.glob("*.jsonl")):
        meta, jobs = findings.read_jsonl(data)
        for name, drawn in findings.pngs(data, meta, jobs):
            png = data.parent / name
            assert png.stat().st_size <= findings.MAX_PNG_BYTES, png
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            if meta["matplotlib"] == matplotlib.__version__:  # another version may draw other bytes
                assert findings.same_drawing(png.read_bytes(), drawn), png


def test_the_reproduce_command_gives_ablation_jobs_their_own_launch():
    """Jobs launched with a key of their own (a sweep's ablation rows) are rerun by a second command, joined by &&:
    one product of every key's values would give the whole sweep the ablation's key."""
    from blocklab.report.findings_data import _command

    sweep = [["task=lm", f"attn={a}", f"seed={s}"] for a in ("mha", "gla") for s in (0, 1)]
    ablation = [["task=lm", "attn=gla", f"seed={s}", "++attn.rotary=True"] for s in (0, 1)]
    assert _command("k", 1, sweep + ablation) == ("python train.py -m sweep=k task=lm attn=gla,mha seed=0,1 && "
                                                  "python train.py -m sweep=k task=lm attn=gla seed=0,1 "
                                                  "++attn.rotary=True")
    assert _command("k", 4, sweep) == "python train.py -m sweep=k study.scale=4 task=lm attn=gla,mha seed=0,1"
    assert _command("k", 1, []) == "python train.py -m sweep=k"


def test_the_reproduce_command_reruns_a_stage_2_and_no_job_that_never_ran():
    """A second seed at each setting's best learning rate (recall's stage 2) is no product of its keys' values: the
    command gives it launches of its own, which expand to exactly the jobs that ran, not seed=0,1 across the grid."""
    import itertools

    from blocklab.report.findings_data import _command

    stage_1 = [(a, c, lr, "0") for a in ("mha", "gla", "linear") for c in ("0", "4") for lr in ("0.001", "0.01")]
    best = {("mha", "0"): "0.001", ("mha", "4"): "0.001", ("gla", "4"): "0.01", ("linear", "4"): "0.01"}
    stage_2 = [(a, c, lr, "1") for (a, c), lr in best.items()] + [("linear", "0", "0.001", "1")]
    jobs = stage_1 + stage_2
    command = _command("recall", 1, [[f"attn={a}", f"attn.short_conv={c}", f"optim.lr={lr}", f"seed={s}"]
                                     for a, c, lr, s in jobs])
    launches = command.split(" && ")
    expanded = []
    for launch in launches:
        head, *overrides = launch.split(" ")[3:]
        assert head == "sweep=recall"
        values = dict(o.split("=") for o in overrides)
        expanded += itertools.product(*(values[k].split(",") for k in ("attn", "attn.short_conv", "optim.lr", "seed")))
    assert sorted(expanded) == sorted(jobs)  # every job once, and none that never ran
    assert launches[0].endswith("attn=gla,linear,mha attn.short_conv=0,4 optim.lr=0.001,0.01 seed=0")
    assert len(launches) <= 4  # mha at 0.001 both ways, gla and linear with the conv at 0.01, linear at 0.001


def test_a_figure_counts_as_redrawn_across_a_pixel_of_float_noise_but_not_across_a_changed_plot():
    """same_drawing: 10 pixels apart of 240,000 (an error bar's end moved by BLAS's last bits) is the same figure;
    a 40 x 40 block (0.7%), another size or bytes that are no PNG are not."""
    import io

    import numpy as np
    from matplotlib import image

    def png(pixels) -> bytes:
        buf = io.BytesIO()
        image.imsave(buf, pixels, format="png")
        return buf.getvalue()

    base = np.zeros((400, 600, 3))
    noise, block = base.copy(), base.copy()
    noise[200, 100:110] = 1.0
    block[100:140, 100:140] = 1.0
    assert findings.same_drawing(png(base), png(noise))
    assert not findings.same_drawing(png(base), png(block))
    assert not findings.same_drawing(png(base), png(np.zeros((400, 601, 3))))
    assert not findings.same_drawing(png(base), b"not a png")


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
        assert f"| not testable | – | – | [{name}]({name}.md) |" in index


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


SETUP = {"sweep": "x", "jobs": 9, "seeds": [0, 1, 2], "task": ["copy"], "d_model": [64], "n_layers": [2],
         "n_heads": [4], "steps": [10], "scale": 1, "machines": {}, "train_time_s": 1.0, "commit": None,
         "commit_recorded": False, "date": "d", "command": "python train.py -m sweep=x", "report": "r"}


def _meta(**verdict) -> dict:
    return {"study": {"compare": ["pos"], "metrics": ["exact_match_out"], "paper": "P",
                      "verdict": {"metric": "exact_match_out", "better": {"pos": "a"}, "than": {"pos": "b"},
                                  "claim": "A beats B", "paper_scale": "1B", **verdict}}}


def _jobs(values: dict[str, list], metric: str = "exact_match_out", learned: float = 1.0) -> list[dict]:
    """Runs of settings pos=<name>, one per seed in order; None: a run that diverged before recording the metric."""
    return [{**_job({"pos": name}, seed, v, learned), "metrics": {metric: v},
             "status": "diverged" if v is None else "completed"}
            for name, vs in values.items() for seed, v in enumerate(vs)]


@pytest.mark.parametrize("a, b, outcome, said", [
    # a - b = 0.8, 0.55, 0.7: mean 0.68333, sd 0.125831, se 0.072648, t = 9.4061 on 2 degrees of freedom, whose
    # two-sided p has the closed form 1 - t / sqrt(t^2 + 2) = 0.0111; t_(0.975, 2) = 4.302653: [0.371, 0.996].
    # One claim: Holm is the plain test.
    ([0.9, 0.8, 0.85], [0.1, 0.25, 0.15], "yes", "+0.683 [0.371, 0.996] (95%, Holm), p = 0.011 (Holm)"),
    ([0.1, 0.25, 0.15], [0.9, 0.8, 0.85], "no", "-0.683 [-0.996, -0.371] (95%, Holm), p = 0.011 (Holm)"),
    # -0.1, 0.1, 0.1: mean 0.0333, sd 0.11547, se 0.066667, t = 0.5, p = 1 - 0.5 / 1.5 = 0.667.
    ([0.1, 0.9, 0.5], [0.2, 0.8, 0.4], "nd", "p = 0.667 (Holm)"),
    # Means 0.65 against 0.25, but 0.7, -0.2, 0.7: mean 0.4, sd 0.5196, se 0.3, t = 1.3333, p = 1 - 1.3333 /
    # 1.9437 = 0.314: not distinguishable, whatever the means say.
    ([0.9, 0.1, 0.95], [0.2, 0.3, 0.25], "nd", "+0.400 [-0.891, 1.691] (95%, Holm), p = 0.314 (Holm)"),
])
def test_the_verdict_follows_the_paired_test(a, b, outcome, said):
    got, sentence = findings.judge(_meta(), _jobs({"a": a, "b": b}))
    assert got == outcome and said in sentence and "P(" not in sentence
    assert sentence.startswith({"yes": "A beats B: ", "no": "A beats B? ",
                                "nd": "A beats B? Not distinguishable at 3 seeds: "}[outcome])
    assert ("agrees with P" in sentence) == (outcome == "yes") and ("contradicts P" in sentence) == (outcome == "no")


def test_holm_over_the_page_s_claims_can_undo_a_decision():
    """The first claim's p = 0.0111 (above). Two further claims whose settings have no runs are not tested but
    count: m = 3, so Holm tests it at 0.05/3 (adjusted p 3 x 0.0111 = 0.0333, still decided) and draws its interval
    at 98.3%: with 2 degrees of freedom t_q solves t / sqrt(t^2 + 2) = 2q - 1 = 0.983333, t^2 = 2 r^2 / (1 - r^2) =
    58.504, t = 7.6488, so 0.68333 ± 7.6488 x 0.072648 = [0.128, 1.239]. With 5 claims, 5 x 0.0111 = 0.0556 > 0.05:
    not distinguishable at 3 seeds."""
    jobs = _jobs({"a": [0.9, 0.8, 0.85], "b": [0.1, 0.25, 0.15]})
    untested = {"metric": "exact_match_out", "better": {"pos": "x"}, "than": {"pos": "y"}}
    outcome, sentence = findings.judge(_meta(also=[untested] * 2), jobs)
    assert outcome == "yes" and "+0.683 [0.128, 1.239] (98.3%, Holm), p = 0.033 (Holm)" in sentence
    assert [o for o, _ in findings.also(_meta(also=[untested] * 2), jobs)] == ["none", "none"]
    outcome, sentence = findings.judge(_meta(also=[untested] * 4), jobs)
    assert outcome == "nd" and "p = 0.056 (Holm)" in sentence


def test_a_diverged_run_of_a_loss_counts_as_the_page_s_worst_value():
    """pos=a's seed 2 diverged. final_train_loss is better lower, so it counts as the worst final_train_loss on
    the page, pos=c's 3.0. Pairs a - b: 1.0 - 1.5, 1.2 - 1.6, 3.0 - 1.4 = -0.5, -0.4, +1.6: mean +0.2333; deviations
    -0.7333, -0.6333, 1.3667, squares summing to 2.80667, sd 1.184624, se 0.683943, t = 0.341160, two-sided p =
    1 - 0.341160 / sqrt(2.116390) = 0.7655: not distinguishable."""
    jobs = _jobs({"a": [1.0, 1.2, None], "b": [1.5, 1.6, 1.4], "c": [3.0, 2.0, 2.5]}, "final_train_loss")
    meta = _meta(metric="final_train_loss")
    outcome, sentence = findings.judge(meta, jobs)
    assert outcome == "nd"
    assert ("pos=a 1.733 against pos=b 1.500 on final_train_loss; paired difference over 3 seeds +0.233" in sentence
            and "p = 0.765 (Holm) (seed 2: pos=a diverged: counted as the worst final_train_loss on this page, "
                "3.000)" in sentence)
    row = findings.judge_page(meta, jobs)[0].row
    assert row[3] == "3 (1 at the worst)"


def test_a_missing_pair_of_a_metric_better_higher_is_shown_and_the_claim_marked():
    """pos=b has no run of seed 2, and token accuracy has no worst value to stand in: the pair is named, left out,
    and the claim marked. Pairs 0.8, 0.55: mean 0.675, sd 0.17678, se 0.125, t = 5.4 on 1 degree of freedom (a
    Cauchy distribution): p = 1 - (2 / pi) atan(5.4) = 0.1165."""
    jobs = _jobs({"a": [0.9, 0.8, 0.85], "b": [0.1, 0.25]}, "token_acc_in")
    outcome, sentence = findings.judge(_meta(metric="token_acc_in"), jobs)
    assert outcome == "nd" and "Not distinguishable at 2 seeds" in sentence and "p = 0.117 (Holm)" in sentence
    assert sentence.endswith("Marked: 1 pair left out of the test (seed 2: pos=b has no run).")
    assert findings.judge_page(_meta(metric="token_acc_in"), jobs)[0].row[3] == "2 (+1 incomplete)"


def test_a_constant_metric_cannot_carry_a_verdict_and_a_diverged_setting_stays_on_the_page():
    jobs = _jobs({"a": [0.0, 0.0, 0.0], "b": [0.0, 0.0, 0.0]}, "diverged")
    jobs += [{**j, "status": "diverged", "in_distribution_exact_match": 0.0}
             for j in _jobs({"c": [1.0, 1.0, 1.0]}, "diverged")]
    meta = {**_meta(metric="diverged"), **SETUP}
    meta["study"]["metrics"] = ["diverged", "final_train_loss"]
    outcome, sentence = findings.judge(meta, jobs)
    assert outcome == "const" and sentence == ("A beats B: not testable: diverged is 0.000 on every run of both "
                                               "pos=a and pos=b (3 seeds each), and a constant cannot carry a verdict.")
    page = findings.render_page(meta, jobs, None)
    assert "| **not testable** |" in page
    assert "| pos=c | 3 (3 diverged) | 0 of 3 | 1.000 [1.000, 1.000] | – (diverged) |" in page
    assert "Diverged, and kept as data" in page and "Not completed" not in page


def test_a_decided_difference_inside_min_effect_does_not_matter():
    """a - b = 0.010, 0.011, 0.012, 0.010, 0.011, 0.012 on a loss: mean 0.011, sd sqrt(4e-6 / 5) = 0.000894, se
    0.000365, t = 30.1: decided; t_(0.975, 5) = 2.570582: 0.011 ± 0.000939 = [0.0101, 0.0119], inside ±0.05. Every
    difference positive: the exact sign-flip p over 6 pairs is 2/64 = 0.031."""
    b = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
    a = [x + d for x, d in zip(b, [0.010, 0.011, 0.012, 0.010, 0.011, 0.012])]
    jobs = _jobs({"a": a, "b": b}, "final_val_loss")
    v = findings.judge_page(_meta(metric="final_val_loss", min_effect=0.05), jobs)[0]
    assert v.outcome == "trivial" and v.sentence.startswith("A beats B? No difference that matters: ")
    assert "+0.011 [0.010, 0.012] (95%, Holm), p < 0.001 (Holm)" in v.sentence and "inside ±0.05" in v.sentence
    assert v.row[8] == "0.031"
    assert findings.judge_page(_meta(metric="final_val_loss"), jobs)[0].outcome == "no"  # without it: B is lower
    assert findings.judge(_meta(metric="final_val_loss", min_effect="big"), jobs)[0] == "none"


@pytest.mark.parametrize("a, learned, expected", [([0.1, 0.9, 0.5], 1.0, "nd"),  # not distinguishable
                                                  ([0.9, 0.9, 0.9], 0.4, "learn")])  # never learned
def test_a_verdict_that_does_not_show_carries_what_the_sweep_found_about_why(a, learned, expected):
    jobs = [_job({"pos": "a"}, s, v, learned) for s, v in enumerate(a)] + \
        [_job({"pos": "b"}, s, v) for s, v in enumerate([0.2, 0.8, 0.4])]
    outcome, sentence = findings.judge(_meta(why="the budget is too small"), jobs)
    assert outcome == expected and sentence.endswith("(the budget is too small).")


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
    # The scaled data's numbers, escaped in a sentence: a - b = 0.8, 0.6, 0.7, mean 0.7, sd 0.1, se 0.057735;
    # t_(0.975, 2) = 4.302653: 0.7 ± 0.248414.
    assert "| GPU | 40 | yes |" in row and "pos=a 0.850 against pos=b 0.150" in row
    assert "+0.700 \\[0.452, 0.948\\]" in row
    assert "| 1 (this page) | CPU | 10 | not distinguishable |" in page and "x-scaled" not in page
    assert "At other scales" not in findings.render_page(*findings.read_jsonl(tmp_path / "x-scale4.jsonl"), None)


def test_a_setting_that_did_not_learn_is_not_judged_and_is_flagged_first():
    jobs = [_job({"pos": "a"}, s, 0.9, learned=0.4) for s in range(3)] + [_job({"pos": "b"}, s, 0.0) for s in range(3)]
    outcome, sentence = findings.judge(_meta(), jobs)
    assert outcome == "learn" and sentence.startswith("Not testable: pos=a did not learn its task")
    assert "in-distribution exact match 0.400 < 0.900 (0 of 3 seeds clear it)" in sentence
    meta = {**_meta(), "sweep": "x", "jobs": 6, "seeds": [0, 1, 2], "task": ["copy"], "d_model": [64],
            "n_layers": [2], "n_heads": [4], "steps": [10], "scale": 1, "machines": {}, "train_time_s": 1.0,
            "commit": None, "commit_recorded": False, "date": "d", "command": "python train.py -m sweep=x",
            "report": "r"}
    page = findings.render_page(meta, jobs, None)
    assert page.index("No: 1 of 2 settings did not") < page.index("### Registered claims")
    assert "| pos=a | 0 of 3 | in-distribution exact match 0.400 &lt; 0.900 (0 of 3 seeds clear it) |" in page


def test_further_claims_are_judged_as_the_first_each_against_its_own_paper():
    jobs = ([_job({"pos": "a"}, s, v) for s, v in enumerate([0.9, 0.8, 0.85])]
            + [_job({"pos": "b"}, s, v) for s, v in enumerate([0.1, 0.2, 0.15])]
            + [_job({"pos": "c"}, s, v) for s, v in enumerate([0.1, 0.9, 0.5])])
    meta = _meta(also=[{"claim": "C beats B", "metric": "exact_match_out", "better": {"pos": "c"},
                        "than": {"pos": "b"}, "paper": "Q"},
                       {"claim": "B beats A", "metric": "exact_match_out", "better": {"pos": "b"},
                        "than": {"pos": "a"}}])
    (o1, s1), (o2, s2) = findings.also(meta, jobs)
    # c - b = 0, 0.7, 0.35: t = 0.35 / 0.2021 = 1.732, p = 1 - 1.732 / sqrt(5) = 0.225; no paper_scale of its own
    assert o1 == "nd" and "p = 0.225 (Holm); Q saw it at a larger scale." in s1
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
    assert "| 0.01 (the highest tried: not bracketed) |" in row_a and "2 of 3 (0.001, 0.01)" in row_a
    row_b = next(line for line in page.splitlines() if line.startswith("| attn=b |"))
    assert "not learned at any" in row_b
    flag = page[page.index("### What did not learn"):]
    assert "attn=b, lr=0.01" in flag and "attn=a" not in flag and "1 of 2 settings" in page


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
