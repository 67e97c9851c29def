"""Multi-head attention covering MHA, GQA and MQA (through n_kv_heads), causal or not,
optionally windowed, with a KV cache. The hot path is F.scaled_dot_product_attention;
an explicit softmax path runs only when attention weights are asked for (analysis)."""
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.model.position import PositionScheme


@dataclass
class KVCache:
    """Keys/values per layer plus what the mask needs to know about each cached key."""

    window: int | None = None
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    index: Tensor | None = None  # (Tc,) absolute index of each cached key, for causality/window
    positions: Tensor | None = None  # (B, Tc) position ids, for position biases
    valid: Tensor | None = None  # (B, Tc) False where the key is padding

    @property
    def next_index(self) -> int:
        return 0 if self.index is None else int(self.index[-1]) + 1

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def trim(self):
        """Local attention only ever looks `window` keys back, so older ones can go."""
        if self.window is None or self.index.numel() <= self.window:
            return
        keep = slice(-self.window, None)
        self.keys = [k[:, :, keep] for k in self.keys]
        self.values = [v[:, :, keep] for v in self.values]
        self.index, self.positions, self.valid = self.index[keep], self.positions[:, keep], self.valid[:, keep]


@dataclass
class AttentionContext:
    """Everything attention needs that is the same for every layer of one forward pass."""

    positions: Tensor  # (B|1, T) positions of the new tokens
    position_scheme: PositionScheme
    mask: Tensor | None  # float, broadcastable to (B, H, Tq, Tk); None on the fast causal path
    is_causal: bool
    cache: KVCache | None = None
    need_weights: bool = False


def build_mask(
    q_index: Tensor,
    k_index: Tensor,
    causal: bool,
    window: int | None,
    key_valid: Tensor | None,
    bias: Tensor | None,
) -> tuple[Tensor | None, bool]:
    """Fold causality, the local window, key padding and a position bias into one float mask.

    Returns (mask, is_causal); mask is None when SDPA's own causal flag says it all."""
    plain_causal = causal and q_index.numel() == k_index.numel() and bool((q_index == k_index).all())
    if window is None and key_valid is None and bias is None and (plain_causal or not causal):
        return None, causal
    offset = q_index[:, None] - k_index[None, :]  # how far back each key is
    allowed = torch.ones_like(offset, dtype=torch.bool)
    if causal:
        allowed &= offset >= 0
    if window is not None:
        allowed &= offset.abs() < window
    allowed = allowed[None, None]  # (1, 1, Tq, Tk)
    if key_valid is not None:
        # Padding queries still see themselves, so no softmax row is empty (no NaN); their outputs are ignored.
        allowed = (allowed & key_valid[:, None, None, :]) | (offset == 0)
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=q_index.device)
    mask = mask.masked_fill(~allowed, float("-inf"))
    if bias is not None:
        mask = mask + bias
    return mask, False


class Attention(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        scale: float | None = None,
        qk_norm: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
        causal: bool = True,
        window: int | None = None,
    ):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.d_head = d_model // n_heads
        self.scale = 1 / math.sqrt(self.d_head) if scale is None else scale
        self.causal, self.window, self.dropout = causal, window, dropout
        self.q_proj = nn.Linear(d_model, n_heads * self.d_head, bias=bias)
        self.k_proj = nn.Linear(d_model, self.n_kv_heads * self.d_head, bias=bias)
        self.v_proj = nn.Linear(d_model, self.n_kv_heads * self.d_head, bias=bias)
        self.out_proj = nn.Linear(n_heads * self.d_head, d_model, bias=bias)
        self.q_norm = nn.RMSNorm(self.d_head) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.d_head) if qk_norm else nn.Identity()
        self.last_weights: Tensor | None = None

    def _heads(self, x: Tensor, n: int) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, n, self.d_head).transpose(1, 2)

    def forward(self, x: Tensor, ctx: AttentionContext, layer: int = 0) -> Tensor:
        q = self.q_norm(self._heads(self.q_proj(x), self.n_heads))
        k = self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads))
        v = self._heads(self.v_proj(x), self.n_kv_heads)
        q, k = ctx.position_scheme.rotate(q, k, ctx.positions)
        if ctx.cache is not None:
            if layer < len(ctx.cache.keys):
                k = torch.cat((ctx.cache.keys[layer], k), dim=2)
                v = torch.cat((ctx.cache.values[layer], v), dim=2)
                ctx.cache.keys[layer], ctx.cache.values[layer] = k, v
            else:
                ctx.cache.keys.append(k)
                ctx.cache.values.append(v)
        dropout = self.dropout if self.training else 0.0
        if ctx.need_weights:
            y, self.last_weights = self.explicit(q, k, v, ctx.mask, ctx.is_causal, dropout)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=ctx.mask, is_causal=ctx.is_causal, dropout_p=dropout,
                scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads,
            )
        return self.out_proj(y.transpose(1, 2).flatten(2))

    def explicit(self, q, k, v, mask, is_causal, dropout) -> tuple[Tensor, Tensor]:
        """softmax(q k^T * scale + mask) v, written out so the weights can be returned."""
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        if is_causal:
            tq, tk = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(1), float("-inf"))
        if mask is not None:
            scores = scores + mask
        weights = scores.softmax(dim=-1)
        return F.dropout(weights, dropout) @ v, weights
