"""Length generalization over seeds: the `length_curve` plot (mean over seeds, min-max band, the longest
trained length) and the `study.length_table` table, from fabricated sweep directories whose numbers are
worked out by hand below."""
import json
import re

import matplotlib.pyplot as plt
import pytest
from omegaconf import OmegaConf

from blocklab.errors import ConfigError
from blocklab.report.build import PLOTS, build_report, plot, section
from blocklab.report.collect import collect, study_specs

# pos -> (longest training length, {seed: {length: exact match}}); lengths up to the training max are in
# distribution. The table's expected cells, by hand:
#   rope:  means 4: 1.0, 8: 0.9933, 12: 0.91, 16: 0.8233 -> longest with mean >= 0.9: 12;
#          at 2 x 8 = 16: seeds 0 (0.92) and 2 (0.95) reach 0.9 -> 2/3; in distribution per seed 1.0, 0.99, 1.0.
#   none:  no mean reaches 0.9 -> none; 0/3 at 16; in distribution 0.4, 0.3, 0.35 -> 0.350 ± 0.050.
#   alibi: trained to 10, evaluated to 15: 2 x 10 = 20 was not evaluated; longest 15.
#   sinusoidal: seed 2 stopped at 12, so only 2 seeds evaluated 16 (0.95, 0.5) -> 1/2, 1 of 3 missing;
#          means 8: 0.9667, 12: 0.8667 -> longest 8.
RUNS = {
    "rope": (8, {0: {4: 1.0, 8: 1.0, 12: 0.95, 16: 0.92},
                 1: {4: 1.0, 8: 0.98, 12: 0.90, 16: 0.60},
                 2: {4: 1.0, 8: 1.0, 12: 0.88, 16: 0.95}}),
    "none": (8, {0: {4: 0.5, 8: 0.3, 12: 0.0, 16: 0.0},
                 1: {4: 0.4, 8: 0.2, 12: 0.0, 16: 0.0},
                 2: {4: 0.6, 8: 0.1, 12: 0.0, 16: 0.0}}),
    "alibi": (10, {0: {5: 1.0, 10: 1.0, 15: 0.97},
                   1: {5: 1.0, 10: 1.0, 15: 0.93},
                   2: {5: 1.0, 10: 0.99, 15: 0.91}}),
    "sinusoidal": (8, {0: {4: 1.0, 8: 1.0, 12: 0.9, 16: 0.95},
                       1: {4: 1.0, 8: 0.9, 12: 0.8, 16: 0.5},
                       2: {4: 1.0, 8: 1.0, 12: 0.9}}),
}
STUDY = {"name": "length_study", "question": "Which scheme extrapolates?", "compare": ["pos"],
         "plots": [{"kind": "length_curve", "metric": "exact_match", "by": "pos"}],
         "length_table": {"metric": "exact_match", "threshold": 0.9, "at": 2}}


def fabricate(root, study=STUDY, runs=RUNS):
    """One run directory per (pos, seed) as a sweep writes it: results.json and .hydra/config.yaml."""
    for pos, (train_max, seeds) in runs.items():
        for seed, scores in seeds.items():
            run_dir = root / f"pos={pos},seed={seed}"
            (run_dir / ".hydra").mkdir(parents=True)
            config = {"study": study, "seed": seed, "pos": {"name": pos}, "task": {"name": "copy", "max_len": train_max},
                      "trainer": {"max_steps": 100}}
            OmegaConf.save(OmegaConf.create(config), run_dir / ".hydra" / "config.yaml")
            results = {
                "status": "completed", "task": "copy", "study": study["name"], "choices": {"pos": pos, "seed": seed},
                "params": 1000, "steps": 100, "train_time_s": 1.0, "tokens_per_s": 1000.0, "final_train_loss": 0.1,
                "final_val_loss": 0.2, "diverged_at_step": None, "train_lengths": [1, train_max],
                "overrides": [f"pos={pos}", f"seed={seed}"],
                "eval": [{"length": n, "in_distribution": n <= train_max, "exact_match": em, "token_acc": em,
                          "loss": 1 - em, "n": 128} for n, em in scores.items()],
            }
            (run_dir / "results.json").write_text(json.dumps(results))
    return collect(root)


