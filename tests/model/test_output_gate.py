"""attn.output_gate (Qiu et al. 2025, "Gated Attention for Large Language Models") and model.value_residual (Zhou et
al. 2024, ResFormer): each on a case computed by hand from the papers' equations, the gate also against the authors'
code (qiuzh20/gated_attention, modeling_qwen3.py at commit 49645df63aafe9e680bc44a9c0ca280d4aefa8e9: the lines that
split the gate from q_proj's output and apply it, copied into `reference_gated_attention`), and both with cached
decoding = recomputation. Plus the attention-sink measure (analysis.metrics.first_token_share) by hand."""
import math

import pytest
import torch
import torch.nn.functional as F

from blocklab.analysis import metrics
from blocklab.model import build_model
from blocklab.model.config import AttnConfig, ModelConfig
from blocklab.model.mask import self_attention_context
from blocklab.schema import group_errors
from helpers import assert_cached_steps_equal_full, tokens
from variants import tiny_cfg, tiny_model

H, D = 4, 8  # the tiny model's heads and head width (d_model 32)


def context(model, length, batch=1):
    return self_attention_context(torch.zeros(batch, length, dtype=torch.long), None, None, None, model.pos, True,
                                  model.pattern)


# ------------------------------------------------------------------------------------------------- the gate

