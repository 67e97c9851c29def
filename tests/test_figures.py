"""The figure each exercise asks for, drawn from a synthetic findings page (hand-made jsonl job lines) through the
one path both the page and the HTML report take (report/figures.py). Each test inspects the matplotlib Figure: its
axes' scales, how many series it draws, that no two lines share colour and style, where the legend sits, and the
labels. Oracles are exact by construction: a power law's log-log slope is its exponent; GELU'(0) = Phi(0) = 1/2,
SiLU'(0) = sigma(0) = 1/2 and ReLU' = 1 above 0 and 0 below, by hand."""
import json
import math

import numpy as np
import pytest

from blocklab.report import figures, findings
from blocklab.report.figures_cost import CONTEXT
from blocklab.report.figures_data import _rounded, figure_record, lowest_seeds, page_rows


def _job(setting: dict, seed: int, metrics: dict = (), layers: dict = (), keys: dict = (), maps: dict = (),
         status: str = "completed") -> dict:
    """A job line of format 2 as findings_data.job_record and figures_data.figure_record write it."""
    return {"job": f"{setting},{seed}", "setting": setting, "seed": seed, "status": status, "choices": {},
            "overrides": [], "eval": [{"length": 4, "in_distribution": True, "exact_match": 1.0}],
            "metrics": dict(metrics),
            "figure": {"keys": dict(keys), "values": {}, "layers": dict(layers), "attention_weights": dict(maps)}}


def _meta(**context) -> dict:
    return {"format": 2, "sweep": "x", "study": {"name": "x"}, **({"figure_context": context} if context else {})}


def _data_lines(fig):
    """Every labelled line of every visible axes: the series a reader tells apart."""
    return [line for ax in fig.axes if ax.get_visible() for line in ax.get_lines()
            if not line.get_label().startswith("_")]


def _assert_distinct_styles(fig) -> None:
    for ax in fig.axes:
        styles = [(line.get_color(), line.get_linestyle()) for line in ax.get_lines()
                  if not line.get_label().startswith("_")]
        assert len(styles) == len(set(styles)), styles


def _assert_legends_outside(fig) -> None:
    """No legend overlaps the axes it names (legends sit beside the data)."""
    renderer = fig.canvas.get_renderer()
    legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_visible() and ax.get_legend()]
    assert legends
    for ax, legend in legends:
        assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))


def _one(jobs, spec, **context):
    ((note, fig),) = figures.page_figures(_meta(**context), jobs, [spec])
    return note, fig


def test_cost_scaling_draws_time_and_memory_log_log_with_each_kinds_fitted_slope_and_the_unfused_path():
    """Exercise 1.1. Full attention's time ~ n^2 and both kinds' memory ~ n (the fused kernel), the window's time
    ~ n; the bench's unfused path holds the n x n weights (memory ~ n^2). Slopes of exact power laws: 2 and 1."""
    lengths = [256, 512, 1024, 2048]
    jobs = [_job({"attn": attn, "task.block_size": n}, seed,
                 {"ms_per_step": (n / 256) ** p * (1 + seed / 100), "costs.step_peak_bytes": 2 ** 20 * n / 64})
            for attn, p in (("mha", 2), ("local", 1)) for n in lengths for seed in range(2)]
    bench = {"lengths": lengths, "fused": {"peak_mb": [n / 100 for n in lengths], "ms": [1.0] * 4},
             "explicit": {"peak_mb": [n * n / 1e5 for n in lengths], "ms": [1.0] * 4}}
    spec = {"kind": "cost_scaling", "metric": "ms_per_step", "memory": "costs.step_peak_bytes",
            "x": "task.block_size", "by": ["attn"]}
    note, fig = _one(jobs, spec, **{CONTEXT: bench})
    time, memory, layer = [ax for ax in fig.axes if ax.get_visible()]
    for ax in (time, memory, layer):
        assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert sorted(line.get_label() for line in time.get_lines()) == ["local (slope 1.00)", "mha (slope 2.00)"]
    assert sorted(line.get_label() for line in memory.get_lines()) == ["local (slope 1.00)", "mha (slope 1.00)"]
    assert [line.get_label() for line in layer.get_lines()] == [
        "full, fused (SDPA) (slope 1.00)", "full, unfused (n×n weights held) (slope 2.00)"]
    assert "ms_per_step" in time.get_ylabel() and "MB" in memory.get_ylabel()
    assert "never holds the n×n weights" in note and "slope 2.00" in note
    _assert_distinct_styles(fig)
    _assert_legends_outside(fig)


