"""Position schemes behind one interface, so attention never asks which scheme it runs.

A scheme implements any of three hooks; the defaults do nothing (NoPE implements none):
  embed(x, positions)          absolute schemes add a vector to the token embeddings
  rotate(q, k, positions)      RoPE rotates queries and keys before attention
  bias(q_positions, k_positions)  additive attention bias (ALiBi, T5 buckets, FIRE), (B|1, H, Tq, Tk)
Positions are explicit integer tensors of shape (B|1, T), so left padding, KV-cache decoding
and evaluation beyond the training length all go through the same code.

Context extension (`pos.scaling`, `pos.scaling_factor`): a scheme with a rotation (RoPE) or a table (learned)
can be stretched past the context it trained at, by the entries of POSITION_SCALINGS (PI, NTK-aware, YaRN, Llama 3),
through the same hooks, so training, evaluation and cached decoding all see the same scaled positions. Each is
tested against transformers' `modeling_rope_utils` (tests/model/test_position_scaling.py names the version).
"""
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.model.meta import counting
from blocklab.registry import Registry

POSITION_SCHEMES: Registry = Registry("pos.name", framework_args=("d_model", "n_heads", "d_head", "causal"))
POSITION_SCALINGS: Registry = Registry("pos.scaling")


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
    """A scheme's options are its constructor's keyword arguments past the four the model supplies. The
    context-extension options (`scaling`, `scaling_factor`, `yarn_alpha`, `yarn_beta`, `yarn_ramp`,
    `llama3_low_freq_factor`, `llama3_high_freq_factor`, `original_context`) are every scheme's; `scalings` says which methods a scheme can apply (none only, unless it rotates or has a table).
    `logit_scale` multiplies every attention logit q.k (YaRN's 1/t; RoPE folds it into its rotation, a kind that
    rotates only part of q and k, MLA, scales the rest itself)."""

    scalings: tuple[str, ...] = ("none",)
    logit_scale = 1.0

    def __init__(self, d_model: int, n_heads: int, d_head: int, causal: bool = True, scaling: str = "none",
                 scaling_factor: float = 1.0, yarn_alpha: float = 1.0, yarn_beta: float = 32.0,
                 yarn_ramp: str = "reference", llama3_low_freq_factor: float = 1.0,
                 llama3_high_freq_factor: float = 4.0, original_context: int | None = None):
        super().__init__()
        self.d_model, self.n_heads, self.d_head, self.causal = d_model, n_heads, d_head, causal
        self.memo = PerPositions()
        self.scaling = ScalingSpec(scaling, float(scaling_factor), float(yarn_alpha), float(yarn_beta),
                                   original_context, yarn_ramp, float(llama3_low_freq_factor),
                                   float(llama3_high_freq_factor))

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
    def rotates_only(cls) -> bool:
        """Whether the scheme acts only by rotating queries and keys (RoPE): an attention kind that skips the
        rotation then sees no positions at all."""
        return cls.rotate is not PositionScheme.rotate and cls.embed is PositionScheme.embed and not cls.adds_bias()

    @classmethod
    def derived_options(cls, cfg) -> dict:
        """Values of options left null ('derive it') in the config, from the model config."""
        return {}

    @classmethod
    def errors(cls, cfg, options: dict) -> list[str]:
        """Constraints on the model config and this scheme's (resolved) options, one line each. A subclass
        adds its own to these (the scaling options every scheme takes)."""
        return scaling_errors(cls, options)

    @classmethod
    def old_run_options(cls, options: dict) -> dict:
        """`options` (the pos group of a run saved by an older BlockLab: its .hydra/config.yaml's `pos`, or its
        model.json's pos options) with each key added since given the value that keeps what that run computed.
        pos.yarn_ramp (added with the reference ramp as its default): a YaRN run that lacks it ramped as the paper
        prints it; a run under any other scaling never read it, so it stays unset there."""
        if options.get("scaling") == "yarn" and "yarn_ramp" not in options:
            return {**options, "yarn_ramp": "paper"}
        return options


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