@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_a_one_token_layer_gives_the_gated_value_by_hand(gate):
    """One token: softmax over one key is 1, so each head's output is its value v_h, and the paper's G1 gate gives
    out_proj(sigmoid(x W_theta + b) * v) (eq. 5: Y' = g(Y, X, W_theta, sigma) = Y * sigma(X W_theta))."""
    model = tiny_model("none", output_gate=gate, n_layers=1)
    attn = model.blocks[0].attn
    x = torch.randn(1, 1, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w_v, b_v = attn.projection("v")
    value = (x @ w_v.T + b_v).view(H, D)
    gate_rows = attn.output_gate.proj
    sigma = 1 / (1 + torch.exp(-(x[0, 0] @ gate_rows.weight.T + gate_rows.bias)))
    gated = value * (sigma[:, None] if gate == "headwise" else sigma.view(H, D))
    expected = attn.out_proj(gated.flatten())
    with torch.no_grad():
        torch.testing.assert_close(attn(x, context(model, 1))[0, 0], expected, rtol=1e-12, atol=1e-12)
    assert gate_rows.out_features == (H if gate == "headwise" else H * D)


def reference_gated_attention(hidden_states, q_proj, k_proj, v_proj, o_proj, num_heads, num_key_value_heads,
                              head_dim, headwise):
    """modeling_qwen3.py's Qwen3Attention.forward, eager path, the gate's lines as written (no rotary: pos=none)."""
    bsz, q_len, _ = hidden_states.size()
    num_key_value_groups = num_heads // num_key_value_heads
    query_states = q_proj(hidden_states)
    key_states = k_proj(hidden_states)
    value_states = v_proj(hidden_states)
    if headwise:
        query_states = query_states.view(bsz, q_len, num_key_value_heads, -1)
        query_states, gate_score = torch.split(query_states, [head_dim * num_key_value_groups, num_key_value_groups], dim=-1)
        gate_score = gate_score.reshape(bsz, q_len, -1, 1)
        query_states = query_states.reshape(bsz, q_len, -1, head_dim).transpose(1, 2)
    else:
        query_states = query_states.view(bsz, q_len, num_key_value_heads, -1)
        query_states, gate_score = torch.split(query_states, [head_dim * num_key_value_groups, head_dim * num_key_value_groups], dim=-1)
        gate_score = gate_score.reshape(bsz, q_len, -1, head_dim)
        query_states = query_states.reshape(bsz, q_len, -1, head_dim).transpose(1, 2)
    key_states = key_states.view(bsz, q_len, -1, head_dim).transpose(1, 2)
    value_states = value_states.view(bsz, q_len, -1, head_dim).transpose(1, 2)
    key_states = key_states.repeat_interleave(num_key_value_groups, dim=1)  # repeat_kv
    value_states = value_states.repeat_interleave(num_key_value_groups, dim=1)
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    causal_mask = torch.full((q_len, q_len), float("-inf"), dtype=attn_weights.dtype).triu(1)
    attn_weights = attn_weights + causal_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    attn_output = attn_output * torch.sigmoid(gate_score)
    attn_output = attn_output.reshape(bsz, q_len, -1)
    return o_proj(attn_output)


@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_the_gate_computes_the_authors_attention_on_the_same_weights(gate, n_kv_heads):
    kv = n_kv_heads or H
    model = tiny_model("none", output_gate=gate, n_kv_heads=n_kv_heads, n_layers=1)
    attn = model.blocks[0].attn
    groups, per_gate = H // kv, (1 if gate == "headwise" else D)
    # The reference's q_proj holds, per K/V group, the group's query rows and then its gate rows.
    w_q, b_q = attn.projection("q")
    g_w, g_b = attn.output_gate.proj.weight, attn.output_gate.proj.bias
    stack = lambda q, g: torch.cat((q.reshape(kv, groups * D, -1), g.reshape(kv, groups * per_gate, -1)), 1)  # noqa: E731
    q_proj = torch.nn.Linear(32, H * D + H * per_gate).double()
    with torch.no_grad():
        q_proj.weight.copy_(stack(w_q, g_w).reshape(H * D + H * per_gate, 32))
        q_proj.bias.copy_(stack(b_q[:, None], g_b[:, None]).flatten())
    k_proj, v_proj = (torch.nn.Linear(32, kv * D).double() for _ in "kv")
    with torch.no_grad():
        for proj, part in ((k_proj, "k"), (v_proj, "v")):
            proj.weight.copy_(attn.projection(part)[0])
            proj.bias.copy_(attn.projection(part)[1])
    x = torch.randn(2, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference_gated_attention(x, q_proj, k_proj, v_proj, attn.out_proj, H, kv, D, gate == "headwise")
        # the reference computes its softmax in float32 (dtype=torch.float32): float32 tolerance
        torch.testing.assert_close(attn(x, context(model, 7, 2)), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["softmax", "diff", "forgetting", "gla", "mla"])
def test_the_gate_applies_to_every_kind_and_decodes_as_it_recomputes(kind):
    plain, gated = tiny_model("rope", kind=kind), tiny_model("rope", kind=kind, output_gate="headwise")
    idx = tokens((2, 9))
    with torch.no_grad():
        assert not torch.allclose(plain(idx), gated(idx))
        assert_cached_steps_equal_full(gated, idx, prefix=4)


def test_an_unknown_gate_is_refused_in_one_line():
    errs = group_errors("attn", {"output_gate": "per_head"})
    assert len(errs) == 1 and "attn.output_gate='per_head'" in errs[0] and "headwise" in errs[0], errs


# --------------------------------------------------------------------------------------- the value residual

@pytest.mark.parametrize("learned", [False, True])
def test_later_layers_mix_in_the_first_layers_values_by_hand(learned):
    """One token: each layer's attention output is out_proj(v) with v its (mixed) value, so layer 1 gives
    out_proj(lambda v_1(x1) + (1 - lambda) v_0(x0)), lambda 0.5 (the reference) or the learned weight (here 0.3)."""
    cfg = tiny_cfg("none", n_layers=3, value_residual=True, value_residual_learned=learned)
    torch.manual_seed(0)
    model = build_model(cfg).double().eval()
    first, second = model.blocks[0].attn, model.blocks[1].attn
    assert first.value_residual.weight is None and (second.value_residual.weight is not None) == learned
    if learned:
        second.value_residual.weight.data.fill_(0.3)
    lam = 0.3 if learned else 0.5
    x0, x1 = torch.randn(2, 1, 1, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ctx = context(model, 1)
    value = lambda attn, x: x[0, 0] @ attn.projection("v")[0].T + attn.projection("v")[1]  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(first(x0, ctx, 0)[0, 0], first.out_proj(value(first, x0)))
        mixed = lam * value(second, x1) + (1 - lam) * value(first, x0)
        torch.testing.assert_close(second(x1, ctx, 1)[0, 0], second.out_proj(mixed))


@pytest.mark.parametrize("fields", [dict(), dict(value_residual_learned=True), dict(kind="diff"),
                                    dict(kind="gla"), dict(arch="encoder_decoder")],
                         ids=["fixed", "learned", "diff", "gla", "encoder_decoder"])
def test_the_value_residual_changes_the_model_and_decodes_as_it_recomputes(fields):
    model = tiny_model("rope", n_layers=3, value_residual=True, **fields)
    plain = tiny_model("rope", n_layers=3, **{k: v for k, v in fields.items() if k != "value_residual_learned"})
    idx, src = tokens((2, 9)), tokens((2, 5), seed=3)
    extra = {"source": src} if fields.get("arch") == "encoder_decoder" else {}
    with torch.no_grad():
        assert not torch.allclose(model(idx, **extra), plain(idx, **extra))
        full, cache = model(idx, **extra), model.new_cache()
        torch.testing.assert_close(model(idx[:, :4], cache=cache, **extra), full[:, :4], rtol=1e-10, atol=1e-10)
        for t in range(4, 9):
            torch.testing.assert_close(model(idx[:, t:t + 1], cache=cache, **extra)[:, 0], full[:, t], rtol=1e-10,
                                       atol=1e-10)


def test_the_learned_weight_gets_a_gradient_and_mla_is_refused():
    model = tiny_model("rope", n_layers=2, value_residual=True, value_residual_learned=True).train()
    model(tokens((2, 6))).sum().backward()
    assert model.blocks[1].attn.value_residual.weight.grad.abs() > 0
    cfg = ModelConfig(value_residual=True, attn=AttnConfig(kind="mla"))
    errs = cfg.errors()
    assert len(errs) == 1 and "model.value_residual" in errs[0] and "mla" in errs[0], errs
    errs = ModelConfig(value_residual_learned=True).errors()
    assert len(errs) == 1 and "model.value_residual=true" in errs[0], errs
    errs = group_errors("model", {"value_residual": "yes"})
    assert len(errs) == 1 and "model.value_residual='yes' must be true or false" in errs[0], errs

# --------------------------------------------------------------------------------------------- the sink

def test_the_first_token_share_by_hand():
    """Two heads, three queries: the share is the weight on key 0, averaged over queries 1 and 2 (query 0 has
    only itself to attend to), padding rows left out."""
    w = torch.zeros(1, 2, 3, 3)
    w[0, 0] = torch.tensor([[1, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]])
    w[0, 1] = torch.tensor([[1, 0, 0], [0.1, 0.9, 0], [0.9, 0.05, 0.05]])
    torch.testing.assert_close(metrics.first_token_share(w), torch.tensor([0.35, 0.5]))
    torch.testing.assert_close(metrics.first_token_share(w, torch.tensor([[True, True, False]])),
                               torch.tensor([0.5, 0.1]))