def test_cost_scaling_without_the_bench_says_how_to_measure_the_unfused_path():
    jobs = [_job({"attn": "mha", "task.block_size": n}, 0, {"ms_per_step": n}) for n in (64, 128)]
    note, fig = _one(jobs, {"kind": "cost_scaling", "metric": "ms_per_step", "x": "task.block_size", "by": "attn"})
    assert "python -m blocklab.bench attention" in note
    assert any("python -m blocklab.bench attention" in t.get_text() for ax in fig.axes for t in ax.texts)


def _causal_uniform(t: int) -> list:
    return [[round(1 / (q + 1), 4) if k <= q else 0.0 for k in range(t)] for q in range(t)]


def test_attention_maps_per_task_come_from_the_recorded_weights_and_entropy_and_distance_by_layer():
    """Exercise 1.2: one block of layers x heads per task and `when`, from the lowest seed's weights; entropy and
    mean distance by layer, one line per task."""
    weights = [[_causal_uniform(5)] * 2] * 3  # 3 layers x 2 heads of (5, 5)
    layers = {"end": {"attention_entropy": [1.0, 0.5, 0.25], "attention_distance": [2.0, 1.0, 1.0]}}
    jobs = [_job({"task": task}, seed, layers=layers, maps={"init": weights, "end": weights} if seed == 0 else {})
            for task in ("count", "repeats") for seed in (0, 1)]
    note, fig = _one(jobs, {"kind": "attention_maps", "metric": "attention_maps", "by": "task",
                            "when": ["init", "end"]})
    images = [ax for ax in fig.get_axes() if ax.images]
    assert len(images) == 2 * 2 * 3 * 2  # tasks x whens x layers x heads
    assert images[0].images[0].get_array().shape == (5, 5)
    assert "task=count (seed 0), at init" in [sub._suptitle.get_text() for sub in fig.subfigs[0:1]]
    assert "entropy (all queries) per layer" in note
    for metric in ("attention_entropy", "attention_distance"):
        _, fig = _one(jobs, {"kind": "by_layer", "metric": metric, "by": "task", "when": "end"})
        assert [line.get_label() for line in _data_lines(fig)] == ["count, None", "repeats, None"]
        assert fig.axes[0].get_yscale() == "log"  # every value positive: decades
        _assert_distinct_styles(fig)
        _assert_legends_outside(fig)


def test_activation_functions_come_from_the_registry_without_any_run():
    """Exercise 1.9: each activation's shape and derivative, drawn with no training (a page with no runs)."""
    note, fig = _one([], {"kind": "activation_functions", "metric": "activation"})
    values, slopes = [ax for ax in fig.axes if ax.get_visible()]
    curves = [line for line in values.get_lines() if len(line.get_xdata()) > 2]
    names = [line.get_label().split(" / ")[0] for line in curves]  # relu / reglu (gate): one function, two users
    assert {"relu", "gelu", "silu", "relu2"} <= set(names)
    derivative = dict(zip(names, [line for line in slopes.get_lines() if len(line.get_xdata()) > 2]))
    assert len(derivative) == len(curves)  # one derivative per function
    x = np.asarray(derivative["relu"].get_xdata())
    relu = np.asarray(derivative["relu"].get_ydata())
    assert np.all(relu[x > 0.01] == 1) and np.all(relu[x < -0.01] == 0)
    for name in ("gelu", "silu"):
        at_zero = np.asarray(derivative[name].get_ydata())[np.argmin(np.abs(x))]
        assert at_zero == pytest.approx(0.5, abs=1e-9)
    assert "off" in note
    _assert_distinct_styles(fig)


