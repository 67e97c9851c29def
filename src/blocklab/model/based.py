"""Based (`attn.kind=based`): Arora, Eyuboglu, Zhang, Timalsina, Alberti, Zinsley, Zou, Rudra and Ré 2024, "Simple
linear attention language models balance the recall-throughput tradeoff" (ICML 2024), sec. 4.

Two token mixers, each with a fixed-size decoding state:
  - linear attention with the 2nd-order Taylor feature map of exp (sec. 4.1): each head's queries and keys are
    projected to a small feature dimension d' (16), x' = x / d'^(1/4), and
        phi(x') = [1, x', vec(x' x'^T) / sqrt(2)],   so   phi(q') . phi(k') = 1 + q'.k' + (q'.k')^2 / 2,
    the Taylor expansion of exp(q.k / sqrt(d')); normalized as linear attention is (Katharopoulos et al. 2020),
    y_i = sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j), which is positive for every q, k
    ((s + 1)^2 + 1) / 2 > 0. vec(x' x'^T) keeps each pair i < j once, times sqrt(2) for its two copies: the same
    product with 1 + d' + d' (d' + 1) / 2 features in place of 1 + d' + d'^2. Its state: sum phi(k) v^T and sum phi(k),
    (1 + d' + d' (d' + 1) / 2) x (d_head + 1) per K/V head.
  - softmax attention over a small sliding window (64 tokens, itself included), sec. 4.2. Its state: the last
    window - 1 keys and values.
The paper's models interleave separate layers: gated short convolutions (`attn.kind=base_conv`), Taylor linear
attention (`attn.kind=taylor`) and sliding-window softmax (`attn.kind=softmax attn.pattern=window`), one kind per layer
through `attn.layers` (model/schedule.py; presets experiment=based_hybrid and attn=based_mqar). `attn.kind=based` is a
single-layer approximation that mixes both paths on the same queries, keys and values, so every layer can recall
exactly what is near (the window) and approximately what is far (the Taylor map). `attn.path_mix=true` (the default)
weighs each path per head by a learned scalar, both starting at 1, so a head can turn the Taylor path down (with its
feature projection at zero that path is the running mean of the values, which a plain sum adds at full weight);
`false` sums them, as runs saved before the option did. The Taylor path reads q and k unrotated (no position scheme,
as in Based's linear layers); the window path rotates them (RoPE) like softmax.

Training: the linear path is linear_attention's chunked prefix sums (a pass of one chunk: the within-chunk form on
the d' projected entries alone, Taylor.attend); the window path runs in blocks of queries, each against the keys it
can reach (block + window - 1) through F.scaled_dot_product_attention, so time and memory are linear in the length. GQA/MQA: the
query heads of a group share their K/V head's features, sums and window. Padding: padded keys get phi = 0 and no
window weight (a padded query sees itself, so no softmax row is empty)."""
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.model.attention import ATTENTION_KINDS
from blocklab.model.linear_attention import (KernelAttention, RunningState, at_least_float32, is_positive_int,
                                             key_valid, with_defaults)
from blocklab.model.recurrent import grouped, recurrent_errors


def taylor_features(x: Tensor) -> Tensor:
    """[1, x, x_i^2 / sqrt(2) (each i), x_i x_j (each i < j)] of (..., d) -> (..., 1 + d + d (d + 1) / 2): the
    distinct entries of vec(x x^T) / sqrt(2), each pair i != j once, times sqrt(2) for its two copies, so the dot
    product is the same, 1 + q.k + (q.k)^2 / 2, with half the features (and half the decoding state).
    The pairs in triu order, row by row as slices: gathering them with an index tensor is ~10x slower on the CPU."""
    pairs = [x[..., i:i + 1] * x[..., i + 1:] for i in range(x.shape[-1] - 1)]
    return torch.cat((x.new_ones(*x.shape[:-1], 1), x, x * x / math.sqrt(2), *pairs), dim=-1)