def length_table(page: str) -> dict[str, list[str]]:
    """The Length generalization table of a report page: setting -> its cells."""
    body = re.search(r"<table class='length-gen'>(.*?)</table>", page, re.DOTALL).group(1)
    rows = [re.findall(r"<td>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", body)]
    return {cells[0]: cells[1:] for cells in rows if cells}


def test_the_table_has_the_hand_computed_numbers(tmp_path):
    rows = fabricate(tmp_path / "sweep")
    page = section("length_study", STUDY, rows, tmp_path)
    assert "<b>Length generalization.</b>" in page
    head = re.search(r"<table class='length-gen'><thead><tr>(.*?)</tr>", page).group(1)
    assert re.findall(r"<th>(.*?)</th>", head) == [
        "pos", "seeds", "exact_match in distribution", "longest length with mean ≥ 0.9",
        "seeds ≥ 0.9 at 2× longest train length"]
    table = length_table(page)
    assert list(table) == ["alibi", "none", "rope", "sinusoidal"]
    assert table["rope"] == ["3", "0.997 ± 0.006", "12", "2/3 at length 16"]
    assert table["none"] == ["3", "0.350 ± 0.050", "none", "0/3 at length 16"]
    assert table["alibi"] == ["3", "0.998 ± 0.003", "15", "length 20 not evaluated"]
    assert table["sinusoidal"] == ["3", "0.983 ± 0.029", "8", "1/2 at length 16 (1 of 3 seeds not evaluated there)"]


def test_the_threshold_and_factor_come_from_the_spec(tmp_path):
    """threshold 0.95 at 1.5x: rope's means pass to 8 only; 1.5 x 8 = 12, where seed 0 (0.95) alone reaches it;
    alibi's 1.5 x 10 = 15 was evaluated: seed 0 (0.97) alone reaches 0.95, and the mean there (0.937) does not,
    so alibi's longest is 10. `by` replaces the study's compare keys ([]: one row of all runs)."""
    rows = fabricate(tmp_path / "sweep")
    spec = {**STUDY, "length_table": {"threshold": 0.95, "at": 1.5, "by": "pos"}}
    table = length_table(section("length_study", spec, rows, tmp_path))
    assert table["rope"][2:] == ["8", "1/3 at length 12"]
    assert table["alibi"][2:] == ["10", "1/3 at length 15"]
    assert table["none"][2:] == ["none", "0/3 at length 12"]
    one_row = length_table(section("length_study", {**STUDY, "length_table": {"by": []}}, rows, tmp_path))
    # No keys: one row of all 12 runs (its first cell, the seed count, keys the dict). Pooled means: 15 is alibi's
    # alone (0.937); targets 2 x 8 = 16 (rope 2, none 0, sinusoidal 1 of 8 evaluated) and 2 x 10 = 20 (alibi's, none).
    assert one_row == {"12": ["0.832 ± 0.292", "15", "3/8 at lengths 16, 20 (4 of 12 seeds not evaluated there)"]}


