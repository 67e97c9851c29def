"""Diagnostics: the measurements agree with the math, and show the seed documents' claims."""
import json
import math
import subprocess
import sys

import pytest
import torch

from blocklab.analysis import metrics
from blocklab.analysis.probe import forward_stats, probe_gradients
from blocklab.model import ModelConfig, Transformer
from blocklab.model.config import AttnConfig, InitConfig, NormConfig, PosConfig
from blocklab.tasks import build_task
from blocklab.results import read_results
from conftest import ROOT, run_in_process


@pytest.fixture(scope="module")
def copy_task():
    return build_task(dict(name="copy", alphabet="abcdefghijklmnop", min_len=1, max_len=16, eval_lengths=None,
                           batch_size=8, eval_examples=32, eval_seed=1), 0)


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


def test_prenorm_bound_is_tight_for_tiny_weights(copy_task):
    m = model(copy_task, init=InitConfig("normal", std=1e-4))  # scores ~ 0: attention ~ uniform, bound ~ 1
    layer = forward_stats(m, copy_task.probe_batch(4))["layers"][0]
    assert max(layer["spectral_prenorm_bound"]) < 1.01


def test_relative_residual_is_zero_for_rank_one_and_positive_otherwise():
    x = torch.randn(1, 1, 16).expand(2, 9, 16)  # every token the same vector
    assert metrics.relative_residual(x) == pytest.approx({"fro": 0.0, "l1_inf": 0.0}, abs=1e-12)
    r = metrics.relative_residual(torch.randn(2, 9, 16))
    assert 0.5 < r["fro"] <= 1  # the mean-removing projection never grows the Frobenius norm
    assert 0.3 < r["l1_inf"] < 2  # the composite norm has no such guarantee
    scaled = metrics.relative_residual(5 * torch.randn(1, 9, 16) + 3)
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
    w = torch.softmax(torch.randn(3, 1, 5, 5), -1).expand(3, 4, 5, 5)
    sim = metrics.head_similarity(w)
    assert torch.allclose(sim, torch.ones(4, 4), atol=1e-6)
    distinct = metrics.head_similarity(torch.softmax(10 * torch.randn(3, 4, 5, 5), -1))
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
    assert (tmp_path / "on" / "diagnostics" / "attention_end_layer1.png").exists()


def test_analyze_cli_init_and_run(tmp_path):
    out = tmp_path / "init"
    proc = subprocess.run([sys.executable, "-m", "blocklab.analyze", "--init", "norm=post_ln", "model.n_layers=3",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    analysis = json.loads((out / "diagnostics" / "analysis.json").read_text())
    assert len(analysis["layers"]) == 3 and len(analysis["gradients"]) == 3
    assert analysis["layers"][0]["spectral_prenorm_bound"] is None  # post-LN
    assert len(list((out / "diagnostics").glob("attention_init_layer*.png"))) == 3

    run_dir = tmp_path / "run"
    run_in_process(["trainer=debug", "logger=none", "task.eval_examples=16", "diagnostics=none"], run_dir)
    proc = subprocess.run([sys.executable, "-m", "blocklab.analyze", str(run_dir)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trained = json.loads((run_dir / "diagnostics" / "analysis.json").read_text())
    assert trained["tag"] == "trained" and len(trained["layers"]) == 2
