"""How a model's initialization, learning rates and multipliers scale with its width (`param`): `sp`, the standard
parametrization (every weight the same learning rate, the init scheme's std whatever the width), and `mup`, the
Maximal Update Parametrization for Adam (Yang et al. 2022, "Tensor Programs V: Tuning Large Neural Networks via
Zero-Shot Hyperparameter Transfer", arXiv 2203.03466, Table 3; Yang & Hu 2021, "Tensor Programs IV"), under which the
learning rate tuned at one width serves every width.

Under `mup` (rules from Microsoft's `mup` package, github.com/microsoft/mup at 1981497: mup/layer.py MuReadout and
MuSharedReadout, mup/optim.py MuAdam, mup/init.py, mup/shape.py set_base_shapes; and EleutherAI's nanoGPT-mup,
github.com/EleutherAI/nanoGPT-mup at b2a5e60, model.py):
- width is d_model, grown at a fixed head width d_head (more heads), d_ff and n_kv_heads in proportion (MQA's one
  K/V head stays one), from
  `param.base_width` (64). At the base width `mup` is `sp` but for the attention scale.
- Which dimensions of a weight are widths is read as the package's set_base_shapes does: the model is built (on the
  meta device) at the base width and at twice it, and a dimension that differs is a width, with multiplier
  m = its size / its size at the base width.
- hidden (matrix-like: two width dimensions) weights: init std times m^(-1/2), so that it goes as 1/sqrt(fan_in)
  (mup.init's constant_std_init_), Adam learning rate times 1/m and weight decay times m (MuAdam: torch's AdamW decays
  by lr * wd, which so stays the same; nanoGPT-mup leaves the decay to shrink with the rate instead).
- the output layer (the LM head): its input multiplied by 1/m (the readout multiplier), its weight at the base
  lr and the init scheme's std (MuReadout). Tied to the token embeddings, the shared weight is the embedding's, at the
  base lr, and the multiplier is the head's alone (MuSharedReadout; nanoGPT-mup scales x before lm_head the same).
- other layers from a width to a fixed size (an MoE router, GLA's low-rank gate, BERT's next-sentence classifier):
  Table 3's output weights without a multiplier, init std times 1/m, lr times 1/m (wd times m). (The package asserts
  such a layer be a MuReadout; the two forms train alike under Adam.)
- embeddings, biases, norm gains and every other vector-like weight (one width dimension or none): as under `sp`.
- attention: scores scaled by 1/d_head instead of 1/sqrt(d_head) (scale_factor still multiplies), in kinds whose
  scale is a softmax temperature (softmax, ssmax, mla, linformer, performer, based's window). Linear attention, GLA
  and DeltaNet have none: there `mup` sets their projections only. An explicit attn.scale is kept.
- the init scheme's std is its value at the base width: `mup` takes only schemes whose std does not depend on width
  (normal, gpt2, zero_branch); xavier, small, default, deepnet and fixup already scale with width and are refused.
Limits: rows stacked in one matrix take the matrix's rule (MLA's W_DKV rows, to a latent of fixed size, are treated
as hidden rows); zero init of the readout and queries (the package's option) is not offered.
"""
import math
from dataclasses import replace
from fractions import Fraction

import torch
from torch import nn

from blocklab.model.architectures import ARCHITECTURES
from blocklab.registry import Registry

PARAMETRIZATIONS: Registry = Registry("param.name")


class Readout(nn.Linear):
    """The output layer, bias-free: logits = (multiplier x) W^T (mup's MuReadout; 1 under sp). The multiplier scales the
    input, as nanoGPT-mup does: the same logits, on d_model numbers rather than the vocabulary's."""

    def __init__(self, d_in: int, d_out: int, multiplier: float = 1.0):
        super().__init__(d_in, d_out, bias=False)
        self.multiplier = multiplier

    def forward(self, x):
        return super().forward(x if self.multiplier == 1 else x * self.multiplier)


@PARAMETRIZATIONS.register("sp")
class Standard:
    """The standard parametrization: what BlockLab always did (a run saved before `param` existed reads as sp)."""

    scales_init = False  # whether the init scheme's std is read as its value at a base width (init.py checks)

    def errors(self, cfg) -> list[str]:
        return []

    def attention_scale(self, scale: float, qk_dim: int) -> float:
        """The softmax temperature, from the kind's own (scale_factor / sqrt(qk_dim) unless attn.scale is set)."""
        return scale

    def readout_multiplier(self, cfg) -> float:
        return 1.0

    def rescale_init(self, model: nn.Module) -> None:
        """After the init scheme: nothing."""

    def multipliers(self, model: nn.Module) -> dict[int, tuple[float, float]]:
        """id(parameter) -> (lr multiplier, weight-decay multiplier), for those not (1, 1)."""
        return {}


