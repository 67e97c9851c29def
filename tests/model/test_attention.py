"""Attention: causality, MHA/GQA/MQA grouping, the SDPA and explicit paths, scaling, padding."""
import math

import pytest
import torch
import torch.nn.functional as F

from blocklab.model import ModelConfig, Transformer
from blocklab.model.attention import SoftmaxAttention
from blocklab.model.config import AttnConfig
from helpers import masked_softmax, tokens
from variants import SCHEMES, VARIANTS, tiny_cfg, tiny_model

V, D, H, DH = 20, 32, 4, 8


def make_cfg(pos="rope", causal=True, n_layers=2, std=0.2, **attn):
    return tiny_cfg(pos, causal, n_layers, std, vocab_size=V, **attn)


make_model = tiny_model


def forward(model, idx, need_weights=False, **kw):
    with torch.no_grad():
        out = model(idx, need_weights=need_weights, **kw)
    return out[0] if need_weights else out


# ------------------------------------------------------------------------------------ causality

@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pos", SCHEMES)
def test_later_tokens_never_change_earlier_outputs(pos, variant, need_weights):
    model = make_model(pos, **VARIANTS[variant])
    idx = tokens((2, 10))
    base = forward(model, idx, need_weights)
    for t in (1, 2, 5, 9):
        changed = idx.clone()
        changed[:, t:] = (idx[:, t:] + 1 + tokens((2, 10 - t), seed=t) % (V - 1)) % V
        assert bool((changed[:, t:] != idx[:, t:]).all())
        out = forward(model, changed, need_weights)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert (out[:, t] - base[:, t]).abs().max() > 1e-4  # the changed position itself does change


@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pos", SCHEMES)
def test_non_causal_model_lets_later_tokens_change_earlier_outputs(pos, variant, need_weights):
    model = make_model(pos, causal=False, **VARIANTS[variant])
    idx = tokens((2, 10))
    changed = idx.clone()
    changed[:, -1] = (idx[:, -1] + 1) % V
    base, out = forward(model, idx, need_weights), forward(model, changed, need_weights)
    # The position just before the change is within every window and must see the new token.
    assert (out[:, -2] - base[:, -2]).abs().max() > 1e-4


# ----------------------------------------------------------------------------- MQA / GQA / MHA

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n_kv", [None, 4, 2, 1])
def test_attention_parameter_count(n_kv, bias):
    cfg = ModelConfig(vocab_size=V, d_model=D, n_heads=H, bias=bias, attn=AttnConfig(n_kv_heads=n_kv))
    attn = Transformer(cfg).blocks[0].attn
    kv = n_kv or H
    b = 1 if bias else 0
    expected = (D * D + b * D) + 2 * (D * kv * DH + b * kv * DH) + (D * D + b * D)
    assert sum(p.numel() for p in attn.parameters()) == expected


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_keys_and_values_have_kv_heads(variant):
    model = make_model("rope", n_layers=3, **VARIANTS[variant])
    kv = VARIANTS[variant].get("n_kv_heads") or H
    window = VARIANTS[variant].get("window") or 99
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens((2, 3)), positions=torch.arange(3).expand(2, 3), cache=cache)
        assert len(cache.keys) == len(cache.values) == 3
        for k, v in zip(cache.keys, cache.values):
            assert k.shape == v.shape == (2, kv, min(3, window), DH)
        model(tokens((2, 2)), cache=cache)
        for k, v in zip(cache.keys, cache.values):
            assert k.shape == v.shape == (2, kv, min(5, window), DH)


