"""Reference code for the recurrent attention kinds, copied from its authors' libraries: the test oracles of
tests/model/test_recurrent_reference.py.

flash-linear-attention 0.3.2 (PyPI `fla-core==0.3.2`, which `flash-linear-attention==0.3.2` depends on; repository
https://github.com/fla-org/flash-linear-attention; MIT License, Copyright (c) 2023-2025 Songlin Yang, Yu Zhang). Its
naive functions are plain PyTorch, but `import fla` imports its Triton kernels (triton is absent on a CPU-only
machine), so they are copied here, not imported:
  - `naive_recurrent_gla`        from fla/ops/gla/naive.py
  - `delta_rule_recurrence`      from fla/ops/delta_rule/naive.py
  - `naive_parallel_based`       from fla/ops/based/naive.py
  - `naive_recurrent_linear_attn` from fla/ops/linear_attn/naive.py, with `normalize_output` (fla/ops/linear_attn/utils.py)
  - `elu_p1`                     from fla/layers/delta_net.py (Katharopoulos et al.'s feature map elu(x) + 1)
  - `TaylorFeatureMap` and `flatten_diag_outer_product_off1` from fla/modules/feature_map.py
Zoology (https://github.com/HazyResearch/zoology, commit d88d6f5474f36998d82d5c3bd58a190248d0a669, Apache License 2.0;
not on PyPI):
  - `TaylorExp`                  from zoology/mixers/feature_maps/taylor.py (its `forward`; FeatureMap's fields inlined)
  - `zoology_based_linear`       the causal "linear" training view of `Based.forward` in zoology/mixers/based.py

The only edits, each marked `# edit:`: fla's functions cast their inputs to float32 (`.float()`); here they keep the
input's dtype, so the comparison runs in float64. fla's `@checkpoint` (activation checkpointing, no numerical
effect) and unused imports (einops, opt_einsum) are dropped. Everything else is as published."""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


# ------------------------------------------------------------------ fla/ops/gla/naive.py (fla-core 0.3.2)

def naive_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False
):
    dtype = q.dtype
    q, k, v, gk = map(lambda x: x.transpose(1, 2), (q, k, v, gk))  # edit: was .float()
    B, H, T, K, V = *q.shape, v.shape[-1]
    o = torch.zeros_like(v)
    scale = K ** -0.5

    h = q.new_zeros(B, H, K, V)  # edit: was dtype=torch.float32
    if initial_state is not None:
        h += initial_state  # edit: was initial_state.float()

    for i in range(T):
        q_i = q[:, :, i] * scale
        k_i = k[:, :, i]
        v_i = v[:, :, i]
        gk_i = gk[:, :, i].exp()
        kv_i = k_i[..., None] * v_i[..., None, :]
        h = h * gk_i[..., None] + kv_i
        o[:, :, i] = (q_i[..., None] * h).sum(-2)

    if not output_final_state:
        h = None
    return o.transpose(1, 2).to(dtype), h


# ------------------------------------------------------------ fla/ops/delta_rule/naive.py (fla-core 0.3.2)

def delta_rule_recurrence(q, k, v, beta, initial_state=None, output_final_state=True):
    orig_dtype = q.dtype
    b, h, l, d_k = q.shape
    # edit: was q, k, v, beta = map(lambda x: x.float(), [q, k, v, beta])
    d_v = v.shape[-1]
    o = torch.zeros_like(v)
    S = torch.zeros(b, h, d_k, d_v).to(v)
    q = q * (d_k ** -0.5)

    if beta.ndim < v.ndim:
        beta = beta[..., None]

    if initial_state is not None:
        S += initial_state

    for i in range(l):
        _k = k[:, :, i]
        _q = q[:, :, i]
        _v = v[:, :, i].clone()
        beta_i = beta[:, :, i]
        _v = _v - (S.clone() * _k[..., None]).sum(-2)
        _v = _v * beta_i
        S = S.clone() + _k.unsqueeze(-1) * _v.unsqueeze(-2)
        o[:, :, i] = torch.einsum('bhd,bhdm->bhm', _q, S)
    S = None if output_final_state is False else S
    return o.to(orig_dtype), S


# ----------------------------------------------------------------- fla/ops/based/naive.py (fla-core 0.3.2)

def naive_parallel_based(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    use_norm: bool = True
):
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q = q * scale
    attn = q @ k.transpose(-2, -1)
    attn = 1 + attn + 1/2 * (attn ** 2)
    attn.masked_fill_(~torch.tril(torch.ones(
        q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device)), 0)
    o = attn @ v
    if use_norm:
        z = attn.sum(-1)
        return o / (z[..., None] + 1e-6)
    else:
        return o


