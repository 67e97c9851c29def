"""FFN variants (parameter matching, each activation's formula) and the init schemes' weight scales."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blocklab.model import ModelConfig, Transformer
from blocklab.model.config import ActConfig, InitConfig, NormConfig, PosConfig
from blocklab.model.ffn import FFN

PLAIN = ["relu", "gelu", "silu", "relu2"]
GATED = ["glu", "swiglu", "geglu", "reglu"]


# ------------------------------------------------------------------------------ parameter counts

def n_params(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("act", GATED)
def test_gated_ffn_matches_plain_mlp_parameters(act):
    d, d_ff = 64, 258  # 258 = 3 * 86: 2/3 d_ff is a whole number
    plain = 2 * d * d_ff
    for other in PLAIN:
        assert n_params(FFN(d, d_ff, other, match_params=True, bias=False)) == plain
        assert n_params(FFN(d, d_ff, other, match_params=False, bias=False)) == plain
    assert n_params(FFN(d, d_ff, act, match_params=True, bias=False)) == plain
    assert n_params(FFN(d, d_ff, act, match_params=False, bias=False)) == 3 * d * d_ff == 1.5 * plain


@pytest.mark.parametrize("act", GATED)
def test_gated_model_has_the_plain_models_parameter_count(act):
    def count(name, match):
        cfg = ModelConfig(vocab_size=10, d_model=64, d_ff=258, n_layers=2, n_heads=4, bias=False,
                          act=ActConfig(name, match_params=match))
        assert cfg.errors() == []
        return Transformer(cfg).num_params()

    assert count(act, True) == count("gelu", True)
    assert count(act, False) - count("gelu", True) == 2 * (64 * 258)  # one more d x d_ff matrix per layer


# ------------------------------------------------------------------------------------ formulas

def gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def sigmoid(x):
    return 1 / (1 + torch.exp(-x))


FORMULAS = {
    "relu": lambda h: h.clamp(min=0),
    "gelu": gelu,
    "silu": lambda h: h * sigmoid(h),
    "relu2": lambda h: h.clamp(min=0) ** 2,
    # gated: (x W_gate, x W_up) -> act(x W_gate) * (x W_up)
    "glu": lambda g, u: sigmoid(g) * u,
    "swiglu": lambda g, u: g * sigmoid(g) * u,
    "geglu": lambda g, u: gelu(g) * u,
    "reglu": lambda g, u: g.clamp(min=0) * u,
}


@pytest.mark.parametrize("match_params", [True, False])
@pytest.mark.parametrize("act", PLAIN + GATED)
def test_ffn_computes_its_formula(act, match_params):
    torch.manual_seed(0)
    d, d_ff = 8, 12
    ffn = FFN(d, d_ff, act, match_params=match_params, bias=True).double()
    with torch.no_grad():
        for p in ffn.parameters():
            p.normal_()
    x = torch.randn(5, 3, d, dtype=torch.float64)
    w_in, b_in = ffn.in_proj.weight, ffn.in_proj.bias
    w_out, b_out = ffn.out_proj.weight, ffn.out_proj.bias
    if act in GATED:
        hidden = 8 if match_params else 12
        assert w_in.shape == (2 * hidden, d) and w_out.shape == (d, hidden)
        gate = x @ w_in[:hidden].T + b_in[:hidden]
        up = x @ w_in[hidden:].T + b_in[hidden:]
        h = FORMULAS[act](gate, up)
    else:
        assert w_in.shape == (d_ff, d) and w_out.shape == (d, d_ff)
        h = FORMULAS[act](x @ w_in.T + b_in)
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), h @ w_out.T + b_out, rtol=1e-10, atol=1e-10)


def test_relu2_is_squared_relu():
    from blocklab.model.ffn import relu2

    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 3.0])
    assert relu2(x).tolist() == [0.0, 0.0, 0.0, 0.25, 9.0]


# ------------------------------------------------------------------------------------ init

D, N = 128, 4
BETA = (8 * N) ** -0.25


def init_model(name, placement="pre", std=0.02):
    cfg = ModelConfig(vocab_size=64, max_len=32, d_model=D, n_layers=N, n_heads=4, bias=True,
                      norm=NormConfig(placement=placement), pos=PosConfig("rope"), init=InitConfig(name, std))
    assert cfg.errors() == []
    torch.manual_seed(0)
    return Transformer(cfg)


def xavier(weight):
    fan_out, fan_in = weight.shape
    return math.sqrt(2 / (fan_in + fan_out))


def matrices(block):
    """(weight, bias) of each matrix in the block, W_q, W_k and W_v as the rows of the stacked projection."""
    a, f = block.attn, block.ffn
    return {"q": a.projection("q"), "k": a.projection("k"), "v": a.projection("v"),
            **{key: (m.weight, m.bias) for key, m in (("attn_out", a.out_proj), ("ffn_in", f.in_proj),
                                                      ("ffn_out", f.out_proj))}}


def check_std(tensor, expected, what):
    std = float(tensor.detach().std())
    assert std == pytest.approx(expected, rel=0.1), f"{what}: std {std:.5f}, expected {expected:.5f}"


def check_biases_zero(model):
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and m.bias is not None:
            assert bool((m.bias == 0).all()), name


def check_layers(model, expected: dict):
    for i, block in enumerate(model.blocks):
        for key, (weight, _) in matrices(block).items():
            check_std(weight, expected[key](weight), f"layer {i} {key}")


def test_init_normal():
    model = init_model("normal")
    check_layers(model, {k: lambda l: 0.02 for k in ("q", "k", "v", "attn_out", "ffn_in", "ffn_out")})
    check_std(model.tok_emb.weight, 0.02, "tok_emb")
    check_biases_zero(model)


def test_init_normal_uses_the_configured_std():
    model = init_model("normal", std=0.05)
    check_layers(model, {k: lambda l: 0.05 for k in ("q", "k", "v", "attn_out", "ffn_in", "ffn_out")})


def test_init_gpt2_scales_residual_outputs():
    model = init_model("gpt2")
    scaled = 0.02 / math.sqrt(2 * N)
    check_layers(model, {"q": lambda l: 0.02, "k": lambda l: 0.02, "v": lambda l: 0.02, "ffn_in": lambda l: 0.02,
                         "attn_out": lambda l: scaled, "ffn_out": lambda l: scaled})
    check_std(model.tok_emb.weight, 0.02, "tok_emb")
    check_biases_zero(model)


def test_init_xavier():
    model = init_model("xavier")
    check_layers(model, {k: xavier for k in ("q", "k", "v", "attn_out", "ffn_in", "ffn_out")})
    # the matrices differ in shape, so the stds differ: q (128x128) vs ffn_in (512x128)
    assert xavier(model.blocks[0].attn.projection("q")[0]) == pytest.approx(math.sqrt(2 / 256))
    assert xavier(model.blocks[0].ffn.in_proj.weight) == pytest.approx(math.sqrt(2 / 640))
    check_biases_zero(model)


def test_init_small():
    model = init_model("small")
    std = math.sqrt(2 / (5 * D))
    check_layers(model, {k: lambda l: std for k in ("q", "k", "v", "attn_out", "ffn_in", "ffn_out")})
    check_std(model.tok_emb.weight, std, "tok_emb")
    check_biases_zero(model)


@pytest.mark.parametrize("placement", ["pre", "deepnorm"])
def test_init_deepnet(placement):
    """beta * xavier on values, attention output and FFN; gain 1 on queries and keys. Beta is applied
    once, also when the placement is deepnorm (which would otherwise scale by beta itself)."""
    model = init_model("deepnet", placement)
    check_layers(model, {"q": xavier, "k": xavier,
                         "v": lambda l: BETA * xavier(l), "attn_out": lambda l: BETA * xavier(l),
                         "ffn_in": lambda l: BETA * xavier(l), "ffn_out": lambda l: BETA * xavier(l)})
    check_biases_zero(model)


def test_deepnorm_placement_scales_normal_init_by_beta():
    model = init_model("normal", "deepnorm")
    check_layers(model, {"q": lambda l: 0.02, "k": lambda l: 0.02, "v": lambda l: 0.02 * BETA,
                         "attn_out": lambda l: 0.02 * BETA, "ffn_in": lambda l: 0.02 * BETA,
                         "ffn_out": lambda l: 0.02 * BETA})


def test_init_default_keeps_pytorch_defaults():
    model = init_model("default")
    # nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), std 1/sqrt(3 fan_in)
    check_layers(model, {k: (lambda w: 1 / math.sqrt(3 * w.shape[1]))
                         for k in ("q", "k", "v", "attn_out", "ffn_in", "ffn_out")})


def test_init_zero_branch_makes_every_block_the_identity():
    model = init_model("zero_branch").double().eval()
    for i, block in enumerate(model.blocks):
        for key in ("attn_out", "ffn_out"):
            weight, bias = matrices(block)[key]
            assert bool((weight == 0).all()) and bool((bias == 0).all()), f"layer {i} {key}"
        for key in ("q", "k", "v", "ffn_in"):
            check_std(matrices(block)[key][0], 0.02, f"layer {i} {key}")
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    idx = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        logits = model(idx)
    assert len(seen) == N
    for x, y in seen:
        assert torch.equal(x, y)
    # embeddings go straight to the head (through the final pre-LN norm; RoPE adds nothing to x)
    emb = model.tok_emb.weight
    expected = F.layer_norm(emb[idx], (D,), eps=1e-5) @ emb.T
    torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-10)
