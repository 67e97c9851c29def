"""Differential attention (attn.kind=diff) against the authors' code: microsoft/unilm, Diff-Transformer/
multihead_diffattn.py and rms_norm.py at commit 768a3c873f598bb9b4d4dfb9267b099e35f8fe56. Their forward is copied
below as the oracle, adapted to the CPU: flash_attn and apex are not imported (the naive file only imports them), and
the rotary embedding is the identity (both sides run with pos=none), so the comparison is of differential attention
itself. Causality, cached decoding = recomputation and the weights it writes out are checked for every kind in
test_linear_attention."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blocklab.model.config import AttnConfig, ModelConfig
from blocklab.model.diff_attention import lambda_init_at
from blocklab.model.mask import self_attention_context
from helpers import assert_cached_steps_equal_full, tokens
from variants import tiny_cfg, tiny_model


# ---- the reference (copied; only the rotary call, the imports and the print are changed) --------------------------

class RMSNorm(nn.Module):  # Diff-Transformer/rms_norm.py
    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine=True, memory_efficient=False):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_parameter('weight', None)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        if self.weight is not None:
            output = output * self.weight
        return output


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, n_kv_heads, slen, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, None, :, :]
        .expand(bs, n_kv_heads, n_rep, slen, head_dim)
        .reshape(bs, n_kv_heads * n_rep, slen, head_dim)
    )


def lambda_init_fn(depth):
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


class MultiheadDiffAttn(nn.Module):
    def __init__(self, embed_dim, depth, num_heads, num_kv_heads=None):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.n_rep = self.num_heads // self.num_kv_heads
        self.head_dim = embed_dim // num_heads // 2
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim // self.n_rep, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim // self.n_rep, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.lambda_init = lambda_init_fn(depth)
        self.lambda_q1 = nn.Parameter(torch.zeros(self.head_dim, dtype=torch.float32).normal_(mean=0, std=0.1))
        self.lambda_k1 = nn.Parameter(torch.zeros(self.head_dim, dtype=torch.float32).normal_(mean=0, std=0.1))
        self.lambda_q2 = nn.Parameter(torch.zeros(self.head_dim, dtype=torch.float32).normal_(mean=0, std=0.1))
        self.lambda_k2 = nn.Parameter(torch.zeros(self.head_dim, dtype=torch.float32).normal_(mean=0, std=0.1))
        self.subln = RMSNorm(2 * self.head_dim, eps=1e-5, elementwise_affine=True)

    def forward(self, x, rel_pos, attn_mask=None):
        bsz, tgt_len, embed_dim = x.size()
        src_len = tgt_len
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        q = q.view(bsz, tgt_len, 2 * self.num_heads, self.head_dim)
        k = k.view(bsz, src_len, 2 * self.num_kv_heads, self.head_dim)
        v = v.view(bsz, src_len, self.num_kv_heads, 2 * self.head_dim)
        # q = apply_rotary_emb(q, *rel_pos, interleaved=True)   (identity here: pos=none on both sides)
        # k = apply_rotary_emb(k, *rel_pos, interleaved=True)
        offset = src_len - tgt_len
        q = q.transpose(1, 2)
        k = repeat_kv(k.transpose(1, 2), self.n_rep)
        v = repeat_kv(v.transpose(1, 2), self.n_rep)
        q *= self.scaling
        attn_weights = torch.matmul(q, k.transpose(-1, -2))
        if attn_mask is None:
            attn_mask = torch.triu(
                torch.zeros([tgt_len, src_len]).float().fill_(float("-inf")).type_as(attn_weights),
                1 + offset,
            )
        attn_weights = torch.nan_to_num(attn_weights)
        attn_weights += attn_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).type_as(attn_weights)
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1).float()).type_as(q)
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1).float()).type_as(q)
        lambda_full = lambda_1 - lambda_2 + self.lambda_init
        attn_weights = attn_weights.view(bsz, self.num_heads, 2, tgt_len, src_len)
        attn_weights = attn_weights[:, :, 0] - lambda_full * attn_weights[:, :, 1]
        attn = torch.matmul(attn_weights, v)
        attn = self.subln(attn)
        attn = attn * (1 - self.lambda_init)
        attn = attn.transpose(1, 2).reshape(bsz, tgt_len, self.num_heads * 2 * self.head_dim)
        attn = self.out_proj(attn)
        return attn

# ---- end of the reference ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa-of-pairs"])
@pytest.mark.parametrize("layer", [0, 1])
def test_the_layer_computes_the_authors_forward_on_the_same_weights(layer, n_kv_heads):
    """8 of our heads = 4 differential heads of the reference; GQA with 2 and 1... K/V heads of the reference
    (ours: 4 and 2, even, since a differential head pairs two key heads)."""
    ours_kv = None if n_kv_heads is None else 2 * n_kv_heads
    cfg = tiny_cfg("none", kind="diff", n_kv_heads=ours_kv, bias=False, n_layers=2)
    cfg.n_heads = 8
    assert cfg.errors() == []
    torch.manual_seed(0)
    from blocklab.model import build_model
    model = build_model(cfg).eval()
    ours = model.blocks[layer].attn
    torch.manual_seed(1)
    ref = MultiheadDiffAttn(32, depth=layer, num_heads=4, num_kv_heads=n_kv_heads).eval()
    with torch.no_grad():
        ref.subln.weight.uniform_(0.5, 1.5)  # a gain that is not 1, so that its mapping counts
        ours.qkv_proj.weight.copy_(torch.cat((ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight)))
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(ours, name).copy_(getattr(ref, name))
        ours.sub_norm.weight.copy_(ref.subln.weight)
    assert ours.lambda_init == ref.lambda_init == lambda_init_at(layer)
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(2))
    ctx = self_attention_context(x[..., 0].long(), None, None, None, model.pos, True, model.pattern)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, ctx, layer), ref(x, None), rtol=1e-5, atol=1e-6)
        ctx_w = self_attention_context(x[..., 0].long(), None, None, None, model.pos, True, model.pattern, True)
        torch.testing.assert_close(ours(x, ctx_w, layer), ref(x, None), rtol=1e-5, atol=1e-6)  # the explicit path


def test_lambda_init_follows_the_papers_schedule_by_depth():
    # the paper: 0.8 - 0.6 exp(-0.3 (l - 1)) for l = 1..L; l = 1 is 0.2, and it tends to 0.8
    assert [round(lambda_init_at(i), 6) for i in (0, 1, 2)] == [0.2, round(0.8 - 0.6 * math.exp(-0.3), 6),
                                                                 round(0.8 - 0.6 * math.exp(-0.6), 6)]
    model = tiny_model("none", kind="diff", n_layers=3)
    assert [b.attn.lambda_init for b in model.blocks] == [lambda_init_at(i) for i in range(3)]
    fixed = tiny_model("none", kind="diff", n_layers=2, options={"lambda_init": 0.5})
    assert [b.attn.lambda_init for b in fixed.blocks] == [0.5, 0.5]


def test_it_has_the_parameters_of_the_plain_layer_plus_its_lambdas_and_norm():
    plain, diff = tiny_model("rope"), tiny_model("rope", kind="diff")
    d_head = 8
    extra = 2 * (4 * d_head + 2 * d_head)  # per layer: four lambda vectors and the RMSNorm's gain
    assert sum(p.numel() for p in diff.parameters()) == sum(p.numel() for p in plain.parameters()) + extra


@pytest.mark.parametrize("pos", ["rope", "alibi"])
def test_cached_decoding_equals_recomputation_with_positions(pos):
    model = tiny_model(pos, kind="diff", n_kv_heads=2)
    assert_cached_steps_equal_full(model, tokens((2, 10)), prefix=4, then=2)


def test_it_cross_attends_in_an_encoder_decoder():
    model = tiny_model("rope", kind="diff", arch="encoder_decoder")
    src, tgt = tokens((2, 7)), tokens((2, 6), seed=2)
    with torch.no_grad():
        full = model(tgt, source=src)
        cache = model.new_cache()
        torch.testing.assert_close(model(tgt[:, :3], source=src, cache=cache), full[:, :3], rtol=1e-10, atol=1e-10)
        for t in range(3, 6):
            torch.testing.assert_close(model(tgt[:, t:t + 1], cache=cache)[:, 0], full[:, t], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("heads, kv", [(3, None), (4, 1)])
def test_odd_heads_are_refused_in_one_line(heads, kv):
    cfg = ModelConfig(d_model=24, n_heads=heads, attn=AttnConfig(kind="diff", n_kv_heads=kv))
    errs = cfg.errors()
    assert len(errs) == 1 and "attn.kind=diff" in errs[0] and "even" in errs[0], errs
