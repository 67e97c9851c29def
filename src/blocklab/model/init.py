"""Named initialization schemes, applied after construction. Depth-dependent schemes
(GPT-2 residual scaling, DeepNet beta, Fixup) read the depth from the config or the model."""
import math

import torch
from torch import Tensor, nn

from blocklab.model.attention import Attention
from blocklab.model.block import Residual
from blocklab.model.ffn import FFN
from blocklab.model.norm import PLACEMENTS, deepnorm_beta, embedding_recipe
from blocklab.model.param import PARAMETRIZATIONS
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


# Schemes whose std does not depend on width: param=mup reads it as the std at its base width and scales from there.
for _scheme in (init_normal, init_gpt2):
    _scheme.constant_std = True


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


def fixup_layers(branch: nn.Module) -> list[tuple[list[Tensor], nn.Linear, int]]:
    """(the weights Fixup scales, the last layer it zeroes, m: the weight layers the branch's signal passes
    through in sequence) for each attention or FFN inside one residual branch (each expert of a mixture).
    Attention's signal passes W_v then W_o (queries and keys only choose the mixing weights, a convex
    combination); an MLP's W_in then W_out; a GLU's gate and up halves of W_in then W_out, act(x W_g) * (x W_u)
    being a product of two layers (m = 3)."""
    layers = []
    for module in branch.modules():
        if isinstance(module, Attention):
            layers.append(([module.projection("v")[0]], module.out_proj, 2))
        elif isinstance(module, FFN):
            layers.append(([module.in_proj.weight], module.out_proj, 3 if module.gated else 2))
    return layers


@INIT_SCHEMES.register("fixup")
def init_fixup(model, cfg):
    """Fixup (Zhang, Dauphin & Ma 2019, "Fixup Initialization: Residual Learning Without Normalization", ICLR):
    1. the classification layer and the last layer of every residual branch start at 0;
    2. the other layers start from a standard init (here Xavier normal, embeddings N(0, std)), and the
       layers inside residual branches are scaled by L^(-1/(2m-2)), L the number of residual branches and
       m the number of layers in each; 3. a scalar multiplier (from 1) on every branch: `branch_gate`.
    For a Transformer: every sublayer (attention, FFN, cross-attention; encoder ones too) is a branch, so
    L = 2 n_layers for a decoder; m = 2 for attention (W_v, W_o) and an MLP (W_in, W_out), scaling W_v and
    W_in by L^(-1/2); m = 3 for a GLU, whose gate and up halves are scaled by L^(-1/4) (fixup_layers).
    Queries and keys keep Xavier: they shape the attention weights, not the size of the branch's output.
    The scalar biases of rule 3 are the linear layers' own biases (model.bias=true; none without it). A head
    tied to the token embeddings cannot start at 0 (the input would be 0 too): only an untied one does."""
    init_xavier(model, cfg)
    branches = [module.sublayer for module in model.modules() if isinstance(module, Residual)]
    with torch.no_grad():
        for branch in branches:
            for inner, last, m in fixup_layers(branch):
                for weight in inner:
                    weight.mul_(len(branches) ** (-1 / (2 * m - 2)))
                nn.init.zeros_(last.weight)
        if model.head.weight is not model.tok_emb.weight:
            nn.init.zeros_(model.head.weight)


init_fixup.branch_gate = 1.0  # rule 3's multiplier: a learned scalar on every branch (Residual's gate)


def _zeroed_branch_errors(cfg) -> list[str]:
    """A scheme that zeroes each branch's last layer cannot meet a branch gate starting at 0 (ReZero): each one's
    gradient is a product with the other, so neither ever moves."""
    if PLACEMENTS[cfg.norm.placement].gate != 0:
        return []
    return [f"init={cfg.init.name} zeroes every branch's last layer and norm.placement={cfg.norm.placement} starts "
            f"every branch's gate at 0, so neither gets a gradient and no branch ever learns; use "
            f"init=normal with norm.placement={cfg.norm.placement}"]


init_fixup.errors = _zeroed_branch_errors
init_zero_branch.errors = _zeroed_branch_errors
init_zero_branch.constant_std = True


def scheme_errors(cfg) -> list[str]:
    """The chosen init scheme's constraints on the rest of the model config (one line each), and the
    parametrization's on the scheme: µP scales a width-free std from its base width, so a scheme whose std already
    depends on width (Xavier, Kaiming, 1/sqrt(d)) would be scaled twice."""
    scheme = INIT_SCHEMES[cfg.init.name]
    check = getattr(scheme, "errors", None)
    errs = check(cfg) if check is not None else []
    param = PARAMETRIZATIONS.get(cfg.param.name)
    if param is not None and param.scales_init and not getattr(scheme, "constant_std", False):
        fits = [name for name in INIT_SCHEMES if getattr(INIT_SCHEMES[name], "constant_std", False)]
        errs.append(f"init={cfg.init.name} sets a std that depends on width, which param={cfg.param.name} sets itself "
                    f"from the std at its base width; use init={' or init='.join(fits)}, or param=sp")
    return errs


def apply_init(model, cfg):
    scheme = INIT_SCHEMES[cfg.init.name]
    scheme(model, cfg)
    # DeepNorm is alpha on the residual *and* beta at init, whatever the scheme; deepnet applied beta itself.
    gain = PLACEMENTS[cfg.norm.placement].init_gain(cfg.n_layers)
    if gain != 1.0 and not getattr(scheme, "applies_deepnorm_gain", False):
        with torch.no_grad():
            for weight in deepnet_scaled(model):
                weight.mul_(gain)
    cfg.param.rule().rescale_init(model)  # µP: from the base width's std to this width's
    recipe = embedding_recipe(cfg.norm.type, cfg.norm.options, cfg.d_model)
    if recipe is not None:  # the norm type's own embedding init (DyT's, with its learned gain) replaces the scheme's
        nn.init.normal_(model.tok_emb.weight, 0.0, recipe[1])