@pytest.mark.parametrize("batch", [1, 2])
def test_cache_continues_from_default_positions(batch):
    """A prompt run through the cache with default positions, then one more token: the same logits
    as the full sequence without a cache (documented default: positions continue from the cache)."""
    model = make_model("rope", n_kv_heads=2)
    idx = tokens((batch, 6))
    full = forward(model, idx)
    cache = model.new_cache()
    with torch.no_grad():
        first = model(idx[:, :5], cache=cache)
        step = model(idx[:, 5:], cache=cache)
    torch.testing.assert_close(first, full[:, :5], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(step, full[:, 5:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("pos", SCHEMES)
def test_mha_equals_gqa_with_as_many_kv_heads_as_heads(pos):
    mha = make_model(pos, n_kv_heads=None)
    gqa = make_model(pos, seed=5, n_kv_heads=H)
    gqa.load_state_dict(mha.state_dict())
    idx = tokens((2, 9))
    torch.testing.assert_close(forward(gqa, idx), forward(mha, idx), rtol=0, atol=1e-12)
    torch.testing.assert_close(forward(gqa, idx, True), forward(mha, idx, True), rtol=0, atol=1e-12)


def repeat_kv(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """(n_kv * d_head, ...) -> (n_kv * groups * d_head, ...): each K/V head copied for its query group."""
    n_kv = weight.shape[0] // DH
    return weight.reshape(n_kv, DH, *weight.shape[1:]).repeat_interleave(groups, dim=0).reshape(-1, *weight.shape[1:])


def tile_kv(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """The wrong grouping: the K/V heads copied as a whole, so query heads interleave across groups."""
    n_kv = weight.shape[0] // DH
    return weight.reshape(n_kv, DH, *weight.shape[1:]).repeat(groups, *([1] * weight.dim())).reshape(
        -1, *weight.shape[1:])


def with_kv_rows(state: dict, expand) -> dict:
    """The state with each layer's W_k and W_v rows (and biases) of qkv_proj replaced by expand(rows)."""
    out = dict(state)
    for name, value in state.items():
        if ".qkv_proj." in name:
            n_kv = (value.shape[0] // DH - H) // 2
            q, k, v = value.split((H * DH, n_kv * DH, n_kv * DH))
            out[name] = torch.cat((q, expand(k), expand(v)))
    return out


@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("n_kv", [2, 1])
@pytest.mark.parametrize("pos", ["rope", "alibi", "t5_bias"])
def test_gqa_equals_mha_with_kv_heads_repeated_per_group(pos, n_kv, need_weights):
    """Query head h reads K/V head h // (n_heads / n_kv_heads): consecutive heads form a group."""
    gqa = make_model(pos, n_kv_heads=n_kv)
    mha = make_model(pos, seed=5)
    mha.load_state_dict(with_kv_rows(gqa.state_dict(), lambda w: repeat_kv(w, H // n_kv)))
    idx = tokens((2, 9))
    torch.testing.assert_close(forward(gqa, idx, need_weights), forward(mha, idx, need_weights),
                               rtol=1e-10, atol=1e-10)
    # Sanity: a different grouping (heads interleaved across groups) gives different outputs.
    other = make_model(pos, seed=5)
    other.load_state_dict(with_kv_rows(gqa.state_dict(), lambda w: tile_kv(w, H // n_kv)))
    if n_kv > 1:
        assert (forward(other, idx, need_weights) - forward(gqa, idx, need_weights)).abs().max() > 1e-4


@pytest.mark.parametrize("n_kv", [None, 2, 1], ids=["mha", "gqa", "mqa"])
def test_stacked_projection_is_three_separate_matrices(n_kv):
    """qkv_proj's rows are W_q, W_k, W_v in that order: attention computed from three separate
    linear maps built from projection('q'/'k'/'v') gives the module's output."""
    from blocklab.model.attention import AttentionContext
    from blocklab.model.position import NoPE

    torch.manual_seed(0)
    attn = make_model("none", n_layers=1, n_kv_heads=n_kv).blocks[0].attn
    kv = n_kv or H
    x = torch.randn(2, 6, D, dtype=torch.float64)
    ctx = AttentionContext(torch.arange(6)[None], NoPE(D, H, DH), None, True)
    with torch.no_grad():
        (w_q, b_q), (w_k, b_k), (w_v, b_v) = (attn.projection(part) for part in "qkv")
        assert w_q.shape == (H * DH, D) and w_k.shape == w_v.shape == (kv * DH, D)
        q = F.linear(x, w_q, b_q).view(2, 6, H, DH).transpose(1, 2)
        k, v = (F.linear(x, w, b).view(2, 6, kv, DH).transpose(1, 2).repeat_interleave(H // kv, dim=1)
                for w, b in ((w_k, b_k), (w_v, b_v)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        torch.testing.assert_close(attn(x, ctx), attn.out_proj(y), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- SDPA vs explicit

def left_padding(padded: bool) -> dict:
    """Model inputs for a batch of 2 x 9 whose first row starts with 3 padding tokens (or none)."""
    if not padded:
        return {}
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[0, :3] = False
    return dict(valid=valid, positions=(valid.long().cumsum(1) - 1).clamp(min=0))


@pytest.mark.parametrize("padded", [False, True], ids=["full", "left_padded"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pos", SCHEMES)
def test_sdpa_and_explicit_paths_agree(pos, variant, causal, padded):
    model = make_model(pos, causal=causal, **VARIANTS[variant])
    idx, kw = tokens((2, 9)), left_padding(padded)
    fast = forward(model, idx, **kw)
    with torch.no_grad():
        slow, weights = model(idx, need_weights=True, **kw)
    torch.testing.assert_close(slow, fast, rtol=1e-10, atol=1e-10)
    assert len(weights) == 2
    window = VARIANTS[variant].get("window")
    i, j = torch.arange(9)[:, None], torch.arange(9)[None]
    forbidden = torch.zeros(9, 9, dtype=torch.bool)
    if causal:
        forbidden |= j > i
    if window is not None:
        forbidden |= (i - j).abs() >= window
    for w in weights:
        assert w.shape == (2, H, 9, 9)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, H, 9, dtype=torch.float64), rtol=0, atol=1e-12)
        assert bool((w[..., forbidden] == 0).all())
        assert bool((w[..., ~forbidden][1] > 0).all())  # unpadded row: every allowed key gets weight
        if padded:  # real queries of the padded row give no weight to padding keys
            assert bool((w[0, :, 3:, :3] == 0).all())


def _grads(model, idx, need_weights, **kw):
    model.zero_grad()
    out = model(idx, need_weights=need_weights, **kw)
    logits = out[0] if need_weights else out
    (logits * torch.linspace(-1, 1, V, dtype=logits.dtype)).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padded", [False, True], ids=["full", "left_padded"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pos", SCHEMES)
def test_sdpa_and_explicit_paths_give_the_same_gradients(pos, variant, causal, padded):
    """Training goes through the fast path (T5's trained bias through its own backward); its
    gradients, the position parameters' included, are those of softmax attention written out."""
    model = make_model(pos, causal=causal, **VARIANTS[variant])
    idx, kw = tokens((2, 9)), left_padding(padded)
    fast, slow = _grads(model, idx, False, **kw), _grads(model, idx, True, **kw)
    assert fast.keys() == slow.keys() == {name for name, _ in model.named_parameters()}
    for name in fast:
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("n_kv, mask_shape", [(4, (2, 4, 5, 7)), (2, (1, 4, 5, 7)), (1, (1, 1, 5, 7))])
def test_learned_bias_attention_gradients_by_finite_differences(n_kv, mask_shape):
    """The hand-written backward against numerical derivatives, for every input: grouped K/V heads
    and masks broadcast over batch and heads, as T5's bias and padding produce them."""
    from blocklab.model.attention import LearnedBiasAttention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, n_kv, 7, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.randn(mask_shape, generator=g, dtype=torch.float64)
    mask[..., 0, 1:3] = float("-inf")  # masked keys, as causality and padding make them
    mask.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *x: LearnedBiasAttention.apply(*x, 0.7), (q, k, v, mask))


# ------------------------------------------------------------------------------------- scaling

@pytest.mark.parametrize("scale, expected", [(None, 1 / math.sqrt(DH)), ("default", 1 / math.sqrt(DH)),
                                             ("none", 1.0), (0.3, 0.3), (2, 2.0)])
def test_attention_scale_setting(scale, expected):
    model = Transformer(make_cfg(scale=scale))
    for block in model.blocks:
        assert block.attn.scale == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("n_kv", [None, 2])
@pytest.mark.parametrize("scale, value", [(None, 1 / math.sqrt(DH)), ("none", 1.0), (0.3, 0.3)])
def test_attention_weights_match_hand_computation(scale, value, n_kv):
    """One pre-LN layer, no positions: weights = softmax(q k^T * scale + causal mask)."""
    model = make_model("none", n_layers=1, n_kv_heads=n_kv, scale=scale)
    idx = tokens((2, 7))
    with torch.no_grad():
        logits, weights = model(idx, need_weights=True)
        x = F.layer_norm(model.tok_emb.weight[idx], (D,), eps=1e-5)
        attn = model.blocks[0].attn
        kv = n_kv or H
        (w_q, b_q), (w_k, b_k) = attn.projection("q"), attn.projection("k")
        q = (x @ w_q.T + b_q).view(2, 7, H, DH).transpose(1, 2)
        k = (x @ w_k.T + b_k).view(2, 7, kv, DH).transpose(1, 2)
        k = k[:, [h * kv // H for h in range(H)]]  # query head h reads kv head h // (H / kv)
        scores = (q @ k.transpose(-1, -2)) * value
        torch.testing.assert_close(weights[0], masked_softmax(scores, causal=True), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(model(idx), logits, rtol=1e-10, atol=1e-10)  # SDPA uses the same scale


def test_scale_changes_the_outputs():
    idx = tokens((2, 7))
    a = forward(make_model("rope", scale=None), idx)
    b = forward(make_model("rope", scale="none"), idx)
    assert (a - b).abs().max() > 1e-4


# -------------------------------------------------------------------------------------- padding

@pytest.mark.parametrize("variant", ["mha", "gqa", "local"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("pos", SCHEMES)
def test_right_padding_does_not_change_outputs(pos, causal, variant):
    model = make_model(pos, causal=causal, **VARIANTS[variant])
    short, long = tokens((1, 5), seed=2), tokens((1, 8), seed=3)
    garbage = tokens((1, 3), seed=4)
    idx = torch.cat((torch.cat((short, garbage), 1), long))
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[0, 5:] = False
    batch = forward(model, idx, valid=valid)
    torch.testing.assert_close(batch[0, :5], forward(model, short)[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(batch[1], forward(model, long)[0], rtol=1e-10, atol=1e-10)
    # without the mask a bidirectional model reads the padding (so the mask is what makes this pass)
    if causal is False:
        assert (forward(model, idx)[0, :5] - batch[0, :5]).abs().max() > 1e-4


@pytest.mark.parametrize("variant", ["mha", "gqa", "local"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("pos", SCHEMES)
def test_left_padding_with_positions_does_not_change_outputs(pos, causal, variant):
    model = make_model(pos, causal=causal, **VARIANTS[variant])
    short, long = tokens((1, 5), seed=2), tokens((1, 8), seed=3)
    garbage = tokens((1, 3), seed=4)
    idx = torch.cat((torch.cat((garbage, short), 1), long))
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[0, :3] = False
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    batch = forward(model, idx, valid=valid, positions=positions)
    torch.testing.assert_close(batch[0, 3:], forward(model, short)[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(batch[1], forward(model, long)[0], rtol=1e-10, atol=1e-10)
    # without the key mask every model (causal too) reads the padding on the left
    unmasked = forward(model, idx, positions=positions)
    assert (unmasked[0, 3:] - batch[0, 3:]).abs().max() > 1e-4


# ------------------------------------------------------------------------------ mixed precision

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pos", SCHEMES)
def test_under_bf16_autocast_attention_itself_computes_in_float32(pos, variant, monkeypatch):
    """trainer.precision=bf16-mixed on CPU: the projections run in bfloat16 but the attention kernel
    gets float32 q/k/v (torch's bfloat16 CPU kernel is several times slower), in training (T5's
    trained bias through its own backward) as in evaluation; outputs and gradients stay close to float32."""
    model = make_model(pos, **VARIANTS[variant]).float().train()
    idx = tokens((2, 9))
    reference = _grads(model, idx, False)
    with torch.no_grad():
        expected = model(idx)
    seen = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: seen.append(q.dtype) or sdpa(q, k, v, **kw))
    explicit = SoftmaxAttention.explicit  # soft-capped scores take the explicit path instead of the kernel
    monkeypatch.setattr(SoftmaxAttention, "explicit", lambda self, q, *a: seen.append(q.dtype) or explicit(self, q, *a))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = _grads(model, idx, False)
        with torch.no_grad():
            out = model(idx)
    assert seen == [torch.float32] * 2 * model.cfg.n_layers
    assert out.dtype == torch.bfloat16  # the head is a bfloat16 matmul: autocast was on
    scale = expected.abs().max()
    assert 0 < (out.float() - expected).abs().max() < 0.03 * scale
    assert mixed.keys() == reference.keys()
    largest = max(float(g.norm()) for g in reference.values())
    for name, grad in mixed.items():
        assert grad.dtype == torch.float32
        # A gradient ~1e-4 of the largest (FIRE's hidden bias, whose effect the softmax mostly cancels) is all
        # rounding in direction; it must still be as small in absolute terms.
        assert float((grad - reference[name]).norm()) < 0.02 * largest, name
        if reference[name].norm() > 0.01 * largest:
            cosine = F.cosine_similarity(grad.flatten(), reference[name].flatten(), dim=0)
            assert cosine > 0.99, (name, float(cosine))