# ---------------------------------------------------------- fla/ops/linear_attn/naive.py (fla-core 0.3.2)

# fla/ops/linear_attn/utils.py; edit: @torch.jit.script dropped. Unused by the tests: on fla 0.3's (B, T, H, K) layout
# its cumsum(-2) runs over the heads, not the tokens (fla-org/flash-linear-attention PR #594, issue #850), so the tests
# take the numerator and the denominator from normalize=False (with v, and with ones).
def normalize_output(q, k, o):
    k = k.cumsum(-2)
    z = (q * k).sum(-1, keepdim=True)
    return o / (z + 1e-10)


def naive_recurrent_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    scale: Optional[float] = None,
    normalize: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    dtype = q.dtype
    if scale is None:
        scale = q.shape[-1] ** -0.5
    B, T, H, K, V = *q.shape, v.shape[-1]
    # edit: was q, k, v = map(lambda x: x.to(torch.float32), (q, k, v))
    o = torch.empty_like(v)

    S = torch.zeros((B, H, K, V), device=q.device, dtype=q.dtype)  # edit: was dtype=torch.float32
    if initial_state is not None:
        S = S + initial_state
    for t in range(T):
        S = S + torch.einsum('b h k, b h v -> b h k v', k[:, t], v[:, t])
        o[:, t] = torch.einsum('b h k v, b h k -> b h v', S, q[:, t] * scale)
    if normalize:
        o = normalize_output(q * scale, k, o)
    return o.to(dtype), S if output_final_state else None


def elu_p1(x):  # fla/layers/delta_net.py
    return (F.elu(x, 1., False) + 1.).to(x)


# ------------------------------------------------------------- fla/modules/feature_map.py (fla-core 0.3.2)

def flatten_diag_outer_product_off1(x, y):  # edit: @checkpoint dropped
    z = torch.einsum("...i,...j->...ij", x, y)
    N = z.size(-1)
    indicies = torch.triu_indices(N, N, 1)
    indices2 = torch.arange(0, N)
    return z[..., indicies[0], indicies[1]], z[..., indices2, indices2]


class TaylorFeatureMap(nn.Module):
    def __init__(
        self,
        head_dim: int
    ):
        super().__init__()
        self.head_dim = head_dim
        self.r2 = math.sqrt(2)
        self.rd = math.sqrt(self.head_dim)
        self.rrd = math.sqrt(self.rd)

    def forward(self, x: torch.Tensor):
        x2_1, x2_2 = flatten_diag_outer_product_off1(x, x)
        return torch.cat([torch.ones_like(x[..., 0:1]), x / self.rrd, x2_2 / (self.rd * self.r2), x2_1 / self.rd], dim=-1)


# ------------------------------------ zoology/mixers/feature_maps/taylor.py (Zoology d88d6f5, Apache 2.0)

class TaylorExp(nn.Module):
    """
    Feature map to compute 2nd-order Taylor approx. of exp(q^T k / sqrt(d))
    """
    def __init__(self, input_dim: int, head_dim_idx: int = -1):  # edit: FeatureMap.__init__'s two fields inlined
        super().__init__()
        self.input_dim = input_dim
        self.head_dim_idx = head_dim_idx
        self.r2  = math.sqrt(2)
        self.rd  = math.sqrt(self.input_dim)
        self.rrd = math.sqrt(self.rd)

    def forward(self, x: torch.Tensor):
        # Get 2nd-order terms (rearrange(x * x), '... m n -> ... (m n)')
        x2 = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(start_dim=-2) / self.r2
        return torch.cat([torch.ones(x[..., :1].shape).to(x.device),
                          x / self.rrd, x2 / self.rd], dim=self.head_dim_idx)


# ---------------------------------------------- zoology/mixers/based.py, Based.forward (Zoology d88d6f5)

def zoology_based_linear(q, k, v, eps: float = 1e-12):
    """Based.forward's causal `train_view == "linear"` branch without the CUDA kernel, from the feature-mapped
    q, k (B, H, T, f) and v (B, H, T, d), as it reads there."""
    q, k, v = q.unsqueeze(-2), k.unsqueeze(-2), v.unsqueeze(-1)
    return ((q * (k * v).cumsum(dim=2)).sum(dim=-1) /
            ((q * k.cumsum(dim=2)).sum(dim=-1) + eps))
