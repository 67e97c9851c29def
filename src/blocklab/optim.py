"""The optimizers (`optim.name`), a registry: each entry builds one torch optimizer for a model from the optim
group (its shared keys: lr, betas, weight_decay, the schedule's) and the entry's own options (its keyword arguments).

- adamw: AdamW with weight decay on matrices and embeddings only (nanoGPT's groups).
- muon: Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks", kellerjordan.github.io
  and github.com/KellerJordan/Muon; Liu et al. 2025, "Muon is Scalable for LLM Training", MoonshotAI/Moonlight) on
  torch's own `torch.optim.Muon` for the hidden matrices, AdamW for the rest, as both reference setups split them."""
import torch
from torch import nn

from blocklab.registry import Registry
from blocklab.schedule import SCHEDULE_KEYS

# The optim group's keys every optimizer shares (the schema checks them); the rest are the entry's own options.
SHARED_KEYS = ("name", "lr", "min_lr", "betas", "weight_decay", "warmup_steps", "z_loss", *SCHEDULE_KEYS)
OPTIMIZERS: Registry = Registry("optim.name", framework_args=("model", "optim"))


def own_options(optim: dict) -> dict:
    """The optim group's keys that belong to the chosen optimizer (not SHARED_KEYS)."""
    return {key: value for key, value in optim.items() if key not in SHARED_KEYS}


def model_errors(optim: dict, param: str) -> list[str]:
    """Between the optimizer and the model's parametrization (model.param): an entry that declares the
    parametrizations it serves (`parametrizations`, with the reason as `parametrization_why`) refuses the others."""
    name = optim.get("name", "adamw")
    served = getattr(OPTIMIZERS.get(name), "parametrizations", None)
    if served is None or param in served:
        return []
    return [f"optim={name} with param={param}: {OPTIMIZERS[name].parametrization_why}; use param={served[0]} with "
            f"optim={name}"]


def optimizer_errors(optim: dict) -> list[str]:
    name = optim.get("name", "adamw")
    if name not in OPTIMIZERS:
        return [OPTIMIZERS.unknown(name)]
    errors = OPTIMIZERS.option_errors(name, own_options(optim), "optim")
    check = getattr(OPTIMIZERS[name], "errors", None)
    return errors or ([] if check is None else check({**OPTIMIZERS.options(name), **own_options(optim)}))


def build_optimizer(model: nn.Module, optim: dict) -> torch.optim.Optimizer:
    name = optim.get("name", "adamw")
    return OPTIMIZERS[name](model, optim, **own_options(optim))


def optimizer_groups(model: nn.Module, params: list | None = None) -> dict[tuple[bool, float, float], list]:
    """AdamW's parameter groups over `params` (default: all the model's), in its order: (decayed, lr multiplier,
    weight-decay multiplier) -> parameters. The decayed (matrices and embeddings) at multipliers 1, the rest at 1
    (both always there, as in checkpoints saved before param existed), then one group per other pair of multipliers
    (param=mup's hidden weights: model/param.py; every multiplier is 1 under sp)."""
    multipliers = model.cfg.param.rule().multipliers(model) if hasattr(model, "cfg") else {}
    chosen = list(model.parameters()) if params is None else params
    groups: dict[tuple[bool, float, float], list] = {(True, 1.0, 1.0): [], (False, 1.0, 1.0): []}
    for decay in (True, False):
        for p in chosen:
            if (p.dim() >= 2) == decay:
                groups.setdefault((decay, *multipliers.get(id(p), (1.0, 1.0))), []).append(p)
    return groups


def optimizer_params(model: nn.Module) -> list[list]:
    """The parameters of each of AdamW's groups, in its order (optimizer_groups)."""
    return list(optimizer_groups(model).values())


def adamw_groups(model: nn.Module, optim: dict, params: list | None = None) -> list[dict]:
    """optimizer_groups as AdamW's param_groups: weight decay on the decayed groups only, each group's lr and decay
    times its multipliers."""
    return [{"params": group, "lr": optim["lr"] * lr_mult,
             "weight_decay": optim["weight_decay"] * wd_mult if decay else 0.0}
            for (decay, lr_mult, wd_mult), group in optimizer_groups(model, params).items()]


