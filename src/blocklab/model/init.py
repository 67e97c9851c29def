"""Named initialization schemes, applied after construction. Depth-dependent schemes
(GPT-2 residual scaling, DeepNet beta) read the depth from the config."""
import math

import torch
from torch import Tensor, nn

from blocklab.model.attention import Attention
from blocklab.model.ffn import FFN
from blocklab.model.norm import PLACEMENTS, deepnorm_beta
from blocklab.registry import Registry


def _linears_and_embeddings(model):
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]


def _normal(model, std: float):
    for module in _linears_and_embeddings(model):
        nn.init.normal_(module.weight, 0.0, std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def branch_outputs(model) -> list[nn.Linear]:
    """The projections that write into the residual stream: attention out and FFN out."""
    return [m.out_proj for m in model.modules() if isinstance(m, (Attention, FFN))]


def deepnet_scaled(model) -> list[Tensor]:
    """DeepNet scales the value, attention-output and FFN matrices by beta (not queries/keys)."""
    weights = []
    for module in model.modules():
        if isinstance(module, Attention):
            weights += [module.projection("v")[0], module.out_proj.weight]
        elif isinstance(module, FFN):
            weights += [module.in_proj.weight, module.out_proj.weight]
    return weights


def weight_matrices(model) -> list[Tensor]:
    """Every linear layer's weight but the output head's, with the stacked q/k/v projection as the
    three matrices it holds: Xavier's fan-out is that of W_q, not of [W_q; W_k; W_v]."""
    stacked = {id(m.qkv_proj): m for m in model.modules() if isinstance(m, Attention)}
    weights = []
    for module in model.modules():
        if id(module) in stacked:
            weights += [stacked[id(module)].projection(part)[0] for part in "qkv"]
        elif isinstance(module, nn.Linear) and module is not getattr(model, "head", None):
            weights.append(module.weight)
    return weights


INIT_SCHEMES: Registry = Registry("init.name", framework_args=("model", "cfg"))


@INIT_SCHEMES.register("default")
def init_default(model, cfg):
    """PyTorch's own per-layer defaults: nothing to do."""


@INIT_SCHEMES.register("normal")
def init_normal(model, cfg):
    _normal(model, cfg.init.std)


@INIT_SCHEMES.register("gpt2")
def init_gpt2(model, cfg):
    _normal(model, cfg.init.std)
    for layer in branch_outputs(model):
        nn.init.normal_(layer.weight, 0.0, cfg.init.std / math.sqrt(2 * cfg.n_layers))


@INIT_SCHEMES.register("xavier")
def init_xavier(model, cfg):
    _normal(model, cfg.init.std)  # embeddings
    for weight in weight_matrices(model):
        nn.init.xavier_normal_(weight)


@INIT_SCHEMES.register("small")
def init_small(model, cfg):
    """Nguyen & Salazar (2019): N(0, sqrt(2 / (5 d))) everywhere."""
    _normal(model, math.sqrt(2 / (5 * cfg.d_model)))


@INIT_SCHEMES.register("deepnet")
def init_deepnet(model, cfg):
    """Wang et al. (2022): Xavier normal, gain beta on value/output/FFN, gain 1 on queries/keys."""
    init_xavier(model, cfg)
    beta = deepnorm_beta(cfg.n_layers)
    for weight in deepnet_scaled(model):
        nn.init.xavier_normal_(weight, gain=beta)


init_deepnet.applies_deepnorm_gain = True  # DeepNorm placements must not scale its weights a second time


@INIT_SCHEMES.register("zero_branch")
def init_zero_branch(model, cfg):
    """Every residual branch starts as exactly zero, so each block starts as the identity."""
    _normal(model, cfg.init.std)
    for layer in branch_outputs(model):
        nn.init.zeros_(layer.weight)


def apply_init(model, cfg):
    scheme = INIT_SCHEMES[cfg.init.name]
    scheme(model, cfg)
    # DeepNorm is alpha on the residual *and* beta at init, whatever the scheme; deepnet applied beta itself.
    gain = PLACEMENTS[cfg.norm.placement].init_gain(cfg.n_layers)
    if gain != 1.0 and not getattr(scheme, "applies_deepnorm_gain", False):
        with torch.no_grad():
            for weight in deepnet_scaled(model):
                weight.mul_(gain)
