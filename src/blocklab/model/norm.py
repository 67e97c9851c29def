"""Normalization: the norm types (what a norm computes) and the placements (where norms sit around
each sublayer), each a registry. A placement is described once here; the Block, the final norm,
the init schemes, the config and the analysis probe read that description."""
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from blocklab.registry import Registry

NORM_TYPES: Registry = Registry("norm.type", framework_args=("dim", "eps", "bias", "affine"))
PLACEMENTS: Registry = Registry("norm.placement")


@NORM_TYPES.register("layernorm")
def layernorm(dim: int, eps: float, bias: bool, affine: bool) -> nn.Module:
    return nn.LayerNorm(dim, eps=eps, elementwise_affine=affine, bias=bias)


@NORM_TYPES.register("rmsnorm")
def rmsnorm(dim: int, eps: float, bias: bool, affine: bool) -> nn.Module:
    return nn.RMSNorm(dim, eps=eps, elementwise_affine=affine)


class TokenBatchNorm(nn.BatchNorm1d):
    """Batch normalization (Ioffe & Szegedy 2015, "Batch Normalization: Accelerating Deep Network Training by
    Reducing Internal Covariate Shift") with every token of the batch as one sample: in training, feature c of
    every token becomes gamma_c (x_c - mu_c) / sqrt(var_c + eps) + beta_c, with mu_c and var_c (biased) taken
    over the batch's real tokens only, padding excluded; those statistics also update running estimates
    (momentum 0.1; torch keeps the unbiased variance). In evaluation each token is normalized with the running
    estimates, so its output depends on nothing else in the batch and cached decoding works one token at a time.
    What the sources hold against it is visible here: statistics of one batch differ from the running ones
    (small batches most), and in training a token's statistics include the later tokens of its batch, so a
    causal model sees a little of its future. model.bias does not apply: beta comes with gamma (norm.affine)."""

    masked = True  # called as norm(x, valid): valid (B, T) is False at padding, None when there is none

    def forward(self, x: Tensor, valid: Tensor | None = None) -> Tensor:
        if valid is None or not self.training:
            return super().forward(x.reshape(-1, x.shape[-1])).view_as(x)
        out = x.new_zeros(x.shape)  # padding comes out as 0: nothing reads it, and nothing of it was counted
        out[valid] = super().forward(x[valid])
        return out


@NORM_TYPES.register("batchnorm")
def batchnorm(dim: int, eps: float, bias: bool, affine: bool) -> nn.Module:
    return TokenBatchNorm(dim, eps=eps, affine=affine)


batchnorm.min_batch_size = 2  # statistics of one sequence are not a batch's; the running ones would not match them


class DynamicTanh(nn.Module):
    """DyT (Zhu, Chen, He, LeCun & Liu 2025, "Transformers without Normalization", CVPR; reference:
    jiachenzhu/DyT, dynamic_tanh.py): gamma * tanh(alpha x) + beta in place of a norm, alpha one learned scalar
    starting at `alpha_init` (the reference's alpha_init_value, 0.5 by default; its LLaMA runs tune it per width),
    gamma and beta per channel. No statistics: each token is squashed on its own, so like LayerNorm it bounds a
    token's length (by sqrt(d) max|gamma| + ||beta||), and cached decoding needs nothing. eps is not read."""

    def __init__(self, dim: int, alpha_init: float, bias: bool, affine: bool):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((1,), float(alpha_init)))
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine and bias else None

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.alpha * x)
        if self.weight is not None:
            x = x * self.weight
        return x if self.bias is None else x + self.bias


@NORM_TYPES.register("dyt")
def dynamic_tanh(dim: int, eps: float, bias: bool, affine: bool, alpha_init: float = 0.5,
                 embedding_gain: bool = True) -> nn.Module:
    """embedding_gain: the token embeddings as the authors' LLaMA runs have them (jiachenzhu/DyT,
    other_tasks/LLaMA/fms_fsdp/models/llama.py: fms's WordEmbedding initialised at std d^-1/2, times `shared_scale`,
    one learned scalar starting at sqrt(d)), so the stack starts from unit-scale tokens and a tied readout of
    weights d^-1/2. DyT's output lies in [-1, 1]^d: with the usual std 0.02 embeddings the readout can reach the
    unigram logits only by saturating the final DyT, which then outputs one vector at every position (measured:
    docs/decisions/dyt-embedding-gain.md). The model reads it (`embedding_recipe`), not the layer; false is the
    layer alone, as the paper prints it."""
    return DynamicTanh(dim, alpha_init, bias, affine)


# A run saved before the option existed trained without it.
dynamic_tanh.old_run_options = lambda options: {"embedding_gain": False, **options}


def embedding_recipe(norm_type: str, options: dict, d_model: int) -> tuple[float, float] | None:
    """(the learned embedding gain's start, the embeddings' init std) if the norm type asks for them (DyT's
    `embedding_gain`: sqrt(d) and d^-1/2), else None."""
    asks = {**NORM_TYPES.options(norm_type), **options}.get("embedding_gain", False)
    return (math.sqrt(d_model), 1 / math.sqrt(d_model)) if asks else None


@NORM_TYPES.register("none")
def no_norm(dim: int, eps: float, bias: bool, affine: bool) -> None:
    """No normalization at all: every place a norm would sit is left empty."""
    return None


def build_norm(norm_type: str, dim: int, eps: float = 1e-5, bias: bool = True,
               affine: bool = True, **options) -> nn.Module | None:
    """The norm module, or None for the 'none' type (a missing module is cheaper than nn.Identity).
    affine=False leaves out the learned gain and shift; `options` are the type's own (DyT's alpha_init)."""
    return NORM_TYPES[norm_type](dim, eps, bias, affine, **options)


