"""Context extension for position schemes (`pos.scaling`, `pos.scaling_factor`): the entries of POSITION_SCALINGS
(PI, NTK-aware, YaRN, Llama 3) stretch a rotation's frequencies or a table's positions past the context a model
trained at, and set the logits' temperature, through the hooks of model/position.py's schemes. Each is tested
against transformers' `modeling_rope_utils` (tests/model/test_position_scaling.py names the version)."""
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from blocklab.registry import Registry

POSITION_SCALINGS: Registry = Registry("pos.scaling")


def rope_frequencies(base: float, dim: int, device=None) -> Tensor:
    """theta_i = base^(-2i/dim), i = 0 .. dim/2 - 1, in float32."""
    return base ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)


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