def rope_frequencies(base: float, dim: int, device=None) -> Tensor:
    """theta_i = base^(-2i/dim), i = 0 .. dim/2 - 1, in float32."""
    return base ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)


def _angles(positions: Tensor, dim: int, base: float) -> Tensor:
    """positions (B, T) -> angles (B, T, dim/2) with frequencies base^(-2i/dim)."""
    return positions.to(torch.float32)[..., None] * rope_frequencies(base, dim, positions.device)


# ------------------------------------------------------------------------------ context extension

@dataclass(frozen=True)
class ScalingSpec:
    """A scheme's context-extension settings: pos.scaling, pos.scaling_factor (s = target / trained context),
    YaRN's ramp bounds pos.yarn_alpha and pos.yarn_beta and its form pos.yarn_ramp (YARN_RAMPS), Llama 3's
    pos.llama3_low_freq_factor and pos.llama3_high_freq_factor, and pos.original_context (L, the trained context in
    tokens; null in the yaml: derived from the task)."""

    method: str = "none"
    factor: float = 1.0
    alpha: float = 1.0
    beta: float = 32.0
    original_context: int | None = None
    ramp: str = "reference"
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


@POSITION_SCALINGS.register("none")
class NoScaling:
    """The scheme as trained: positions, frequencies and logits untouched (pos.scaling_factor is not read)."""

    what = "leaves positions as trained"

    @staticmethod
    def errors(options: dict, d_head: int | None) -> list[str]:
        """This method's constraints on the scaling options, one line each."""
        return []

    @staticmethod
    def positions(positions: Tensor, spec: ScalingSpec) -> Tensor:
        """The positions a scheme reads in place of `positions` (the same tensor where unscaled)."""
        return positions

    @staticmethod
    def frequencies(base: float, dim: int, spec: ScalingSpec, device=None) -> Tensor:
        """RoPE's per-pair frequencies (dim/2,), float32."""
        return rope_frequencies(base, dim, device)

    @staticmethod
    def temperature(spec: ScalingSpec) -> float:
        """sqrt(1/t): multiplies q and k, so every logit q.k is multiplied by 1/t."""
        return 1.0


@POSITION_SCALINGS.register("pi")
class PositionInterpolation(NoScaling):
    """Chen et al. 2023, "Extending Context Window of Large Language Models via Positional Interpolation"
    (arXiv 2306.15595), eq. (4): f'(x, m) = f(x, m L / L'), i.e. position m is read as m / s with s = L'/L, so
    the position L s gets the angle (or the table row) of position L: no position is beyond those trained."""

    what = "rescales a rotation's positions or a learned table's rows"

    @staticmethod
    def errors(options, d_head):
        return factor_errors(options)

    @staticmethod
    def positions(positions, spec):
        return positions.to(torch.float32) / spec.factor


@POSITION_SCALINGS.register("ntk")
class NTKAware(NoScaling):
    """NTK-aware scaling (bloc97 2023), as the YaRN paper defines it (§3.1, eq. 16): the base is raised,
    b' = b s^(|D| / (|D| - 2)), so the lowest frequency is interpolated by s while the highest is kept. |D| is the
    rotated width (d_head, or ModelConfig.kind_rotated_width: attn.rope_dim under attn.kind=mla), so it needs |D| > 2."""

    what = "changes rotary frequencies"

    @staticmethod
    def errors(options, d_head):
        if d_head is not None and d_head <= 2:
            return factor_errors(options) + [
                f"pos.scaling=ntk raises the base by s^(d/(d-2)), undefined for a rotated width d of {d_head} (the "
                "head dimension, or attn.rope_dim under attn.kind=mla); rotate more dimensions per head or use "
                "pos.scaling=pi"]
        return factor_errors(options)

    @staticmethod
    def frequencies(base, dim, spec, device=None):
        if dim <= 2:  # refused by `errors` before any work; here so that no path divides by zero
            raise ValueError(f"pos.scaling=ntk needs a rotated width above 2 (got {dim})")
        return rope_frequencies(base * spec.factor ** (dim / (dim - 2)), dim, device)


