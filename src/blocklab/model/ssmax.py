"""Scalable-Softmax (`attn.kind=ssmax`; Nakanishi 2025, "Scalable-Softmax Is Superior for Attention",
arXiv 2501.19399): softmax attention whose logits are multiplied by s log n, n the number of keys the query
sees, so the largest weight does not fade as the context grows.

SSMax(z)_j = n^(s z_j) / sum_k n^(s z_k) = softmax(s log(n) z)_j   (the paper's eq. for z = scale q k^T)

with s learned, one per head of each layer (the paper's per-layer, per-head scaling parameter). Fixed at s = 1
it is Chiang & Cholak 2022's log-n scaling ("Overcoming a Theoretical Limitation of Self-Attention"), which is
also where s starts (`s_init`). As the paper does, the factor multiplies the queries, so the hot path stays
F.scaled_dot_product_attention (or a pattern's blocked kernel) and the explicit path used for analysis sees
the same logits. Under a causal mask a query at index i sees n = i + 1 keys; padding and sparse patterns
count only the keys they leave visible, so a left-padded prompt decodes as it trains unpadded."""
import torch
from torch import nn

from blocklab.model.attention import ATTENTION_KINDS, SoftmaxAttention


@ATTENTION_KINDS.register("ssmax")
class ScalableSoftmaxAttention(SoftmaxAttention):
    """Softmax attention (MHA/GQA/MQA, any pattern, a KV cache) with logits times s_h log n_i."""

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 s_init: float = 1.0):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias)
        self.length_gain = nn.Parameter(torch.full((n_heads,), float(s_init)))  # the paper's s, per head

    @classmethod
    def label(cls, cfg) -> str:
        base = SoftmaxAttention.label(cfg)
        return "ssmax" if base == "mha" else f"ssmax_{base}"

    @classmethod
    def errors(cls, cfg, options):
        s_init = options.get("s_init", 1.0)
        if isinstance(s_init, bool) or not isinstance(s_init, (int, float)) or not s_init > 0:
            return [f"attn.s_init={s_init!r} must be a number > 0 (the starting s in s log n; 1 is Chiang & "
                    f"Cholak's log-n scaling)"]
        return []

    def _attend(self, q, k, v, ctx):
        log_n = ctx.keys_seen(q.shape[-2], k.shape[-2])[:, 0].to(q.dtype).log()  # (B|1, Tq, 1)
        # The parameter meets the activation in one elementwise product, then the heads move to dim 1.
        gain = (log_n * self.length_gain).transpose(1, 2).unsqueeze(-1)  # (B|1, H, Tq, 1)
        return super()._attend((q * gain).to(q.dtype), k, v, ctx)
