"""The recurrent attention kinds against their authors' reference code (tests/model/reference_fla.py, copied from
flash-linear-attention 0.3.2 and Zoology d88d6f5), in float64: each kind's chunked parallel form and its recurrent
(decoding) form give the reference's outputs and final state, from an empty and from a held state, at lengths that
are not multiples of the chunk, with grouped query heads (GQA: each K/V head's state read by 2 query heads).

Conventions, where ours differs from flash-linear-attention's on purpose (each adapted explicitly below):
  - GLA: the same scale (q times d_k^-1/2) and gate (log alpha = logsigmoid(.) / 16). fla's layer defaults to
    d_k = d_model / 2 (`expand_k=0.5`) and an output gate; ours uses d_k = d_head and no output gate (model/gla.py's
    docstring), so the layer oracle is fla's layer with `expand_k=1, use_output_gate=False`.
  - DeltaNet: fla multiplies the unit queries by d_k^-1/2; ours does not, since each head's output is RMS-normalized
    next, which cancels a constant factor (tested on the whole layer). fla's eps constants (l2norm 1e-6, o_norm 1e-5)
    are numerical guards; the layer oracle uses ours.
  - Based: the kernel 1 + s + s^2/2 of s = q.k / sqrt(d'), as fla's `naive_parallel_based` at its default scale,
    fla's `TaylorFeatureMap` and Zoology's `TaylorExp` give it. (fla's `BasedLinearAttention` in its default
    'parallel' mode passes scale=1, unlike its own chunk modes and Zoology; we follow the paper and Zoology.)
    `naive_parallel_based` adds 1e-6 to its denominator: the exact comparison takes its numerator and denominator
    apart (use_norm=False, with v and with ones); Zoology adds 1e-12, below float64 tolerance here.
  - linear (Katharopoulos et al. 2020): fla's naive_recurrent_linear_attn on elu(x) + 1 features, numerator and
    denominator apart (normalize=False, with v and with ones): fla 0.3.2's normalize_output sums over the wrong axis
    (reference_fla.py). The scale cancels in the ratio; ours has none."""
import pytest
import torch
import torch.nn.functional as F

from blocklab.model.attention import ATTENTION_KINDS
from blocklab.model.based import taylor_features
from blocklab.model.deltanet import delta_chunked, delta_step
from blocklab.model.gla import gla_chunked, gla_step
from blocklab.model.linear_attention import KernelAttention
from blocklab.model.mask import AttentionContext
from blocklab.model.position import NoPE
from blocklab.model.recurrent import FixedState
from reference_fla import (TaylorExp, TaylorFeatureMap, delta_rule_recurrence, elu_p1, naive_parallel_based,
                           naive_recurrent_gla, naive_recurrent_linear_attn, zoology_based_linear)

B, H_KV, G, D = 2, 2, 2, 8  # 4 query heads over 2 K/V heads
LENGTHS = [1, 5, 13]  # with chunk 4: shorter than, and not multiples of, the chunk
CHUNK = 4
TOL = dict(rtol=1e-12, atol=1e-12)
F64 = dict(dtype=torch.float64)


def draw(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), **F64)


def per_query_head(t):
    """(B, H_kv, T, d) -> (B, H_kv * G, T, d): each K/V head repeated for its G query heads, as fla's layers do."""
    return t.repeat_interleave(G, dim=1)


def context(length: int, start: int = 0) -> AttentionContext:
    positions = torch.arange(start, start + length)[None]
    return AttentionContext(positions=positions, position_scheme=NoPE(4 * D, 4, D), mask=None, is_causal=True,
                            k_positions=torch.arange(start + length)[None])


# ------------------------------------------------------------------------------------------------- GLA

def gla_inputs(length):
    q, k, v = draw(B, H_KV * G, length, D, seed=1), draw(B, H_KV, length, D, seed=2), draw(B, H_KV, length, D, seed=3)
    log_alpha = F.logsigmoid(3 * draw(B, H_KV, length, D, seed=4)) / 16 + F.logsigmoid(draw(B, H_KV, length, D, seed=5))
    return q, k, v, log_alpha


