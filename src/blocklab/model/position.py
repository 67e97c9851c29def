"""Position schemes behind one interface, so attention never asks which scheme it runs.

A scheme implements any of three hooks; the defaults do nothing (NoPE implements none):
  embed(x, positions)          absolute schemes add a vector to the token embeddings
  rotate(q, k, positions)      RoPE rotates queries and keys before attention
  bias(q_positions, k_positions)  additive attention bias (ALiBi, T5 buckets, FIRE), (B|1, H, Tq, Tk)
Positions are explicit integer tensors of shape (B|1, T), so left padding, KV-cache decoding
and evaluation beyond the training length all go through the same code.
"""
import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.registry import Registry

POSITION_SCHEMES: Registry = Registry("pos.name", framework_args=("d_model", "n_heads", "d_head", "causal"))


class PerPositions:
    """Remembers what a scheme derived from the last few position tensors. Every layer of a pass sees
    the same positions object, and default positions are one shared tensor per length
    (`default_positions`), so tables are built once per length, not once per layer and step.
    Keyed by identity and version: a new or modified positions tensor is always recomputed
    (inference tensors, made during decoding, carry no version and are keyed by identity alone)."""

    def __init__(self, size: int = 4):
        self.size, self.entries = size, OrderedDict()

    def get(self, tensors: tuple[Tensor, ...], extra: tuple, make):
        key = tuple((id(t), -1 if t.is_inference() else t._version) for t in tensors) + extra
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key][1]
        with torch.inference_mode(False):  # a table first built during validation must serve training too
            value = make()
        self.entries[key] = (tensors, value)  # holding the tensors keeps their ids from being reused
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


_DEFAULT_POSITIONS: dict = {}


def default_positions(length: int, device) -> Tensor:
    """Positions 0..length-1 as (1, length): one shared, never-modified tensor per length and device."""
    key = (length, str(device))
    if key not in _DEFAULT_POSITIONS:
        with torch.inference_mode(False):
            _DEFAULT_POSITIONS[key] = torch.arange(length, device=device)[None]
    return _DEFAULT_POSITIONS[key]


class PositionScheme(nn.Module):
    """A scheme's options are its constructor's keyword arguments past the four the model supplies."""

    def __init__(self, d_model: int, n_heads: int, d_head: int, causal: bool = True):
        super().__init__()
        self.d_model, self.n_heads, self.d_head, self.causal = d_model, n_heads, d_head, causal
        self.memo = PerPositions()

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return x

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return q, k

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        return None

    @classmethod
    def adds_bias(cls) -> bool:
        """Whether the scheme adds to attention scores (so bounds on q.k alone do not hold)."""
        return cls.bias is not PositionScheme.bias

    @classmethod
    def derived_options(cls, cfg) -> dict:
        """Values of options left null ('derive it') in the config, from the model config."""
        return {}

    @classmethod
    def errors(cls, cfg, options: dict) -> list[str]:
        """Constraints on the model config and this scheme's (resolved) options, one line each."""
        return []


@POSITION_SCHEMES.register("none")
class NoPE(PositionScheme):
    """No positional information; a causal mask still breaks permutation symmetry."""


def base_errors(base: float) -> list[str]:
    """The frequencies base^(-2i/d) fall from 1 towards 1/base only for base > 1: base 1 gives every pair the same
    frequency, below 1 they grow past 1 radian per position, and base <= 0 is NaN at the first step."""
    if base > 1:
        return []
    return [f"pos.base={base!r} must be > 1 (frequencies base^(-2i/d) fall from 1 to 1/base; "
            "the papers use 10000)"]


def _angles(positions: Tensor, dim: int, base: float) -> Tensor:
    """positions (B, T) -> angles (B, T, dim/2) with frequencies base^(-2i/dim)."""
    inv_freq = base ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    return positions.to(torch.float32)[..., None] * inv_freq


@POSITION_SCHEMES.register("sinusoidal")
class Sinusoidal(PositionScheme):
    """Vaswani et al.: PE[p, 2i] = sin(p w_i), PE[p, 2i+1] = cos(p w_i), w_i = base^(-2i/d), added to
    the token embeddings multiplied by sqrt(d) as in the paper (scale_embeddings). Unscaled, a
    small-init embedding is drowned by the unit-amplitude PE and a model barely learns."""

    def __init__(self, d_model, n_heads, d_head, causal=True, base: float = 10000.0, scale_embeddings: bool = True):
        super().__init__(d_model, n_heads, d_head, causal)
        self.base = base
        self.embed_scale = math.sqrt(d_model) if scale_embeddings else 1.0

    @classmethod
    def errors(cls, cfg, options):
        errs = [f"pos=sinusoidal needs an even model.d_model (got {cfg.d_model})"] if cfg.d_model % 2 else []
        return errs + base_errors(options["base"])

    def table(self, positions: Tensor) -> Tensor:
        return self.memo.get((positions,), (), lambda: self._table(positions))

    def _table(self, positions: Tensor) -> Tensor:
        angles = _angles(positions, self.d_model, self.base)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)

    def embed(self, x, positions):
        return x * self.embed_scale + self.table(positions).to(x.dtype)