# YaRN's ramp between interpolated and kept pairs: `reference` as the authors' code (jquesnelle/yarn) and
# transformers compute it, linear in the pair index; `paper` as §3.2 prints it, linear in r (jquesnelle/yarn
# issue #60 records the gap).
YARN_RAMPS = ("reference", "paper")


def ramp_in_r(dim: int, base: float, original_context: int, low: float, high: float) -> Tensor:
    """float64 per pair d = 0 .. dim/2 - 1: the wavelength lambda_d = 2 pi b^(2d/dim), r(d) = L / lambda_d (how many
    turns the pair makes over the trained context L), and gamma(r) = 0 for r < low, 1 for r > high, linear between.
    YaRN §3.2's ramp (low alpha, high beta) and Llama 3's smoothing (low_freq_factor, high_freq_factor)."""
    pair = torch.arange(dim // 2, dtype=torch.float64)
    wavelength = 2 * math.pi * base ** (2 * pair / dim)
    return ((original_context / wavelength - low) / (high - low)).clamp(0.0, 1.0)


def yarn_ramp(dim: int, base: float, original_context: int, alpha: float, beta: float,
              form: str = "reference") -> Tensor:
    """gamma per pair d = 0 .. dim/2 - 1, float64: 1 where the pair keeps its frequency, 0 where it is interpolated
    by s as by PI, between them a linear ramp.

    `paper` (YaRN §3.2): linear in r(d) = L / lambda_d from r = alpha to r = beta (`ramp_in_r`).
    `reference` (jquesnelle/yarn's `_yarn_find_correction_range` and `_yarn_linear_ramp_mask`; transformers'
    `_compute_yarn_parameters`, whose `beta_fast` is beta and `beta_slow` alpha): the pair index where r = beta,
    d(beta) = dim ln(L / (2 pi beta)) / (2 ln b), rounded down, and where r = alpha, rounded up, clamped to
    [0, dim - 1] (dim - 1, not dim/2 - 1, in both references), and gamma = 1 - clamp((d - low) / (high - low), 0, 1),
    linear in d between them (high nudged by 0.001 where the two meet). At a short trained context the rounding
    keeps the fastest pair exactly: at d_head 16, L 64, s 4 the paper form interpolates it 2.1x."""
    if form == "paper":
        return ramp_in_r(dim, base, original_context, alpha, beta)

    def pair_index(turns: float) -> float:
        return dim * math.log(original_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(pair_index(beta)), 0), min(math.ceil(pair_index(alpha)), dim - 1)
    if low == high:
        high += 0.001
    pair = torch.arange(dim // 2, dtype=torch.float64)
    return 1.0 - ((pair - low) / (high - low)).clamp(0.0, 1.0)


def _between(interpolated: Tensor, theta: Tensor, gamma: Tensor) -> Tensor:
    """(1 - gamma) theta/s + gamma theta, computed as theta/s + gamma (theta - theta/s): exactly theta at s = 1."""
    return interpolated + gamma.to(theta) * (theta - interpolated)


@POSITION_SCALINGS.register("yarn")
class YaRN(NoScaling):
    """Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models" (arXiv 2309.00071).
    §3.2, NTK-by-parts: h(theta_d) = (1 - gamma_d) theta_d / s + gamma_d theta_d: pairs that turn many times over
    the trained context (gamma 1) keep their frequency, those that turn less than alpha times are interpolated as
    by PI, a ramp between (`yarn_ramp`; pos.yarn_ramp picks its form, `reference` by default: as the authors' code
    and transformers run it). §3.4: the logits are divided by t, sqrt(1/t) = 0.1 ln(s) + 1 (eq. 22), which
    multiplies q and k through the rotation's magnitude, as transformers' attention factor multiplies cos and sin."""

    what = "changes rotary frequencies"

    @staticmethod
    def errors(options, d_head):
        errs = factor_errors(options)
        alpha, beta = options.get("yarn_alpha", 1.0), options.get("yarn_beta", 32.0)
        ramp = options.get("yarn_ramp", "reference")
        if not (_finite_number(alpha) and _finite_number(beta) and 0 <= alpha < beta):
            errs.append(f"pos.yarn_alpha={alpha!r}, pos.yarn_beta={beta!r}: YaRN's ramp needs 0 <= alpha < beta "
                        "(the paper's: 1 and 32)")
        elif ramp == "reference" and alpha == 0:
            errs.append("pos.yarn_alpha=0: the reference ramp ends at the pair that turns alpha times, which no pair "
                        "does at 0; use alpha > 0 (the paper's: 1) or pos.yarn_ramp=paper")
        return errs + context_errors(options, "yarn")

    @staticmethod
    def frequencies(base, dim, spec, device=None):
        theta = rope_frequencies(base, dim, device)
        gamma = yarn_ramp(dim, base, spec.original_context, spec.alpha, spec.beta, spec.ramp)
        return _between(theta / spec.factor, theta, gamma)

    @staticmethod
    def temperature(spec):
        return 0.1 * math.log(spec.factor) + 1.0


@POSITION_SCALINGS.register("llama3")
class Llama3(NoScaling):
    """Llama 3.1's RoPE scaling (Meta 2024; `apply_scaling` in meta-llama/llama-models, transformers'
    `_compute_llama3_parameters`): with lambda = 2 pi / theta and L the trained context, pairs whose wavelength
    exceeds L / low_freq_factor are interpolated by s, those shorter than L / high_freq_factor are kept, and between
    them the frequency is (1 - g) theta / s + g theta with g = (L / lambda - low) / (high - low): YaRN's paper ramp
    (`ramp_in_r`) with bounds low_freq_factor and high_freq_factor (Llama 3.1's 1 and 4), and no temperature."""

    what = "changes rotary frequencies"

    @staticmethod
    def errors(options, d_head):
        errs = factor_errors(options)
        low, high = options.get("llama3_low_freq_factor", 1.0), options.get("llama3_high_freq_factor", 4.0)
        if not (_finite_number(low) and _finite_number(high) and 0 < low < high):
            errs.append(f"pos.llama3_low_freq_factor={low!r}, pos.llama3_high_freq_factor={high!r}: Llama 3's "
                        "smoothing needs 0 < low < high (Llama 3.1's: 1 and 4)")
        return errs + context_errors(options, "llama3")

    @staticmethod
    def frequencies(base, dim, spec, device=None):
        theta = rope_frequencies(base, dim, device)
        gamma = ramp_in_r(dim, base, spec.original_context, spec.low_freq_factor, spec.high_freq_factor)
        return _between(theta / spec.factor, theta, gamma)


def context_errors(options: dict, method: str) -> list[str]:
    context = options.get("original_context")
    if isinstance(context, int) and not isinstance(context, bool) and context > 0:
        return []
    return [f"pos.original_context={context!r} must be a positive integer for pos.scaling={method}: the context the "
            "model trained at, in tokens (null: derived from the task)"]


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The largest context extension: a million times the trained context is past any length a run here evaluates, and
# keeps NTK's base b s^(d/(d-2)) (s^2 at the smallest head it allows, 4) and YaRN's ln(s) finite.
MAX_SCALING_FACTOR = 10 ** 6


def factor_errors(options: dict) -> list[str]:
    factor = options.get("scaling_factor", 1.0)
    if _finite_number(factor) and 1 <= factor <= MAX_SCALING_FACTOR:
        return []
    return [f"pos.scaling_factor={factor!r} must be a finite number >= 1 and at most {MAX_SCALING_FACTOR:,} (the "
            "target context over the trained one; 1: unscaled)"]


def scaling_errors(scheme: type, options: dict, d_head: int | None = None) -> list[str]:
    """The scaling options of `scheme` (a PositionScheme class) with its resolved `options`, one line each."""
    context = options.get("original_context")
    if context is not None and not (isinstance(context, int) and not isinstance(context, bool) and context > 0):
        # checked whatever pos.scaling is: analyze --eval-scaling applies a scaling to the trained run later, and
        # reads the context it trained at from here
        return [f"pos.original_context={context!r} must be null (derived from the task) or a positive integer: the "
                "context the model trained at, in tokens (YaRN's L, which --eval-scaling uses too)"]
    method = options.get("scaling", "none")
    if method not in POSITION_SCALINGS:
        return [POSITION_SCALINGS.unknown(method)]
    ramp = options.get("yarn_ramp", "reference")
    if ramp not in YARN_RAMPS:
        return [f"pos.yarn_ramp={ramp!r} is unknown; use reference (linear in the pair index, as YaRN's code and "
                "transformers) or paper (linear in r, as §3.2 prints it)"]
    if method not in scheme.scalings:
        able = [name for name in POSITION_SCHEMES if method in getattr(POSITION_SCHEMES[name], "scalings", ())]
        return [f"pos.scaling={method} {POSITION_SCALINGS[method].what}, which "
                f"pos={getattr(scheme, 'registry_name', scheme.__name__)} does not have; use pos.scaling=none, or "
                f"pos={' or pos='.join(able)}"]
    return POSITION_SCALINGS[method].errors(options, d_head)


@POSITION_SCHEMES.register("sinusoidal")
class Sinusoidal(PositionScheme):
    """Vaswani et al.: PE[p, 2i] = sin(p w_i), PE[p, 2i+1] = cos(p w_i), w_i = base^(-2i/d), added to
    the token embeddings multiplied by sqrt(d) as in the paper (scale_embeddings). Unscaled, a
    small-init embedding is drowned by the unit-amplitude PE and a model barely learns."""

    def __init__(self, d_model, n_heads, d_head, causal=True, base: float = 10000.0, scale_embeddings: bool = True,
                 **scaling):
        super().__init__(d_model, n_heads, d_head, causal, **scaling)
        self.base = base
        self.embed_scale = math.sqrt(d_model) if scale_embeddings else 1.0

    @classmethod
    def errors(cls, cfg, options):
        errs = [f"pos=sinusoidal needs an even model.d_model (got {cfg.d_model})"] if cfg.d_model % 2 else []
        return scaling_errors(cls, options) + errs + base_errors(options["base"])

    def table(self, positions: Tensor) -> Tensor:
        return self.memo.get((positions,), (), lambda: self._table(positions))

    def _table(self, positions: Tensor) -> Tensor:
        angles = _angles(positions, self.d_model, self.base)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)

    def embed(self, x, positions):
        return x * self.embed_scale + self.table(positions).to(x.dtype)


@POSITION_SCHEMES.register("learned")
class Learned(PositionScheme):
    """A trained vector per absolute position (GPT-2). Positions past the table are an error. Under
    pos.scaling=pi (Chen et al. 2023, §2.3 "the position embeddings ... interpolated") position p reads the table
    at p/s, linearly between the two rows around it, so a model shown s times its trained length sees only the
    positions it trained."""

    scalings = ("none", "pi")

    def __init__(self, d_model, n_heads, d_head, causal=True, max_len: int = 512, **scaling):
        super().__init__(d_model, n_heads, d_head, causal, **scaling)
        self.max_len = max_len
        self.table = nn.Embedding(max_len, d_model)

    @classmethod
    def derived_options(cls, cfg):
        return {"max_len": cfg.max_len}  # the table covers the longest sequence trained or evaluated

    @classmethod
    def errors(cls, cfg, options):
        errs = scaling_errors(cls, options)
        if options["max_len"] < cfg.max_len:
            errs.append(f"pos.max_len={options['max_len']} is shorter than the longest sequence to train or evaluate "
                        f"({cfg.max_len} tokens); raise pos.max_len or set it to null (auto)")
        return errs

    def embed(self, x, positions):
        scaled = POSITION_SCALINGS[self.scaling.method].positions(positions, self.scaling)
        if positions.numel() and float(scaled.max()) > self.max_len - 1:
            raise ValueError(
                f"position {int(positions.max())} is past the learned table (pos.max_len={self.max_len}); "
                "raise pos.max_len or use shorter sequences"
            )
        if scaled is positions:
            return x + self.table(positions)
        # Interpolated: row floor(p/s) and the next, weighted by the fraction (weight 0: the row itself, exactly).
        low = scaled.floor()
        below = low.long()
        above = (below + 1).clamp(max=self.max_len - 1)
        weight = (scaled - low)[..., None].to(self.table.weight.dtype)
        return x + torch.lerp(self.table(below), self.table(above), weight)


@POSITION_SCHEMES.register("rope")
class RoPE(PositionScheme):
    """Su et al.: rotate each pair (x_2i, x_2i+1) of q and k by angle p * base^(-2i/d_head). Under pos.scaling
    the positions, the frequencies and the logits' temperature are the scaling's (POSITION_SCALINGS); the
    temperature sqrt(1/t) multiplies q and k through the rotation's magnitude, as YaRN's reference code does.
    The rotated width is d_head, or the attention kind's (ModelConfig.kind_rotated_width: MLA's attn.rope_dim)."""

    scalings = ("none", "pi", "ntk", "yarn", "llama3")

    def __init__(self, d_model, n_heads, d_head, causal=True, base: float = 10000.0, rotary_fraction: float = 1.0,
                 rotary_form: str = "frequencies", **scaling):
        super().__init__(d_model, n_heads, d_head, causal, **scaling)
        self.base = base
        self.rotary_fraction, self.rotary_form = float(rotary_fraction), rotary_form
        self.logit_scale = POSITION_SCALINGS[self.scaling.method].temperature(self.scaling) ** 2

    @classmethod
    def errors(cls, cfg, options):
        own = cfg.kind_rotated_width
        errs = scaling_errors(cls, options, d_head=cfg.d_head if own is None else own)
        if own is None and cfg.d_head % 2:  # a kind that rotates a width of its own (MLA) checks it itself
            return errs + [f"pos=rope needs an even head dimension, but model.d_model/model.n_heads = {cfg.d_head}; "
                           "change model.n_heads or model.d_model"]
        return errs + base_errors(options["base"]) + partial_rotary_errors(options, d_head=cfg.d_head if own is None
                                                                          else own)

    def rotate(self, q, k, positions):
        # the rotated width is q's: d_head, or a part of it (MLA's decoupled RoPE dimensions); under
        # rotary_form=dimensions only its first rotary_fraction of it (GPT-NeoX's rotary_pct)
        width = q.shape[-1]
        rotated = rotated_dimensions(width, self.rotary_fraction, self.rotary_form)
        rotation = self.rotations(positions, q.dtype, rotated)
        if rotated == width:
            return _rotate_pairs(q, rotation), _rotate_pairs(k, rotation)
        return tuple(torch.cat([_rotate_pairs(x[..., :rotated], rotation), x[..., rotated:]], dim=-1) for x in (q, k))

    def rotations(self, positions: Tensor, dtype: torch.dtype, dim: int | None = None) -> Tensor:
        """exp(i angle) for every position and frequency, (B|1, 1, T, dim/2), once per positions tensor; dim
        (default d_head) the rotated width, its frequencies base^(-2i/dim)."""
        dim = self.d_head if dim is None else dim

        def make():
            scaling = POSITION_SCALINGS[self.scaling.method]
            frequencies = scaling.frequencies(self.base, dim, self.scaling, positions.device)
            if self.rotary_form == "frequencies" and self.rotary_fraction < 1:
                frequencies = kept_frequencies(frequencies, dim, self.rotary_fraction)
            scaled = scaling.positions(positions, self.scaling)
            angles = (scaled.to(torch.float32)[..., None] * frequencies)[:, None]
            magnitude = torch.full_like(angles, scaling.temperature(self.scaling))  # 1 but under YaRN
            return torch.polar(magnitude, angles).to(_COMPLEX[_rotation_dtype(dtype)])

        return self.memo.get((positions,), (dtype, dim), make)


# ------------------------------------------------------------------------------ partial rotation

# pos.rotary_form: how pos.rotary_fraction < 1 leaves part of q and k unrotated.
ROTARY_FORMS = {
    # p-RoPE (Barbero et al. 2025, "Round and Round We Go! What makes Rotary Positional Encodings useful?", ICLR;
    # reference: google-deepmind/gemma, gemma/positional_embeddings.py apply_rope's rope_proportion): the first
    # int(p * d // 2) pairs keep their frequencies base^(-2i/d), the lowest ones get frequency 0 (left unrotated).
    "frequencies": "keep the highest fraction of frequencies, leave the lowest pairs unrotated (p-RoPE)",
    # GPT-NeoX's rotary_pct (EleutherAI/gpt-neox, megatron/model/positional_embeddings.py; transformers'
    # GPTNeoXRotaryEmbedding): the first int(d * p) dimensions are rotated with frequencies base^(-2i/(d p)).
    "dimensions": "rotate the first fraction of dimensions with their own frequencies (GPT-NeoX rotary_pct)",
}


def kept_frequencies(frequencies: Tensor, dim: int, fraction: float) -> Tensor:
    """p-RoPE's frequencies: the first int(fraction * dim // 2) kept, the rest 0 (gemma's rope_angles)."""
    kept = int(fraction * dim // 2)
    return torch.cat([frequencies[:kept], frequencies.new_zeros(frequencies.shape[0] - kept)])


def rotated_dimensions(width: int, fraction: float, form: str) -> int:
    """How many leading dimensions of a width-`width` q or k are rotated: all of them, but int(width * fraction)
    under rotary_form=dimensions (GPT-NeoX's rotary_ndims)."""
    return int(width * fraction) if form == "dimensions" and fraction < 1 else width


def partial_rotary_errors(options: dict, d_head: int) -> list[str]:
    fraction, form = options.get("rotary_fraction", 1.0), options.get("rotary_form", "frequencies")
    if form not in ROTARY_FORMS:
        return [f"pos.rotary_form={form!r} is unknown; use one of {sorted(ROTARY_FORMS)}"]
    if not (isinstance(fraction, (int, float)) and 0 <= fraction <= 1):
        return [f"pos.rotary_fraction={fraction!r} must be in [0, 1] (1: every pair rotated, as plain RoPE)"]
    rotated = rotated_dimensions(d_head, fraction, form)
    if rotated != d_head and rotated % 2:  # an odd head width itself is the scheme's or the kind's own error
        return [f"pos.rotary_fraction={fraction} rotates int({d_head} * {fraction}) = {rotated} dimensions, an odd "
                f"number (rotation acts on pairs); choose a fraction giving an even count"]
    if fraction < 1 and options.get("scaling", "none") != "none":
        return [f"pos.rotary_fraction={fraction} with pos.scaling={options['scaling']}: the context-extension "
                "methods are defined (and tested) on every pair; use pos.rotary_fraction=1 or pos.scaling=none"]
    return []


_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def _rotation_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in _COMPLEX else torch.float32  # half precisions rotate in float32


def _rotate_pairs(x: Tensor, rotation: Tensor) -> Tensor:
    """Each pair as one complex number times exp(i angle): one kernel forward and one backward,
    where the same rotation in real arithmetic takes 4-7 (`python -m blocklab.bench step`: rope vs none)."""
    work = x.to(_rotation_dtype(x.dtype))
    if any(stride % 2 for stride in work.stride()[:-1]):  # a slice of an odd-width projection (MLA's k^R)
        work = work.contiguous()
    pairs = torch.view_as_complex(work.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


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


def build_position(name: str, d_model: int, n_heads: int, d_head: int, causal: bool, **options) -> PositionScheme:
    return POSITION_SCHEMES[name](d_model, n_heads, d_head, causal, **options)
