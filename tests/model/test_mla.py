"""Multi-head latent attention (attn.kind=mla) against DeepSeek-V2's equations (§2.1.2-2.1.3), written out here
head by head, and against transformers' DeepseekV2Attention (transformers 5.24.0, pinned in pyproject's dev extra) on
shared weights: causality, cached decoding = recomputation, the absorbed decode form = the explicit form, a cache of
(kv_rank + rope_dim) numbers per token and layer, and an even rotated width at every head dimension."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from blocklab.model import build_model
from blocklab.model.config import PosConfig
from blocklab.model.mla import MultiHeadLatentAttention
from blocklab.model.position import RoPE

from helpers import assert_cached_steps_equal_full, tokens
from variants import tiny_cfg  # noqa: E402

H, D_MODEL = 4, 32
D_H = D_MODEL // H


def mla_model(pos="rope", kv_rank=12, rope_dim=4, seed=0, pos_options=None, latent_norm=True, **fields):
    cfg = tiny_cfg(pos, kind="mla", options={"kv_rank": kv_rank, "rope_dim": rope_dim, "latent_norm": latent_norm},
                   max_len=128, **fields)
    if pos_options:
        cfg = dataclasses.replace(cfg, pos=PosConfig(pos, options=pos_options))
        assert cfg.errors() == []
    torch.manual_seed(seed)
    return build_model(cfg).double().eval()


def paper_layer(attn: MultiHeadLatentAttention, h: torch.Tensor, rope: RoPE) -> torch.Tensor:
    """Eqs. 9-18 for one causal sequence h (T, d_model), head by head, from the layer's weights."""
    w_q, w_kr, w_dkv = attn.qkv_proj.weight.split(attn.qkv_sizes)
    b_q, b_kr, b_dkv = attn.qkv_proj.bias.split(attn.qkv_sizes)
    w_uk, w_uv = attn.up_proj.weight.view(2, H, D_H, attn.kv_rank)
    c_kv = h @ w_dkv.T + b_dkv  # eq. 9
    if attn.latent_norm is not None:  # the released model's kv_a_layernorm: c / rms(c) times a gain
        gain, eps = attn.latent_norm.weight, attn.latent_norm.eps
        c_kv = gain * c_kv / torch.sqrt(c_kv.pow(2).mean(-1, keepdim=True) + eps)
    positions = torch.arange(h.shape[0])[None]
    k_r = h @ w_kr.T + b_kr  # eq. 15, before RoPE: one for all heads
    q_r_all = (h @ attn.q_rope_proj.weight.T + attn.q_rope_proj.bias).view(-1, H, attn.rope_dim)
    outputs = []
    for i in range(H):
        q_c = h @ w_q[i * D_H:(i + 1) * D_H].T + b_q[i * D_H:(i + 1) * D_H]
        k_c, v_c = c_kv @ w_uk[i].T, c_kv @ w_uv[i].T  # eqs. 10-11
        q_r, k_rot = rope.rotate(q_r_all[None, None, :, i], k_r[None, None], positions)  # eqs. 14-15
        q = torch.cat((q_c, q_r[0, 0]), -1)
        k = torch.cat((k_c, k_rot[0, 0]), -1)
        scores = q @ k.T / math.sqrt(D_H + attn.rope_dim)  # eq. 17
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        outputs.append(scores.softmax(-1) @ v_c)
    return torch.cat(outputs, -1) @ attn.out_proj.weight.T + attn.out_proj.bias  # eq. 18


