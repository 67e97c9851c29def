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
    """Keys/values per layer, in buffers that grow by doubling, so a decoding step writes its token
    into a free slot instead of copying the whole cache; plus what the mask needs about each held key.
    The held keys have absolute indices start .. start + length - 1. For inference (no autograd).
    Encoder-decoder models also keep the encoder output and each layer's cross-attention K/V."""

    window: int | None = None
    length: int = 0  # keys held, the same in every layer
    start: int = 0  # absolute index of the first held key (> 0 once a window has dropped keys)
    positions: Tensor | None = None  # (B, length) position ids, for position biases and the next positions
    valid: Tensor | None = None  # (B, length) False where the key is padding; None when none is
    memory: Tensor | None = None  # encoder output (B, S, D)
    memory_valid: Tensor | None = None
    cross: dict = field(default_factory=dict)  # layer -> (k, v) of the memory
    buffers: list = field(default_factory=list)  # per layer (K, V), each (B, H_kv, capacity, d_head)

    @property
    def next_index(self) -> int:
        return self.start + self.length

    @property
    def keys(self) -> list[Tensor]:
        return [k[:, :, :self.length] for k, _ in self.buffers]

    @property
    def values(self) -> list[Tensor]:
        return [v[:, :, :self.length] for _, v in self.buffers]

    def bytes(self) -> int:
        """Bytes of the held keys and values (the buffers' spare capacity not counted)."""
        tensors = self.keys + self.values + [t for kv in self.cross.values() for t in kv]
        return sum(t.numel() * t.element_size() for t in tensors)

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this pass's (already rotated) keys and values after the held ones; return all of them."""
        end = self.length + k.shape[2]
        if layer == len(self.buffers):
            self.buffers.append((None, None))
        k_buf, v_buf = self.buffers[layer]
        if k_buf is None or end > k_buf.shape[2]:
            k_buf, v_buf = self._grown(k_buf, k, end), self._grown(v_buf, v, end)
            self.buffers[layer] = (k_buf, v_buf)
        k_buf.narrow(2, self.length, k.shape[2]).copy_(k)
        v_buf.narrow(2, self.length, v.shape[2]).copy_(v)
        return k_buf.narrow(2, 0, end), v_buf.narrow(2, 0, end)

    def _grown(self, buffer: Tensor | None, new: Tensor, needed: int) -> Tensor:
        batch, heads, _, dim = new.shape
        grown = new.new_empty(batch, heads, max(2 * needed, 16), dim)
        if buffer is not None:
            grown[:, :, :self.length] = buffer[:, :, :self.length]
        return grown

    def with_new_keys(self, positions: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Positions and validity (None: no padding) of the held keys followed by new ones."""
        k_positions = positions if self.positions is None else torch.cat((self.positions, positions), dim=1)
        if valid is None and self.valid is None:
            return k_positions, None
        held = self.valid if self.valid is not None else positions.new_ones(positions.shape[0], self.length, dtype=torch.bool)
        new = valid if valid is not None else positions.new_ones(positions.shape, dtype=torch.bool)
        return k_positions, torch.cat((held, new), dim=1)

    def commit(self, ctx: "AttentionContext") -> None:
        """After a forward pass: count the new keys, drop what a window never sees again."""
        self.positions, self.valid = ctx.k_positions, ctx.k_valid
        self.length = self.positions.shape[1]
        drop = 0 if self.window is None else self.length - self.window
        if drop <= 0:
            return
        for k_buf, v_buf in self.buffers:  # local attention only ever looks `window` keys back
            k_buf[:, :, :self.window] = k_buf[:, :, drop:self.length].clone()
            v_buf[:, :, :self.window] = v_buf[:, :, drop:self.length].clone()
        self.start, self.length = self.start + drop, self.window
        self.positions = self.positions[:, drop:]
        self.valid = None if self.valid is None else self.valid[:, drop:]


@dataclass
class AttentionContext:
    """Everything attention needs that is the same for every layer of one forward pass."""

    positions: Tensor  # (B|1, T) positions of the new tokens
    position_scheme: PositionScheme
    mask: Tensor | None  # float, broadcastable to (B, H, Tq, Tk); None on the fast causal path
    is_causal: bool
    cache: KVCache | None = None
    need_weights: bool = False
    # Positions and validity of all keys (held + new), which the cache keeps after the pass.
    k_positions: Tensor | None = None
    k_valid: Tensor | None = None


def self_attention_context(idx: Tensor, positions: Tensor | None, valid: Tensor | None, cache: KVCache | None,
                           scheme: PositionScheme, causal: bool, window: int | None,
                           need_weights: bool = False) -> AttentionContext:
    """Positions, mask and position bias for self-attention over `idx` (the new tokens), continuing
    from the cache if there is one. Positions default to 0..T-1, or to the cache's next ones."""
    batch, length = idx.shape
    if positions is None:
        positions = default_positions(length, idx.device)  # shared per length, so schemes can reuse their tables
        if cache is not None and cache.positions is not None:
            positions = cache.positions[:, -1:] + 1 + positions
    if valid is not None and bool(valid.all()):
        valid = None  # no padding: nothing to mask, and SDPA can take its fast path
    q_start, k_start, k_positions, k_valid = 0, 0, positions, valid
    if cache is not None:
        positions = positions.expand(batch, length)  # the cache keeps one row per sequence
        q_start, k_start = cache.next_index, cache.start
        k_positions, k_valid = cache.with_new_keys(positions, valid)
    mask, is_causal = build_mask(q_start, length, k_start, k_positions.shape[1], causal, window, k_valid,
                                 scheme.bias(positions, k_positions), idx.device)
    return AttentionContext(positions, scheme, mask, is_causal, cache, need_weights, k_positions, k_valid)


def cross_attention_context(memory_valid: Tensor | None, scheme: PositionScheme, cache: KVCache | None,
                            need_weights: bool = False) -> AttentionContext:
    """Decoder queries see every valid encoder position; positions are already in the memory."""
    mask = None
    if memory_valid is not None and not bool(memory_valid.all()):
        mask = torch.zeros(memory_valid.shape, dtype=torch.float32, device=memory_valid.device)
        mask = mask.masked_fill(~memory_valid, float("-inf"))[:, None, None, :]
    return AttentionContext(torch.zeros(1, 1, dtype=torch.long), scheme, mask, False, cache, need_weights)


def build_mask(
    q_start: int,
    q_len: int,
    k_start: int,
    k_len: int,
    causal: bool,
    window: int | None,
    key_valid: Tensor | None,
    bias: Tensor | None,
    device=None,
) -> tuple[Tensor | None, bool]:
    """Fold causality, the local window, key padding and a position bias into one float mask.
    Queries have absolute indices q_start.., keys k_start..; the keys end with the queries themselves.

    Returns (mask, is_causal); mask is None when SDPA's own causal flag says it all."""
    if window is None and key_valid is None and bias is None:
        if not causal or q_len == k_len:
            return None, causal  # no held keys: SDPA's own causal flag
        if q_len == 1:
            return None, False  # one new token (decoding): every key is in its past
    q_index = torch.arange(q_start, q_start + q_len, device=device)
    k_index = torch.arange(k_start, k_start + k_len, device=device)
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
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
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
        # W_q, W_k and W_v stacked in one matrix (GPT-2's c_attn), rows in that order: one matmul
        # instead of three, ~9% of a cached decoding step and 2-4% of a training step.
        self.qkv_sizes = (n_heads * self.d_head, self.n_kv_heads * self.d_head, self.n_kv_heads * self.d_head)
        self.qkv_proj = nn.Linear(d_model, sum(self.qkv_sizes), bias=bias)
        self.out_proj = nn.Linear(n_heads * self.d_head, d_model, bias=bias)
        self.q_norm = nn.RMSNorm(self.d_head) if qk_norm else None  # None, not Identity: a module call less
        self.k_norm = nn.RMSNorm(self.d_head) if qk_norm else None
        self.last_weights: Tensor | None = None
        self.register_load_state_dict_pre_hook(_stack_separate_projections)

    def projection(self, part: str) -> tuple[Tensor, Tensor | None]:
        """(weight, bias) of W_q, W_k or W_v ('q', 'k', 'v'): views of their rows of qkv_proj."""
        index = "qkv".index(part)
        return self._rows(sum(self.qkv_sizes[:index]), self.qkv_sizes[index])

    def _rows(self, start: int, size: int) -> tuple[Tensor, Tensor | None]:
        bias = self.qkv_proj.bias
        return self.qkv_proj.weight.narrow(0, start, size), None if bias is None else bias.narrow(0, start, size)

    def _heads(self, x: Tensor) -> Tensor:
        """(B, T, n * d_head) -> (B, n, T, d_head)"""
        batch, length, _ = x.shape
        return x.view(batch, length, -1, self.d_head).transpose(1, 2)

    def forward(self, x: Tensor, ctx: AttentionContext, layer: int = 0, memory: Tensor | None = None) -> Tensor:
        """Self-attention over x, or cross-attention from x to `memory` (the encoder output)."""
        if memory is None:
            # Split before the head view: the backward then joins the three gradients straight into
            # (B, T, .) instead of also copying a transposed (B, T, heads, d_head) (~0.5 ms a step).
            q, k, v = (self._heads(part) for part in self.qkv_proj(x).split(self.qkv_sizes, dim=-1))
            q, k = _normed(q, self.q_norm), _normed(k, self.k_norm)
            q, k = ctx.position_scheme.rotate(q, k, ctx.positions)
            if ctx.cache is not None:
                k, v = ctx.cache.extend(layer, k, v)
        else:
            q = _normed(self._heads(F.linear(x, *self.projection("q"))), self.q_norm)
            k, v = self._memory_kv(memory, ctx.cache, layer)
        if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # Mixed precision: the projections run in bfloat16, attention itself in float32. Torch's
            # bfloat16 SDPA on CPU is ~4x slower than its float32 kernel (forward + backward, baby config).
            with torch.autocast("cpu", enabled=False):
                y = self._attend(q.float(), k.float(), v.float(), ctx)
        else:
            y = self._attend(q, k, v, ctx)
        return self.out_proj(y.transpose(1, 2).flatten(2))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        """softmax(scale q k^T + mask) v per head: (B, H, Tq, d_head)."""
        dropout = self.dropout if self.training else 0.0
        if ctx.need_weights:
            y, self.last_weights = self.explicit(q, k, v, ctx.mask, ctx.is_causal, dropout)
            return y
        # The mask must share q's dtype: torch's CPU SDPA silently mis-reads a float32 mask with
        # float64 q/k/v from length 16 on (masks are built in float32; .to is free when they match).
        mask = None if ctx.mask is None else ctx.mask.to(q.dtype)
        if mask is not None and mask.requires_grad and dropout == 0.0 and torch.is_grad_enabled():
            return LearnedBiasAttention.apply(q, k, v, mask, self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=ctx.is_causal, dropout_p=dropout,
                                              scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads)

    def _memory_kv(self, memory: Tensor, cache: KVCache | None, layer: int) -> tuple[Tensor, Tensor]:
        if cache is not None and layer in cache.cross:
            return cache.cross[layer]
        q_size, k_size, v_size = self.qkv_sizes
        kv = F.linear(memory, *self._rows(q_size, k_size + v_size))
        k, v = (self._heads(part) for part in kv.chunk(2, dim=-1))
        k = _normed(k, self.k_norm)
        if cache is not None:
            cache.cross[layer] = (k, v)
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


def _normed(x: Tensor, norm: nn.Module | None) -> Tensor:
    return x if norm is None else norm(x)


def _stack_separate_projections(module, state_dict, prefix, *args) -> None:
    """Checkpoints from before qkv_proj hold q_proj, k_proj and v_proj: load them stacked."""
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{part}_proj.{kind}" for part in "qkv"]
        if all(key in state_dict for key in keys):
            state_dict[f"{prefix}qkv_proj.{kind}"] = torch.cat([state_dict.pop(key) for key in keys])


class LearnedBiasAttention(torch.autograd.Function):
    """SDPA with a float mask that is trained (T5's bias). Given a mask that needs gradients, torch's
    CPU SDPA falls back to its unfused math path, whose empty-row checks (isneginf, all, where) and
    copies cost ~0.5 ms a layer at the baby config. Here the forward is SDPA's fused kernel with the
    mask as a constant, and the backward is softmax attention's gradient written out: with
    P = softmax(S), S = scale q k^T + mask, dS = P * (dP - rowsum(dO * O)) is also the mask's gradient.
    Only without dropout (the fused forward's dropout pattern cannot be replayed); every query sees
    at least one key (build_mask guarantees it), so no softmax row is empty."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        # detached: SDPA picks its kernel by requires_grad, even where autograd is off as here
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.detach(), scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        ctx.save_for_backward(q, k, v, mask, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out = ctx.saved_tensors
        group = q.shape[1] // k.shape[1]  # query heads per K/V head (GQA/MQA)
        k_all, v_all = (k, v) if group == 1 else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        # In place where a temporary is not needed again: each is a (B, H, T, T) pass saved.
        probs = torch.softmax((q @ k_all.transpose(-2, -1)).mul_(ctx.scale).add_(mask), dim=-1)
        grad_probs = grad_out @ v_all.transpose(-2, -1)
        grad_scores = grad_probs.sub_((grad_out * out).sum(-1, keepdim=True)).mul_(probs)
        grad_q = (grad_scores @ k_all).mul_(ctx.scale)
        grad_k = (grad_scores.transpose(-2, -1) @ q).mul_(ctx.scale)
        grad_v = probs.transpose(-2, -1) @ grad_out
        if group > 1:  # each K/V head served `group` query heads
            grad_k, grad_v = (g.unflatten(1, (-1, group)).sum(2) for g in (grad_k, grad_v))
        return grad_q, grad_k, grad_v, grad_scores.sum_to_size(mask.shape), None  # mask may be broadcast

