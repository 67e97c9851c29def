"""Scalable-Softmax (attn.kind=ssmax, Nakanishi 2025): the layer computes the paper's formula, counts the keys each
query sees under causality, padding and windows, learns s by the right gradient, and is refused where it cannot
be. Causality, cached decoding and the weights it writes out are checked for every kind in test_linear_attention."""
import math

import pytest
import torch

from blocklab.model.config import AttnConfig, ModelConfig
from blocklab.model.mask import self_attention_context
from variants import tiny_model

V, H = 20, 4


def layer_and_context(idx, causal=True, valid=None, window=None, s=None):
    model = tiny_model("none", kind="ssmax", causal=causal, n_layers=1, window=window, vocab_size=V)
    attn = model.blocks[0].attn
    if s is not None:
        attn.length_gain.data = torch.tensor(s, dtype=torch.float64)
    ctx = self_attention_context(idx, None, valid, None, model.pos, causal, model.pattern)
    return attn, ctx


def paper_ssmax(attn, x, visible):
    """Eq. of the paper, written out: weights n^(s z_j) / sum_k n^(s z_k) over the visible keys, n their count,
    z = q k^T / sqrt(d_head)."""
    d = attn.d_head
    q, k, v = (torch.nn.functional.linear(x, *attn.projection(p)).view(*x.shape[:2], H, d).transpose(1, 2)
               for p in "qkv")
    z = q @ k.transpose(-2, -1) / math.sqrt(d)
    n = visible.sum(-1, keepdim=True).to(z.dtype)  # (B|1, 1, Tq, 1)
    s = attn.length_gain.detach()[:, None, None]
    powers = torch.where(visible, n ** (s * z), torch.zeros_like(z))
    weights = powers / powers.sum(-1, keepdim=True)
    return attn.out_proj((weights @ v).transpose(1, 2).flatten(2))


def test_a_causal_layer_computes_the_papers_formula_with_n_the_keys_each_query_sees():
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    attn, ctx = layer_and_context(idx, s=[1.0, 0.5, 2.0, 0.25])
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    visible = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]  # query i sees i + 1 keys
    with torch.no_grad():
        torch.testing.assert_close(attn(x, ctx), paper_ssmax(attn, x, visible), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal, padded", [(True, True), (False, True), (True, False)],
                         ids=["causal-window-padded", "padded", "causal-window-blocked"])
def test_padding_and_windows_count_only_the_keys_left_visible(causal, padded):
    idx = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(2))
    valid = torch.ones(2, 8, dtype=torch.bool)
    if padded:
        valid[1, :3] = False  # the second row left-padded by 3
    attn, ctx = layer_and_context(idx, causal=causal, valid=valid, window=3 if causal else None)
    assert (ctx.blocked is not None) == (not padded)  # without padding a window takes its blocked kernel
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    pattern = (j <= i) & (i - j < 3) if causal else torch.ones(8, 8, dtype=torch.bool)
    visible = (pattern[None, None] & valid[:, None, None, :]) | (i == j)
    torch.testing.assert_close(ctx.keys_seen(8, 8)[:, 0, :, 0].expand(2, 8), visible[:, 0].sum(-1), rtol=0, atol=0)
    x = torch.randn(2, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, expected = attn(x, ctx), paper_ssmax(attn, x, visible)
    real = valid[:, :, None].expand_as(out)  # padded queries' outputs are ignored
    torch.testing.assert_close(out[real], expected[real], rtol=1e-10, atol=1e-10)


def test_a_left_padded_prompt_gives_its_real_tokens_the_outputs_it_gives_unpadded():
    model = tiny_model("rope", kind="ssmax", vocab_size=V)
    idx = torch.randint(1, V, (1, 6), generator=torch.Generator().manual_seed(4))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), idx], 1)
    valid = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)], 1)
    positions = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.arange(6)[None]], 1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded, positions=positions, valid=valid)[:, 3:], model(idx),
                                   rtol=1e-10, atol=1e-10)


def needle_weight(kind: str, n: int) -> float:
    """The weight a query gives the one key whose logit is +3 among n - 1 at -2 (the paper's figure 1), through
    the layer itself: x_0 = e_0 (the needle), every other x_j = e_1; W_q, W_k set so q . k / sqrt(d_head) is 3 for
    the needle and -2 for the rest, in every head. s = 0.43 as in the figure."""
    model = tiny_model("none", kind=kind, causal=False, n_layers=1, vocab_size=V, max_len=n)
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.qkv_proj.weight.zero_()
        attn.qkv_proj.bias.zero_()
        d = attn.d_head
        for h in range(H):
            attn.qkv_proj.bias[h * d] = math.sqrt(d)  # q = sqrt(d_head) e_0 whatever the token
            k_row = H * d + h * d
            attn.qkv_proj.weight[k_row, 0], attn.qkv_proj.weight[k_row, 1] = 3.0, -2.0
        if kind == "ssmax":
            attn.length_gain.fill_(0.43)
        x = torch.zeros(1, n, 32, dtype=torch.float64)
        x[0, 0, 0] = 1.0
        x[0, 1:, 1] = 1.0
        ctx = self_attention_context(torch.zeros(1, n, dtype=torch.long), None, None, None, model.pos, False,
                                     model.pattern, need_weights=True)
        attn(x, ctx)
    return attn.last_weights[0, :, -1, 0].min().item()


def test_the_needles_weight_does_not_fade_with_more_keys_as_softmaxs_does():
    softmax = [needle_weight("softmax", n) for n in (10, 1000)]
    ssmax = [needle_weight("ssmax", n) for n in (10, 1000)]
    assert softmax[0] == pytest.approx(math.exp(3) / (math.exp(3) + 9 * math.exp(-2)), rel=1e-9)
    assert softmax[1] < 0.15  # fading: e^3 / (e^3 + 999 e^-2)
    assert ssmax[1] > 0.99 and ssmax[1] > ssmax[0]  # n^(0.43 z): the needle's share grows with n


def test_the_gradient_of_s_matches_finite_differences():
    idx = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(5))
    attn, ctx = layer_and_context(idx, s=[1.0, 0.7, 1.3, 0.4])
    x = torch.randn(1, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    weights = torch.randn(1, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(7))

    def loss(s):
        return (torch.func.functional_call(attn, {"length_gain": s}, (x, ctx)) * weights).sum()

    assert torch.autograd.gradcheck(loss, (attn.length_gain.detach().clone().requires_grad_(),))
    attn.length_gain.data = torch.tensor([1.0, 0.7, 1.3, 0.4], dtype=torch.float64)
    (attn(x, ctx) * weights).sum().backward()
    assert attn.length_gain.grad.abs().min() > 0  # every head's s is trained


@pytest.mark.parametrize("s_init", [0, -1.0, "big", True])
def test_a_bad_s_init_is_one_line(s_init):
    cfg = ModelConfig(vocab_size=V, d_model=32, n_heads=H, attn=AttnConfig(kind="ssmax", options={"s_init": s_init}))
    errors = cfg.errors()
    assert len(errors) == 1 and errors[0].startswith(f"attn.s_init={s_init!r} must be a number")


def test_its_label_names_the_kv_grouping():
    labels = [ModelConfig(vocab_size=V, d_model=32, n_heads=H, attn=AttnConfig(kind="ssmax", n_kv_heads=kv)).attn_label
              for kv in (None, 2, 1)]
    assert labels == ["ssmax", "ssmax_gqa", "ssmax_mqa"]
