"""Norm layers and the residual placements around a sublayer: each computes the formula it claims."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blocklab.model import ModelConfig, Transformer
from blocklab.model.block import Residual
from blocklab.model.config import InitConfig, NormConfig, PosConfig
from blocklab.model.norm import PLACEMENTS, build_norm, deepnorm_alpha, deepnorm_beta

D = 16
EPS = 1e-5


def sample(shape=(4, 7, D), seed=0):
    g = torch.Generator().manual_seed(seed)
    return 3.0 * torch.randn(*shape, generator=g, dtype=torch.float64) + 1.5


# ---------------------------------------------------------------------------------- statistics

def test_layernorm_rows_have_mean_zero_and_unit_variance():
    x = sample()
    y = build_norm("layernorm", D).double()(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(4, 7, dtype=torch.float64), rtol=0, atol=1e-10)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(4, 7, dtype=torch.float64), rtol=0, atol=1e-4)


def test_rmsnorm_rows_have_unit_rms_and_keep_the_mean():
    x = sample()
    y = build_norm("rmsnorm", D).double()(x)
    rms = y.square().mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(4, 7, dtype=torch.float64), rtol=0, atol=1e-4)
    # RMSNorm only rescales: y is x / rms(x), not re-centred
    torch.testing.assert_close(y, x / x.square().mean(-1, keepdim=True).add(EPS).sqrt(), rtol=1e-10, atol=1e-10)
    assert y.mean(-1).mean() > 0.2  # inputs have mean 1.5, std 3: outputs keep a positive mean


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "deepnorm"])
def test_none_norm_leaves_no_norm_anywhere(placement):
    """norm.type=none: every block computes x + f(x) (alpha x + f(x) for deepnorm), no norm module anywhere."""
    assert build_norm("none", D) is None
    model = Transformer(small_cfg(placement, norm_type="none", n_layers=1)).double()
    assert not any(isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for m in model.modules())
    res = model.blocks[0].ffn_residual
    x = sample().reshape(2, -1, D)[:, :4]
    alpha = PLACEMENTS[placement].alpha(1)
    torch.testing.assert_close(res(x), alpha * x + res.sublayer(x), rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------------- placements

def layer_norm(x, norm):
    """LayerNorm written out, with the module's affine parameters."""
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).square().mean(-1, keepdim=True)
    return (x - mean) / (var + EPS).sqrt() * norm.weight + norm.bias


def make_residual(placement, residual=True, alpha=1.0, seed=0):
    torch.manual_seed(seed)
    f = nn.Linear(D, D)
    res = Residual(f, PLACEMENTS[placement], "layernorm", D, EPS, True, 0.0, residual=residual, alpha=alpha).double()
    # random affine parameters, so that the two norms of a sandwich are told apart
    with torch.no_grad():
        for m in res.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.5)
                m.bias.normal_(0.0, 0.5)
    return res, res.sublayer


def layernorms(module):
    return [m for name, m in module.named_modules() if isinstance(m, nn.LayerNorm)]