def test_ffn_sparsity_by_layer_keeps_a_linear_axis_where_a_fraction_reaches_zero():
    """Exercise 1.10: the fraction of units off per layer, one line per activation."""
    jobs = [_job({"act": act}, 0, layers={"end": {"ffn_off": off}}, keys={"model.n_layers": 3})
            for act, off in (("relu", [0.5, 0.6, 0.7]), ("gelu", [0.0, 0.0, 0.01]))]
    note, fig = _one(jobs, {"kind": "by_layer", "metric": "ffn_off", "by": "act", "when": "end"})
    ax = fig.axes[0]
    assert ax.get_yscale() == "linear" and [line.get_label() for line in _data_lines(fig)] == ["gelu, 3", "relu, 3"]
    assert list(ax.get_lines()[1].get_ydata()) == [0.5, 0.6, 0.7] and "layer" in ax.get_xlabel()
    assert "act=relu, n_layers=3: 0.500 → 0.700" in note


def test_gradient_norm_by_layer_per_placement_is_the_seed_mean_on_a_log_axis():
    """Exercise 1.11: gradient norm per layer for each norm placement (mean over seeds, seed range shaded)."""
    jobs = [_job({"norm.placement": placement}, seed, layers={"init": {"grad_ffn": [g * (1 + seed) for g in grads]}},
                 keys={"model.n_layers": 3})
            for placement, grads in (("post", [1e-3, 1e-2, 1e-1]), ("pre", [0.1, 0.1, 0.1])) for seed in (0, 1)]
    _, fig = _one(jobs, {"kind": "by_layer", "metric": "grad_ffn", "by": ["norm.placement"], "when": "init"})
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and len(_data_lines(fig)) == 2
    assert np.allclose(ax.get_lines()[0].get_ydata(), [1.5e-3, 1.5e-2, 1.5e-1])  # (1 + 2) / 2 x each
    assert ax.get_title().startswith("grad_ffn") and ax.get_legend().get_title().get_text() == "placement, n_layers"
    _assert_legends_outside(fig)


def test_activation_rms_against_depth_draws_one_line_per_init_and_depth():
    """Exercise 1.12: activation RMS by layer for each init at each depth (12 and 48 layers)."""
    jobs = [_job({"init": init}, 0, layers={"init": {"activation_rms": [1.0 + i * growth for i in range(depth)]}},
                 keys={"model.n_layers": depth})
            for init in ("normal", "gpt2", "deepnet") for depth, growth in ((12, 0.1), (48, 0.01))]
    _, fig = _one(jobs, {"kind": "by_layer", "metric": "activation_rms", "by": ["init"], "when": "init"})
    lines = _data_lines(fig)
    assert len(lines) == 6 and sorted(len(line.get_xdata()) for line in lines) == [12, 12, 12, 48, 48, 48]
    _assert_distinct_styles(fig)


def test_panels_split_by_a_key_and_keep_each_lines_style_across_them():
    """Exercise 1.12 at init_depth's size: 2 inits x 2 depths x 2 norms would be 8 lines on one axes; with
    `panels: norm` each norm gets a panel of 4 lines, one y axis, and a line keeps its style in every panel."""
    jobs = [_job({"init": init, "norm": norm}, 0, layers={"init": {"grad_ffn": [1.0 + k] * depth}},
                 keys={"model.n_layers": depth})
            for k, (init, depth) in enumerate([(i, d) for i in ("normal", "deepnet") for d in (12, 48)])
            for norm in ("pre_ln", "post_ln")]
    note, fig = _one(jobs, {"kind": "by_layer", "metric": "grad_ffn", "by": ["init"], "panels": "norm"})
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["norm=post_ln", "norm=pre_ln"]
    styles = [{line.get_label(): (line.get_color(), line.get_linestyle()) for line in ax.get_lines()
               if not line.get_label().startswith("_")} for ax in panels]
    assert len(styles[0]) == 4 and styles[0] == styles[1] and len(set(styles[0].values())) == 4
    assert panels[0].get_legend() is None and panels[1].get_legend() is not None  # one legend, beside the last
    assert "norm=pre_ln: grad_ffn at init" in note
    _assert_legends_outside(fig)


