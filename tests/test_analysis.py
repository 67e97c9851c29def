"""Diagnostics: the measurements agree with the math, and show the seed documents' claims."""
import json
import math
import subprocess
import sys

import pytest
import torch

from blocklab.analysis import metrics, plots
from blocklab.analysis.probe import forward_stats, probe_gradients
from blocklab.model import ModelConfig, Transformer
from blocklab.model.config import InitConfig, NormConfig, PosConfig
from blocklab.results import read_results
from conftest import ROOT, run_in_process


def model(task, **kw):
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=task.vocab_size, max_len=64, **kw))


def test_spectral_norm_of_uniform_rows_is_one_and_one_hot_column_is_sqrt_n():
    n = 7
    uniform = torch.full((1, 1, n, n), 1 / n)
    assert metrics.spectral_norms(uniform).item() == pytest.approx(1.0)
    one_hot = torch.zeros(1, 1, n, n)
    one_hot[..., 0] = 1  # every query attends to the first key
    assert metrics.spectral_norms(one_hot).item() == pytest.approx(math.sqrt(n))
    assert metrics.generic_bounds(n) == (1.0, math.sqrt(n))


def test_prenorm_bound_formula_limits():
    n = 10
    assert metrics.prenorm_bound(n, 0.0) == pytest.approx(1.0)  # equal scores: uniform rows
    assert metrics.prenorm_bound(n, 50.0) == pytest.approx(math.sqrt(n))  # unbounded scores
    assert metrics.prenorm_bound(n, 1.0) == pytest.approx(math.sqrt(n / (1 + (n - 1) * math.exp(-2))))


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("pos", ["rope", "alibi", "learned"])
def test_every_measured_head_lies_within_the_bounds(copy_task, placement, pos):
    m = model(copy_task, norm=NormConfig(placement=placement), pos=PosConfig(pos), init=InitConfig("xavier"))
    stats = forward_stats(m, copy_task.probe_batch(8))
    for layer in stats["layers"]:
        low, high = layer["spectral_generic_bound"]
        assert all(low - 1e-9 <= s <= high + 1e-9 for s in layer["spectral_norm_max"])
        bound = layer["spectral_prenorm_bound"]
        if placement == "pre" and pos != "alibi":
            assert bound is not None and all(s <= b + 1e-9 for s, b in zip(layer["spectral_norm_max"], bound))
        else:
            assert bound is None  # the theorem does not cover post-norm inputs or position biases


def test_prenorm_bound_is_tight_for_tiny_weights_under_the_causal_mask(copy_task):
    """Scores ~ 0: each query spreads evenly over its i + 1 keys, the first key's column sums to the harmonic number
    H_n, and the bound is sqrt(H_n); the unmasked formula's 1 would be below the measured norm."""
    m = model(copy_task, init=InitConfig("normal", std=1e-4))
    stats = forward_stats(m, copy_task.probe_batch(4))
    layer, n = stats["layers"][0], stats["n_keys"]
    harmonic = sum(1 / k for k in range(1, n + 1))
    assert layer["spectral_prenorm_bound"] == pytest.approx([math.sqrt(harmonic)] * 4, rel=1e-3)
    assert metrics.prenorm_bound(n, 0.0) < 1.01 < min(layer["spectral_norm_max"])
    assert all(s <= b for s, b in zip(layer["spectral_norm_max"], layer["spectral_prenorm_bound"]))


def test_relative_residual_is_zero_for_rank_one_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)  # fixed draws: the ranges below are about these, not any draw
    x = torch.randn(1, 1, 16, generator=g).expand(2, 9, 16)  # every token the same vector
    assert metrics.relative_residual(x) == pytest.approx({"fro": 0.0, "l1_inf": 0.0}, abs=1e-12)
    r = metrics.relative_residual(torch.randn(2, 9, 16, generator=g))
    assert 0.5 < r["fro"] <= 1  # the mean-removing projection never grows the Frobenius norm
    assert 0.3 < r["l1_inf"] < 2  # the composite norm has no such guarantee
    scaled = metrics.relative_residual(5 * torch.randn(1, 9, 16, generator=g) + 3)
    assert scaled["fro"] > 0  # relative: scale free, a shared offset lowers it but not to zero