def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, window: int, scale: float) -> Tensor:
    """softmax(scale q k^T) v over the last `window` keys of each query, itself included, in blocks of queries.
    q (B, H, G, T, d); k, v (B, H, T + h, d) with the h keys held before the queries (h = window - 1 while decoding,
    0 in a pass from the start); valid (B, T + h) False where a key is padding. -> (B, H, G, T, d).
    A pass no longer than the window is one block against every key; a longer one goes in blocks of `window` queries,
    each against the block + window - 1 keys it can reach, so time and memory are linear in the length. Each block is
    one F.scaled_dot_product_attention call on 4-d tensors (on the CPU a 5-d call takes the slow math path)."""
    batch, kv_heads, groups, length, _ = q.shape
    held = k.shape[-2] - length
    if length <= window:  # one block: the query r is key held + r
        block, lead, front = length, held, 0
    else:  # every block's reach starts window - 1 keys before its first query; keys before the first held: padding
        block, lead, front = window, window - 1, window - 1 - held
    blocks = -(-length // block)
    extra = blocks * block - length  # queries past the end: zeros, their outputs dropped
    k, v = F.pad(k, (0, 0, front, extra)), F.pad(v, (0, 0, front, extra))
    valid = F.pad(valid, (front, extra), value=False)
    reach = block + lead  # the keys a block of queries can see
    kw, vw = (t.unfold(-2, reach, block).permute(0, 2, 1, 4, 3).flatten(0, 1) for t in (k, v))  # (B N, H, reach, d)
    qb = F.pad(q.flatten(1, 2), (0, 0, 0, extra)).unflatten(-2, (blocks, block)).transpose(1, 2).flatten(0, 1)
    row = torch.arange(block, device=q.device)[:, None]
    lag = row + lead - torch.arange(reach, device=q.device)[None, :]  # query r of a block is key r + lead of its reach
    in_window = (lag >= 0) & (lag < window)
    allowed = (in_window & valid.unfold(-1, reach, block)[:, :, None, None, :]) | (lag == 0)  # (B, N, 1, block, reach)
    out = F.scaled_dot_product_attention(qb, kw, vw, attn_mask=allowed.flatten(0, 1), scale=scale,
                                         enable_gqa=groups > 1)  # (B N, H G, block, d)
    return out.unflatten(0, (batch, blocks)).transpose(1, 2).flatten(2, 3)[..., :length, :].unflatten(1, (kv_heads, -1))


def sliding_window_weights(q: Tensor, k: Tensor, valid: Tensor, window: int, scale: float) -> Tensor:
    """The same weights written out, (B, H, G, T, T), for a pass with no held keys (analysis)."""
    length = q.shape[-2]
    index = torch.arange(length, device=q.device)
    offset = index[:, None] - index[None, :]
    allowed = ((offset >= 0) & (offset < window) & valid[:, None, None, None, :]) | (offset == 0)
    scores = (q @ k[:, :, None].transpose(-2, -1)) * scale
    return scores.masked_fill(~allowed, torch.finfo(scores.dtype).min).softmax(-1)


class BasedState:
    """Based's decoding state, fixed in size: the Taylor path's running sums and the window's last window - 1
    (rotated) keys and values with their padding flags, allocated whole at the first step."""

    def __init__(self):
        self.linear = RunningState()
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.valid: Tensor | None = None

    def bytes(self) -> int:
        held = [t for t in (self.keys, self.values, self.valid) if t is not None]
        return self.linear.bytes() + sum(t.numel() * t.element_size() for t in held)

    def drop_oldest(self, count: int) -> None:
        raise ValueError("Based's state holds a fixed window, not keys a pattern could drop; it takes no "
                         "attn.window (its own is attn.window_size)")


@ATTENTION_KINDS.register("taylor")
class Taylor(KernelAttention):
    """Based's linear attention layer alone (module docstring, first mixer): the Taylor path with no window, as the
    paper's Taylor layers (HazyResearch/based, based/models/mixers/linear_attention.py, LinearAttention with
    TaylorExp). Options: chunk (tokens per chunk of the prefix sums), feature_dim (d', 16 in the paper). Queries and
    keys reach d' features through W_q (W_k) then one per-head map shared by both, where the reference projects
    x to d' per head directly: the same maps wherever d_head >= d'."""

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 chunk: int = 64, feature_dim: int = 16):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias, chunk)
        self.feature_dim = feature_dim
        self.feature_proj = nn.Linear(self.d_head, feature_dim, bias=False)  # per head, shared by q and k

    @classmethod
    def uses_rotation(cls, options: dict) -> bool:
        return False  # the Taylor path reads q and k unrotated

    @classmethod
    def errors(cls, cfg, options):
        errs = recurrent_errors(cls.registry_name, cfg, options)
        feature_dim = with_defaults(cls.registry_name, options)["feature_dim"]
        if not is_positive_int(feature_dim):
            errs.append(f"attn.feature_dim={feature_dim!r} must be a positive integer (the Taylor map's feature "
                        f"dimension d')")
        return errs

    def projected(self, x: Tensor) -> Tensor:
        """x' = x W / d'^(1/4): the d' entries the Taylor map expands."""
        return self.feature_proj(x) / self.feature_dim ** 0.25

    def features(self, x, is_query):
        return taylor_features(self.projected(x)), None

    def rotate(self, q, k, ctx):
        return q, k

    def chunk_scores(self, qc: Tensor, kc: Tensor) -> Tensor:
        """phi(q).phi(k) within a chunk from the d' projected entries the features hold after their constant,
        1 + s + s^2 / 2 with s = q'.k' (the constants' product: 0 at a padded key, whose features are zeros),
        in place of the products of all 1 + d' + d' (d' + 1) / 2 features: the same kernel, ~10x fewer flops."""
        s = qc[..., 1:1 + self.feature_dim] @ kc[..., 1:1 + self.feature_dim].transpose(-2, -1)
        return qc[..., :1] * kc[..., :1].transpose(-2, -1) + s + s * s / 2

    @at_least_float32
    def attend(self, q, k, v, ctx, state):
        """A causal pass of one chunk that keeps no state (training and evaluation at T <= chunk) is the chunked form's
        within-chunk part alone, sum_j<=i (1 + s_ij + s_ij^2 / 2) [v_j, 1] with s = q'.k': it runs on the d' projected
        entries, never forming the 1 + d' + d' (d' + 1) / 2 features (as fla's parallel_based; ~6x faster to train
        at T = 64 on the CPU). Anything else (decoding, longer passes, attention weights) goes chunk by chunk."""
        length = q.shape[-2]
        causal = ctx.k_positions is not None and ctx.position_scheme.causal
        if state is not None or ctx.need_weights or not causal or k.shape[-2] != length or length > self.chunk:
            return super().attend(q, k, v, ctx, state)
        s = grouped(self.projected(q), self.n_kv_heads) @ self.projected(k)[:, :, None].transpose(-2, -1)
        scores = 1 + s + s * s / 2  # (B, Hkv, G, T, T)
        valid = key_valid(ctx, length)
        if valid is not None:  # padded keys weigh nothing (their features are zeros in the chunked form)
            scores = scores.masked_fill(~valid[:, None, None, None, :], 0.0)
        out = scores.tril() @ torch.cat((v, v.new_ones(*v.shape[:-1], 1)), dim=-1)[:, :, None]
        num, den = out[..., :-1], out[..., -1:]
        return (num / den.clamp_min(torch.finfo(den.dtype).tiny)).flatten(1, 2)