def fla_gla(q, k, v, log_alpha, held=None):
    """naive_recurrent_gla on (B, T, H, d) per query head; output (B, H, T, d) and the final state per query head."""
    out, final = naive_recurrent_gla(*(t.transpose(1, 2) for t in (q, per_query_head(k), per_query_head(v),
                                                                      per_query_head(log_alpha))),
                                     initial_state=None if held is None else per_query_head(held),
                                     output_final_state=True)
    return out.transpose(1, 2), final


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("held", [False, True])
def test_gla_chunked_and_recurrent_forms_equal_fla_naive_recurrent_gla(length, held):
    q, k, v, log_alpha = gla_inputs(length)
    state = draw(B, H_KV, D, D, seed=6) if held else None
    expected, expected_final = fla_gla(q, k, v, log_alpha, state)
    scale = ATTENTION_KINDS["gla"](4 * D, 4, 2).scale
    assert scale == pytest.approx(D ** -0.5, rel=1e-15)  # fla's naive_recurrent_gla: scale = K ** -0.5
    grouped_q = (q * scale).unflatten(1, (H_KV, G))
    out, final = gla_chunked(grouped_q, k, v, log_alpha, state, CHUNK)
    torch.testing.assert_close(out.flatten(1, 2), expected, **TOL)
    torch.testing.assert_close(per_query_head(final), expected_final, **TOL)
    steps = []
    for t in range(length):  # the recurrent form, token by token
        out, state = gla_step(grouped_q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :],
                              log_alpha[..., t:t + 1, :], state)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=-2).flatten(1, 2), expected, **TOL)
    torch.testing.assert_close(per_query_head(state), expected_final, **TOL)


def test_gla_layer_equals_fla_gla_layer_without_output_gate():
    """The whole layer, chunked and decoded through `attend` with a state, against fla/layers/gla.py's
    GatedLinearAttention.forward (expand_k=1, use_output_gate=False, no short conv): q, k, v from the projections,
    gk = logsigmoid(x W_gk) / gate_logit_normalizer (16), K/V heads repeated per group, naive_recurrent_gla, each
    head RMS-normalized (g_norm), o_proj."""
    layer = ATTENTION_KINDS["gla"](4 * D, 4, 2, chunk=CHUNK).double()
    torch.manual_seed(0)
    for p in layer.parameters():
        p.data = torch.randn_like(p) * 0.3
    x = draw(B, 11, 4 * D, seed=7)
    with torch.no_grad():
        q, k, v = (layer._heads(t) for t in layer.qkv_proj(x).split(layer.qkv_sizes, dim=-1))
        gk = layer._heads(F.logsigmoid(layer.gate_up(layer.gate_down(x))) / 16)
        out, _ = fla_gla(q, k, v, gk)
        expected = layer.out_proj(layer.out_norm(out).transpose(1, 2).flatten(2))
        torch.testing.assert_close(layer(x, context(11)), expected, **TOL)
        state, steps = FixedState(), []
        for t in range(11):  # the layer's decoding path: run_forms picks the step form for one token
            layer.pending = gk[..., t:t + 1, :]
            steps.append(layer.attend(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :], context(1, t), state))
        torch.testing.assert_close(torch.cat(steps, dim=-2), layer.out_norm(out), **TOL)


# -------------------------------------------------------------------------------------------- DeltaNet

def delta_inputs(length):
    q = F.normalize(draw(B, H_KV * G, length, D, seed=1), dim=-1)
    k = F.normalize(draw(B, H_KV, length, D, seed=2), dim=-1)
    return q, k, draw(B, H_KV, length, D, seed=3), torch.sigmoid(draw(B, H_KV, length, seed=4))


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("held", [False, True])
def test_deltanet_chunked_and_recurrent_forms_equal_fla_delta_rule_recurrence(length, held):
    """fla scales the unit queries by d_k^-1/2 (its default scale); ours does not (module docstring): adapted by
    multiplying our outputs by it. The state does not depend on the queries, so it is compared as is."""
    q, k, v, beta = delta_inputs(length)
    state = draw(B, H_KV, D, D, seed=6) if held else None
    expected, expected_final = delta_rule_recurrence(q, *(per_query_head(t) for t in (k, v, beta)),
                                                     initial_state=None if state is None else per_query_head(state))
    fla_scale = D ** -0.5
    grouped_q = q.unflatten(1, (H_KV, G))
    out, final = delta_chunked(grouped_q, k, v, beta, state, CHUNK)
    torch.testing.assert_close(out.flatten(1, 2) * fla_scale, expected, **TOL)
    torch.testing.assert_close(per_query_head(final), expected_final, **TOL)
    steps = []
    for t in range(length):
        out, state = delta_step(grouped_q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :],
                                beta[..., t:t + 1], state)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=-2).flatten(1, 2) * fla_scale, expected, **TOL)
    torch.testing.assert_close(per_query_head(state), expected_final, **TOL)


