"""Context extension (pos.scaling) checked against the papers' formulas, written out here independently:
PI (Chen et al. 2023, eq. 4), NTK-aware (YaRN paper §3.1, eq. 16) and YaRN (Peng et al. 2023, §3.2 and eq. 22) with
pos.yarn_ramp=paper; the reference ramp's hand-computed points. The library oracle (transformers) for every method
is tests/model/test_rope_reference.py."""
import dataclasses
import math

import pytest
import torch

from blocklab.model import ModelConfig, build_model
from blocklab.model.config import PosConfig
from blocklab.model.position import Learned, RoPE
from blocklab.model.rope_scaling import POSITION_SCALINGS, yarn_ramp

from variants import tiny_cfg  # noqa: E402

D_HEAD, BASE, L = 8, 10000.0, 256  # L: the trained (original) context, YaRN's L
METHODS = list(POSITION_SCALINGS)


def scaled_cfg(pos="rope", max_len=64, **options) -> ModelConfig:
    cfg = tiny_cfg(pos, max_len=max_len)
    cfg = dataclasses.replace(cfg, pos=PosConfig(pos, options=options))
    assert cfg.errors() == [], cfg.errors()
    return cfg


def model_with(pos="rope", seed=0, **options):
    cfg = scaled_cfg(pos, **options)
    torch.manual_seed(seed)
    return build_model(cfg).double().eval()


def rope(method="none", factor=1.0, **kw) -> RoPE:
    return RoPE(32, 4, D_HEAD, scaling=method, scaling_factor=factor, original_context=L, **kw)


def angles(scheme: RoPE, position: int) -> torch.Tensor:
    """The angle each pair turns at `position`, read back from the rotation the scheme applies (float64)."""
    rotation = scheme.rotations(torch.tensor([[position]]), torch.float64)[0, 0, 0]
    return rotation.angle()


def magnitude(scheme: RoPE) -> torch.Tensor:
    return scheme.rotations(torch.tensor([[3]]), torch.float64)[0, 0, 0].abs()


# --------------------------------------------------------------------------------- factor 1 is RoPE itself

@pytest.mark.parametrize("method", METHODS)
def test_every_method_at_factor_one_is_plain_rope_bit_for_bit(method):
    idx = torch.randint(0, 20, (2, 40), generator=torch.Generator().manual_seed(0))
    plain = model_with("rope", original_context=L)
    scaled = model_with("rope", scaling=method, scaling_factor=1.0, original_context=L)
    with torch.no_grad():
        assert torch.equal(scaled(idx), plain(idx))


@pytest.mark.parametrize("method", ["none", "pi"])
def test_learned_table_at_factor_one_is_the_table_bit_for_bit(method):
    idx = torch.randint(0, 20, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model_with("learned", scaling=method)(idx), model_with("learned")(idx))