@PARAMETRIZATIONS.register("mup")
class MaximalUpdate(Standard):
    """µP for Adam (the module docstring has the rules and their sources). Option: base_width, the d_model at which
    every multiplier is 1 and the learning rate and init are tuned."""

    scales_init = True

    def __init__(self, base_width: int = 64):
        self.base_width = base_width

    def errors(self, cfg) -> list[str]:
        width = self.base_width
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            return [f"param.base_width={width!r} must be a positive integer (the d_model the lr is tuned at)"]
        errs = []
        for at in (width, 2 * width):  # the two widths the base shapes are read from
            if (bad := width_error(cfg, at)) is not None:
                errs.append(f"param=mup widens the model at a fixed d_head={cfg.d_head}, with d_ff and n_kv_heads in "
                            f"proportion, and at d_model={at} {bad}; set param.base_width to a multiple of "
                            f"{cfg.d_head} that gives whole sizes, or param=sp")
                break
        return errs

    def width_mult(self, cfg) -> float:
        return cfg.d_model / self.base_width

    def attention_scale(self, scale: float, qk_dim: int) -> float:
        return scale / math.sqrt(qk_dim)  # scale_factor / sqrt(d) -> scale_factor / d

    def readout_multiplier(self, cfg) -> float:
        return 1 / self.width_mult(cfg)

    def rescale_init(self, model: nn.Module) -> None:
        """mup.init's rule: the scheme drew each weight as at the base width; hidden ones shrink by m^(-1/2),
        output-like ones (to a fixed size) by 1/m."""
        with torch.no_grad():
            for param, (kind, mult) in self.roles(model).items():
                if kind != "vector":
                    param.mul_(mult ** -0.5 if kind == "hidden" else 1 / mult)

    def multipliers(self, model: nn.Module) -> dict[int, tuple[float, float]]:
        return {id(param): (1 / mult, mult) for param, (kind, mult) in self.roles(model).items()
                if kind != "vector" and mult != 1}

    def roles(self, model: nn.Module) -> dict[nn.Parameter, tuple[str, float]]:
        """Every parameter -> ("hidden" | "output" | "vector", its fan-in's width multiplier)."""
        widths = width_dims(model, self.base_width)
        linear = {id(m.weight): m for m in model.modules() if isinstance(m, nn.Linear) and not isinstance(m, Readout)}
        roles = {}
        for name, param in model.named_parameters():
            mults = widths[name]
            inf = [m for m in mults if m is not None]
            if len(inf) == 2 and param.dim() == 2:
                roles[param] = ("hidden", mults[1])  # (fan_out, fan_in) as nn.Linear stores it
            elif len(inf) >= 2:
                raise ValueError(f"param=mup has no rule for {name}, a {param.dim()}-d weight with {len(inf)} width "
                                 "dimensions; use param=sp")
            elif id(param) in linear and mults[1] is not None:
                roles[param] = ("output", mults[1])  # a width in, a fixed size out
            else:
                roles[param] = ("vector", 1.0)
        return roles


def width_error(cfg, width: int) -> str | None:
    """Why `cfg` cannot be built at d_model=`width` with its d_head fixed (a phrase), or None."""
    ratio = Fraction(width, cfg.d_model)
    sizes = {"n_heads": cfg.n_heads * ratio, "d_ff": cfg.d_ff * ratio}
    if cfg.attn.n_kv_heads not in (None, 1):
        sizes["n_kv_heads"] = cfg.attn.n_kv_heads * ratio
    bad = [f"{key}={float(value):g}" for key, value in sizes.items() if value.denominator != 1 or value < 1]
    return f"{', '.join(bad)} would not be whole" if bad else None


def at_width(cfg, width: int):
    """`cfg` (a ModelConfig) widened or narrowed to d_model=`width` as µP grows it: d_head fixed (n_heads in
    proportion), d_ff and n_kv_heads in proportion (MQA's one K/V head stays one), every other key as it is."""
    error = width_error(cfg, width)
    if error is not None:
        raise ValueError(f"d_model={width}: {error}")
    ratio = Fraction(width, cfg.d_model)
    kv = cfg.attn.n_kv_heads
    return replace(cfg, d_model=width, n_heads=int(cfg.n_heads * ratio), d_ff=int(cfg.d_ff * ratio),
                   attn=replace(cfg.attn, n_kv_heads=kv if kv in (None, 1) else int(kv * ratio)))


def width_dims(model: nn.Module, base_width: int) -> dict[str, list[float | None]]:
    """Each parameter's dimensions, by name: its width multiplier (size / size at base_width) where the dimension grows
    with d_model, None where it does not. Read off the model built at base_width and at twice it, under sp, on the
    meta device (mup's set_base_shapes with a base and a delta model)."""
    cfg = replace(model.cfg, param=replace(model.cfg.param, name="sp", options={}))  # sp: no recursion
    with torch.device("meta"):
        base, delta = (ARCHITECTURES[cfg.arch](at_width(cfg, w)) for w in (base_width, 2 * base_width))
    base_shapes = {name: p.shape for name, p in base.named_parameters()}
    delta_shapes = {name: p.shape for name, p in delta.named_parameters()}
    return {name: [None if b == d else size / b for size, b, d in zip(p.shape, base_shapes[name], delta_shapes[name])]
            for name, p in model.named_parameters()}