def normalizes(norm_type: str) -> bool:
    return build_norm(norm_type, 2) is not None


def is_masked(norm: nn.Module | None) -> bool:
    """Whether a norm needs the padding mask (its statistics span tokens): it is called as norm(x, valid)."""
    return getattr(norm, "masked", False) is True


def bounds_token_length(norm: nn.Module) -> bool:
    """Whether each token comes out at most sqrt(d) max|gain| + ||shift|| long: LN and RMSNorm scale a token by its
    own statistics; BatchNorm's span tokens, so no single token's length is bounded."""
    return not is_masked(norm)


def apply_norm(norm: nn.Module, x: Tensor, valid: Tensor | None) -> Tensor:
    """norm(x), given the padding mask (B, T) if the norm's statistics span tokens."""
    return norm(x, valid) if is_masked(norm) else norm(x)


def batch_size_errors(norm_type: str, batch_size: int) -> list[str]:
    """A norm type whose statistics span the batch refuses a training batch too small for them."""
    need = getattr(NORM_TYPES[norm_type], "min_batch_size", 1)
    if batch_size >= need:
        return []
    return [f"norm.type={norm_type} needs task.batch_size >= {need} (got {batch_size}): its statistics would come "
            f"from one sequence and its running estimates would not match them; raise task.batch_size or use "
            f"norm.type=layernorm"]


@dataclass
class Placement:
    """Where a sublayer f's norms sit. One norm on the branch input (`norm_in`), one on the branch
    output (`norm_out`), which `norm_after_sum` moves after the residual sum; `final_norm` gives the
    stack one last norm before the head, for stacks that leave the residual stream unnormalized;
    `depth_scaled` is DeepNorm's alpha on the residual and beta on branch weights at init; `gate`, if set,
    is a learned scalar multiplying every branch, starting at that value; `unnormalized_name` labels the
    placement with norm.type=none."""

    formula: str
    norm_in: bool
    norm_out: bool
    norm_after_sum: bool
    final_norm: bool
    depth_scaled: bool = False
    gate: float | None = None
    unnormalized_name: str = "none"

    def alpha(self, n_layers: int) -> float:
        return deepnorm_alpha(n_layers) if self.depth_scaled else 1.0

    def init_gain(self, n_layers: int) -> float:
        return deepnorm_beta(n_layers) if self.depth_scaled else 1.0

    @property
    def places_norms(self) -> bool:
        return self.norm_in or self.norm_out or self.final_norm

    def errors(self, cfg) -> list[str]:
        """A placement without norms takes no norm type (it would be silently unused)."""
        if self.places_norms or not normalizes(cfg.norm.type):
            return []
        return [f"norm.placement={self.registry_name} places no norm, so norm.type={cfg.norm.type} would be unused; "
                f"use norm.type=none (norm={self.unnormalized_name})"]


PLACEMENTS.register("pre")(Placement("x + f(LN(x))", norm_in=True, norm_out=False, norm_after_sum=False,
                                     final_norm=True))
PLACEMENTS.register("post")(Placement("LN(x + f(x))", norm_in=False, norm_out=True, norm_after_sum=True,
                                      final_norm=False))
PLACEMENTS.register("sandwich")(Placement("x + LN2(f(LN1(x)))", norm_in=True, norm_out=True, norm_after_sum=False,
                                          final_norm=True))
PLACEMENTS.register("deepnorm")(Placement("LN(alpha x + f(x))", norm_in=False, norm_out=True, norm_after_sum=True,
                                          final_norm=False, depth_scaled=True))
# ReZero (Bachlechner et al. 2020, "ReZero is All You Need: Fast Convergence at Large Depth", arXiv 2003.04887):
# x_{i+1} = x_i + alpha_i F(x_i), no norm, alpha_i learned from 0, so every block starts as the identity.
# One alpha per sublayer; the authors' RZTX layers share one between a layer's attention and FFN.
PLACEMENTS.register("rezero")(Placement("x + alpha f(x), alpha learned from 0", norm_in=False, norm_out=False,
                                        norm_after_sum=False, final_norm=False, gate=0.0,
                                        unnormalized_name="rezero"))

# Canonical names of the shipped presets, used to label runs by what they compute.
_PRESET_NAMES = {
    ("layernorm", "pre"): "pre_ln",
    ("layernorm", "post"): "post_ln",
    ("rmsnorm", "pre"): "pre_rms",
    ("rmsnorm", "post"): "post_rms",
    ("layernorm", "sandwich"): "sandwich_ln",
    ("layernorm", "deepnorm"): "deepnorm",
    ("batchnorm", "pre"): "pre_bn",
    ("batchnorm", "post"): "post_bn",
}


def norm_name(norm_type: str, placement: str, affine: bool = True) -> str:
    """Short label for a (type, placement) pair: 'pre_ln' for the presets, else 'placement_type'; '_noaffine'
    appended without the learned gain and shift; with no norm, 'none' or the placement's own ('rezero')."""
    if not normalizes(norm_type):
        return PLACEMENTS[placement].unnormalized_name if placement in PLACEMENTS else "none"
    name = _PRESET_NAMES.get((norm_type, placement), f"{placement}_{norm_type}")
    return name if affine else f"{name}_noaffine"


def deepnorm_alpha(n_layers: int) -> float:
    """DeepNet residual scale for a decoder-only stack of N layers: (2N)^(1/4)."""
    return (2 * n_layers) ** 0.25


def deepnorm_beta(n_layers: int) -> float:
    """DeepNet init gain for a decoder-only stack of N layers: (8N)^(-1/4)."""
    return (8 * n_layers) ** -0.25