@OPTIMIZERS.register("adamw")
def adamw(model: nn.Module, optim: dict) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only, and each parameter's learning rate and decay times
    the parametrization's multipliers (param=mup). The fused kernel does the same update as the default per-tensor
    loop in one pass over all parameters, which shortens a small model's CPU step markedly
    (`python -m blocklab.bench step` times the step)."""
    return torch.optim.AdamW(adamw_groups(model, optim), lr=optim["lr"], betas=tuple(optim["betas"]), fused=True)


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The weights Muon updates: every nn.Linear's matrix inside the blocks (attention's stacked q/k/v and output
    projections, the FFN's), not the token or position embeddings, not the output head (tied to the token
    embedding or not), not norms, biases or learned scalars: the split of Keller Jordan's Muon README and Moonlight's
    examples. A matrix of a recurrent kind's gates or convolution that is not an nn.Linear stays with AdamW."""
    head = getattr(model, "head", None)
    excluded = {id(p) for module in model.modules() if isinstance(module, nn.Embedding) for p in module.parameters()}
    if head is not None:
        excluded |= {id(p) for p in head.parameters()}
    hidden, seen = [], set()
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in excluded and id(module.weight) not in seen:
            seen.add(id(module.weight))
            hidden.append(module.weight)
    return hidden


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer object over two: torch.optim.Muon for the hidden matrices, AdamW for every other parameter, so
    that Lightning's automatic optimization, gradient clipping, the learning-rate schedule (which scales every group's
    lr by the same factor) and checkpoints see a single optimizer. param_groups are the two optimizers' own group
    dicts, so a change the schedule makes reaches both."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.optimizers = (muon, adamw)
        self.defaults = {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}
        self._zero_grad_profile_name = "MuonWithAdamW.zero_grad"

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        """Both optimizers' per-parameter states, the same dicts (a device move in place reaches them)."""
        return {**self.optimizers[0].state, **self.optimizers[1].state}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.optimizers[0].state_dict(), "adamw": self.optimizers[1].state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizers[0].load_state_dict(state_dict["muon"])
        self.optimizers[1].load_state_dict(state_dict["adamw"])

    def __repr__(self) -> str:
        return f"MuonWithAdamW({self.optimizers[0]!r}, {self.optimizers[1]!r})"


MUON_LR_ADJUSTMENTS = ("match_rms_adamw", "original")
ADAMW_MOMENTS, MUON_MOMENTS = ("step", "exp_avg", "exp_avg_sq"), ("momentum_buffer",)


def saved_state_parts(model: nn.Module, state: dict) -> list[tuple[str, dict, list[list], tuple[str, ...]]]:
    """What an optimizer's saved state_dict must hold for `model`, part by part: (name, that part's state_dict,
    its parameter groups in order, the tensors each parameter's state keeps). A Muon run's state has a part per
    inner optimizer (MuonWithAdamW.state_dict); any other is AdamW's. A moment must have its parameter's shape
    (AdamW's step is a scalar: not checked for shape)."""
    params = list(model.parameters())
    if isinstance(state, dict) and set(state) == {"muon", "adamw"}:
        hidden_ids = {id(p) for p in hidden_matrices(model)}
        rest = [p for p in params if id(p) not in hidden_ids]
        return [("Muon's", state["muon"], [[p for p in params if id(p) in hidden_ids]], MUON_MOMENTS),
                ("AdamW's", state["adamw"], list(optimizer_groups(model, rest).values()), ADAMW_MOMENTS)]
    return [("AdamW's", state, optimizer_params(model), ADAMW_MOMENTS)]


@OPTIMIZERS.register("muon")
def muon(model: nn.Module, optim: dict, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
         adjust_lr: str = "match_rms_adamw") -> MuonWithAdamW:
    """Muon on the hidden matrices, AdamW (fused, optim.betas) on the rest, both at optim.lr and optim.weight_decay.

    adjust_lr=match_rms_adamw (the default) is "Muon is Scalable"'s update scale, 0.2 sqrt(max(A, B)) per A x B
    matrix, which makes Muon's update RMS match AdamW's so that one learning rate and weight decay serve both groups
    (torch.optim.Muon's adjust_lr_fn); `original` is Keller Jordan's sqrt(max(1, A/B)), which wants its own, larger lr.
    The Newton-Schulz iteration is torch's (ns_steps, its quintic coefficients); none is written here.

    Stacked matrices: attention's q/k/v projection and a gated FFN's gate/up are one nn.Linear each here (one matmul
    instead of three), and torch.optim.Muon orthogonalizes each parameter as one matrix, so the stacked update is
    orthogonalized jointly, not per block as Keller Jordan's later modded-nanogpt does with its (3, d, d) qkv weight.
    Splitting them would change every checkpoint's layout; Moonlight's reference example, on a model with separate
    q, k and v, is per matrix. The difference between the two is not measured here."""
    hidden = hidden_matrices(model)
    hidden_ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in hidden_ids]
    inner_muon = torch.optim.Muon(hidden, lr=optim["lr"], weight_decay=optim["weight_decay"], momentum=momentum,
                                  nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr)
    inner_adamw = torch.optim.AdamW(adamw_groups(model, optim, rest), lr=optim["lr"], betas=tuple(optim["betas"]),
                                    fused=True)
    return MuonWithAdamW(inner_muon, inner_adamw)


def _muon_errors(options: dict) -> list[str]:
    errors = []
    if options["adjust_lr"] not in MUON_LR_ADJUSTMENTS:
        errors.append(f"optim.adjust_lr={options['adjust_lr']!r} is unknown; use one of {list(MUON_LR_ADJUSTMENTS)}")
    if not 0 <= options["momentum"] < 1:
        errors.append(f"optim.momentum={options['momentum']} must be in [0, 1) (Muon's references use 0.95)")
    if not (isinstance(options["ns_steps"], int) and options["ns_steps"] >= 1):
        errors.append(f"optim.ns_steps={options['ns_steps']!r} must be a positive integer (Newton-Schulz steps; 5)")
    return errors


muon.errors = _muon_errors
muon.parametrizations = ("sp",)
muon.parametrization_why = ("µP's per-layer learning rates are Adam's table (Yang et al. 2022), and Muon scales its "
                            "update by width itself (optim.adjust_lr)")
