"""Forgetting attention (attn.kind=forgetting; Lin et al. 2025, "Forgetting Transformer", ICLR): the parallel form
(the decay as a float mask on SDPA) equals a recurrent reference written from the paper (eqs. 5-8: each step decays
every held key's weight by f_t, then adds its own), a tiny case computed by hand, the gradient of the fused path
equals the explicit softmax's, and the config refusals. Cached decoding = recomputation: test_linear_attention
(every kind) and below with a prefix."""
import pytest
import torch

from blocklab.model.attention import ATTENTION_KINDS
from blocklab.model.config import AttnConfig, ModelConfig
from blocklab.model.mask import self_attention_context
from helpers import assert_cached_steps_equal_full, tokens
from variants import tiny_model


def recurrent_reference(q, k, v, f, scale):
    """o_t = sum_{j<=t} exp(scale q_t.k_j) F_tj v_j / sum_{j<=t} exp(scale q_t.k_j) F_tj, F_tj = prod_{l=j+1..t} f_l,
    one step at a time: at step t every held key's decay is multiplied by f_t, then key t joins with decay 1.
    q, k, v (H, T, d), f (H, T) -> (H, T, d)."""
    heads, length, _ = q.shape
    out = torch.zeros_like(q)
    for h in range(heads):
        keys, values, decays = [], [], []
        for t in range(length):
            decays = [d * f[h, t] for d in decays]
            keys.append(k[h, t]), values.append(v[h, t]), decays.append(torch.ones((), dtype=q.dtype))
            weights = torch.stack([torch.exp(scale * q[h, t] @ kj) * dj for kj, dj in zip(keys, decays)])
            out[h, t] = (weights[:, None] * torch.stack(values)).sum(0) / weights.sum()
    return out


def context(model, idx, need_weights=False):
    return self_attention_context(idx, None, None, None, model.pos, True, model.pattern, need_weights)


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_the_parallel_form_equals_the_recurrence_of_the_paper(n_kv_heads):
    model = tiny_model("none", kind="forgetting", n_kv_heads=n_kv_heads, n_layers=1)
    attn = model.blocks[0].attn
    x = torch.randn(1, 10, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    heads = lambda part: (x[0] @ attn.projection(part)[0].T + attn.projection(part)[1]).view(10, -1, 8).transpose(0, 1)  # noqa: E731
    group = 4 // (n_kv_heads or 4)
    q, k, v = heads("q"), heads("k").repeat_interleave(group, 0), heads("v").repeat_interleave(group, 0)
    f = torch.sigmoid(x[0] @ attn.forget_proj.weight.T + attn.forget_proj.bias).T  # (H, T)
    expected = attn.out_proj(recurrent_reference(q, k, v, f, attn.scale).transpose(0, 1).flatten(1))
    with torch.no_grad():
        torch.testing.assert_close(attn(x, context(model, x[..., 0].long()))[0], expected, rtol=1e-10, atol=1e-12)


def test_a_tiny_case_by_hand():
    """One head, q = k = 0 (every score 0): query t weighs key j by prod_{l=j+1..t} f_l alone. With f_2 = 1/2 and
    f_3 = 1/4 and values 1, 2, 4: o_1 = 1, o_2 = (1/2 + 2) / (3/2) = 5/3, o_3 = (1/8 + 2/4 + 4) / (1/8 + 1/4 + 1) = 37/11."""
    layer = ATTENTION_KINDS["forgetting"](2, 1).double()
    q = k = torch.zeros(1, 1, 3, 2, dtype=torch.float64)
    v = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64).view(1, 1, 3, 1).expand(1, 1, 3, 2)
    layer.pending = torch.tensor([0.9, 0.5, 0.25], dtype=torch.float64).log().view(1, 1, 3)  # f_1 never counts
    model = tiny_model("none", kind="forgetting")
    out = layer.attend(q, k, v, context(model, torch.zeros(1, 3, dtype=torch.long)), None)
    torch.testing.assert_close(out[0, 0, :, 0], torch.tensor([1, 5 / 3, 37 / 11], dtype=torch.float64))


def test_the_fused_paths_gradient_is_the_explicit_softmaxs():
    model = tiny_model("none", kind="forgetting", n_layers=1, n_kv_heads=2).train()
    attn, idx = model.blocks[0].attn, tokens((2, 9))
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    grads = []
    for need_weights in (False, True):  # the fused SDPA + written-out backward, then autograd through the softmax
        attn.zero_grad()
        attn(x, context(model, idx, need_weights)).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in (attn.forget_proj.weight, attn.forget_proj.bias, attn.qkv_proj.weight)])
    for fused, explicit in zip(*grads):
        assert fused.abs().sum() > 0
        torch.testing.assert_close(fused, explicit, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("pos", ["none", "rope", "alibi"])
def test_cached_decoding_equals_recomputation(pos):
    assert_cached_steps_equal_full(tiny_model(pos, kind="forgetting"), tokens((2, 11)), prefix=3, then=3)


def test_the_cache_holds_each_keys_log_decay_sum():
    model = tiny_model("none", kind="forgetting")
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens((2, 5)), cache=cache)
    per_token = model.cache_bytes_per_token()
    # per layer: K and V (4 heads of 8, float64) and one c_j per head; the cache holds 2 sequences of 5 tokens
    assert per_token == 2 * (2 * 4 * 8 * 8 + 4 * 8) and cache.bytes() == 2 * 5 * per_token


@pytest.mark.parametrize("fields, key", [(dict(causal=False), "attn.causal"), (dict(arch="encoder_decoder"), "model.arch")])
def test_what_it_cannot_be_is_refused_in_one_line(fields, key):
    arch = fields.pop("arch", "decoder")
    errs = ModelConfig(arch=arch, attn=AttnConfig(kind="forgetting", **fields)).errors()
    assert len(errs) == 1 and key in errs[0] and "forgetting" in errs[0], errs