@pytest.mark.parametrize("activation", ["silu", "none"])
def test_deltanet_layer_equals_fla_deltanet_layer(activation):
    """The whole layer, chunked and decoded, against fla/layers/delta_net.py's DeltaNet.forward (use_short_conv=False,
    use_gate=False, qk_norm='l2', qk_activation 'silu' or 'identity'): q, k from the projections, SiLU, L2 norm
    (use_qk_l2norm_in_kernel), beta = sigmoid(x W_b), the delta rule with fla's scale d_k^-1/2, each head
    RMS-normalized (o_norm), o_proj. fla applies SiLU to v too (`v = F.silu(self.v_proj(x))`); ours with
    attn.v_activation=silu, the default, and none with qk_activation=none here (fla always does without the conv)."""
    layer = ATTENTION_KINDS["deltanet"](4 * D, 4, 2, chunk=CHUNK, qk_activation=activation,
                                        v_activation=activation).double()
    torch.manual_seed(0)
    for p in layer.parameters():
        p.data = torch.randn_like(p) * 0.3
    x = draw(B, 11, 4 * D, seed=7)
    act = F.silu if activation == "silu" else (lambda t: t)
    with torch.no_grad():
        q, k, v = (layer._heads(t) for t in layer.qkv_proj(x).split(layer.qkv_sizes, dim=-1))
        beta = torch.sigmoid(layer.beta_proj(x)).transpose(1, 2)
        unit_q, unit_k = F.normalize(act(q), dim=-1), F.normalize(act(k), dim=-1)
        kv_beta = [per_query_head(t) for t in (unit_k, act(v), beta)]
        got = layer(x, context(11))
        # fla's layer as is: its scale d_k^-1/2 cancels in the head norm up to that norm's eps (relative eps / mean o^2)
        out, _ = delta_rule_recurrence(unit_q, *kv_beta)
        torch.testing.assert_close(got, layer.out_proj(layer.out_norm(out).transpose(1, 2).flatten(2)),
                                   rtol=1e-7, atol=1e-9)
        # exactly, with the scale taken out (the queries times d_k^1/2)
        out, _ = delta_rule_recurrence(unit_q * D ** 0.5, *kv_beta)
        torch.testing.assert_close(got, layer.out_proj(layer.out_norm(out).transpose(1, 2).flatten(2)), **TOL)
        state, steps = FixedState(), []
        for t in range(11):
            layer.pending = beta[..., t:t + 1]
            steps.append(layer.attend(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :], context(1, t), state))
        torch.testing.assert_close(torch.cat(steps, dim=-2), layer.out_norm(out), **TOL)


# ----------------------------------------------------------------------------------------------- Based

@pytest.mark.parametrize("feature_dim", [1, 4, 16])
def test_taylor_features_are_fla_taylor_feature_map_and_give_zoology_taylor_exp_kernel(feature_dim):
    """Ours on x / d'^(1/4) is fla's TaylorFeatureMap(d') on x entry for entry ([1, x, x_i^2 / sqrt 2, x_i x_j for
    i < j], in triu order). Zoology's TaylorExp keeps all d'^2 products (each pair twice), so its features differ in
    count, not in the kernel phi(q).phi(k) = 1 + s + s^2/2, s = q.k / sqrt(d')."""
    q, k = draw(3, 5, feature_dim, seed=1), draw(3, 7, feature_dim, seed=2)
    ours = taylor_features(q / feature_dim ** 0.25)
    torch.testing.assert_close(ours, TaylorFeatureMap(feature_dim)(q), **TOL)
    zoology = TaylorExp(feature_dim)
    kernel = ours @ taylor_features(k / feature_dim ** 0.25).transpose(-2, -1)
    torch.testing.assert_close(kernel, zoology(q) @ zoology(k).transpose(-2, -1), **TOL)
    s = q @ k.transpose(-2, -1) / feature_dim ** 0.5
    torch.testing.assert_close(kernel, 1 + s + s * s / 2, **TOL)