@pytest.mark.parametrize("latent_norm", [True, False])
def test_the_layer_is_the_papers_equations(latent_norm):
    model = mla_model(latent_norm=latent_norm)
    attn = model.blocks[0].attn
    assert (attn.latent_norm is not None) == latent_norm
    if latent_norm:
        with torch.no_grad():  # a gain other than its initial ones, so that the gain is checked too
            attn.latent_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    h = torch.randn(1, 10, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ctx = SimpleNamespace(positions=torch.arange(10)[None], position_scheme=model.pos, mask=None, is_causal=True,
                          cache=None, need_weights=False)
    with torch.no_grad():
        ours = attn(h, ctx)
        rope = RoPE(D_MODEL, H, attn.rope_dim)  # RoPE over the decoupled dimensions only
        expected = paper_layer(attn, h[0], rope)
    torch.testing.assert_close(ours[0], expected, rtol=1e-10, atol=1e-10)


def test_absorbed_form_equals_explicit_form():
    model = mla_model(kv_rank=6, rope_dim=2)
    attn = model.blocks[1].attn
    g = torch.Generator().manual_seed(3)
    q_c = torch.randn(2, H, 7, D_H, dtype=torch.float64, generator=g)
    q_r = torch.randn(2, H, 7, 2, dtype=torch.float64, generator=g)
    latent = torch.randn(2, 1, 11, 6, dtype=torch.float64, generator=g)
    k_r = torch.randn(2, 1, 11, 2, dtype=torch.float64, generator=g)
    mask = torch.randn(2, 1, 7, 11, dtype=torch.float64, generator=g)  # a bias and padding read the same
    for ctx in (SimpleNamespace(mask=None, is_causal=False, need_weights=False),
                SimpleNamespace(mask=mask, is_causal=False, need_weights=False)):
        with torch.no_grad():
            explicit = attn.explicit_form(q_c, q_r, latent, k_r, ctx)
            absorbed = attn.absorbed(q_c, q_r, latent, k_r, ctx)
        torch.testing.assert_close(absorbed, explicit, rtol=1e-10, atol=1e-10)
        assert explicit.abs().max() > 1e-3  # not trivially zero


def test_causal_no_output_sees_a_later_token():
    model = mla_model()
    idx = tokens((2, 16))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 20
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.equal(a[:, :9], b[:, :9])
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-6


@pytest.mark.parametrize("pos,options", [("rope", None), ("alibi", None), ("none", None),
                                         ("rope", {"scaling": "yarn", "scaling_factor": 4.0, "original_context": 8}),
                                         ("rope", {"scaling": "pi", "scaling_factor": 2.0})])
def test_cached_decoding_equals_recomputation(pos, options):
    model = mla_model(pos, pos_options=options)
    assert_cached_steps_equal_full(model, tokens((2, 24)), prefix=6, then=3, tol=1e-9)


def test_cache_holds_the_latent_and_the_rope_key_only():
    kv_rank, rope_dim = 12, 4
    model = mla_model(kv_rank=kv_rank, rope_dim=rope_dim).float()
    layers = len(model.blocks)
    assert model.cache_bytes_per_token() == (kv_rank + rope_dim) * 4 * layers  # float32: 4 bytes
    assert model.double().cache_bytes_per_token() == (kv_rank + rope_dim) * 8 * layers
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens((3, 10)), cache=cache)
        model(tokens((3, 1)), cache=cache)
    assert cache.bytes() == 3 * 11 * (kv_rank + rope_dim) * 8 * layers  # 3 sequences of 11 tokens, float64
    # ...less than MHA's 2 d_model numbers per token and layer
    assert kv_rank + rope_dim < 2 * D_MODEL


def test_hot_path_is_scaled_dot_product_attention(monkeypatch):
    model = mla_model()
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        model(tokens((1, 8)))
        assert len(calls) == len(model.blocks)
        cache = model.new_cache()
        model(tokens((1, 8)), cache=cache)
        model(tokens((1, 1)), cache=cache)
    assert len(calls) == 3 * len(model.blocks)


