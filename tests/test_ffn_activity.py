"""FFN activity (exercises 1.9, 1.10): where each activation counts as off, its derivative by autograd, and the
per-layer off fraction and dead units the diagnostics record."""
import math

import pytest
import torch
import torch.nn.functional as F

from blocklab.analysis import activations
from blocklab.analysis.probe import forward_stats
from blocklab.model import ModelConfig, Transformer
from blocklab.model.config import ActConfig
from blocklab.model.ffn import ACTIVATIONS

EPS = activations.OFF_EPS


def phi(x: float) -> float:  # standard normal CDF
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@pytest.mark.parametrize("fn, at_level", [
    (F.gelu, lambda x: abs(x * phi(x))),  # GELU(x) = x Phi(x)
    (F.silu, lambda x: abs(x / (1 + math.exp(-x)))),
    (torch.sigmoid, lambda x: 1 / (1 + math.exp(-x))),
])
def test_off_level_is_where_the_tail_reaches_eps(fn, at_level):
    level = activations.off_level(fn)
    assert at_level(level) <= EPS < at_level(level + 0.002)  # the grid's step is 0.001
    # and nothing below it comes back above eps (GELU and SiLU dip below zero on the way)
    assert all(at_level(level - k * 0.05) <= EPS for k in range(1, 400))


def test_relu_family_is_off_exactly_at_and_below_zero():
    assert activations.off_level(F.relu) == 0.0
    assert activations.off_level(ACTIVATIONS["relu2"].fn) == 0.0
    assert activations.off_level(lambda x: x) == float("-inf")  # the identity has no flat tail


def test_derivatives_by_autograd_match_the_closed_forms():
    x = torch.linspace(-4, 4, 81, dtype=torch.float64)
    x = x[x != 0]  # ReLU's kink
    curves = {names[0]: (y, dy) for names, y, dy in activations.curves(x)}
    assert set(curves) == {names[0] for names, _ in activations.distinct()}
    s = torch.sigmoid(x)
    pdf, cdf = torch.exp(-x ** 2 / 2) / math.sqrt(2 * math.pi), 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    expected = {"relu": (x > 0).double(), "gelu": cdf + x * pdf, "silu": s * (1 + x * (1 - s)),
                "relu2": 2 * F.relu(x), "glu (gate)": s * (1 - s)}
    for name, derivative in expected.items():
        assert torch.allclose(curves[name][1], derivative, atol=1e-9), name
    assert torch.allclose(curves["gelu"][0], x * cdf)
    # gated entries appear with the plain function they use, not as curves of their own
    assert [n for n, _ in activations.distinct() if "swiglu (gate)" in n] == [["silu", "swiglu (gate)"]]


def test_off_fraction_and_dead_units_count_the_tail():
    level = activations.off_level(F.gelu)
    pre = torch.tensor([[level - 1, 0.5, level, -1.0],
                        [level - 5, level - 2, 1.0, -1.0],
                        [level - 0.1, -3.0, 2.0, level + 0.1]], dtype=torch.float64)
    off, dead = activations.off_fraction_and_dead(pre, F.gelu)
    assert off == pytest.approx(6 / 12)
    assert dead == 1  # only the first unit is off on every token


def ffn_stats(task, act: str, kill: int = 0) -> list[dict]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=task.vocab_size, max_len=64, act=ActConfig(act)))
    with torch.no_grad():  # `kill` units of layer 0 pushed far into the tail (the gate's half when gated)
        model.blocks[0].ffn.in_proj.bias[:kill] = -100.0
    return forward_stats(model, task.probe_batch(8))["layers"]


@pytest.mark.parametrize("act", ["relu", "gelu", "swiglu"])
def test_probe_counts_units_pushed_into_the_tail_as_dead(copy_task, act):
    before, after = ffn_stats(copy_task, act), ffn_stats(copy_task, act, kill=5)
    assert after[0]["ffn_dead"] == before[0]["ffn_dead"] + 5
    assert after[1]["ffn_dead"] == before[1]["ffn_dead"]
    assert after[0]["ffn_off"] > before[0]["ffn_off"]
    if before[0]["ffn_off"] == 0:  # GELU, SiLU gate: nothing was off, now 5 units on every token
        assert after[0]["ffn_off"] == pytest.approx(5 / after[0]["ffn_units"])


def test_relu_units_are_off_half_the_time_at_init_gelu_never(copy_task):
    """N(0, 0.02) weights give pre-activations of a few tenths: ReLU's half-line below 0 holds half of them,
    GELU's tail (x <= -2.675) none."""
    relu, gelu = ffn_stats(copy_task, "relu"), ffn_stats(copy_task, "gelu")
    assert all(0.4 < layer["ffn_off"] < 0.6 for layer in relu)
    assert all(abs(layer["ffn_off"] - layer["ffn_sparsity"]) < 0.02 for layer in relu)  # exact zeros either way
    assert all(layer["ffn_off"] == 0 and layer["ffn_dead"] == 0 for layer in gelu)
    assert gelu[0]["ffn_off_level"] == pytest.approx(-2.675, abs=0.002)