def test_pure_attention_stacks_collapse_but_skip_connections_prevent_it(copy_task):
    probe = copy_task.probe_batch(8)

    def last_residual(**kw):
        m = model(copy_task, n_layers=12, norm=NormConfig(type="none"), init=InitConfig("xavier"), **kw)
        return forward_stats(m, probe)["layers"][-1]["relative_residual"]["fro"]

    collapsed = last_residual(residual=False, ffn=False)
    with_skips = last_residual(residual=True, ffn=False)
    assert collapsed < 0.01 and with_skips > 0.1  # measured here: 0.003 vs 0.15 at 12 layers
    assert with_skips > 30 * collapsed


def test_xiong_gradients_at_init_post_ln_grow_to_the_top_pre_ln_shrink(copy_task):
    """Xiong et al. (2020): at init, post-LN's last-layer FFN gradient is large; pre-LN's decays with depth."""
    probe = copy_task.probe_batch(32)

    def ffn_grads(placement):
        m = model(copy_task, n_layers=24, norm=NormConfig(placement=placement), init=InitConfig("xavier"))
        grads = probe_gradients(m, probe)
        assert all(p.grad is None for p in m.parameters())  # nothing left behind
        return grads[0]["ffn"], grads[-1]["ffn"]

    post_first, post_last = ffn_grads("post")
    pre_first, pre_last = ffn_grads("pre")
    assert post_last >= post_first
    assert pre_last < 0.5 * pre_first


def test_sparsity_counts_relu_zeros(copy_task):
    relu = forward_stats(model(copy_task, act=__import__("blocklab.model.config", fromlist=["ActConfig"]).ActConfig("relu")),
                         copy_task.probe_batch(8))
    gelu = forward_stats(model(copy_task), copy_task.probe_batch(8))
    assert all(0.3 < layer["ffn_sparsity"] < 0.7 for layer in relu["layers"])  # half the pre-activations < 0
    assert all(layer["ffn_sparsity"] < 0.2 for layer in gelu["layers"])
    assert metrics.sparsity(torch.tensor([0.0, 1e-4, 0.5, -2.0]), 1e-3) == 0.5


def test_head_similarity_is_one_for_identical_heads():
    g = torch.Generator().manual_seed(0)
    w = torch.softmax(torch.randn(3, 1, 5, 5, generator=g), -1).expand(3, 4, 5, 5)
    sim = metrics.head_similarity(w)
    assert torch.allclose(sim, torch.ones(4, 4), atol=1e-6)
    distinct = metrics.head_similarity(torch.softmax(10 * torch.randn(3, 4, 5, 5, generator=g), -1))
    assert metrics.mean_off_diagonal(distinct) < 0.9
    assert metrics.mean_off_diagonal(metrics.head_similarity(w[:, :1])) is None  # one head: no pair to compare


def test_entropy_and_distance_of_known_patterns():
    n = 6
    uniform = torch.full((1, 1, n, n), 1 / n)
    assert metrics.attention_entropy(uniform).item() == pytest.approx(math.log(n))
    previous = torch.zeros(1, 1, n, n)
    previous[0, 0, 0, 0] = 1
    for i in range(1, n):
        previous[0, 0, i, i - 1] = 1  # attend one token back
    assert metrics.attention_distance(previous).item() == pytest.approx((n - 1) / n)
    assert metrics.attention_entropy(previous).item() == pytest.approx(0.0, abs=1e-9)


def losses(run_dir):
    import csv

    rows = list(csv.DictReader(open(next(run_dir.glob("csv/version_*/metrics.csv")))))
    return [(r["step"], r["train/loss"]) for r in rows if r.get("train/loss")]


