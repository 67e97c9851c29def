"""DyT (norm.type=dyt) against its authors' code: jiachenzhu/DyT, dynamic_tanh.py (MIT), whose `DynamicTanh` is
written out below for channels-last inputs, as the oracle."""
import pytest
import torch
from torch import nn

from blocklab.model.config import ModelConfig
from blocklab.model.norm import build_norm
from blocklab.model.transformer import build_model


class ReferenceDynamicTanh(nn.Module):
    """jiachenzhu/DyT dynamic_tanh.py, DynamicTanh with channels_last=True."""

    def __init__(self, normalized_shape, alpha_init_value=0.5):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1) * alpha_init_value)
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))

    def forward(self, x):
        x = torch.tanh(self.alpha * x)
        return x * self.weight + self.bias


@pytest.mark.parametrize("alpha_init", [0.5, 0.05, 2.0])
def test_dyt_matches_the_reference_with_the_same_parameters(alpha_init):
    ours = build_norm("dyt", 8, alpha_init=alpha_init)
    reference = ReferenceDynamicTanh(8, alpha_init)
    torch.testing.assert_close(ours.alpha, reference.alpha)  # the same start
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (reference.weight, reference.bias):
            p.copy_(torch.randn(p.shape, generator=g))
        ours.weight.copy_(reference.weight)
        ours.bias.copy_(reference.bias)
    x = 3 * torch.randn(2, 5, 8, generator=g)
    torch.testing.assert_close(ours(x), reference(x), rtol=0, atol=0)


def test_dyt_by_hand():
    """alpha 0.5, gain 2, shift 1: x = 2 gives 2 tanh(1) + 1 = 2.523188..."""
    norm = build_norm("dyt", 1)
    with torch.no_grad():
        norm.weight.fill_(2.0)
        norm.bias.fill_(1.0)
    assert norm(torch.tensor([[2.0]])).item() == pytest.approx(2 * 0.7615941559557649 + 1)


def test_without_affine_or_bias_dyt_keeps_only_alpha():
    assert [n for n, _ in build_norm("dyt", 4, affine=False).named_parameters()] == ["alpha"]
    assert [n for n, _ in build_norm("dyt", 4, bias=False).named_parameters()] == ["alpha", "weight"]


def groups(**norm) -> dict:
    return {"model": {}, "norm": norm, "act": {}, "init": {}, "attn": {}, "pos": {"name": "rope"}}


def test_every_norm_of_the_stack_is_dyt_with_the_configured_start():
    cfg = ModelConfig.from_groups(groups(type="dyt", alpha_init=0.2), vocab_size=16, max_len=32)
    assert cfg.errors() == []
    model = build_model(cfg)
    norms = [m for m in model.modules() if type(m).__name__ == "DynamicTanh"]
    assert len(norms) == 2 * cfg.n_layers + 1  # each sublayer's input, and the final norm of the pre-LN stack
    assert all(m.alpha.item() == pytest.approx(0.2) for m in norms)
    assert not any(isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for m in model.modules())


def test_an_option_the_norm_type_does_not_take_is_one_line():
    errors = ModelConfig.from_groups(groups(type="layernorm", alpha_init=0.5), vocab_size=16, max_len=32).errors()
    assert len(errors) == 1 and errors[0].startswith("norm.alpha_init is not a key of norm")
    wrong = ModelConfig.from_groups(groups(type="dyt", alpha_init="big"), vocab_size=16, max_len=32).errors()
    assert len(wrong) == 1 and "norm.alpha_init" in wrong[0]
