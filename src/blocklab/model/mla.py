"""Multi-head latent attention (`attn.kind=mla`), DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and
Efficient Mixture-of-Experts Language Model" (arXiv 2405.04434), §2.1.2-2.1.3.

Keys and values are read from one low-rank latent per token, and position enters through a decoupled RoPE key
shared by the heads, so decoding caches only (kv_rank + rope_dim) numbers per token and layer:

    c_KV = RMSNorm(W_DKV h)             (eq. 9)     the latent, attn.kv_rank wide; the RMSNorm (attn.latent_norm) is
                                                    the released model's `kv_a_layernorm`, which eq. 9 omits
    k^C_i = W_UK,i c_KV, v^C_i = W_UV,i c_KV        (eqs. 10-11)
    q^C_i = W_Q,i h                     (queries uncompressed, as DeepSeek-V2-Lite; eq. 12's c_Q omitted)
    q^R_i = RoPE(W_QR,i h), k^R = RoPE(W_KR h)      (eqs. 14-15; k^R one for all heads), attn.rope_dim wide
    o_i = softmax([q^C_i; q^R_i] . [k^C_i; k^R] / sqrt(d_h + d_R)) v^C_i,  u = W_O [o_1; ...; o_H]   (eqs. 16-18)

Training and full passes use this explicit form. With a cache (decoding) the absorbed form of §2.1.2 ("W_UK can
be absorbed into W_Q, and W_UV into W_O") runs instead: each head's query becomes [W_UK,i^T q^C_i; q^R_i], the
keys are [c_KV; k^R] and the values c_KV, shared by every head (one K/V head, as MQA), and W_UV,i maps each
head's latent output back. Both go through F.scaled_dot_product_attention.

Checked against transformers' DeepseekV2Attention on shared weights (tests/model/test_mla.py names the version)."""
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.model.architectures import ARCHITECTURES
from blocklab.model.attention import ATTENTION_KINDS, Attention
from blocklab.model.cache import KVState


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def derived_rope_dim(d_head: int) -> int:
    """attn.rope_dim left null: d_head / 2 (DeepSeek-V2's 64 of 128) rounded down to an even width (RoPE rotates
    pairs), at least 2: 8 at d_head 16, 2 at d_head 4 and 6, 4 at 10. Any head dimension gets an even width."""
    return max(2, 2 * (d_head // 4))


@ATTENTION_KINDS.register("mla")
class MultiHeadLatentAttention(Attention):
    """Options: kv_rank (d_c, the latent's width; null: 4 d_h, the paper's choice), rope_dim (d_h^R, the
    decoupled RoPE part per head; null: d_h / 2 rounded down to an even width, at least 2: the paper's d_h / 2
    where d_h is a multiple of 4) and latent_norm (an RMSNorm with a learned gain, eps 1e-6, on c_KV, as DeepSeek-V2's
    released `kv_a_layernorm`; true by default; a run saved before the option existed had none and reads false).
    The stacked projection (qkv_proj) holds W_Q
    ('q'), W_KR ('k': the only key rows h meets directly) and W_DKV ('v': the latent values are read from);
    W_QR is q_rope_proj, and [W_UK; W_UV] is up_proj. The position scheme rotates q^R and k^R only (a rotation
    of d_h^R dimensions); its logit temperature (YaRN's 1/t) is applied to the content part here."""

    per_head_qk = False  # no W_K per head: bounds read from per-head q/k projections (analysis) do not apply
    mixes_values = False  # its values are read from the latent: model.value_residual does not apply

    @property
    def qk_dim(self) -> int:
        return self.d_head + self.rope_dim  # content and decoupled RoPE parts (eq. 17's scale)

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 kv_rank: int | None = None, rope_dim: int | None = None, latent_norm: bool = True):
        super().__init__(d_model, n_heads, None, scale, qk_norm, dropout, bias)
        d_head = self.d_head
        self.kv_rank = kv_rank or 4 * d_head
        self.rope_dim = rope_dim or derived_rope_dim(d_head)
        self.n_kv_heads = 1  # one latent and one RoPE key, shared by all heads
        self.scale = 1 / math.sqrt(d_head + self.rope_dim) if scale is None else scale  # eq. 17
        self.qkv_sizes = (n_heads * d_head, self.rope_dim, self.kv_rank)
        self.qkv_proj = nn.Linear(d_model, sum(self.qkv_sizes), bias=bias)
        self.q_rope_proj = nn.Linear(d_model, n_heads * self.rope_dim, bias=bias)
        self.up_proj = nn.Linear(self.kv_rank, 2 * n_heads * d_head, bias=False)  # [W_UK; W_UV]
        self.latent_norm = nn.RMSNorm(self.kv_rank, eps=1e-6) if latent_norm else None  # DeepSeek's eps

    @classmethod
    def derived_options(cls, cfg):
        return {"kv_rank": 4 * cfg.d_head, "rope_dim": derived_rope_dim(cfg.d_head)}

    @classmethod
    def rotated_width(cls, cfg) -> int:
        """What the position scheme rotates per head: attn.rope_dim (ModelConfig.kind_rotated_width)."""
        rope_dim = cfg.attn.options.get("rope_dim")
        return rope_dim if _positive_int(rope_dim) else derived_rope_dim(cfg.d_head)

    @classmethod
    def old_run_options(cls, options: dict) -> dict:
        """The attn options of a run saved before attn.latent_norm existed (no key): no norm, as it trained."""
        return options if "latent_norm" in options else {**options, "latent_norm": False}

    @classmethod
    def errors(cls, cfg, options):
        errs = []
        for key in ("kv_rank", "rope_dim"):
            value = options.get(key)
            if value is not None and not _positive_int(value):
                errs.append(f"attn.{key}={value!r} must be a positive integer (or null: the paper's choice)")
        rope_dim = options.get("rope_dim")
        if _positive_int(rope_dim) and rope_dim % 2:
            errs.append(f"attn.rope_dim={rope_dim} must be even: the decoupled RoPE rotates pairs of dimensions")
        if cfg.attn.n_kv_heads is not None:
            errs.append(f"attn.n_kv_heads={cfg.attn.n_kv_heads}: attn.kind=mla reads keys and values from one shared "
                        "latent (attn.kv_rank), not from K/V heads; leave attn.n_kv_heads null")
        if cfg.attn.qk_norm or cfg.attn.short_conv:
            errs.append("attn.qk_norm and attn.short_conv act on separate per-head keys, which attn.kind=mla does "
                        "not have; set attn.qk_norm=false attn.short_conv=0")
        if cfg.arch in ARCHITECTURES and ARCHITECTURES[cfg.arch].is_encoder_decoder:
            errs.append(f"attn.kind=mla is self-attention over one stream; model.arch={cfg.arch} also cross-attends "
                        "to an encoder: use model.arch=decoder or encoder")
        return errs

    def state_bytes_per_token(self, element_size: int) -> int:
        return (self.kv_rank + self.rope_dim) * element_size  # c_KV and k^R: all a decoding step keeps

    def new_state(self) -> KVState:
        return KVState()  # the latent c_KV held as its 'keys', the RoPE key k^R as its 'values', (B, 1, T, width)

    def up_weights(self) -> tuple[Tensor, Tensor]:
        """W_UK and W_UV as (H, d_h, d_c): head i's key is W_UK[i] c_KV, its value W_UV[i] c_KV."""
        return self.up_proj.weight.view(2, self.n_heads, self.d_head, self.kv_rank).unbind(0)

    def forward(self, x: Tensor, ctx, layer: int = 0, memory: Tensor | None = None) -> Tensor:
        q_content, k_rope, latent = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q_content = self._heads(q_content)  # (B, H, T, d_h)
        batch, length, _ = x.shape
        q_rope = self.q_rope_proj(x).view(batch, length, self.n_heads, self.rope_dim).transpose(1, 2)
        k_rope = k_rope[:, None]  # (B, 1, T, d_R)
        latent = latent[:, None]  # (B, 1, T, d_c)
        if self.latent_norm is not None:
            latent = self.latent_norm(latent)  # before the cache: decoding keeps the normalised latent
        q_rope, k_rope = ctx.position_scheme.rotate(q_rope, k_rope, ctx.positions)
        # YaRN's temperature reaches q^R and k^R through the rotation's magnitude; the content logits get it here.
        q_content = q_content * ctx.position_scheme.logit_scale if ctx.position_scheme.logit_scale != 1 else q_content
        if ctx.cache is not None:
            latent, k_rope = ctx.cache.state(layer, self.new_state).extend(latent, k_rope)
            out = self.absorbed(q_content, q_rope, latent, k_rope, ctx)
        else:
            out = self.explicit_form(q_content, q_rope, latent, k_rope, ctx)
        return self.output(x, out)

    def _mask(self, q: Tensor, ctx) -> Tensor | None:
        mask = None if ctx.mask is None else ctx.mask.to(q.dtype)
        return mask.contiguous() if mask is not None and mask.is_cuda else mask

    def explicit_form(self, q_content, q_rope, latent, k_rope, ctx) -> Tensor:
        """Eqs. 10-18 as written: per-head keys [W_UK,i c; k^R] and values W_UV,i c. (B, H, Tq, d_h)."""
        w_uk, w_uv = self.up_weights()
        k_content = torch.einsum("bxtc,hdc->bhtd", latent, w_uk)
        values = torch.einsum("bxtc,hdc->bhtd", latent, w_uv)
        q = torch.cat((q_content, q_rope), dim=-1)
        k = torch.cat((k_content, k_rope.expand(-1, self.n_heads, -1, -1)), dim=-1)
        return self._sdpa(q, k, values, ctx, enable_gqa=False)

    def absorbed(self, q_content, q_rope, latent, k_rope, ctx) -> Tensor:
        """The same attention with W_UK folded into each head's query and W_UV applied after: keys and values
        are the cached latent (and k^R), one head shared by all queries. (B, H, Tq, d_h)."""
        w_uk, w_uv = self.up_weights()
        q = torch.cat((torch.einsum("bhtd,hdc->bhtc", q_content, w_uk), q_rope), dim=-1)  # (B, H, T, d_c + d_R)
        k = torch.cat((latent, k_rope), dim=-1)  # (B, 1, S, d_c + d_R)
        out_latent = self._sdpa(q, k, latent, ctx, enable_gqa=True)  # (B, H, T, d_c)
        return torch.einsum("bhtc,hdc->bhtd", out_latent, w_uv)

    def _sdpa(self, q, k, v, ctx, enable_gqa: bool) -> Tensor:
        dropout = self.dropout if self.training else 0.0
        mask = self._mask(q, ctx)
        if ctx.need_weights:  # analysis: the weights written out
            group = q.shape[1] // k.shape[1]
            k_all, v_all = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = q @ k_all.transpose(-2, -1) * self.scale
            if ctx.is_causal:
                tq, tk = scores.shape[-2:]
                scores = scores.masked_fill(torch.ones(tq, tk, dtype=torch.bool, device=q.device).triu(1),
                                            float("-inf"))
            if mask is not None:
                scores = scores + mask
            self.last_weights = scores.softmax(-1)
            return F.dropout(self.last_weights, dropout) @ v_all
        # Values padded with zeros to the queries' width (the d_R rope columns): the CPU flash kernel needs one head
        # width, and without it SDPA falls back to its math path, which holds the (T, T) weights.
        width = v.shape[-1]
        v = F.pad(v, (0, q.shape[-1] - width))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=ctx.is_causal, dropout_p=dropout,
                                              scale=self.scale, enable_gqa=enable_gqa)[..., :width]