def test_diagnostics_do_not_change_training(tmp_path):
    common = ["trainer=debug", "trainer.log_every_n_steps=1", "logger=csv", "task.eval_examples=16",
              "model.dropout=0.1"]  # dropout: a change in the random state would show
    run_in_process([*common, "diagnostics=none"], tmp_path / "off")
    run_in_process([*common, "diagnostics=full", "diagnostics.every_n_steps=5"], tmp_path / "on")
    assert losses(tmp_path / "off") == losses(tmp_path / "on") and len(losses(tmp_path / "on")) >= 15
    off, on = read_results(tmp_path / "off"), read_results(tmp_path / "on")
    assert off["eval"] == on["eval"]
    assert "diagnostics" not in off
    diag = on["diagnostics"]
    assert diag["init"]["step"] == 0 and diag["end"]["step"] == 20
    history = json.loads((tmp_path / "on" / "diagnostics" / "history.json").read_text())
    assert [h["step"] for h in history] == [0, 5, 10, 15, 20]
    maps = sorted(p.name for p in (tmp_path / "on" / "diagnostics").glob("attention_*.png"))
    assert maps == ["attention_end.png", "attention_init.png", "attention_step10.png", "attention_step15.png",
                    "attention_step5.png"]  # one figure per measurement, not one per layer