@pytest.mark.parametrize("alpha", [1.0, 2.0])
@pytest.mark.parametrize("residual", [True, False])
def test_pre_norm(residual, alpha):
    res, f = make_residual("pre", residual, alpha)
    assert len(layernorms(res)) == 1
    x = sample()
    branch = f(layer_norm(x, res.norm_in))
    torch.testing.assert_close(res(x), alpha * x + branch if residual else branch, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("residual", [True, False])
def test_post_norm(residual):
    res, f = make_residual("post", residual)
    assert len(layernorms(res)) == 1
    x = sample()
    expected = layer_norm(x + f(x) if residual else f(x), res.norm_out)
    torch.testing.assert_close(res(x), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("residual", [True, False])
def test_sandwich_norm(residual):
    res, f = make_residual("sandwich", residual)
    assert len(layernorms(res)) == 2
    x = sample()
    branch = layer_norm(f(layer_norm(x, res.norm_in)), res.norm_out)
    torch.testing.assert_close(res(x), x + branch if residual else branch, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("residual", [True, False])
def test_deepnorm(residual):
    alpha = deepnorm_alpha(6)
    res, f = make_residual("deepnorm", residual, alpha=alpha)
    assert len(layernorms(res)) == 1
    x = sample()
    expected = layer_norm(alpha * x + f(x) if residual else f(x), res.norm_out)
    torch.testing.assert_close(res(x), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n_layers", [1, 2, 6, 24])
def test_deepnorm_constants(n_layers):
    cfg = ModelConfig(norm=NormConfig(placement="deepnorm"), n_layers=n_layers)
    assert cfg.residual_alpha == pytest.approx((2 * n_layers) ** 0.25, rel=1e-12)
    assert deepnorm_beta(n_layers) == pytest.approx((8 * n_layers) ** -0.25, rel=1e-12)
    for placement in ("pre", "post", "sandwich"):
        assert ModelConfig(norm=NormConfig(placement=placement), n_layers=n_layers).residual_alpha == 1.0


def small_cfg(placement="pre", norm_type="layernorm", n_layers=3, **kw):
    return ModelConfig(vocab_size=20, max_len=32, d_model=D, n_layers=n_layers, n_heads=4,
                       norm=NormConfig(type=norm_type, placement=placement), pos=PosConfig("rope"),
                       init=InitConfig("normal", 0.2), **kw)


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "deepnorm"])
def test_model_blocks_compute_their_placement(placement):
    """The FFN sublayer inside a built model follows the placement formula, alpha included."""
    torch.manual_seed(0)
    model = Transformer(small_cfg(placement, n_layers=3)).double()
    alpha = (2 * 3) ** 0.25 if placement == "deepnorm" else 1.0
    x = sample()
    block = model.blocks[1]
    ffn = block.ffn
    out = block.ffn_residual(x)

    def ln(t):
        return F.layer_norm(t, (D,), eps=EPS)  # affine parameters are 1 / 0 at init

    expected = {
        "pre": x + ffn(ln(x)),
        "post": ln(x + ffn(x)),
        "sandwich": x + ln(ffn(ln(x))),
        "deepnorm": ln(alpha * x + ffn(x)),
    }[placement]
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "deepnorm"])
def test_residual_false_drops_the_skip_in_the_model(placement):
    torch.manual_seed(0)
    model = Transformer(small_cfg(placement, residual=False)).double()
    x = sample()
    block = model.blocks[0]

    def ln(t):
        return F.layer_norm(t, (D,), eps=EPS)

    expected = {
        "pre": block.ffn(ln(x)),
        "post": ln(block.ffn(x)),
        "sandwich": ln(block.ffn(ln(x))),
        "deepnorm": ln(block.ffn(x)),
    }[placement]
    torch.testing.assert_close(block.ffn_residual(x), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm_type, cls", [("layernorm", nn.LayerNorm), ("rmsnorm", nn.RMSNorm)])
def test_norm_type_is_used_by_every_block(norm_type, cls):
    model = Transformer(small_cfg("sandwich", norm_type))
    # sandwich: two norms per sublayer, two sublayers per block, plus the final norm
    assert sum(isinstance(m, cls) for m in model.modules()) == 3 * 4 + 1
    assert not any(isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and not isinstance(m, cls) for m in model.modules())


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "deepnorm"])
def test_final_norm_only_for_pre_and_sandwich(placement):
    """logits = head(LN(last block output)) for pre/sandwich, head(last block output) for post/deepnorm."""
    torch.manual_seed(0)
    model = Transformer(small_cfg(placement)).double().eval()
    final = placement in ("pre", "sandwich")
    assert PLACEMENTS[placement].final_norm == final
    assert isinstance(model.final_norm, nn.LayerNorm) == final
    seen = {}
    model.blocks[-1].register_forward_hook(lambda m, args, out: seen.update(out=out))
    idx = torch.randint(0, 20, (2, 6))
    with torch.no_grad():
        logits = model(idx)
    h = seen["out"]
    if final:
        h = F.layer_norm(h, (D,), eps=EPS)
    torch.testing.assert_close(logits, h @ model.tok_emb.weight.T, rtol=1e-10, atol=1e-10)