def test_rank_collapse_is_drawn_on_a_log_axis_even_where_a_layer_reaches_zero():
    jobs = [_job({"model.residual": r}, 0, layers={"end": {"relative_residual": rel}}, keys={"model.n_layers": 3})
            for r, rel in ((False, [0.5, 1e-4, 0.0]), (True, [0.5, 0.4, 0.4]))]
    _, fig = _one(jobs, {"kind": "by_layer", "metric": "relative_residual", "by": ["model.residual"],
                         "when": "end", "scale": "log"})
    assert fig.axes[0].get_yscale() == "log" and len(_data_lines(fig)) == 2


def test_twelve_settings_never_share_colour_and_style():
    """More settings than the 10 colours: the line style changes, so no two lines look alike."""
    jobs = [_job({"attn": f"k{i}"}, 0, layers={"end": {"activation_rms": [1.0, 2.0]}}) for i in range(12)]
    _, fig = _one(jobs, {"kind": "by_layer", "metric": "activation_rms", "by": "attn", "when": "end"})
    assert len(_data_lines(fig)) == 12
    _assert_distinct_styles(fig)


def test_a_format_1_page_reads_and_its_per_layer_figure_says_what_was_not_recorded(tmp_path):
    job = {k: v for k, v in _job({"norm": "pre"}, 0).items() if k != "figure"}
    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in [{**_meta(), "format": 1}, job]), encoding="utf-8")
    meta, jobs = findings.read_jsonl(path)
    note, fig = _one(jobs, {"kind": "by_layer", "metric": "grad_ffn", "by": "norm"})
    assert "not recorded" in note and not _data_lines(fig)


def test_a_collected_run_keeps_what_its_plots_read_and_the_page_draws_it_back():
    """figure_record (the jsonl's figure block) keeps the plots' series at their `when`, the keys they group
    by, and the lowest seed's weights; page_rows gives the plot kinds the same series."""
    plots = [{"kind": "by_layer", "metric": "grad_ffn", "by": ["norm"], "when": "init"},
             {"kind": "attention_maps", "metric": "attention_maps", "by": "norm", "when": ["end"]}]
    runs = [{"run": f"/nowhere/{s}", "seed": s, "norm": "pre", "model.n_layers": 2, "status": "completed",
             "layers_init": {"grad_ffn": [0.123456789, 0.2], "activation_rms": [1.0, 1.0]},
             "layers_end": {"attention_entropy": [1.0, 1.0]}, "attention_weights": {"end": [[[[1.0]]]]}}
            for s in (1, 0)]
    keep = lowest_seeds(runs, ["norm"])
    assert keep == {"/nowhere/0"}
    records = [figure_record(r, plots, r["run"] in keep) for r in runs]
    assert records[1]["layers"]["init"] == {"grad_ffn": [0.12346, 0.2]}  # only what a plot reads, 5 digits
    assert records[1]["layers"]["end"] == {"attention_entropy": [1.0, 1.0]}
    assert "attention_weights" not in records[0] and records[1]["attention_weights"] == {"end": [[[[1.0]]]]}
    assert records[1]["keys"] == {"model.n_layers": 2, "norm": "pre"}
    rows = page_rows([{**_job({"norm": "pre"}, r["seed"]), "figure": rec} for r, rec in zip(runs, records)])
    assert rows[1]["layers_init"]["grad_ffn"] == [0.12346, 0.2] and rows[1]["model.n_layers"] == 2
    assert math.isclose(rows[0]["diverged"], 0.0)


def test_a_compare_key_that_is_also_a_plot_s_x_keeps_its_own_value_in_a_bar_label():
    """by_choice over model.n_layers records it among the figure values as a float; the bar over the same key labels
    the setting as its sweep named it (n_layers 2, not 2.0)."""
    plots = [{"kind": "bar", "metric": "final_val_loss", "by": ["model.n_layers"]},
             {"kind": "by_choice", "metric": "final_val_loss", "x": "model.n_layers", "by": []}]
    run = {"run": "/nowhere/0", "seed": 0, "model.n_layers": 2, "status": "completed", "final_val_loss": 2.5}
    record = figure_record(run, plots, False)
    assert record["values"]["model.n_layers"] == 2.0 and isinstance(record["values"]["model.n_layers"], float)
    rows = page_rows([{**_job({"model.n_layers": 2}, 0), "figure": record}])
    assert rows[0]["model.n_layers"] == 2 and isinstance(rows[0]["model.n_layers"], int)


