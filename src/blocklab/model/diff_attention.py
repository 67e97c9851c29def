"""Differential attention (`attn.kind=diff`): Ye et al. 2025, "Differential Transformer" (ICLR; arXiv 2410.05258),
as the authors' code has it (microsoft/unilm, Diff-Transformer/multihead_diffattn.py, commit 768a3c8):

    [Q1; Q2] = X W_Q, [K1; K2] = X W_K, V = X W_V
    A = softmax(Q1 K1^T / sqrt(d)) - lambda softmax(Q2 K2^T / sqrt(d))
    lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init
    lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)), l = 1..L the layer (the code's depth = l - 1)
    head = (1 - lambda_init) RMSNorm(A V)

A differential head pairs two of the config's heads: query/key heads 2h and 2h+1 (d_head wide) make differential
head h, whose value is 2 d_head wide, so n_heads/2 differential heads hold the parameters of n_heads plain ones (the
reference's advice: "num_heads set to half of baseline Transformer's num_heads"). The per-head normalization is an
RMSNorm over the 2 d_head channels with one learned gain shared by the heads (the code's `subln`; the paper says
GroupNorm); the lambda vectors start at N(0, 0.1) as there. The hot path is F.scaled_dot_product_attention twice,
once per softmax map (A V = softmax_1 V - lambda softmax_2 V); a KV cache as softmax attention. Checked against the
reference's forward on the same weights (tests/model/test_frontier_attention.py)."""
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.model.attention import ATTENTION_KINDS, Attention
from blocklab.model.cache import KVState
from blocklab.registry import is_number


def lambda_init_at(layer: int) -> float:
    """The paper's lambda_init for the layer of index `layer` (0-based: the reference's depth)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


@ATTENTION_KINDS.register("diff")
class DifferentialAttention(Attention):
    """Option lambda_init: a constant in place of the depth schedule (null: 0.8 - 0.6 exp(-0.3 (l - 1)))."""

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 layer: int = 0, lambda_init: float | None = None):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias)
        d = self.d_head
        self.lambda_init = lambda_init_at(layer) if lambda_init is None else float(lambda_init)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.zeros(d).normal_(mean=0, std=0.1)) for _ in range(4))
        self.sub_norm = nn.RMSNorm(2 * d, eps=1e-5)

    @classmethod
    def errors(cls, cfg, options):
        errs = []
        kv = cfg.attn.n_kv_heads or cfg.n_heads
        if cfg.n_heads % 2 or kv % 2:
            errs.append(f"attn.kind=diff pairs heads (two softmax maps per differential head): model.n_heads="
                        f"{cfg.n_heads} and attn.n_kv_heads={kv} must be even")
        value = options.get("lambda_init")
        if value is not None and not is_number(value):
            errs.append(f"attn.lambda_init={value!r} must be a number (or null: the paper's schedule by depth)")
        return errs

    @property
    def out_heads(self) -> int:
        return self.n_heads // 2

    def _value_heads(self, v: Tensor) -> Tensor:
        """(B, T, n_kv * d) -> (B, n_kv / 2, T, 2 d): one value head per pair of key heads."""
        batch, length, _ = v.shape
        return v.view(batch, length, -1, 2 * self.d_head).transpose(1, 2)

    def state_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.n_kv_heads * self.d_head * element_size

    def new_state(self) -> KVState:
        return KVState()

    def lambda_full(self) -> Tensor:
        dot = lambda a, b: torch.exp(torch.sum(a * b, dim=-1).float())  # noqa: E731
        return dot(self.lambda_q1, self.lambda_k1) - dot(self.lambda_q2, self.lambda_k2) + self.lambda_init

    def _pairs(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The keys of each differential head's two maps and its values, one head per differential head (or, where
        every pair shares its key head, the key heads, for SDPA's grouped form): the reference's repeat_kv."""
        repeat = self.n_heads // self.n_kv_heads
        if repeat == 1:
            return k[:, 0::2], k[:, 1::2], v
        if repeat % 2 == 0:  # both maps of a differential head read one key head
            return k, k, v.repeat_interleave(2, dim=1)
        heads = torch.arange(self.n_heads // 2, device=k.device)
        return k[:, 2 * heads // repeat], k[:, (2 * heads + 1) // repeat], v[:, heads // repeat]

    def attend(self, q, k, v, ctx, state):
        if state is not None:
            k, v = state.extend(k, v)
        if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):  # as softmax attention: float32 SDPA on the CPU
                return self._attend(q.float(), k.float(), v.float(), ctx)
        return self._attend(q, k, v, ctx)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        dropout = self.dropout if self.training else 0.0
        k1, k2, v = self._pairs(k, v)
        mask = None if ctx.mask is None else ctx.mask.to(q.dtype)
        # A per-head bias (ALiBi, T5) is per query head: each map takes its heads' rows.
        masks = (mask, mask) if mask is None or mask.shape[1] == 1 else (mask[:, 0::2], mask[:, 1::2])
        maps = ((q[:, 0::2], k1, masks[0]), (q[:, 1::2], k2, masks[1]))
        if ctx.need_weights:  # analysis: the two maps, heads 2h and 2h+1 for differential head h
            w1, w2 = (self._weights(qi, ki, mi, ctx.is_causal) for qi, ki, mi in maps)
            self.last_weights = torch.stack((w1, w2), dim=2).flatten(1, 2)
            group = w1.shape[1] // v.shape[1]
            v_all = v.repeat_interleave(group, dim=1)
            a1, a2 = F.dropout(w1, dropout) @ v_all, F.dropout(w2, dropout) @ v_all
        else:
            # Queries and keys padded with zeros to the values' width (the scores are unchanged): torch's CPU flash
            # kernel needs one head width; without it SDPA takes its math path (a layer step 3.4x slower at n = 2048).
            pad = lambda x: F.pad(x, (0, self.d_head))  # noqa: E731
            a1, a2 = (F.scaled_dot_product_attention(pad(qi), pad(ki), v, attn_mask=mi, is_causal=ctx.is_causal,
                                                     dropout_p=dropout, scale=self.scale,
                                                     enable_gqa=ki.shape[1] != qi.shape[1])
                      for qi, ki, mi in maps)
        out = a1 - self.lambda_full().to(a1.dtype) * a2
        return self.sub_norm(out) * (1 - self.lambda_init)

    def _weights(self, q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        if is_causal:
            tq, tk = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(tq, tk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return (scores if mask is None else scores + mask).softmax(dim=-1)
