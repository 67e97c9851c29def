"""Normalization layers. Where a norm sits (pre/post/sandwich/deepnorm) is the Block's business."""
from torch import nn

NORM_TYPES = ("layernorm", "rmsnorm", "none")
PLACEMENTS = ("pre", "post", "sandwich", "deepnorm")

# Canonical names of the shipped presets, used to label runs by what they compute.
_PRESET_NAMES = {
    ("layernorm", "pre"): "pre_ln",
    ("layernorm", "post"): "post_ln",
    ("rmsnorm", "pre"): "pre_rms",
    ("rmsnorm", "post"): "post_rms",
    ("layernorm", "sandwich"): "sandwich_ln",
    ("layernorm", "deepnorm"): "deepnorm",
}


def build_norm(norm_type: str, dim: int, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    if norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    if norm_type == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    if norm_type == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm type {norm_type!r}; choose one of {NORM_TYPES}")


def norm_name(norm_type: str, placement: str) -> str:
    """Short label for a (type, placement) pair: 'pre_ln' for the presets, else 'placement_type'."""
    if norm_type == "none":
        return "none"
    return _PRESET_NAMES.get((norm_type, placement), f"{placement}_{norm_type}")


def has_final_norm(placement: str) -> bool:
    # Pre-norm stacks leave the residual stream unnormalized, so the head needs one last norm.
    return placement in ("pre", "sandwich")


def deepnorm_alpha(n_layers: int) -> float:
    """DeepNet residual scale for a decoder-only stack of N layers: (2N)^(1/4)."""
    return (2 * n_layers) ** 0.25


def deepnorm_beta(n_layers: int) -> float:
    """DeepNet init gain for a decoder-only stack of N layers: (8N)^(-1/4)."""
    return (8 * n_layers) ** -0.25