def test_the_diagnostics_keep_the_first_heads_weights_as_numbers_beside_the_heatmaps(tmp_path):
    """What attention_maps draws on a page: each layer's first MAX_HEADS_KEPT heads of the first probe example, as
    numbers to 3 decimals; each row of a causal softmax still sums to 1 (to the rounding) with zeros above the
    diagonal."""
    import torch

    from blocklab.train.diagnostics import MAX_HEADS_KEPT, write_measurement

    t, heads = 5, MAX_HEADS_KEPT + 2
    scores = torch.randn(heads, t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    weights = [scores.softmax(-1), scores.softmax(-1)]
    out = write_measurement({"weights": weights, "layers": []}, tmp_path / "diagnostics", "end", maps=True)
    kept = np.asarray(out["attention_weights"])
    assert kept.shape == (2, MAX_HEADS_KEPT, t, t) and "weights" not in out and out["attention_maps"]
    assert np.allclose(kept, weights[0][:MAX_HEADS_KEPT].numpy(), atol=5e-4)
    assert np.allclose(kept.sum(-1), 1, atol=t * 5e-4) and np.all(np.triu(kept, 1) == 0)
    assert "attention_weights" not in write_measurement({"weights": weights}, tmp_path / "d2", "end", maps=False)


def test_a_metric_plot_draws_the_reference_levels_its_runs_tasks_state():
    """A bar of exact match draws copy's 0.9 bar, and a loss plot the LM's bigram and unigram losses, as grey lines
    (learned.reference_lines reads them from the jsonl's `references`)."""
    refs = {"learned": [{"name": "bigram", "metric": "loss", "value": 2.5}],
            "lines": [{"name": "unigram", "metric": "loss", "value": 3.3}]}
    jobs = [{**_job({"pos": p}, 0, {"final_val_loss": v}), "references": refs} for p, v in (("a", 2.0), ("b", 2.6))]
    _, fig = _one(jobs, {"kind": "bar", "metric": "final_val_loss", "by": "pos"})
    lines = [line for line in fig.axes[0].get_lines() if line.get_label() == "_reference"]
    assert sorted(line.get_ydata()[0] for line in lines) == [2.5, 3.3]
    assert {t.get_text() for t in fig.axes[0].texts} >= {"bigram 2.5", "unigram 3.3"}


def test_by_choice_ticks_are_the_values_the_sweep_chose():
    """A learning-rate axis is log2, but its ticks read 0.001 and 0.003 as swept, not powers of two (0.0019531)."""
    lrs = (0.0003, 0.001, 0.003, 0.01)
    rows = [{"run": f"/nowhere/{lr}-{s}", "seed": s, "optim.lr": lr, "status": "completed", "final_val_loss": 2 + lr}
            for lr in lrs for s in (0, 1)]
    _, fig = figures.figure(rows, {"kind": "by_choice", "metric": "final_val_loss", "x": "optim.lr", "by": []})
    fig.canvas.draw()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.0003", "0.001", "0.003", "0.01"]
    assert list(ax.get_xticks(minor=True)) == []


def test_a_log_axis_over_ten_decades_still_has_tick_labels():
    """init_depth's activation RMS grows from 0.02 to 1e8 through 48 layers: matplotlib's LogLocator with 1, 2, 5 per
    decade thins such an axis to no tick at all, and the page's figure had an unlabelled y axis."""
    rows = [{"run": f"/nowhere/{s}", "seed": s, "status": "completed", "init": "xavier",
             "layers_init": {"activation_rms": [0.02 * 10 ** (layer / 5) for layer in range(48)]}} for s in (0, 1)]
    _, fig = figures.figure(rows, {"kind": "by_layer", "metric": "activation_rms", "by": ["init"], "when": "init"})
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert "1" in labels and "1e+06" in labels


def test_page_data_keeps_significant_digits_not_decimals():
    """A gradient of 5.12345e-5 keeps its digits (4 decimals made it 0.0001), a loss keeps 4 decimals."""
    assert _rounded([5.123456e-05, 2.5123456, 12.054321, 3]) == [5.1235e-05, 2.5123, 12.054, 3]