@POSITION_SCHEMES.register("learned")
class Learned(PositionScheme):
    """A trained vector per absolute position (GPT-2). Positions past the table are an error."""

    def __init__(self, d_model, n_heads, d_head, causal=True, max_len: int = 512):
        super().__init__(d_model, n_heads, d_head, causal)
        self.max_len = max_len
        self.table = nn.Embedding(max_len, d_model)

    @classmethod
    def derived_options(cls, cfg):
        return {"max_len": cfg.max_len}  # the table covers the longest sequence trained or evaluated

    @classmethod
    def errors(cls, cfg, options):
        if options["max_len"] < cfg.max_len:
            return [f"pos.max_len={options['max_len']} is shorter than the longest sequence to train or evaluate "
                    f"({cfg.max_len} tokens); raise pos.max_len or set it to null (auto)"]
        return []

    def embed(self, x, positions):
        if positions.numel() and int(positions.max()) >= self.max_len:
            raise ValueError(
                f"position {int(positions.max())} is past the learned table (pos.max_len={self.max_len}); "
                "raise pos.max_len or use shorter sequences"
            )
        return x + self.table(positions)


@POSITION_SCHEMES.register("rope")
class RoPE(PositionScheme):
    """Su et al.: rotate each pair (x_2i, x_2i+1) of q and k by angle p * base^(-2i/d_head)."""

    def __init__(self, d_model, n_heads, d_head, causal=True, base: float = 10000.0):
        super().__init__(d_model, n_heads, d_head, causal)
        self.base = base

    @classmethod
    def errors(cls, cfg, options):
        if cfg.d_head % 2:
            return [f"pos=rope needs an even head dimension, but model.d_model/model.n_heads = {cfg.d_head}; "
                    "change model.n_heads or model.d_model"]
        return base_errors(options["base"])

    def rotate(self, q, k, positions):
        rotation = self.rotations(positions, q.dtype)
        return _rotate_pairs(q, rotation), _rotate_pairs(k, rotation)

    def rotations(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """exp(i angle) for every position and frequency, (B|1, 1, T, d_head/2), once per positions tensor."""
        def make():
            angles = _angles(positions, self.d_head, self.base)[:, None]
            return torch.polar(torch.ones_like(angles), angles).to(_COMPLEX[_rotation_dtype(dtype)])

        return self.memo.get((positions,), (dtype,), make)


_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def _rotation_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in _COMPLEX else torch.float32  # half precisions rotate in float32


def _rotate_pairs(x: Tensor, rotation: Tensor) -> Tensor:
    """Each pair as one complex number times exp(i angle): one kernel forward and one backward,
    where the same rotation in real arithmetic takes 4-7 (`python -m blocklab.bench step`: rope vs none)."""
    work = x.to(_rotation_dtype(x.dtype))
    pairs = torch.view_as_complex(work.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def alibi_slopes(n_heads: int) -> Tensor:
    """Press et al.: geometric slopes 2^(-8/n), 2^(-16/n), ...; for n not a power of two,
    the slopes of the nearest lower power of two plus every other slope of the next one."""

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

    def __init__(self, d_model, n_heads, d_head, causal=True):
        super().__init__(d_model, n_heads, d_head, causal)
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

    def __init__(self, d_model, n_heads, d_head, causal=True, num_buckets: int = 32, max_distance: int = 128):
        super().__init__(d_model, n_heads, d_head, causal)
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.table = nn.Embedding(num_buckets, n_heads)

    @classmethod
    def errors(cls, cfg, options):
        buckets, distance = options.get("num_buckets", 32), options.get("max_distance", 128)
        exact = buckets // (2 if not cfg.attn.causal else 1) // 2
        if buckets < 4 or distance <= exact:
            return [f"pos.num_buckets={buckets} / pos.max_distance={distance}: need num_buckets >= 4 and "
                    f"max_distance > {exact} (the exact-bucket range)"]
        return []

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
                 init_L: float = 512.0):
        super().__init__(d_model, n_heads, d_head, causal)
        self.init_L = float(init_L)
        self.c = nn.Parameter(torch.tensor(float(init_c)))
        self.L_scale = nn.Parameter(torch.tensor(1.0))
        self.w1 = nn.Parameter(torch.empty(mlp_hidden, 1).uniform_(-1, 1))  # fan-in 1
        self.b1 = nn.Parameter(torch.empty(mlp_hidden).uniform_(-1, 1))
        bound = 1 / math.sqrt(mlp_hidden)
        self.w2 = nn.Parameter(torch.empty(n_heads, mlp_hidden).uniform_(-bound, bound))

    @classmethod
    def errors(cls, cfg, options):
        errs = []
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


def build_position(name: str, d_model: int, n_heads: int, d_head: int, causal: bool, **options) -> PositionScheme:
    return POSITION_SCHEMES[name](d_model, n_heads, d_head, causal, **options)
