"""Mixture-of-experts FFN (`ffn=moe`): a router sends each token to its top_k experts, each a dense FFN.

Switch Transformer (Fedus, Zoph & Shazeer 2021, "Switch Transformers: Scaling to Trillion Parameter Models with
Simple and Efficient Sparsity", JMLR 23) with top-k routing (Shazeer et al. 2017, "Outrageously Large Neural
Networks: The Sparsely-Gated Mixture-of-Experts Layer", ICLR):

  p(x) = softmax(W_r x)                                   router probabilities over the N experts (eq. 1)
  y(x) = sum over the top_k experts i of p_i(x) E_i(x)    each expert's output weighted by its gate (eq. 2)

The gates are the router's probabilities, as Switch's p_i(x), not renormalized over the chosen k (Shazeer et al.'s
softmax over the kept logits): with top_k=1 that renormalized gate would be 1 and the router would learn from the
load-balancing loss alone. No gating noise. The router runs in float32 under mixed precision (Switch's selective
precision).

Capacity (Switch sec. 2.2): in training each expert takes at most ceil(capacity_factor * tokens * top_k / experts)
of a batch's token assignments, filled in order of choice rank (every token's first choice before any second
choice, as GShard's top-2) and then of position in the batch; an assignment past an expert's capacity is dropped,
and a token with all its assignments dropped passes through the residual connection only (the layer outputs 0
for it). Padding positions are routed too (the FFN does not see which positions are padding), so they take part
in capacity and in the balancing loss. In evaluation and generation no assignment is dropped: a token's output
does not depend on the other tokens of its batch, so cached decoding equals recomputation.

Load balancing (Switch eq. 4-6): aux = N * sum_i f_i P_i, with f_i the fraction of the batch's token assignments
routed to expert i (the top-k choices, before capacity) and P_i the mean router probability of expert i. It is 1
under uniform routing (f_i = P_i = 1/N), the least N * sum_i P_i^2 can be (Cauchy-Schwarz), and N when every token
goes to one expert. The training loss adds aux_loss_weight * aux for every MoE layer (train/module.py)."""
import math

import torch
from torch import Tensor, nn

from blocklab.model.ffn import FFN, FFN_KINDS
from blocklab.schema import POSITIVE, POSITIVE_INT, Described, Number


