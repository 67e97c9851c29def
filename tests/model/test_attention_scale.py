"""The attention scale (attn.scale, attn.scale_factor) against the variance argument for 1/sqrt(d_head)
(Vaswani et al. 2017, sec. 3.2.1 footnote 4): with q and k components independent, zero-mean and of variance s^2,
Var(q.k) = d_head s^4, so unscaled scores spread as d_head grows and scaled ones do not. And the sweep that asks
whether it matters."""
import json
import math
import re

import pytest
import torch
from omegaconf import OmegaConf

from blocklab.model import ModelConfig, build_model
from blocklab.model.config import AttnConfig, InitConfig, PosConfig
from conftest import CONF, FAST, run_in_process
from helpers import refused
from test_sweeps import expand

D_MODEL = 64


def score_variance(n_heads: int, scale, factor: float = 1.0, seeds: int = 4) -> float:
    """Var of the scores scale * q.k that one layer computes at init, read off its attention weights: without
    masks or position terms log w_ij - log w_i0 = s_ij - s_i0, whose variance is 2 Var(s) (k_j, k_0 independent).
    Init N(0, 1/d_model) on LayerNorm'd inputs gives q, k components of variance ~1, so Var(q.k) ~ d_head."""
    values = []
    for seed in range(seeds):
        cfg = ModelConfig(vocab_size=1000, d_model=D_MODEL, n_heads=n_heads, n_layers=1, max_len=64,
                          pos=PosConfig("none"), attn=AttnConfig(causal=False, scale=scale, scale_factor=factor),
                          init=InitConfig("normal", 1 / math.sqrt(D_MODEL)))
        assert cfg.errors() == []
        torch.manual_seed(seed)
        model = build_model(cfg).double().eval()
        idx = torch.randint(0, 1000, (8, 32), generator=torch.Generator().manual_seed(100 + seed))
        with torch.no_grad():
            _, weights = model(idx, need_weights=True)
        log_w = weights[0].log()
        values.append(float((log_w[..., 1:] - log_w[..., :1]).var()) / 2)
    return sum(values) / len(values)


def test_at_init_unscaled_score_variance_grows_as_d_head_and_scaled_stays_flat():
    d_heads = {16: 4, 4: 16, 1: 64}  # n_heads -> d_head at d_model 64
    unscaled = {d: score_variance(h, "none") for h, d in d_heads.items()}
    scaled = {d: score_variance(h, None) for h, d in d_heads.items()}
    for d in d_heads.values():
        assert unscaled[d] / d == pytest.approx(1.0, rel=0.15)  # Var(q.k) = d_head * 1 * 1
        assert scaled[d] == pytest.approx(1.0, rel=0.15)  # Var(q.k / sqrt(d_head)) = 1
    assert 12 < unscaled[64] / unscaled[4] < 20  # in proportion to d_head: 16x
    assert max(scaled.values()) / min(scaled.values()) < 1.2  # flat


@pytest.mark.parametrize("scale, factor", [(None, 0.5), (None, 2.0), ("none", 0.5)])
def test_scale_factor_multiplies_the_scores(scale, factor):
    """Same weights, scores times the factor: their variance times factor^2."""
    assert score_variance(4, scale, factor, seeds=1) / score_variance(4, scale, 1.0, seeds=1) == \
        pytest.approx(factor ** 2, rel=1e-9)


@pytest.mark.parametrize("scale, factor, expected", [
    (None, 0.5, 0.5 / 4), ("default", 0.5, 0.5 / 4), (None, 2.0, 2 / 4), ("none", 0.5, 0.5), (0.3, 2.0, 0.6),
    (None, 1.0, 1 / 4), ("none", 1.0, 1.0), (0.3, 1.0, 0.3)])
def test_each_layer_uses_the_scale_times_the_factor(scale, factor, expected):
    cfg = ModelConfig(vocab_size=20, d_model=D_MODEL, n_heads=4, attn=AttnConfig(scale=scale, scale_factor=factor))
    assert cfg.errors() == []
    assert all(block.attn.scale == pytest.approx(expected, rel=1e-15) for block in build_model(cfg).blocks)


def test_the_default_factor_leaves_the_default_scale_as_it_was():
    """Factor 1 with scale null hands the layer None, so it computes 1/sqrt(d_head) itself, as before the factor."""
    assert AttnConfig().scale_value(16) is None
    assert build_model(ModelConfig(vocab_size=20)).blocks[0].attn.scale == 1 / math.sqrt(16)


@pytest.mark.parametrize("overrides, message", [
    (["attn.scale_factor=0"], "attn.scale_factor=0 must be a number > 0 (it multiplies the scale: 0.5 halves "
                              "1/sqrt(d_head))"),
    (["attn.scale_factor=-0.5"], "attn.scale_factor=-0.5 must be a number > 0 (it multiplies the scale: 0.5 halves "
                                 "1/sqrt(d_head))"),
    (["attn=linear", "attn.scale_factor=0.5"], "attn.scale_factor=0.5 does not apply to attn.kind=linear (elu(x)+1 "
                                               "features have no temperature); set attn.scale_factor=1"),
])
def test_bad_scale_factor_is_a_one_line_error_before_any_work(overrides, message, run_dir):
    with refused(message, run_dir) as err:
        run_in_process([*FAST, *overrides], run_dir)
    assert str(err.value) == message


def test_scale_factor_run_end_to_end(run_dir):
    run_in_process([*FAST, "attn.scale_factor=0.5", "diagnostics=none"], run_dir)
    assert json.loads((run_dir / "results.json").read_text())["status"] == "completed"
    saved = ModelConfig.from_dict(json.loads((run_dir / "model.json").read_text()))
    assert saved.attn.scale_factor == 0.5
    assert build_model(saved).blocks[0].attn.scale == pytest.approx(0.5 / math.sqrt(saved.d_head))


def test_the_attention_scale_sweep_varies_d_head_and_the_scale_over_seeds_and_plots_entropy_per_layer():
    """d_head 64 and 16 (d_head 4 learns copy at no setting by 2400 steps, and the x0.5 factor is the earlier
    design's scale-4 page: the sweep's notes say both)."""
    path = CONF / "sweep" / "attention_scale.yaml"
    jobs = [dict(o.split("=", 1) for o in job) for job in expand("attention_scale")]
    assert len({job["model.n_heads"] for job in jobs}) >= 2  # d_head = d_model / n_heads at a fixed d_model
    assert "model.d_model" not in OmegaConf.load(path)["hydra"]["sweeper"]["params"]
    assert {job["attn.scale"] for job in jobs} >= {"default", "none"}
    assert len({job["seed"] for job in jobs}) >= 3
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert re.search(rf"\b{len(jobs)} jobs, \d+ min\b", " ".join(header))  # the stated count is the real one
    study = OmegaConf.load(path)["study"]
    entropy = [p for p in study["plots"] if p["kind"] == "by_layer" and p["metric"] == "attention_entropy"]
    assert {p["when"] for p in entropy} == {"init", "end"}
