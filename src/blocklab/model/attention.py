"""Multi-head attention covering MHA, GQA and MQA (through n_kv_heads), causal or not,
optionally windowed, with a KV cache. The hot path is F.scaled_dot_product_attention;
an explicit softmax path runs only when attention weights are asked for (analysis)."""
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.model.position import PositionScheme, default_positions


@dataclass
class KVCache:
    """Keys/values per layer plus what the mask needs to know about each cached key.
    Encoder-decoder models also keep the encoder output and each layer's cross-attention K/V."""

    window: int | None = None
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    index: Tensor | None = None  # (Tc,) absolute index of each cached key, for causality/window
    positions: Tensor | None = None  # (B, Tc) position ids, for position biases
    valid: Tensor | None = None  # (B, Tc) False where the key is padding
    memory: Tensor | None = None  # encoder output (B, S, D)
    memory_valid: Tensor | None = None
    cross: dict = field(default_factory=dict)  # layer -> (k, v) of the memory

    @property
    def next_index(self) -> int:
        return 0 if self.index is None else int(self.index[-1]) + 1

    def bytes(self) -> int:
        tensors = self.keys + self.values + [t for kv in self.cross.values() for t in kv]
        return sum(t.numel() * t.element_size() for t in tensors)

    def commit(self, ctx: "AttentionContext") -> None:
        """After a forward pass: remember the new keys' bookkeeping, drop what a window never sees."""
        self.index, self.positions, self.valid = ctx.k_index, ctx.k_positions, ctx.k_valid
        if self.window is None or self.index.numel() <= self.window:
            return
        keep = slice(-self.window, None)  # local attention only ever looks `window` keys back
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
    # Bookkeeping of all keys (cached + new) that the cache stores after the pass.
    k_index: Tensor | None = None
    k_positions: Tensor | None = None
    k_valid: Tensor | None = None


def self_attention_context(idx: Tensor, positions: Tensor | None, valid: Tensor | None, cache: KVCache | None,
                           scheme: PositionScheme, causal: bool, window: int | None,
                           need_weights: bool = False) -> AttentionContext:
    """Positions, mask and position bias for self-attention over `idx` (the new tokens), continuing
    from the cache if there is one. Positions default to 0..T-1, or to the cache's next ones."""
    batch, length = idx.shape
    device = idx.device
    if positions is None and cache is not None and cache.positions is not None:
        positions = cache.positions[:, -1:] + 1 + torch.arange(length, device=device)[None]
    elif positions is None:
        positions = default_positions(length, device)  # shared per length, so schemes can reuse their tables
    offset = cache.next_index if cache is not None else 0
    q_index = torch.arange(offset, offset + length, device=device)
    if cache is not None:
        positions = positions.expand(batch, length)  # the cache keeps one row per sequence
        if valid is None:
            valid = torch.ones(batch, length, dtype=torch.bool, device=device)
    k_index, k_positions, key_valid = q_index, positions, valid
    if cache is not None and cache.index is not None:
        k_index = torch.cat((cache.index, q_index))
        k_positions = torch.cat((cache.positions, positions), dim=1)
        key_valid = torch.cat((cache.valid, valid), dim=1)
    mask_valid = None if key_valid is None or bool(key_valid.all()) else key_valid  # no padding: fast path
    mask, is_causal = build_mask(q_index, k_index, causal, window, mask_valid, scheme.bias(positions, k_positions))
    return AttentionContext(positions, scheme, mask, is_causal, cache, need_weights, k_index, k_positions, key_valid)


def cross_attention_context(memory_valid: Tensor | None, scheme: PositionScheme, cache: KVCache | None,
                            need_weights: bool = False) -> AttentionContext:
    """Decoder queries see every valid encoder position; positions are already in the memory."""
    mask = None
    if memory_valid is not None and not bool(memory_valid.all()):
        mask = torch.zeros(memory_valid.shape, dtype=torch.float32, device=memory_valid.device)
        mask = mask.masked_fill(~memory_valid, float("-inf"))[:, None, None, :]
    return AttentionContext(torch.zeros(1, 1, dtype=torch.long), scheme, mask, False, cache, need_weights)


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
    if window is None and key_valid is None and bias is None:
        # The keys are the cached ones followed by the queries themselves (k_index ends with q_index).
        if not causal or q_index.numel() == k_index.numel():
            return None, causal  # no cache: SDPA's own causal flag
        if q_index.numel() == 1:
            return None, False  # one new token (decoding): every key is in its past
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
    ):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.d_head = d_model // n_heads
        self.scale = 1 / math.sqrt(self.d_head) if scale is None else scale
        self.dropout = dropout  # causality, windows and padding arrive as the context's mask
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

    def forward(self, x: Tensor, ctx: AttentionContext, layer: int = 0, memory: Tensor | None = None) -> Tensor:
        """Self-attention over x, or cross-attention from x to `memory` (the encoder output)."""
        q = self.q_norm(self._heads(self.q_proj(x), self.n_heads))
        if memory is not None:
            k, v = self._memory_kv(memory, ctx.cache, layer)
        else:
            k = self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads))
            v = self._heads(self.v_proj(x), self.n_kv_heads)
            q, k = ctx.position_scheme.rotate(q, k, ctx.positions)
            if ctx.cache is not None:
                k, v = self._extend_cache(ctx.cache, layer, k, v)
        dropout = self.dropout if self.training else 0.0
        if ctx.need_weights:
            y, self.last_weights = self.explicit(q, k, v, ctx.mask, ctx.is_causal, dropout)
        else:
            # The mask must share q's dtype: torch's CPU SDPA silently mis-reads a float32 mask with
            # float64 q/k/v from length 16 on (masks are built in float32; .to is free when they match).
            mask = None if ctx.mask is None else ctx.mask.to(q.dtype)
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=ctx.is_causal, dropout_p=dropout,
                scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads,
            )
        return self.out_proj(y.transpose(1, 2).flatten(2))

    def _memory_kv(self, memory: Tensor, cache: KVCache | None, layer: int) -> tuple[Tensor, Tensor]:
        if cache is not None and layer in cache.cross:
            return cache.cross[layer]
        k = self.k_norm(self._heads(self.k_proj(memory), self.n_kv_heads))
        v = self._heads(self.v_proj(memory), self.n_kv_heads)
        if cache is not None:
            cache.cross[layer] = (k, v)
        return k, v

    @staticmethod
    def _extend_cache(cache: KVCache, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's (already rotated) keys and values; return all of them."""
        if layer < len(cache.keys):
            k = torch.cat((cache.keys[layer], k), dim=2)
            v = torch.cat((cache.values[layer], v), dim=2)
            cache.keys[layer], cache.values[layer] = k, v
        else:
            cache.keys.append(k)
            cache.values.append(v)
        return k, v

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
