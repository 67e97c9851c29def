"""Normalization: the norm types (what a norm computes) and the placements (where norms sit around
each sublayer), each a registry. A placement is described once here; the Block, the final norm,
the init schemes, the config and the analysis probe read that description."""
from dataclasses import dataclass

from torch import nn

from blocklab.registry import Registry

NORM_TYPES: Registry = Registry("norm.type", framework_args=("dim", "eps", "bias"))
PLACEMENTS: Registry = Registry("norm.placement")


@NORM_TYPES.register("layernorm")
def layernorm(dim: int, eps: float, bias: bool) -> nn.Module:
    return nn.LayerNorm(dim, eps=eps, bias=bias)


@NORM_TYPES.register("rmsnorm")
def rmsnorm(dim: int, eps: float, bias: bool) -> nn.Module:
    return nn.RMSNorm(dim, eps=eps)


@NORM_TYPES.register("none")
def no_norm(dim: int, eps: float, bias: bool) -> None:
    """No normalization at all: every place a norm would sit is left empty."""
    return None


def build_norm(norm_type: str, dim: int, eps: float = 1e-5, bias: bool = True) -> nn.Module | None:
    """The norm module, or None for the 'none' type (a missing module is cheaper than nn.Identity)."""
    return NORM_TYPES[norm_type](dim, eps, bias)


def normalizes(norm_type: str) -> bool:
    return build_norm(norm_type, 2) is not None


@dataclass
class Placement:
    """Where a sublayer f's norms sit. One norm on the branch input (`norm_in`), one on the branch
    output (`norm_out`), which `norm_after_sum` moves after the residual sum; `final_norm` gives the
    stack one last norm before the head, for stacks that leave the residual stream unnormalized;
    `depth_scaled` is DeepNorm's alpha on the residual and beta on branch weights at init."""

    formula: str
    norm_in: bool
    norm_out: bool
    norm_after_sum: bool
    final_norm: bool
    depth_scaled: bool = False

    def alpha(self, n_layers: int) -> float:
        return deepnorm_alpha(n_layers) if self.depth_scaled else 1.0

    def init_gain(self, n_layers: int) -> float:
        return deepnorm_beta(n_layers) if self.depth_scaled else 1.0


PLACEMENTS.register("pre")(Placement("x + f(LN(x))", norm_in=True, norm_out=False, norm_after_sum=False,
                                     final_norm=True))
PLACEMENTS.register("post")(Placement("LN(x + f(x))", norm_in=False, norm_out=True, norm_after_sum=True,
                                      final_norm=False))
PLACEMENTS.register("sandwich")(Placement("x + LN2(f(LN1(x)))", norm_in=True, norm_out=True, norm_after_sum=False,
                                          final_norm=True))
PLACEMENTS.register("deepnorm")(Placement("LN(alpha x + f(x))", norm_in=False, norm_out=True, norm_after_sum=True,
                                          final_norm=False, depth_scaled=True))

# Canonical names of the shipped presets, used to label runs by what they compute.
_PRESET_NAMES = {
    ("layernorm", "pre"): "pre_ln",
    ("layernorm", "post"): "post_ln",
    ("rmsnorm", "pre"): "pre_rms",
    ("rmsnorm", "post"): "post_rms",
    ("layernorm", "sandwich"): "sandwich_ln",
    ("layernorm", "deepnorm"): "deepnorm",
}


def norm_name(norm_type: str, placement: str) -> str:
    """Short label for a (type, placement) pair: 'pre_ln' for the presets, else 'placement_type'."""
    if not normalizes(norm_type):
        return "none"
    return _PRESET_NAMES.get((norm_type, placement), f"{placement}_{norm_type}")


def deepnorm_alpha(n_layers: int) -> float:
    """DeepNet residual scale for a decoder-only stack of N layers: (2N)^(1/4)."""
    return (2 * n_layers) ** 0.25


def deepnorm_beta(n_layers: int) -> float:
    """DeepNet init gain for a decoder-only stack of N layers: (8N)^(-1/4)."""
    return (8 * n_layers) ** -0.25
