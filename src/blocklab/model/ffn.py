"""Position-wise feed-forward networks: plain MLP(act) and gated GLU variants."""
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


class FFN(nn.Module):
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
