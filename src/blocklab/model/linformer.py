"""Linformer (`attn.kind=linformer`, Wang et al. 2020): keys and values projected along the sequence to
k rows, so each query meets k mixtures of keys instead of T keys, O(T k) instead of O(T^2)."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from blocklab.model.attention import ATTENTION_KINDS, Attention
from blocklab.model.cache import KVState
from blocklab.model.linear_attention import at_least_float32, common_errors, is_positive_int, key_valid, with_defaults


@ATTENTION_KINDS.register("linformer")
class Linformer(Attention):
    """softmax(scale q (E K)^T) (F V) per head (Wang et al. 2020, eq. 7), with learned E, F of shape
    (k, max_len), sliced to the actual length T, and shared by the heads of a layer (sec. 4, headwise
    sharing); initialized N(0, 1/k) as in Theorem 1. Options: k (projected length), max_len (null: the
    model's max_len, the longest sequence it handles).

    Defined only for non-causal attention: every projected row mixes the whole sequence, so every output
    sees every token; attn.causal=true is a config error. Padded keys and values are zeroed before they
    are projected. RoPE rotates q and k before the projection (the base class does, as for softmax); an
    additive bias (ALiBi, T5) or a window has no projected counterpart and is a config error. Decoding has
    no recurrent form: the state keeps every key and value (a KV cache) and each step projects them all
    again, which is what a non-causal model computes under a cache (the prompt's queries see the whole
    prompt). Attention dropout applies to the (Tq, k) weights. GQA/MQA: the K/V heads are projected once."""

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 k: int = 32, max_len: int | None = None):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias)
        # Scaled in place: the same numbers, and a size count (model/size.py) skips the write.
        self.e_proj = nn.Parameter(torch.randn(k, max_len).div_(math.sqrt(k)))
        self.f_proj = nn.Parameter(torch.randn(k, max_len).div_(math.sqrt(k)))

    @classmethod
    def derived_options(cls, cfg):
        return {"max_len": cfg.max_len}

    @classmethod
    def errors(cls, cfg, options):
        errs = common_errors(cls.registry_name, cfg)
        if cfg.attn.causal:
            errs.append("attn.causal=true: linformer projects keys along the whole sequence, so every output sees "
                        "every token and there is no causal form; set attn.causal=false (or use another attn.kind)")
        options = {**with_defaults(cls.registry_name, options), **cls.derived_options(cfg),
                   **{key: value for key, value in options.items() if value is not None}}
        k, max_len = options["k"], options["max_len"]
        if not is_positive_int(max_len) or max_len < cfg.max_len:
            errs.append(f"attn.max_len={max_len!r} is shorter than the longest sequence to train or evaluate "
                        f"({cfg.max_len} tokens); raise attn.max_len or set it to null (auto)")
        elif not is_positive_int(k) or k > max_len:
            errs.append(f"attn.k={k!r} must be a positive integer no larger than the longest sequence "
                        f"({max_len}): it is the number of rows keys are projected to")
        return errs

    def state_bytes_per_token(self, element_size):
        return 2 * self.n_kv_heads * self.d_head * element_size

    def new_state(self) -> KVState:
        return KVState()

    @at_least_float32
    def attend(self, q, k, v, ctx, state):
        if state is not None:
            k, v = state.extend(k, v)
        length = k.shape[2]
        if length > self.e_proj.shape[1]:
            raise ValueError(f"{length} keys, but linformer's projections cover attn.max_len={self.e_proj.shape[1]}; "
                             f"raise model max_len (or attn.max_len)")
        e, f = self.e_proj[:, :length].to(k.dtype), self.f_proj[:, :length].to(v.dtype)
        valid = key_valid(ctx, length)
        if valid is not None:  # padded keys and values are zero before the projection mixes them in
            padding = ~valid[:, None, :, None]
            k, v = k.masked_fill(padding, 0.0), v.masked_fill(padding, 0.0)
        k, v = e @ k, f @ v  # (B, H_kv, k, d_head)
        dropout = self.dropout if self.training else 0.0
        if ctx.need_weights:
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            probs = (q @ k.transpose(-2, -1) * self.scale).softmax(-1)  # (B, H, Tq, k)
            # What each original value gets: y = P (F V) = (P F) V, padded keys' columns zero.
            f = f if valid is None else f * valid[:, None, None, :]
            self.last_weights = probs @ f
            return F.dropout(probs, dropout) @ v
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=self.scale,
                                              enable_gqa=self.n_kv_heads != self.n_heads)
