"""Position schemes that add a bias to the attention scores (the `bias` hook of model/position.py's PositionScheme):
ALiBi's fixed slopes, T5's learned buckets and FIRE's learned function of the normalised distance. Each bias is an
(B|1, H, Tq, Tk) float mask that SDPA reads whole, so its memory grows with the square of the length
(docs/measurements/2026-11-28-attention-bench.md). Registered in POSITION_SCHEMES when blocklab.model is imported."""
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.model.meta import counting
from blocklab.model.position import POSITION_SCHEMES, PositionScheme, scaling_errors


def alibi_slopes(n_heads: int) -> Tensor:
    """Press et al.: geometric slopes 2^(-8/n), 2^(-16/n), ...; for n not a power of two,
    the slopes of the nearest lower power of two plus every other slope of the next one."""
    if counting():  # the shape only (model/size.py)
        return torch.empty(n_heads)

    def geometric(n):
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    lower = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(lower)
    if lower < n_heads:
        slopes += geometric(2 * lower)[0::2][: n_heads - lower]
    return torch.tensor(slopes)


@POSITION_SCHEMES.register("alibi")
class ALiBi(PositionScheme):
    """Linear distance penalty per head: bias = -slope_h * |i - j|."""

    def __init__(self, d_model, n_heads, d_head, causal=True, **scaling):
        super().__init__(d_model, n_heads, d_head, causal, **scaling)
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def bias(self, q_positions, k_positions):
        # Nothing here is trained: the whole bias is computed once per pair of position tensors.
        return self.memo.get((q_positions, k_positions), (self.slopes.dtype, self.slopes.device),
                             lambda: self._bias(q_positions, k_positions))

    def _bias(self, q_positions, k_positions):
        distance = (q_positions[:, :, None] - k_positions[:, None, :]).abs()  # (B, Tq, Tk)
        return -self.slopes[None, :, None, None] * distance[:, None].to(self.slopes.dtype)


def t5_buckets(relative: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """Raffel et al.: relative = key - query. Exact buckets for small distances, then
    logarithmic buckets up to max_distance, beyond which all distances share the last bucket."""
    bucket = torch.zeros_like(relative)
    distance = -relative  # how far back the key is
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (distance < 0).long() * num_buckets
        distance = distance.abs()
    else:
        distance = distance.clamp(min=0)
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, large)


@POSITION_SCHEMES.register("t5_bias")
class T5Bias(PositionScheme):
    """A learned scalar per (bucketed relative distance, head), shared by all layers."""

    def __init__(self, d_model, n_heads, d_head, causal=True, num_buckets: int = 32, max_distance: int = 128,
                 **scaling):
        super().__init__(d_model, n_heads, d_head, causal, **scaling)
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.table = nn.Embedding(num_buckets, n_heads)

    @classmethod
    def errors(cls, cfg, options):
        buckets, distance = options.get("num_buckets", 32), options.get("max_distance", 128)
        exact = buckets // (2 if not cfg.attn.causal else 1) // 2
        if buckets < 4 or distance <= exact:
            return scaling_errors(cls, options) + [f"pos.num_buckets={buckets} / pos.max_distance={distance}: need num_buckets >= 4 and "
                    f"max_distance > {exact} (the exact-bucket range)"]
        return scaling_errors(cls, options)

    def bias(self, q_positions, k_positions):
        # The buckets depend on positions only (computed once per pair); the table lookup is trained.
        return self.table(self.buckets(q_positions, k_positions)).permute(0, 3, 1, 2)

    def buckets(self, q_positions, k_positions):
        def make():
            relative = k_positions[:, None, :] - q_positions[:, :, None]  # (B, Tq, Tk)
            return t5_buckets(relative, not self.causal, self.num_buckets, self.max_distance)

        return self.memo.get((q_positions, k_positions), (), make)