def based_layer():
    layer = ATTENTION_KINDS["based"](4 * D, 4, 2, chunk=CHUNK, feature_dim=4).double()
    torch.manual_seed(0)
    for p in layer.parameters():
        p.data = torch.randn_like(p) * 0.5
    return layer


def taylor_path(layer, q, k, v, ctx, state=None):
    """Based's Taylor path alone: the kernelized attention on its features, as Based.attend calls it (before the
    window path and the mix)."""
    return KernelAttention.attend(layer, q, k, v, ctx, state)


@pytest.mark.parametrize("length", LENGTHS)
def test_based_taylor_path_equals_fla_naive_parallel_based_and_zoology(length):
    """Parallel (chunked prefix sums) and recurrent (a running state, token by token) forms against fla's
    naive_parallel_based at its default scale d'^-1/2, numerator and denominator apart (module docstring), against
    it whole (its 1e-6 in the denominator), and against Zoology's causal linear view with TaylorExp."""
    layer = based_layer()
    q, k, v = draw(B, H_KV * G, length, D, seed=1), draw(B, H_KV, length, D, seed=2), draw(B, H_KV, length, D, seed=3)
    with torch.no_grad():
        fq, fk = layer.feature_proj(q), per_query_head(layer.feature_proj(k))  # d' features, before the map
        out = taylor_path(layer, q, k, v, context(length))
        state, steps = layer.new_state().linear, []
        for t in range(length):
            steps.append(taylor_path(layer, q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :],
                                     context(1, t), state))
    numerator = naive_parallel_based(fq, fk, per_query_head(v), use_norm=False)
    denominator = naive_parallel_based(fq, fk, torch.ones_like(per_query_head(v)[..., :1]), use_norm=False)
    for got in (out, torch.cat(steps, dim=-2)):
        torch.testing.assert_close(got, numerator / denominator, **TOL)
        torch.testing.assert_close(got, naive_parallel_based(fq, fk, per_query_head(v)), rtol=1e-5, atol=1e-6)
        zoology = TaylorExp(layer.feature_dim)
        torch.testing.assert_close(got, zoology_based_linear(zoology(fq), zoology(fk), per_query_head(v)),
                                   rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------- linear

@pytest.mark.parametrize("length", LENGTHS)
def test_linear_attention_equals_fla_naive_recurrent_linear_attn(length):
    """attn.kind=linear, parallel (chunked prefix sums) and recurrent (a running state) forms: phi = elu_p1 on q and
    k, y = sum phi(q).phi(k) v / sum phi(q).phi(k) over the keys so far, from fla's unnormalized recurrence."""
    layer = ATTENTION_KINDS["linear"](4 * D, 4, 2, chunk=CHUNK).double()
    q, k, v = draw(B, H_KV * G, length, D, seed=1), draw(B, H_KV, length, D, seed=2), draw(B, H_KV, length, D, seed=3)
    with torch.no_grad():
        out = layer.attend(q, k, v, context(length), None)
        state, steps = layer.new_state(), []
        for t in range(length):
            steps.append(layer.attend(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :], context(1, t), state))
    fq, fk, fv = (t.transpose(1, 2) for t in (elu_p1(q), per_query_head(elu_p1(k)), per_query_head(v)))
    numerator, _ = naive_recurrent_linear_attn(fq, fk, fv, scale=1.0)
    denominator, _ = naive_recurrent_linear_attn(fq, fk, torch.ones_like(fv[..., :1]), scale=1.0)
    expected = (numerator / denominator).transpose(1, 2)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(torch.cat(steps, dim=-2), expected, **TOL)
