"""Norm-free residual stacks and affine-free norms: Fixup (init=fixup), ReZero (norm=rezero) and
norm.affine=false, each against its paper's statement, plus their config errors and end-to-end runs."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blocklab.model import ModelConfig, build_model
from blocklab.model.block import Residual
from blocklab.model.config import ActConfig, InitConfig, NormConfig, PosConfig
from blocklab.model.norm import build_norm, norm_name
from conftest import FAST, run_in_process
from helpers import assert_learned_and_changed, refused


def cfg(norm=NormConfig("none"), init="normal", n_layers=2, d_model=16, **kw):
    return ModelConfig(vocab_size=20, max_len=32, d_model=d_model, n_layers=n_layers, n_heads=2, norm=norm,
                       pos=PosConfig("rope"), init=InitConfig(init, 0.2), **kw)


def residuals(model):
    return [m for m in model.modules() if isinstance(m, Residual)]


def embeddings_through_head(model, idx):
    """The logits a stack whose every block is the identity gives (no final norm: norm-free)."""
    return model.tok_emb(idx) @ model.head.weight.T


# ------------------------------------------------------------------------------------------ Fixup

@pytest.mark.parametrize("arch, tie, branches_per_layer", [("decoder", True, 2), ("decoder", False, 2),
                                                           ("encoder_decoder", True, 5)])
def test_fixup_zeroes_every_branch_s_last_layer_and_an_untied_head(arch, tie, branches_per_layer):
    model = build_model(cfg(init="fixup", arch=arch, tie_embeddings=tie, n_layers=3))
    branches = residuals(model)
    assert len(branches) == branches_per_layer * 3  # encoder: attn + FFN; decoder: attn + cross + FFN
    for res in branches:
        assert torch.count_nonzero(res.sublayer.out_proj.weight) == 0
        assert res.gate is not None and res.gate.item() == 1.0  # rule 3's multiplier, learned from 1
    head_zero = torch.count_nonzero(model.head.weight) == 0
    assert head_zero == (not tie)  # a tied head is the embedding table, which must not be 0
    assert torch.count_nonzero(model.tok_emb.weight) > 0


@pytest.mark.parametrize("n_layers", [2, 8])
def test_fixup_scales_the_branches_inner_layers_by_L_to_the_minus_one_over_2m_minus_2(n_layers):
    """L = 2 n_layers branches; attention and an MLP have m = 2 layers (W_v or W_in, then the zeroed W_o or
    W_out): their first layer is Xavier normal times L^(-1/2). Queries and keys stay Xavier."""
    d = 128
    torch.manual_seed(0)
    model = build_model(cfg(init="fixup", n_layers=n_layers, d_model=d))
    scale = (2 * n_layers) ** -0.5
    for block in model.blocks:
        w_v, w_q = block.attn.projection("v")[0], block.attn.projection("q")[0]
        xavier_v = math.sqrt(2 / (w_v.shape[0] + w_v.shape[1]))
        assert w_v.std().item() == pytest.approx(xavier_v * scale, rel=0.05)
        assert w_q.std().item() == pytest.approx(xavier_v, rel=0.05)
        w_in = block.ffn.in_proj.weight
        assert w_in.std().item() == pytest.approx(math.sqrt(2 / sum(w_in.shape)) * scale, rel=0.05)


def test_fixup_scales_a_glu_s_gate_and_up_by_L_to_the_minus_one_quarter():
    """A GLU branch is act(x W_g) * (x W_u) then W_out: three layers in sequence (m = 3), so L^(-1/(2*3-2))."""
    torch.manual_seed(0)
    model = build_model(cfg(init="fixup", n_layers=4, d_model=128, act=ActConfig("swiglu")))
    w_in = model.blocks[0].ffn.in_proj.weight  # the gate and up halves, stacked
    assert w_in.std().item() == pytest.approx(math.sqrt(2 / sum(w_in.shape)) * 8 ** -0.25, rel=0.05)


def next_token_loss(model, idx):
    return F.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())


def test_fixup_starts_every_block_as_the_identity_and_still_learns():
    torch.manual_seed(0)
    model = build_model(cfg(init="fixup", n_layers=4)).double()
    idx = torch.randint(0, 20, (3, 9), generator=torch.Generator().manual_seed(1))
    logits = model(idx)
    torch.testing.assert_close(logits, embeddings_through_head(model, idx), rtol=1e-10, atol=1e-10)
    before = next_token_loss(model, idx)
    before.backward()
    for res in residuals(model):  # the zeroed last layers get a gradient at once (the rest is not zero)
        assert res.sublayer.out_proj.weight.grad.abs().sum() > 0
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # one small step: the loss falls, no block is the identity
    with torch.no_grad():
        assert next_token_loss(model, idx) < before
        assert all(torch.count_nonzero(res.sublayer.out_proj.weight) > 0 for res in residuals(model))


# ----------------------------------------------------------------------------------------- ReZero

def test_rezero_blocks_output_their_input_at_init():
    torch.manual_seed(0)
    model = build_model(cfg(NormConfig("none", "rezero"), n_layers=3)).double()
    assert not any(isinstance(m, (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm1d)) for m in model.modules())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    for res in residuals(model)[1::2]:  # the FFN sublayers: any input
        assert res.gate.item() == 0.0
        assert torch.equal(res(x), x)
        assert res.sublayer(x).abs().sum() > 0  # the branch itself is not zero: the gate holds it back
    idx = torch.randint(0, 20, (2, 7))
    torch.testing.assert_close(model(idx), embeddings_through_head(model, idx), rtol=0, atol=0)


def test_rezero_gate_learns_first_and_then_opens_the_branch():
    """At alpha = 0 only alpha gets a gradient (d/d alpha of x + alpha f(x) is f(x)); one step opens it."""
    torch.manual_seed(0)
    model = build_model(cfg(NormConfig("none", "rezero"))).double()
    idx = torch.randint(0, 20, (4, 8), generator=torch.Generator().manual_seed(1))
    loss = next_token_loss(model, idx)
    loss.backward()
    for res in residuals(model):
        assert res.gate.grad.abs() > 0
        assert all(p.grad is None or p.grad.abs().sum() == 0 for p in res.sublayer.parameters())
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.zero_grad()
    after = next_token_loss(model, idx)
    assert after < loss
    after.backward()  # the gates moved off 0: every branch now gets a gradient of its own
    for res in residuals(model):
        assert res.gate.item() != 0.0
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in res.sublayer.parameters())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    res = residuals(model)[-1]
    with torch.no_grad():
        res.gate.fill_(0.5)
    torch.testing.assert_close(res(x), x + 0.5 * res.sublayer(x), rtol=1e-12, atol=1e-12)


def test_rezero_has_one_gate_per_sublayer():
    model = build_model(cfg(NormConfig("none", "rezero"), n_layers=3))
    gates = [name for name, _ in model.named_parameters() if name.endswith(".gate")]
    assert len(gates) == 6


# ------------------------------------------------------------------------------------ affine-free

@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm", "batchnorm"])
def test_affine_free_norms_have_no_parameters(norm_type):
    assert list(build_norm(norm_type, 16, affine=False).parameters()) == []
    assert len(list(build_norm(norm_type, 16, affine=True).parameters())) > 0


@pytest.mark.parametrize("norm_type, per_norm", [("layernorm", 2 * 16), ("rmsnorm", 16)])
def test_an_affine_free_model_drops_exactly_the_norms_gain_and_shift(norm_type, per_norm):
    """Pre-norm: a norm per sublayer and a final one, (2 n_layers + 1) norms; LN's gain and shift, RMSNorm's gain."""
    with_affine = build_model(cfg(NormConfig(norm_type, "pre")))
    without = build_model(cfg(NormConfig(norm_type, "pre", affine=False)))
    assert with_affine.num_params() - without.num_params() == (2 * 2 + 1) * per_norm
    x = 3 * torch.randn(2, 5, 16) + 1
    norm = without.blocks[0].attn_residual.norm_in
    expected = F.layer_norm(x, (16,), eps=1e-5) if norm_type == "layernorm" else \
        x / x.square().mean(-1, keepdim=True).add(1e-5).sqrt()
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)


def test_every_variant_is_named_distinctly():
    names = [norm_name("layernorm", "pre"), norm_name("layernorm", "pre", affine=False),
             norm_name("rmsnorm", "pre", affine=False), norm_name("batchnorm", "pre"),
             norm_name("batchnorm", "pre", affine=False), norm_name("none", "pre"), norm_name("none", "rezero")]
    assert names == ["pre_ln", "pre_ln_noaffine", "pre_rms_noaffine", "pre_bn", "pre_bn_noaffine", "none", "rezero"]


# --------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("norm, init, message", [
    (NormConfig("layernorm", "rezero"), "normal",
     "norm.placement=rezero places no norm, so norm.type=layernorm would be unused; use norm.type=none (norm=rezero)"),
    (NormConfig("none", "rezero"), "fixup",
     "init=fixup zeroes every branch's last layer and norm.placement=rezero starts every branch's gate at 0, so "
     "neither gets a gradient and no branch ever learns; use init=normal with norm.placement=rezero"),
    (NormConfig("none", "rezero"), "zero_branch", "init=zero_branch zeroes every branch's last layer"),
])
def test_combinations_that_cannot_work_are_one_line(norm, init, message):
    errors = cfg(norm, init).errors()
    assert len(errors) == 1 and errors[0].startswith(message)


def test_a_bad_combination_stops_the_command_before_any_file(run_dir):
    with refused("init=zero_branch zeroes", run_dir) as err:
        run_in_process([*FAST, "norm=rezero", "init=zero_branch"], run_dir)
    assert str(err.value).startswith("init=zero_branch zeroes")


# --------------------------------------------------------------------------------------- end to end

@pytest.mark.parametrize("overrides, name", [
    (["norm=none", "init=fixup"], "none"),
    (["norm=rezero"], "rezero"),
    (["norm.affine=false"], "pre_ln_noaffine"),
    (["norm=pre_rms", "norm.affine=false"], "pre_rms_noaffine"),
])
def test_each_option_trains_end_to_end_and_is_named_in_results(overrides, name, run_dir, default_run):
    run_in_process([*FAST, *overrides], run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    assert_learned_and_changed(results, default_run)
    assert results["choices"]["norm"] == name