@pytest.mark.parametrize("method", ["pi", "ntk", "yarn"])
def test_every_method_past_factor_one_changes_the_model(method):
    """The check above would pass for a method that does nothing: at s = 4 the outputs differ."""
    idx = torch.randint(0, 20, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model_with("rope", original_context=L)(idx)
        scaled = model_with("rope", scaling=method, scaling_factor=4.0, original_context=L)(idx)
    assert (scaled - plain).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------------- PI

@pytest.mark.parametrize("factor", [2.0, 4.0, 2.5, 3.0])
def test_pi_maps_position_L_times_s_to_the_angle_of_L(factor):
    plain, pi = rope(), rope("pi", factor)
    for position in (10, 64, 200):
        assert torch.equal(angles(pi, int(position * factor)), angles(plain, position))
    # and between: position m turns m/s times the published frequencies theta_i = 10000^(-2i/d)
    theta = torch.tensor([BASE ** (-2 * i / D_HEAD) for i in range(D_HEAD // 2)], dtype=torch.float64)
    expected = torch.remainder(7 / factor * theta + math.pi, 2 * math.pi) - math.pi
    torch.testing.assert_close(angles(pi, 7), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(magnitude(pi), torch.ones(D_HEAD // 2, dtype=torch.float64))  # no temperature


def test_pi_interpolates_the_learned_table_linearly():
    scheme = Learned(16, 2, 8, max_len=40, scaling="pi", scaling_factor=4.0).double()
    table = scheme.table.weight.detach()
    zero = torch.zeros(1, 3, 16, dtype=torch.float64)
    with torch.no_grad():
        out = scheme.embed(zero, torch.tensor([[40, 41, 42]]))  # 40/4 = 10, 41/4 = 10.25, 42/4 = 10.5
    torch.testing.assert_close(out[0, 0], table[10], rtol=0, atol=0)
    torch.testing.assert_close(out[0, 1], 0.75 * table[10] + 0.25 * table[11])
    torch.testing.assert_close(out[0, 2], 0.5 * table[10] + 0.5 * table[11])
    with pytest.raises(ValueError, match="past the learned table"):
        scheme.embed(torch.zeros(1, 1, 16, dtype=torch.float64), torch.tensor([[4 * 40]]))  # 160/4 = 40: no row


# -------------------------------------------------------------------------------------------------- NTK

@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
def test_ntk_raises_the_base_by_s_to_the_d_over_d_minus_2(factor):
    new_base = BASE * factor ** (D_HEAD / (D_HEAD - 2))  # YaRN paper eq. 16
    theta = torch.tensor([new_base ** (-2 * i / D_HEAD) for i in range(D_HEAD // 2)], dtype=torch.float64)
    torch.testing.assert_close(angles(rope("ntk", factor), 1), theta, rtol=1e-6, atol=0)
    # the highest frequency is kept, the lowest divided by exactly s^(d/(d-2) * (d-2)/d) = s
    plain = angles(rope(), 1)
    assert angles(rope("ntk", factor), 1)[0] == plain[0]
    torch.testing.assert_close(angles(rope("ntk", factor), 1)[-1], plain[-1] / factor, rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------------- YaRN

def paper_ramp(d: int, alpha: float, beta: float, context: int = L) -> float:
    """gamma(r(d)), r(d) = L / lambda_d, lambda_d = 2 pi b^(2d/|D|): 0 below alpha, 1 above beta, linear between."""
    r = context / (2 * math.pi * BASE ** (2 * d / D_HEAD))
    return 0.0 if r < alpha else 1.0 if r > beta else (r - alpha) / (beta - alpha)


def test_yarn_paper_ramp_at_hand_computed_points():
    # d_head 8, base 10^4: lambda_d = 2 pi 10^d, so at L = 256, r = 40.74, 4.074, 0.4074, 0.04074;
    # alpha 1, beta 32: gamma = 1 (r > beta), 3.07437/31 = 0.099173, 0, 0 (r < alpha).
    ramp = yarn_ramp(D_HEAD, BASE, L, 1.0, 32.0, "paper")
    torch.testing.assert_close(ramp, torch.tensor([1.0, 0.099173, 0.0, 0.0], dtype=torch.float64), rtol=0, atol=1e-6)
    for alpha, beta, context in ((1.0, 32.0, 256), (0.5, 8.0, 64), (2.0, 100.0, 4096)):
        expected = torch.tensor([paper_ramp(d, alpha, beta, context) for d in range(D_HEAD // 2)], dtype=torch.float64)
        torch.testing.assert_close(yarn_ramp(D_HEAD, BASE, context, alpha, beta, "paper"), expected, rtol=1e-12,
                                   atol=1e-12)


def test_yarn_reference_ramp_at_hand_computed_points():
    """The reference ramp (jquesnelle/yarn, transformers): the pair index where a pair turns n times over L is
    d(n) = D ln(L / (2 pi n)) / (2 ln b). At d_head 8, L 256: d(32) = 8 ln(1.2732) / 18.421 = 0.1049 -> floor 0;
    d(1) = 8 ln(40.744) / 18.421 = 1.6101 -> ceil 2; gamma = 1 - clamp(d / 2): 1, 0.5, 0, 0 (the paper's: 1, 0.099,
    0, 0). At context_extension's setting (d_head 16, L 64): d(32) = -0.994 -> 0, d(1) = 2.016 -> 3, so 1, 2/3, 1/3,
    then 0: the fastest pair is kept, where the paper's ramp (gamma 0.296) interpolates it 2.1x."""
    torch.testing.assert_close(yarn_ramp(D_HEAD, BASE, L, 1.0, 32.0),
                               torch.tensor([1.0, 0.5, 0.0, 0.0], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(yarn_ramp(16, BASE, 64, 1.0, 32.0),
                               torch.tensor([1.0, 2 / 3, 1 / 3] + [0.0] * 5, dtype=torch.float64), rtol=0, atol=1e-12)
    assert abs(float(yarn_ramp(16, BASE, 64, 1.0, 32.0, "paper")[0]) - (64 / (2 * math.pi) - 1) / 31) < 1e-12
    # where both bounds round to the same pair (L 4 < 2 pi: d(1) = -0.098 -> 0, as d(32) -> 0), the ramp is a step
    # there (the references nudge the upper bound by 0.001)
    torch.testing.assert_close(yarn_ramp(4, BASE, 4, 1.0, 32.0), torch.tensor([1.0, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("factor", [2.0, 4.0, 16.0])
def test_yarn_paper_frequencies_are_the_paper_h_of_theta(factor):
    expected = []
    for d in range(D_HEAD // 2):
        theta, gamma = BASE ** (-2 * d / D_HEAD), paper_ramp(d, 1.0, 32.0)
        expected.append((1 - gamma) * theta / factor + gamma * theta)  # h(theta_d), §3.2
    torch.testing.assert_close(angles(rope("yarn", factor, yarn_ramp="paper"), 1),
                               torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("factor", [2.0, 4.0, 16.0])
def test_yarn_temperature_scales_every_logit_by_one_over_t(factor):
    root = 0.1 * math.log(factor) + 1  # sqrt(1/t), eq. 22; at s = 4: 1.1386294
    if factor == 4.0:
        assert abs(root - 1.1386294) < 1e-7
    torch.testing.assert_close(magnitude(rope("yarn", factor)), torch.full((D_HEAD // 2,), root, dtype=torch.float64),
                               rtol=1e-6, atol=0)
    q, k = torch.randn(2, 1, 1, 5, D_HEAD, dtype=torch.float64)
    same = torch.zeros(1, 5, dtype=torch.long) + 9  # one position: the rotation cancels, the temperature stays
    rq, rk = rope("yarn", factor).rotate(q, k, same)
    # the rotation is built in float32 (as for every RoPE model here), so equal to float32's precision
    torch.testing.assert_close((rq * rk).sum(-1), root ** 2 * (q * k).sum(-1), rtol=1e-6, atol=1e-6)
    assert rope("yarn", factor).logit_scale == pytest.approx(root ** 2)


# ------------------------------------------------------------------------------------- decoding and errors

@pytest.mark.parametrize("pos,method", [("rope", m) for m in METHODS] + [("learned", "pi")])
def test_cached_decoding_gives_the_logits_of_recomputation(pos, method):
    options = {"scaling": method, "scaling_factor": 4.0}
    model = model_with(pos, **(options if pos == "learned" else {**options, "original_context": 16}))
    idx = torch.randint(0, 20, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache()
        steps = [model(idx[:, :9], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(9, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("pos,options,needle", [
    ("rope", {"scaling": "pi", "scaling_factor": 0.5}, "pos.scaling_factor=0.5 must be a finite number >= 1"),
    ("rope", {"scaling": "ntk", "scaling_factor": float("inf")}, "must be a finite number >= 1"),
    ("rope", {"scaling": "ntk", "scaling_factor": 1e308}, "pos.scaling_factor=1e+308 must be a finite number >= 1 and "
                                                          "at most 1,000,000"),  # NTK's base overflowed
    ("rope", {"scaling": "yarn", "scaling_factor": 2.0, "original_context": None}, "pos.original_context=None"),
    ("rope", {"scaling": "yarn", "scaling_factor": 2.0, "original_context": 64, "yarn_alpha": 32.0},
     "0 <= alpha < beta"),
    ("rope", {"scaling": "yarn", "scaling_factor": 2.0, "original_context": 64, "yarn_alpha": 0.0},
     "pos.yarn_alpha=0: the reference ramp"),
    ("rope", {"scaling": "yarn", "scaling_factor": 2.0, "original_context": 64, "yarn_ramp": "linear"},
     "pos.yarn_ramp='linear' is unknown"),
    ("rope", {"scaling": "llama3", "scaling_factor": 2.0, "original_context": 64, "llama3_high_freq_factor": 0.5},
     "0 < low < high"),
    ("rope", {"scaling": "llama3", "scaling_factor": 2.0}, "pos.original_context=None must be a positive integer for "
     "pos.scaling=llama3"),
    ("rope", {"scaling": "linear"}, "pos.scaling='linear' is unknown"),
    ("alibi", {"scaling": "pi", "scaling_factor": 2.0}, "pos=alibi does not have"),
    ("fire", {"scaling": "yarn", "scaling_factor": 2.0}, "pos=fire does not have"),
    ("learned", {"scaling": "ntk", "scaling_factor": 2.0}, "pos=learned does not have"),
])
def test_bad_scaling_is_one_line_naming_the_key(pos, options, needle):
    cfg = dataclasses.replace(tiny_cfg(pos), pos=PosConfig(pos, options=options))
    errors = cfg.errors()
    assert len(errors) == 1 and needle in errors[0], errors
    assert "\n" not in errors[0]