def test_the_plot_draws_the_seed_mean_and_the_min_max_band(tmp_path):
    rows = fabricate(tmp_path / "sweep")
    fig, ax = plt.subplots()
    note = PLOTS["length_curve"](ax, rows, {"kind": "length_curve", "metric": "exact_match"}, "exact_match", ["pos"])
    # Labels are the swept values (the legend's title names the key), the legend sits beside the axes.
    means = {line.get_label(): line for line in ax.get_lines() if line.get_linestyle() != "--"}
    assert list(means) == ["alibi", "none", "rope", "sinusoidal"]
    legend = ax.get_legend()
    assert legend.get_title().get_text() == "pos" and legend.get_bbox_to_anchor().x0 > ax.bbox.x1 - 1
    rope = means["rope"]
    assert list(rope.get_xdata()) == [4, 8, 12, 16]
    assert list(rope.get_ydata()) == pytest.approx([1.0, 0.99333333, 0.91, 0.82333333])
    assert list(means["sinusoidal"].get_ydata()) == pytest.approx([1.0, 0.96666667, 0.86666667, 0.725])
    # The band of each setting, in its line's colour: at each length its edges are the lowest and highest seed.
    bands = dict(zip(means, ax.collections))
    for label, line in means.items():
        assert tuple(bands[label].get_facecolor()[0][:3]) == pytest.approx(plt.matplotlib.colors.to_rgb(line.get_color()))
    vertices = bands["rope"].get_paths()[0].vertices
    edges = {x: sorted({round(float(y), 6) for vx, y in vertices if vx == x}) for x in (4, 8, 12, 16)}
    assert edges == {4: [1.0], 8: [0.98, 1.0], 12: [0.88, 0.95], 16: [0.6, 0.95]}
    # Dashed vertical lines at the longest training lengths (8 for most settings, 10 for alibi).
    verticals = sorted(line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == "--")
    assert verticals == [8, 10]
    assert note == ("exact_match: mean over seeds per setting, shaded from the lowest to the highest seed; the widest "
                    "seed range beyond the trained lengths: pos=sinusoidal at length 16 (0.50 to 0.95 over 2 seeds).")
    plt.close(fig)
    assert plot(rows, {"kind": "length_curve", "metric": "exact_match", "by": "pos"}, tmp_path / "c.png") == note
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_eleven_settings_never_share_colour_and_style(tmp_path):
    """length_gen sweeps compare 11 methods: past tab10's 10 colours the line style changes (report/figures.py)."""
    from blocklab.report.figures import figure

    runs = {f"scheme{k}": (8, {0: {4: 1.0, 8: k / 10}}) for k in range(11)}
    rows = fabricate(tmp_path / "sweep", runs=runs)
    _, fig = figure(rows, {"kind": "length_curve", "metric": "exact_match", "by": "pos"})
    lines = [line for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")]  # not the verticals
    styles = {(plt.matplotlib.colors.to_hex(line.get_color()), line.get_linestyle()) for line in lines}
    assert len(lines) == 11 and len(styles) == 11


def test_one_seed_per_setting_is_said_not_shaded(tmp_path):
    runs = {pos: (train_max, {0: seeds[0]}) for pos, (train_max, seeds) in RUNS.items()}
    rows = fabricate(tmp_path / "sweep", runs=runs)
    fig, ax = plt.subplots()
    note = PLOTS["length_curve"](ax, rows, {}, "exact_match", ["pos"])
    plt.close(fig)
    assert "one seed per setting" in note
    assert length_table(section("length_study", STUDY, rows, tmp_path))["rope"] == ["1", "1.000", "16", "1/1 at length 16"]


def test_the_report_of_a_sweep_directory_carries_table_and_plot(tmp_path):
    root = tmp_path / "sweep"
    rows = fabricate(root)
    assert rows[0]["train_max_length"] in (8, 10)  # from results.json's train_lengths
    page = build_report(root, rows, study_specs(root, rows)).read_text()
    assert length_table(page)["rope"] == ["3", "0.997 ± 0.006", "12", "2/3 at length 16"]
    assert "length_study_0_exact_match.png" in page and "widest seed range beyond the trained lengths" in page


def test_studies_without_a_length_table_are_unchanged(tmp_path):
    rows = fabricate(tmp_path / "sweep")
    study = {k: v for k, v in STUDY.items() if k != "length_table"}
    for spec in (study, {**study, "length_table": None}, {**study, "length_table": False}):
        assert "Length generalization" not in section("length_study", spec, rows, tmp_path)
    defaults = length_table(section("length_study", {**study, "length_table": True}, rows, tmp_path))
    assert defaults["rope"] == ["3", "0.997 ± 0.006", "12", "2/3 at length 16"]  # true: exact_match, 0.9, 2x


@pytest.mark.parametrize("table, error", [
    ({"treshold": 0.9}, ("study.length_table.treshold is not a key of study.length_table; did you mean "
                         "study.length_table.threshold? its keys are ['at', 'by', 'metric', 'threshold']")),
    ({"threshold": 90}, "study.length_table.threshold=90 must be a number in (0, 1]"),
    ({"metric": "exact_mach"}, ("study.length_table.metric='exact_mach' is not a per-length score in [0, 1]; did "
                                "you mean exact_match? use one of exact_match, exact_match_given_length, token_acc")),
    ({"metric": "loss"}, ("study.length_table.metric='loss' is not a per-length score in [0, 1]; use one of "
                          "exact_match, exact_match_given_length, token_acc")),
    ({"at": 0}, "study.length_table.at=0 must be a number > 0"),
    ({"by": [1]}, ("study.length_table.by=[1] must be a key or a list of keys, e.g. [pos, task.index_hints] "
                   "(default: study.compare)")),
    ("exact_match", ("study.length_table='exact_match' must be a mapping such as {metric: exact_match, "
                     "threshold: 0.9, at: 2}, or true for those defaults")),
])
def test_a_bad_table_spec_is_a_one_line_error_before_anything_is_written(tmp_path, table, error):
    root = tmp_path / "sweep"
    rows = fabricate(root, study={**STUDY, "length_table": table})
    with pytest.raises(ConfigError) as err:
        build_report(root, rows, study_specs(root, rows))
    assert str(err.value) == error and "\n" not in str(err.value)
    assert not (root / "report").exists()
    with pytest.raises(ConfigError, match=re.escape(error)):
        section("length_study", {**STUDY, "length_table": table}, rows, tmp_path)


def test_the_by_position_plot_draws_token_accuracy_by_place_at_twice_the_training_length(tmp_path):
    """Two settings trained to 4, evaluated at 8 (2x): the seed means and ranges per answer place, by hand."""
    by_place = {"rope": {0: [1.0, 0.5, 0.9], 1: [1.0, 0.7, 0.7]},  # means 1.0, 0.6, 0.8
                "none": {0: [0.2, 0.4, 0.6], 1: [0.4, 0.4, 0.2]}}  # means 0.3, 0.4, 0.4
    rows = fabricate(tmp_path / "sweep", runs={pos: (4, {s: {4: 1.0, 8: 0.0} for s in seeds}) for pos, seeds in by_place.items()})
    for row in rows:
        for entry in row["eval"]:
            if entry["length"] == 8:
                entry["token_acc_by_position"] = by_place[row["pos"]][row["seed"]]
    fig, ax = plt.subplots()
    note = PLOTS["by_position"](ax, rows, {"kind": "by_position", "metric": "token_acc"}, "token_acc", ["pos"])
    lines = {line.get_label(): line for line in ax.get_lines() if line.get_linestyle() != "--"}
    assert list(lines["rope"].get_xdata()) == [1, 2, 3]
    assert list(lines["rope"].get_ydata()) == pytest.approx([1.0, 0.6, 0.8])
    assert list(lines["none"].get_ydata()) == pytest.approx([0.3, 0.4, 0.4])
    vertices = dict(zip(lines, ax.collections))["rope"].get_paths()[0].vertices
    assert sorted({round(float(y), 6) for x, y in vertices if x == 2}) == [0.5, 0.7]
    assert [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == "--"] == [4]
    assert note == ("token accuracy by place in the answer at length 8, mean over seeds; pos=none: lowest at place 1 "
                    "(0.30); pos=rope: lowest at place 2 (0.60).")
    plt.close(fig)
    # Runs trained to different lengths have no common length to show: said, not drawn.
    rows[0]["train_max_length"] = 6
    fig, ax = plt.subplots()
    assert PLOTS["by_position"](ax, rows, {"kind": "by_position"}, "token_acc", ["pos"]).startswith(
        "not drawn: the runs trained to different lengths, so 2x is [8, 12]")
    plt.close(fig)
