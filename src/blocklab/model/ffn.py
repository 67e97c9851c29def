"""Position-wise feed-forward networks (`ffn.name`, a registry): `dense`, the plain MLP(act) or gated GLU(act) that
`act` picks, and `moe` (model/moe.py), a mixture of such experts behind a router."""
from dataclasses import dataclass
from typing import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.registry import Registry


def dropout_layer(p: float) -> nn.Module | None:
    """nn.Dropout(p); at p = 0 (the default) None, which is the same computation (no random numbers
    drawn either way) minus a module call per sublayer (`python -m blocklab.bench decode` for its cost)."""
    return nn.Dropout(p) if p > 0 else None


def relu2(x: Tensor) -> Tensor:
    return F.relu(x).square()


@dataclass(frozen=True)
class Activation:
    """A nonlinearity, and whether the FFN is gated: act(x W_gate) * (x W_up) instead of act(x W_in)."""

    fn: Callable[[Tensor], Tensor]
    gated: bool = False

    def hidden_size(self, d_ff: int, match_params: bool) -> int:
        """Gated FFNs have three matrices instead of two; 2/3 of d_ff keeps the parameter count."""
        return max(1, round(d_ff * 2 / 3)) if self.gated and match_params else d_ff


ACTIVATIONS: Registry = Registry("act.name")
ACTIVATIONS.register("relu")(Activation(F.relu))
ACTIVATIONS.register("gelu")(Activation(F.gelu))
ACTIVATIONS.register("silu")(Activation(F.silu))
ACTIVATIONS.register("relu2")(Activation(relu2))
ACTIVATIONS.register("glu")(Activation(F.sigmoid, gated=True))
ACTIVATIONS.register("swiglu")(Activation(F.silu, gated=True))
ACTIVATIONS.register("geglu")(Activation(F.gelu, gated=True))
ACTIVATIONS.register("reglu")(Activation(F.relu, gated=True))


def hidden_size(name: str, d_ff: int, match_params: bool) -> int:
    return ACTIVATIONS[name].hidden_size(d_ff, match_params)


# The constructor arguments every kind gets from the model config; the rest are the kind's own options.
COMMON_ARGS = ("d_model", "d_ff", "act", "match_params", "dropout", "bias")
FFN_KINDS: Registry = Registry("ffn.name", framework_args=COMMON_ARGS)


@FFN_KINDS.register("dense")
class FFN(nn.Module):
    """out_proj(act(in_proj(x))), or gated: out_proj(act(x W_gate) * (x W_up)) (Shazeer 2020)."""

    def __init__(self, d_model: int, d_ff: int, act: str = "gelu", match_params: bool = True,
                 dropout: float = 0.0, bias: bool = True):
        super().__init__()
        activation = ACTIVATIONS[act]
        self.act, self.gated = activation.fn, activation.gated
        self.hidden = activation.hidden_size(d_ff, match_params)
        self.in_proj = nn.Linear(d_model, self.hidden * (2 if self.gated else 1), bias=bias)
        self.out_proj = nn.Linear(self.hidden, d_model, bias=bias)
        self.dropout = dropout_layer(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.in_proj(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.out_proj(h if self.dropout is None else self.dropout(h))

    @classmethod
    def errors(cls, cfg, options: dict) -> list[str]:
        """Constraints on the model config and this kind's options, one line each naming key and fix."""
        return []


def build_ffn(cfg) -> nn.Module:
    """The configured FFN kind for one block of a ModelConfig."""
    kind = FFN_KINDS[cfg.ffn_kind.name]
    return kind(cfg.d_model, cfg.d_ff, cfg.act.name, cfg.act.match_params, cfg.dropout, cfg.bias,
                **cfg.ffn_kind.options)