@FFN_KINDS.register("moe")
class MixtureOfExperts(nn.Module):
    """`experts` dense FFNs (each as ffn=dense would build it) behind a linear router without bias."""

    repeated_by = "experts"  # identical submodules, one per expert: model/size.py counts one and two, not thousands

    def __init__(self, d_model: int, d_ff: int, act: str = "gelu", match_params: bool = True, dropout: float = 0.0,
                 bias: bool = True, experts: int = 4, top_k: int = 1, capacity_factor: float = 1.25,
                 aux_loss_weight: float = 0.01):
        super().__init__()
        self.n_experts, self.top_k = experts, top_k
        self.capacity_factor, self.aux_loss_weight = capacity_factor, aux_loss_weight
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList(FFN(d_model, d_ff, act, match_params, dropout, bias) for _ in range(experts))
        self.aux_loss: Tensor | None = None  # Switch's balancing loss of the last training forward (unweighted)
        # Training totals (int64, so they stay exact; buffers, so a resume carries them): assignments routed to
        # each expert before capacity, and those dropped. The last training batch's, for logging.
        self.register_buffer("routed_total", torch.zeros(experts, dtype=torch.long))
        self.register_buffer("dropped_total", torch.zeros((), dtype=torch.long))
        self.last_routed: Tensor | None = None
        self.last_dropped: Tensor | None = None

    @classmethod
    def errors(cls, cfg, options: dict) -> list[str]:
        """One line per bad option; top_k is compared with experts only once both are whole numbers."""
        specs = {"experts": POSITIVE_INT, "top_k": POSITIVE_INT, "aux_loss_weight": Number(0),
                 "capacity_factor": Described(POSITIVE, "a number > 0 (an expert takes at most ceil(capacity_factor "
                                                        "* tokens * top_k / experts) assignments of a batch)")}
        errs = [line for key, spec in specs.items() if (line := spec.error(f"ffn.{key}", options[key]))]
        if not errs and options["top_k"] > options["experts"]:
            errs.append(f"ffn.top_k={options['top_k']} is more than ffn.experts={options['experts']}: each token "
                        f"goes to top_k different experts; use ffn.top_k<={options['experts']} or more experts")
        if errs:
            return errs
        if not cfg.ffn:
            errs.append(f"model.ffn=false removes the FFN sublayers, so ffn={cls.registry_name} has nothing to "
                        f"replace; use ffn=dense or model.ffn=true")
        return errs

    def capacity(self, tokens: int) -> int:
        """The most token assignments one expert takes from a training batch of `tokens` tokens."""
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts)

    def weighted_aux_loss(self) -> Tensor:
        """What this layer adds to the training loss after a training forward."""
        return self.aux_loss_weight * self.aux_loss

    def _router_probs(self, x: Tensor) -> Tensor:
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return self.router(x.float()).softmax(-1)
        return self.router(x).softmax(-1)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        tokens = flat.shape[0]
        probs = self._router_probs(flat)  # (tokens, experts)
        gates, choices = probs.topk(self.top_k, dim=-1)
        # One row per (choice rank, token), rank-major: the order in which experts fill up to capacity.
        expert, gate = choices.t().reshape(-1), gates.t().reshape(-1)
        token = torch.arange(tokens, device=x.device).repeat(self.top_k)
        order = torch.argsort(expert, stable=True)  # grouped by expert, priority order kept within each
        routed = torch.bincount(expert, minlength=self.n_experts)
        limit = self.capacity(tokens) if self.training else tokens
        out = torch.zeros_like(flat)
        start = 0
        for index, count in enumerate(routed.tolist()):
            # Every expert runs, on no rows if none came: each one's weights are then in the graph (DDP needs it).
            rows = order[start:start + min(count, limit)]
            start += count
            kept = token[rows]
            y = self.experts[index](flat[kept]) * gate[rows, None]
            out.index_add_(0, kept, y.to(out.dtype))
        if self.training:
            self._record(probs, routed, limit)
        return out.view_as(x)

    def _record(self, probs: Tensor, routed: Tensor, limit: int) -> None:
        """Switch's balancing loss, and the training totals (no gradient)."""
        share = routed.to(probs.dtype) / routed.sum()  # f_i over the top_k choices of every token
        self.aux_loss = self.n_experts * (share * probs.mean(0)).sum()
        with torch.no_grad():
            dropped = (routed - routed.clamp(max=limit)).sum()
            self.routed_total += routed
            self.dropped_total += dropped
            self.last_routed, self.last_dropped = routed, dropped


def routed_layers(model: nn.Module) -> list[MixtureOfExperts]:
    """The model's MoE layers, in module order (for an encoder-decoder: decoder blocks, then encoder blocks)."""
    return [module for module in model.modules() if isinstance(module, MixtureOfExperts)]


def load_and_drops(routed: Tensor, dropped: Tensor) -> tuple[list[float], float]:
    """Each expert's share of the routed assignments (sums to 1; 1/experts is balanced), and the fraction dropped."""
    total = max(1, int(routed.sum()))
    return [float(n) / total for n in routed.tolist()], float(dropped) / total


def routing_summary(layers: list[MixtureOfExperts]) -> dict | None:
    """results.json `moe`: per layer, each expert's share of the training assignments and the fraction dropped
    for capacity, over the whole training run (a resume included). None for a model without MoE layers."""
    if not layers:
        return None
    loads, drops = zip(*(load_and_drops(layer.routed_total, layer.dropped_total) for layer in layers))
    first = layers[0]
    return {"experts": first.n_experts, "top_k": first.top_k, "capacity_factor": first.capacity_factor,
            "assignments": int(first.routed_total.sum()), "expert_load": list(loads), "dropped_fraction": list(drops)}