@ATTENTION_KINDS.register("based")
class Based(Taylor):
    """Based (module docstring): the Taylor path and a sliding window in one layer. Options: those of taylor,
    window_size (the sliding window, 64 in the paper), path_mix (a learned weight per head on each path, or their
    plain sum)."""

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 chunk: int = 64, feature_dim: int = 16, window_size: int = 64, path_mix: bool = True):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias, chunk, feature_dim)
        self.window_size = window_size
        # (Taylor, window) weight per head, (2, H, 1, 1); not an nn.Linear, so no init scheme redraws it
        self.path_weights = nn.Parameter(torch.ones(2, n_heads, 1, 1)) if path_mix else None

    @classmethod
    def old_run_options(cls, options: dict) -> dict:
        """A run saved before attn.path_mix summed the two paths."""
        return options if "path_mix" in options else {**options, "path_mix": False}

    @classmethod
    def label(cls, cfg) -> str:
        """based at the paper's window (64); based_wN at another, so a sweep over windows keeps them apart."""
        window = with_defaults(cls.registry_name, cfg.attn.options)["window_size"]
        return cls.registry_name if window == ATTENTION_KINDS.options(cls.registry_name)["window_size"] \
            else f"{cls.registry_name}_w{window}"

    @classmethod
    def uses_rotation(cls, options: dict) -> bool:
        return True  # the window path rotates its own copies

    def _mixed(self, linear: Tensor, window: Tensor) -> Tensor:
        if self.path_weights is None:
            return linear + window
        taylor_weight, window_weight = self.path_weights.to(linear.dtype)
        return taylor_weight * linear + window_weight * window

    @classmethod
    def errors(cls, cfg, options):
        errs = super().errors(cfg, options)
        window = with_defaults(cls.registry_name, options)["window_size"]
        if not is_positive_int(window):
            errs.append(f"attn.window_size={window!r} must be a positive integer (tokens in the sliding window, "
                        f"itself included)")
        return errs

    def new_state(self) -> BasedState:
        return BasedState()

    def attend(self, q, k, v, ctx, state):
        linear = super().attend(q, k, v, ctx, None if state is None else state.linear)
        linear_weights = self.last_weights if ctx.need_weights else None
        dtype = q.dtype
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = (t.to(torch.promote_types(dtype, torch.float32)) for t in (q, k, v))
            q, k = ctx.position_scheme.rotate(q, k, ctx.positions)
            valid = key_valid(ctx, k.shape[2])
            valid = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device) if valid is None else valid
            valid = valid.expand(k.shape[0], -1)
            qg = grouped(q, self.n_kv_heads)
            if ctx.need_weights:
                if state is not None:
                    raise ValueError("attention weights are not available while decoding with a recurrent state")
                weights = sliding_window_weights(qg, k, valid, self.window_size, self.scale)
                self.last_weights = self._mixed(linear_weights, weights.flatten(1, 2))
                return self._mixed(linear, (weights @ v[:, :, None]).flatten(1, 2).to(dtype))
            if state is not None:
                if state.keys is None:
                    held = self.window_size - 1
                    state.keys = k.new_zeros(*k.shape[:2], held, k.shape[-1])
                    state.values = v.new_zeros(*v.shape[:2], held, v.shape[-1])
                    state.valid = valid.new_zeros(k.shape[0], held)
                k, v = torch.cat((state.keys, k), 2), torch.cat((state.values, v), 2)
                valid = torch.cat((state.valid, valid), 1)
                keep = self.window_size - 1
                state.keys, state.values, state.valid = k[:, :, k.shape[2] - keep:], v[:, :, v.shape[2] - keep:], \
                    valid[:, valid.shape[1] - keep:]
            window = sliding_window_attention(qg, k, v, valid, self.window_size, self.scale)
        return self._mixed(linear, window.flatten(1, 2).to(dtype))