def analyze(*args):
    proc = subprocess.run([sys.executable, "-m", "blocklab.analyze", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""  # quiet: only the paths it wrote
    return proc.stdout.splitlines()


def test_analyze_cli_init(tmp_path):
    out = tmp_path / "init"
    lines = analyze("--init", "norm=post_ln", "model.n_layers=3", "--out", out)
    diag = out / "diagnostics"
    assert lines == [f"wrote {diag / name}" for name in ("analysis.json", "attention_init.png", "layers_init.png")]
    analysis = json.loads((diag / "analysis.json").read_text())
    assert len(analysis["layers"]) == 3 and len(analysis["gradients"]) == 3
    assert analysis["layers"][0]["spectral_prenorm_bound"] is None  # post-LN
    assert [p.name for p in diag.glob("attention*.png")] == ["attention_init.png"]  # one figure, all layers


@pytest.fixture(scope="module")
def analyzed_run(tmp_path_factory):
    """A debug run with diagnostics at steps 0, 10, 20, then `analyze RUN_DIR`: (run_dir, printed lines)."""
    run_dir = tmp_path_factory.mktemp("analyze") / "run"
    run_in_process(["trainer=debug", "logger=none", "task.eval_examples=16", "diagnostics.every_n_steps=10"], run_dir)
    return run_dir, analyze(run_dir)


def test_analyze_run_prints_each_figure_it_writes(analyzed_run):
    run_dir, lines = analyzed_run
    diag = run_dir / "diagnostics"
    names = ["analysis.json", "attention_trained.png", "layers_trained.png", "history.png"]
    assert lines == [f"wrote {diag / name}" for name in names]
    assert all((diag / name).stat().st_size > 0 for name in names)
    trained = json.loads((diag / "analysis.json").read_text())
    assert trained["tag"] == "trained" and len(trained["layers"]) == 2


def clipped_texts(fig) -> list[str]:
    """Texts (titles, labels, legends, tick labels) that reach outside the figure once drawn."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    inside = fig.bbox.padded(1)  # a pixel of rounding
    # tick labels are checked through the tight bbox: Text objects of ticks outside the view are kept, not drawn
    ticks = {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
             for tick in axis.get_major_ticks() + axis.get_minor_ticks() for t in (tick.label1, tick.label2)}
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text() and id(t) not in ticks]
    out = [t.get_text() for t in texts if not _within(t.get_window_extent(renderer), inside)]
    drawn = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)  # inches -> pixels
    return out + ([] if _within(drawn, inside) else ["tick labels"])


def _within(box, outer) -> bool:
    return outer.x0 <= box.x0 and outer.y0 <= box.y0 and box.x1 <= outer.x1 and box.y1 <= outer.y1


def test_the_clipping_check_catches_a_clipped_label():
    fig = plots.new_figure(3, 2)
    fig.set_layout_engine("none")  # the layout would make room for it
    ax = fig.add_subplot()
    ax.set_xlabel("key position", labelpad=100)  # pushed below the figure
    assert "key position" in clipped_texts(fig)


def test_attention_figure_is_a_layers_by_heads_grid_with_one_colour_scale(copy_task):
    m = model(copy_task, n_layers=3, n_heads=2)
    weights = forward_stats(m, copy_task.probe_batch(4), keep_weights=True)["weights"]
    fig = plots.attention_figure(weights, "attention (test)")
    maps = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in maps] == [f"layer {i}, head {h}" for i in range(3) for h in range(2)]
    images = [ax.images[0] for ax in maps]
    assert len({id(im.norm) for im in images}) == 1  # one shared colour scale
    [bar] = [im.colorbar for im in images if im.colorbar is not None]
    assert bar.ax in fig.axes and len(fig.axes) == 3 * 2 + 1 and bar.norm is images[0].norm
    assert bar.ax.get_ylabel().startswith("attention weight")
    for ax, w in zip(maps, (w[h] for w in weights for h in range(2))):
        assert torch.equal(torch.as_tensor(ax.images[0].get_array()), w)
    assert {ax.get_xlabel() for ax in maps[-2:]} == {"key position"}
    assert {ax.get_ylabel() for ax in maps[::2]} == {"query position"}
    # Positions are token indices: integer ticks from the first to the last, on the outer panels only.
    last = weights[0].shape[-1] - 1
    ticks = [0, round(last / 3), round(2 * last / 3), last]
    for i, ax in enumerate(maps):
        bottom_row, left_column = i >= len(maps) - 2, i % 2 == 0
        assert list(ax.get_xticks()) == (ticks if bottom_row else [])
        assert list(ax.get_yticks()) == (ticks if left_column else [])
    assert clipped_texts(fig) == []


def lines_by_title(fig) -> dict:
    """{panel title: {line label: y values}}."""
    return {ax.get_title(): {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
            for ax in fig.axes if ax.get_visible() and ax.get_title()}


def test_layer_figure_shows_the_measured_numbers_one_point_per_layer(analyzed_run):
    run_dir, _ = analyzed_run
    stats = json.loads((run_dir / "diagnostics" / "analysis.json").read_text())
    fig = plots.layer_figure(stats, "per-layer (test)")
    panels = lines_by_title(fig)
    layers, grads = stats["layers"], stats["gradients"]
    expected = {
        "gradient norm per sublayer": {"attention": [g["attn"] for g in grads], "FFN": [g["ffn"] for g in grads]},
        "activation RMS (block output)": {"block output": [r["activation_rms"] for r in layers]},
        "rank collapse": {"Frobenius": [r["relative_residual"]["fro"] for r in layers]},
        "attention entropy": {"mean over heads": [sum(r["attention_entropy"]) / 4 for r in layers]},
        "attention spectral norm": {"measured": [max(r["spectral_norm_max"]) for r in layers]},
        "FFN sparsity": {"FFN hidden": [r["ffn_sparsity"] for r in layers]},
    }
    for title, lines in expected.items():
        for label, values in lines.items():
            assert panels[title][label] == pytest.approx(values), (title, label)
    assert panels["activation RMS (block output)"]["embedding"] == pytest.approx([stats["embedding_rms"]] * 2)
    for ax in fig.axes:
        if ax.get_visible():
            assert ax.get_xlabel() == "layer" and ax.get_ylabel()
            assert all(list(line.get_xdata()) == [0, 1] for line in ax.get_lines() if line.get_linestyle() != "--")
    assert clipped_texts(fig) == []


def test_history_figure_shows_each_layer_against_training_step(analyzed_run):
    run_dir, _ = analyzed_run
    history = json.loads((run_dir / "diagnostics" / "history.json").read_text())
    assert [h["step"] for h in history] == [0, 10, 20]
    fig = plots.history_figure(history)
    panels = lines_by_title(fig)
    for i in range(2):
        assert panels["FFN gradient norm"][f"layer {i}"] == pytest.approx([h["gradients"][i]["ffn"] for h in history])
        assert panels["activation RMS (block output)"][f"layer {i}"] == pytest.approx(
            [h["layers"][i]["activation_rms"] for h in history])
    for ax in fig.axes:
        if ax.get_lines():
            assert ax.get_xlabel() == "training step"
            assert all(list(line.get_xdata()) == [0, 10, 20] for line in ax.get_lines())
    assert clipped_texts(fig) == []
    assert plots.history_figure(history[:1]) is None  # nothing to draw a course from
