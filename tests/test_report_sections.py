"""The report shows what every run already measures: attention's spectral norm per layer against seed 000's bounds,
per-head entropy and distance, per-layer gradients and activation RMS, FFN off fraction and dead units, the
activation functions and their derivatives, and the benchmark sections (attention costs, position-scheme costs,
activation speed). A fabricated sweep carries real measurements (analysis.probe on tiny models)."""
import base64
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.collections import PathCollection
from omegaconf import OmegaConf
from PIL import Image

from blocklab.analysis.probe import measure
from blocklab.errors import ConfigError
from blocklab.model import ModelConfig, Transformer
from blocklab.model.config import ActConfig, NormConfig
from blocklab.report import benches
from blocklab.report.build import build_report, plot
from blocklab.report.collect import collect, study_specs
from blocklab.tasks import build_task
from conftest import CONF, report_page, run_cli

PLACEMENTS, SEEDS, LAYERS, HEADS = ("pre", "post"), (0, 1, 2), 3, 4
STUDY = {"name": "sections", "question": "What do the diagnostics show?", "compare": ["norm.placement"],
         "metrics": ["final_train_loss", "ffn_off"], "bench": ["activations", "positions", "attention"],
         "plots": [
             {"kind": "spectral_bounds", "metric": "spectral_norm_max", "by": ["norm.placement"], "when": "init"},
             {"kind": "by_layer", "metric": "grad_ffn", "by": ["norm.placement"], "when": "init"},
             {"kind": "by_layer", "metric": "activation_rms", "by": ["norm.placement"], "when": "end"},
             {"kind": "by_layer", "metric": "ffn_off", "by": ["norm.placement"], "when": "end"},
             {"kind": "bar", "metric": "ffn_dead", "by": ["norm.placement"]},
             {"kind": "per_head", "metric": "attention_entropy", "by": ["norm.placement"], "when": "end"},
             {"kind": "activation_functions", "metric": "activation"}]}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Two placements x three seeds of a 3-layer ReLU model, measured at init by the probe the diagnostics use;
    `end` is the same model with its attention sharpened (query weights x 8), so the two measurements differ."""
    root = tmp_path_factory.mktemp("sections") / "sweep"
    task = build_task(dict(name="copy", alphabet="abcdefghijklmnop", min_len=1, max_len=8, eval_lengths=None,
                           batch_size=8, eval_examples=16, eval_seed=1), 0)
    probe = task.probe_batch(8)
    for placement in PLACEMENTS:
        for seed in SEEDS:
            torch.manual_seed(seed)
            model = Transformer(ModelConfig(vocab_size=task.vocab_size, max_len=32, n_layers=LAYERS, d_model=32,
                                            n_heads=HEADS, act=ActConfig("relu"), norm=NormConfig(placement=placement)))
            init = measure(model, probe)
            with torch.no_grad():
                for block in model.blocks:
                    block.attn.projection("q")[0].mul_(8)  # a view of the fused projection's query rows
            end = measure(model, probe)
            run_dir = root / f"norm.placement={placement},seed={seed}"
            (run_dir / ".hydra").mkdir(parents=True)
            config = {"study": STUDY, "seed": seed, "norm": {"placement": placement}, "task": {"name": "copy"},
                      "trainer": {"max_steps": 10}, "model": {"n_layers": LAYERS}}
            OmegaConf.save(OmegaConf.create(config), run_dir / ".hydra" / "config.yaml")
            results = {"status": "completed", "task": "copy", "study": "sections", "choices": {"seed": seed},
                       "params": 1000, "steps": 10, "tokens_per_s": 1000.0, "final_train_loss": 2.0 + 0.1 * seed,
                       "final_val_loss": 2.0, "train_lengths": [1, 8],
                       "overrides": [f"norm.placement={placement}", f"seed={seed}"],
                       "eval": [{"length": 8, "in_distribution": True, "exact_match": 0.0, "token_acc": 0.1,
                                 "loss": 2.0, "n": 16}],
                       "diagnostics": {"init": {"tag": "init", "step": 0, **init},
                                       "end": {"tag": "end", "step": 10, **end}}}
            (run_dir / "results.json").write_text(json.dumps(results))
    return root


def raw(row: dict, when: str) -> dict:
    return json.loads((Path(row["run"]) / "results.json").read_text())["diagnostics"][when]


@pytest.fixture
def saved(monkeypatch) -> list:
    """The figures the report saves, kept open to look at (it closes them after saving)."""
    import matplotlib.pyplot as plt

    figures, savefig = [], plt.Figure.savefig
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: figures.append(fig) or savefig(fig, *a, **k))
    return figures


def test_rows_carry_the_bounds_per_head_values_and_ffn_activity(sweep):
    rows = collect(sweep)
    assert len(rows) == len(PLACEMENTS) * len(SEEDS)
    for row in rows:
        m = raw(row, "end")
        layers = row["layers_end"]
        assert layers["spectral_norm_max"] == [max(layer["spectral_norm_max"]) for layer in m["layers"]]
        assert layers["spectral_generic_bound"] == [math.sqrt(m["n_keys"])] * LAYERS
        bounds = layers["spectral_prenorm_bound"]
        assert bounds == ([max(layer["spectral_prenorm_bound"]) for layer in m["layers"]]
                          if row["norm.placement"] == "pre" else [None] * LAYERS)  # post-norm: no theorem
        assert layers["attention_entropy_heads"] == [layer["attention_entropy"] for layer in m["layers"]]
        assert all(len(h) == HEADS for h in layers["attention_distance_heads"])
        assert row["ffn_off"] == pytest.approx(sum(layer["ffn_off"] for layer in m["layers"]) / LAYERS)
        assert row["ffn_dead"] == sum(layer["ffn_dead"] for layer in m["layers"])
        assert 0.3 < row["ffn_off"] < 0.7  # ReLU at init: about half the pre-activations below 0


def lines(path_or_fig) -> dict:
    ax = path_or_fig
    return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}


def test_spectral_plot_draws_seed_means_bounds_and_says_whether_each_run_stays_under(sweep, tmp_path, saved):
    rows = collect(sweep)
    note = plot(rows, STUDY["plots"][0], tmp_path / "spectral.png")
    ax = saved[0].axes[0]
    by_placement = {p: [r for r in rows if r["norm.placement"] == p] for p in PLACEMENTS}
    for placement, members in by_placement.items():
        series = [r["layers_init"]["spectral_norm_max"] for r in members]
        mean = [sum(v) / len(v) for v in zip(*series)]
        assert lines(ax)[f"{placement}, {LAYERS}"] == pytest.approx(mean)
        assert f"placement={placement}, n_layers={LAYERS}: ||A||_2 layer 0 {mean[0]:.3f}, deepest {mean[-1]:.3f}" in note
    bound = [sum(v) / len(v) for v in zip(*(r["layers_init"]["spectral_prenorm_bound"] for r in by_placement["pre"]))]
    dashed = [list(line.get_ydata()) for line in ax.get_lines() if line.get_linestyle() == "--" and len(
        line.get_ydata()) == LAYERS]
    assert dashed == [pytest.approx(bound)]  # one bound line: pre-LN's; post-LN has none
    n = math.sqrt(raw(rows[0], "init")["n_keys"])
    assert any(list(line.get_ydata()) == pytest.approx([n, n], abs=1e-3) for line in ax.get_lines())  # grey: √n
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())
    assert "within it in all 3 runs" in note and "ABOVE" not in note
    # A run above its bound is called out (the claim would be false there).
    broken = [dict(r, layers_init={**r["layers_init"], "spectral_prenorm_bound": [0.5] * LAYERS})
              if r["norm.placement"] == "pre" else r for r in rows]
    assert "ABOVE it" in plot(broken, STUDY["plots"][0], tmp_path / "broken.png")


def test_per_head_plot_shows_every_head_and_its_spread(sweep, tmp_path, saved):
    rows = collect(sweep)
    note = plot(rows, STUDY["plots"][5], tmp_path / "heads.png")
    drawn = {"ax": saved[0].axes[0]}
    points = [c for c in drawn["ax"].collections if isinstance(c, PathCollection)]
    assert sum(len(c.get_offsets()) for c in points) == len(rows) * LAYERS * HEADS
    plotted = sorted(float(y) for c in points for _, y in c.get_offsets())
    assert plotted == pytest.approx(sorted(v for r in rows for layer in r["layers_end"]["attention_entropy_heads"]
                                           for v in layer))
    pre = [r for r in rows if r["norm.placement"] == "pre"]
    spread0 = sum(max(r["layers_end"]["attention_entropy_heads"][0]) - min(r["layers_end"]["attention_entropy_heads"][0])
                  for r in pre) / len(pre)
    assert f"placement=pre: {spread0:.3g}," in note


def test_activation_functions_plot_is_every_registered_activation_and_its_derivative(tmp_path, saved):
    from blocklab.analysis.activations import distinct

    note = plot([{"status": "completed"}], STUDY["plots"][6], tmp_path / "act.png")
    drawn = {"fig": saved[0]}
    values, slopes = [ax for ax in drawn["fig"].axes if ax.get_visible()]
    curves = {line.get_label(): line for line in values.get_lines() if not line.get_label().startswith("_")}
    assert set(curves) == {" / ".join(names) for names, _ in distinct()}
    relu = curves["relu / reglu (gate)"]
    x = torch.as_tensor(relu.get_xdata())
    assert torch.allclose(torch.as_tensor(relu.get_ydata()), torch.relu(x))
    assert len([line for line in slopes.get_lines() if len(line.get_xdata()) == len(x)]) == len(curves)
    assert "gelu / geglu (gate): x ≤ -2.675" in note and "ε = 0.01" in note


BENCH = {"machine": {"command": "python -m blocklab.bench activations step --out bench.json", "cpu": "Test CPU",
                     "cpu_threads": 1, "torch": "2.x"},
         "benchmarks": {
             "activations": {"rows": [{"act": "relu", "ms": 1.25, "vs_fastest": 1.0},
                                      {"act": "gelu", "ms": 1.75, "vs_fastest": 1.4}], "wall_s": 1.0,
                             "targets": {"slowest_vs_fastest": {"value": 1.4, "target": 2.0, "met": True,
                                                                "off_by": 0.0}}},
             "step": {"rows": [{"axis": "pos", "variant": "none", "ms": 10.0, "ms_median": 11.0, "tokens_per_s": 76,
                                "gflop_per_step": 1.0, "vs_nope": 1.0},
                               {"axis": "pos", "variant": "fire", "ms": 12.5, "ms_median": 13.0, "tokens_per_s": 61,
                                "gflop_per_step": 1.0, "vs_nope": 1.25},
                               {"axis": "attn", "variant": "gqa_row", "ms": 9.0, "ms_median": 9.5, "tokens_per_s": 85,
                                "gflop_per_step": 0.9, "vs_nope": 0.9}],
                      "tokens_per_step": 768, "wall_s": 2.0,
                      "targets": {"rope_vs_nope": {"value": 1.05, "target": 1.1, "met": True, "off_by": 0.0},
                                  "baby_vs_nanogpt": {"value": 1.2, "target": 0.9, "met": False, "off_by": 0.33}}}}}


def test_bench_sections_read_the_json_or_say_which_command_makes_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no outputs/bench here
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(BENCH))
    positions = benches.section("positions", tmp_path, tmp_path, [path])
    assert positions.startswith("<section id='position_costs'>")
    assert "<td>fire</td><td>12.5</td>" in positions and "gqa_row" not in positions  # position rows only
    assert "rope_vs_nope" in positions and "baby_vs_nanogpt" not in positions
    assert (tmp_path / "position_costs.png").stat().st_size > 1000
    speed = benches.section("activations", tmp_path, tmp_path, [path])
    assert "<td>gelu</td><td>1.75</td><td>1.4</td>" in speed and "PASS slowest_vs_fastest" in speed
    missing = benches.section("attention", tmp_path, tmp_path, [path])
    assert "No benchmark results yet" in missing and "python -m blocklab.bench attention" in missing
    # Without --bench: outputs/bench/<benchmark>.json, under the working directory or the sweep's outputs folder.
    sweep_root = tmp_path / "elsewhere" / "outputs" / "sweeps" / "s"
    (sweep_root.parents[1] / "bench").mkdir(parents=True)
    (sweep_root.parents[1] / "bench" / "activations.json").write_text(json.dumps(BENCH))
    assert benches.find("activations", sweep_root) == BENCH and benches.find("step", sweep_root) is None


def test_an_unknown_bench_or_plot_kind_fails_before_anything_is_written(sweep, tmp_path):
    rows = collect(sweep)
    for bad, match in (({"bench": "activation"}, "did you mean 'activations'"),
                       ({"plots": [{"kind": "spectral_bound", "metric": "x"}]}, "did you mean 'spectral_bounds'")):
        with pytest.raises(ConfigError, match=match):
            build_report(tmp_path / "r", rows, {"sections": {**STUDY, **bad}})
        assert not (tmp_path / "r" / "report").exists()


@pytest.mark.parametrize("plot, match", [
    ({"kind": "by_position", "metric": "token_acc", "att": 3}, r"plots\[1\]\.att is not a key of plot kind by_position; did you mean at\?"),
    ({"kind": "by_position", "metric": "token_acc", "at": 0}, r"plots\[1\]\.at=0 must be a number > 0"),
    ({"kind": "by_layer", "metric": "grad_norm", "when": "ends"}, r"plots\[1\]\.when='ends'.*did you mean end\?"),
    ({"kind": "attention_maps", "metric": "attention_maps", "when": ["init", "middle"]}, r"must be init, end or a list"),
    ({"kind": "tradeoff", "metric": "exact_match_in"}, r"plots\[1\]\.x is missing: plot kind tradeoff needs it"),
    ({"kind": "bar", "by": "pos"}, r"plots\[1\]\.metric is missing"),
    ({"kind": "bar", "metric": "params", "where": "task=copy"}, r"where='task=copy' must be a mapping"),
    ({"kind": "bar", "metric": "params", "by": ["pos", 3]}, r"by=\['pos', 3\] must be a key or a list of keys"),
])
def test_a_plot_key_its_kind_does_not_read_or_a_bad_value_fails_before_anything_is_written(sweep, tmp_path, plot,
                                                                                            match):
    ok = {"kind": "bar", "metric": "params"}
    with pytest.raises(ConfigError, match=match) as error:
        build_report(tmp_path / "r", collect(sweep), {"sections": {**STUDY, "plots": [ok, plot]}})
    assert len(str(error.value).splitlines()) == 1  # the good plot before it raises nothing
    assert not (tmp_path / "r" / "report").exists()


def test_finished_runs_get_the_plots_the_sweep_file_asks_for_now(tmp_path):
    """The saved study block says what the runs did; what to draw (plots, bench) comes from the sweep file."""
    run_dir = tmp_path / "head_count" / "job"
    (run_dir / ".hydra").mkdir(parents=True)
    old = {"name": "head_count", "compare": ["task", "n_heads"], "plots": [{"kind": "bar", "metric": "params"}]}
    OmegaConf.save(OmegaConf.create({"study": old}), run_dir / ".hydra" / "config.yaml")
    now = OmegaConf.to_container(OmegaConf.load(CONF / "sweep" / "head_count.yaml")["study"])
    spec = study_specs(tmp_path, [{"study": "head_count", "run": str(run_dir)}])["head_count"]
    assert spec["plots"] == now["plots"] and any(p["kind"] == "per_head" for p in spec["plots"])
    assert spec["compare"] == old["compare"]


def test_the_page_in_a_browser_shows_the_ci_columns_and_new_sections_and_every_image_decodes(sweep, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    proc = subprocess.run([sys.executable, "-m", "blocklab.report", str(sweep), "--bench", str(bench)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    index = sweep / "report" / "index.html"
    html = index.read_text()
    images = re.findall(r"<img alt='[^']*' src='data:image/png;base64,([^']+)'>", html)
    assert len(images) == len(STUDY["plots"]) + 2 == html.count("<img")  # + position costs and activation speed
    for data in images:
        image = Image.open(io.BytesIO(base64.b64decode(data)))
        image.load()
        assert image.format == "PNG" and image.width > 300 and image.height > 200
    with report_page(index) as page:
        header = page.locator("table.metrics th").all_inner_texts()
        assert "final_train_loss 95% CI" in header and "ffn_off 95% CI" in header
        assert page.locator("table.metrics tbody tr").count() == len(PLACEMENTS)
        ci = page.locator("table.metrics tbody tr").first.locator("td").nth(3).inner_text()
        assert re.fullmatch(r"\[\d\.\d{3}, \d\.\d{3}\]", ci)
        titles = page.locator("h2").all_inner_texts()
        assert titles == ["sections", "activation speed", "position scheme costs", "attention costs"]
        assert "python -m blocklab.bench attention" in page.locator("#attention_costs").inner_text()
        findings = page.locator("#sections").inner_text()
        assert "Attention spectral norm per layer at init" in findings and "range over heads" in findings
        assert page.evaluate("[...document.images].every(i => i.complete && i.naturalWidth > 300)")
        assert page.locator("img").count() == len(images)


@pytest.mark.slow
def test_real_runs_report_ffn_activity_and_the_activation_functions(tmp_path):
    """Two real jobs of the activations sweep (5 steps): the diagnostics' FFN activity reaches the report."""
    sweep_dir = tmp_path / "activations"
    proc = run_cli(["-m", "sweep=activations", "act=relu,gelu", "seed=0", "trainer.max_steps=5", "logger=none",
                    "task.eval_multipliers=[1]", f"hydra.sweep.dir={sweep_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = subprocess.run([sys.executable, "-m", "blocklab.report", str(sweep_dir)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    rows = {r["act"]: r for r in collect(sweep_dir)}
    assert rows["relu"]["ffn_off"] > 0.3 and rows["gelu"]["ffn_off"] < 0.01
    page = (sweep_dir / "report" / "index.html").read_text()
    assert f"act=relu {rows['relu']['ffn_off']:.3f}" in page  # the ffn_off bar's note
    assert "gelu / geglu (gate): x ≤ -2.675" in page and "<h2>activation speed</h2>" in page