@POSITION_SCHEMES.register("fire")
class FIRE(PositionScheme):
    """FIRE, Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context
    Transformers" (arXiv 2310.04418, ICLR 2024): a learned function of the relative distance, normalised
    by the query's position ("progressive interpolation"), added to the scores of head h:

        bias_h(i, j) = f_theta(psi(i - j) / psi(max(L, i)))_h,   psi(x) = log(c x + 1)

    i the query's and j the key's position (computed from the position tensors given, never from
    0..T-1, so arbitrary position ids work), f_theta(x) = W2 relu(w1 x + b1) an MLP 1 -> mlp_hidden ->
    n_heads (the paper's: 32 wide), c and L trained. As in the paper's reference code: psi uses |c| (c
    starts at init_c = 0.1); L = init_L * |L_scale|, L_scale trained from 1 (init_L = 512), so abs keeps
    L >= 0 and L's steps scale with its size; eps = 1e-6 is added to the denominator, which keeps the
    ratio finite should c or L reach 0. Below position L every query shares the normaliser psi(L): the
    bias is then a function of i - j alone. Unlike that code, f_theta's output layer has no bias: a
    constant per head, added to every score of a softmax row, cancels; it could never change the model,
    and its gradient is exactly zero (rounding noise, which AdamW would turn into full-size steps).
    Causal attention only ever unmasks i >= j, where this is the paper's formula. Non-causal attention
    (the paper's formula is causal) uses its signed extension, sign(i - j) psi(|i - j|) / psi(max(L, i)):
    keys after the query feed f_theta negative inputs, so the bias can tell left from right, as T5's
    bidirectional buckets do; one formula serves both, so the causal flag is not consulted.
    One FIRE serves all layers, as t5_bias does here (one bias per pass): the paper's FIRE learns one per
    layer; this is its layer-shared variant (FIRE-S). f_theta keeps nn.Linear's initialisation (uniform
    in +-1/sqrt(fan_in): w1 and b1 in +-1, W2 in +-1/sqrt(mlp_hidden)) whatever init.name says: it is held
    as plain parameters, not nn.Linear, because the model-wide schemes (normal: N(0, 0.02), zero biases)
    would make a 1-input MLP a near-zero linear function of its input. f_theta and psi run in the
    parameters' dtype with autocast off: in bfloat16, nearby normalised distances would collapse."""

    eps = 1e-6

    def __init__(self, d_model, n_heads, d_head, causal=True, mlp_hidden: int = 32, init_c: float = 0.1,
                 init_L: float = 512.0, **scaling):
        super().__init__(d_model, n_heads, d_head, causal, **scaling)
        self.init_L = float(init_L)
        self.c = nn.Parameter(torch.tensor(float(init_c)))
        self.L_scale = nn.Parameter(torch.tensor(1.0))
        self.w1 = nn.Parameter(torch.empty(mlp_hidden, 1).uniform_(-1, 1))  # fan-in 1
        self.b1 = nn.Parameter(torch.empty(mlp_hidden).uniform_(-1, 1))
        bound = 1 / math.sqrt(mlp_hidden)
        self.w2 = nn.Parameter(torch.empty(n_heads, mlp_hidden).uniform_(-bound, bound))

    @classmethod
    def errors(cls, cfg, options):
        errs = scaling_errors(cls, options)
        hidden = options.get("mlp_hidden", 32)
        if not (isinstance(hidden, int) and not isinstance(hidden, bool) and hidden > 0):
            errs.append(f"pos.mlp_hidden={hidden!r} must be a positive integer (the width of FIRE's MLP; "
                        "the paper's is 32)")
        for key, default, why in (("init_c", 0.1, "psi(x) = log(c x + 1) is constant at c = 0"),
                                  ("init_L", 512.0, "the threshold L of max(L, i)")):
            value = options.get(key, default)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and value > 0):
                errs.append(f"pos.{key}={value!r} must be a finite number > 0 ({why}); the paper's is {default}")
        return errs

    @property
    def L(self) -> Tensor:
        """The threshold L, kept positive by abs."""
        return self.L_scale.abs() * self.init_L

    def bias(self, q_positions, k_positions):
        # Only the geometry is remembered (it depends on positions alone); c, L and f_theta are trained.
        sign, distance, query = self.memo.get((q_positions, k_positions), (self.c.dtype, self.c.device),
                                              lambda: self._geometry(q_positions, k_positions))
        with torch.autocast(self.c.device.type, enabled=False):
            c = self.c.abs()
            normalised = sign * torch.log1p(c * distance) / (torch.log1p(c * torch.maximum(query, self.L)) + self.eps)
            hidden = torch.relu(F.linear(normalised[..., None], self.w1, self.b1))
            return F.linear(hidden, self.w2).permute(0, 3, 1, 2)  # (B|1, H, Tq, Tk)

    def _geometry(self, q_positions, k_positions):
        """sign(i - j) and |i - j|, (B|1, Tq, Tk), and i, (B|1, Tq, 1), in the parameters' dtype."""
        relative = (q_positions[:, :, None] - k_positions[:, None, :]).to(self.c.dtype)
        return relative.sign(), relative.abs(), q_positions[:, :, None].to(self.c.dtype)