def test_training_saves_no_length_by_length_tensor():
    """Queries and keys are d_h + d_R wide, values d_h: unequal widths send SDPA to its math path, which keeps the
    (T, T) weights for the backward. The layer pads the values so the fused kernel runs."""
    model = mla_model().float().train()
    length, shapes = 100, []  # no other dimension of the tiny model is 100

    def keep(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(tokens((1, length)))
    assert shapes and not any(shape[-2:] == (length, length) for shape in shapes), shapes


def test_mla_trains():
    model = mla_model().float().train()
    idx = tokens((4, 16))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    assert all(p.grad is not None for p in model.blocks[0].attn.parameters())


@pytest.mark.parametrize("options,fields,needle", [
    ({"rope_dim": 3}, {}, "attn.rope_dim=3 must be even"),
    ({"kv_rank": 0}, {}, "attn.kv_rank=0 must be a positive integer"),
    ({"latent_norm": "yes"}, {}, "attn.latent_norm='yes' must be"),
    ({}, {"n_kv_heads": 2}, "attn.n_kv_heads=2: attn.kind=mla"),
    ({}, {"qk_norm": True}, "attn.qk_norm and attn.short_conv"),
])
def test_bad_options_are_one_line(options, fields, needle):
    cfg = tiny_cfg("rope", kind="mla")
    cfg = dataclasses.replace(cfg, attn=dataclasses.replace(cfg.attn, options=options, **fields))
    errors = cfg.errors()
    assert len(errors) == 1 and needle in errors[0], errors


def test_the_per_head_score_bound_is_not_claimed_for_a_latent():
    """The pre-norm bound reads W_Q,h and W_K,h; MLA has no W_K,h (keys come from the latent), so none is given."""
    from blocklab.analysis.probe import prenorm_score_bounds

    model = mla_model()
    assert prenorm_score_bounds(model, model.blocks[0]) is None
    assert prenorm_score_bounds(build_model(tiny_cfg("rope")), build_model(tiny_cfg("rope")).blocks[0]) is not None


# ----------------------------------------------------------------------------- transformers as the oracle

def deepseek_v2_attention(attn: MultiHeadLatentAttention, pos_options: dict):
    """transformers 5.24.0's DeepseekV2Attention (DeepSeek-V2-Lite's layout: q_lora_rank None, no biases) and its
    rotary embedding, holding `attn`'s weights: q_proj = per head [W_Q,i; W_QR,i], kv_a_proj_with_mqa = [W_DKV; W_KR],
    kv_a_layernorm = the latent norm, kv_b_proj = per head [W_UK,i; W_UV,i], o_proj = W_O."""
    transformers = pytest.importorskip("transformers", reason="the oracle: pip install -e '.[dev]'")
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

    assert transformers.__version__ == "5.24.0", "written against transformers 5.24.0's DeepseekV2Attention"
    rope_parameters, longest = {"rope_type": "default", "rope_theta": 10000.0}, 128
    if pos_options.get("scaling") == "yarn":
        longest = int(pos_options["scaling_factor"] * pos_options["original_context"])  # mscale = mscale_all_dim = 1: the temperature on every logit, eq. 22
        rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": pos_options["scaling_factor"],
                           "original_max_position_embeddings": pos_options["original_context"],
                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    config = hf.DeepseekV2Config(hidden_size=D_MODEL, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=None,
                                 kv_lora_rank=attn.kv_rank, qk_rope_head_dim=attn.rope_dim, qk_nope_head_dim=D_H,
                                 v_head_dim=D_H, attention_bias=False, max_position_embeddings=longest,
                                 rope_parameters=rope_parameters)
    config._attn_implementation = "eager"
    layer, rotary = hf.DeepseekV2Attention(config, layer_idx=0), hf.DeepseekV2RotaryEmbedding(config)
    w_q, w_kr, w_dkv = attn.qkv_proj.weight.split(attn.qkv_sizes)
    w_qr = attn.q_rope_proj.weight
    w_uk, w_uv = attn.up_proj.weight.view(2, H, D_H, attn.kv_rank)
    with torch.no_grad():
        layer.q_proj.weight.copy_(torch.cat((w_q.view(H, D_H, -1), w_qr.view(H, attn.rope_dim, -1)), 1).flatten(0, 1))
        layer.kv_a_proj_with_mqa.weight.copy_(torch.cat((w_dkv, w_kr)))
        layer.kv_a_layernorm.weight.copy_(attn.latent_norm.weight)
        layer.kv_b_proj.weight.copy_(torch.cat((w_uk, w_uv), 1).flatten(0, 1))
        layer.o_proj.weight.copy_(attn.out_proj.weight)
    return layer.eval(), rotary


@pytest.mark.parametrize("pos_options", [{}, {"scaling": "yarn", "scaling_factor": 4.0, "original_context": 8}])
def test_the_layer_is_transformers_deepseek_v2_attention(pos_options):
    """Shared weights, float32 (transformers' RMSNorm and rotary run in float32): the same outputs to float
    precision, without and with YaRN (reference ramp and temperature; DeepSeek's mscale_all_dim puts the
    temperature on every logit, as the layer does)."""
    cfg = tiny_cfg("rope", kind="mla", options={"kv_rank": 12, "rope_dim": 4}, max_len=128, bias=False)
    if pos_options:
        cfg = dataclasses.replace(cfg, pos=PosConfig("rope", options=pos_options))
        assert cfg.errors() == []
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.latent_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    layer, rotary = deepseek_v2_attention(attn, pos_options)
    length = 20  # past the trained context 8 under YaRN
    h = torch.randn(2, length, D_MODEL, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length)[None]
    ctx = SimpleNamespace(positions=positions, position_scheme=model.pos, mask=None, is_causal=True, cache=None,
                          need_weights=False)
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ours = attn(h, ctx)
        theirs, _ = layer(h, attention_mask=causal, position_embeddings=rotary(h, positions))
    assert ours.abs().max() > 1e-2
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ every head dimension

@pytest.mark.parametrize("d_model,n_heads", [(8, 2), (12, 2), (20, 2), (28, 2), (6, 2), (10, 2), (3, 1), (16, 8)])
@pytest.mark.parametrize("scaling", ["none", "ntk", "yarn", "pi", "llama3"])
def test_every_head_dimension_runs_under_every_scaling(d_model, n_heads, scaling):
    """The derived rope_dim is even and at least 2 for every d_head (d_head 6, 10, 14 gave an odd one, which crashed
    at run time; d_head 4 gave 2, where NTK's s^(d/(d-2)) divided by zero): validation accepts the config, or refuses
    it in one line before any work, and an accepted one runs."""
    d_head = d_model // n_heads
    options = {"scaling": scaling, "scaling_factor": 4.0, "original_context": 8}
    cfg = tiny_cfg("none", kind="mla", max_len=64, std=None)
    cfg = dataclasses.replace(cfg, d_model=d_model, n_heads=n_heads, d_ff=4 * d_model,
                              pos=PosConfig("rope", options=options))
    rope_dim = MultiHeadLatentAttention.derived_options(cfg)["rope_dim"]
    assert rope_dim % 2 == 0 and rope_dim >= 2 and rope_dim <= max(2, d_head // 2)
    errors = cfg.errors()
    if scaling == "ntk" and rope_dim == 2:
        assert len(errors) == 1 and "undefined for a rotated width d of 2" in errors[0], errors
        return
    assert errors == []
    model = build_model(cfg).eval()
    with torch.no_grad():
        out = model(tokens((2, 12)))
    assert torch.isfinite(out).all()


def test_the_derived_rope_dim_is_the_papers_half_where_it_is_even():
    from blocklab.model.mla import derived_rope_dim

    assert [derived_rope_dim(d) for d in (1, 2, 3, 4, 6, 8, 10, 14, 16, 128)] == [2, 2, 2, 2, 2, 4, 4, 6, 8, 64]

