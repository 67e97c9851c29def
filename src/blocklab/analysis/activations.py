"""The FFN activations as functions (exercises 1.9, 1.10): their values and derivatives (torch autograd), and where
each is "off". ReLU outputs exact zeros; GELU and SiLU never do, so |h| <= eps on the hidden says little about them.
A unit counts as off on a token when its pre-activation x lies in the activation's flat lower tail: at or below
off_level(fn), the largest x <= 0 with |fn(t)| <= OFF_EPS for every t <= x (ReLU 0, GELU about -2.7, SiLU about
-6.5, the sigmoid gate of GLU about -4.6), computed from the function itself. Gated FFNs are off where their gate is."""
import functools
from typing import Callable

import torch
from torch import Tensor

from blocklab.model.ffn import ACTIVATIONS

# |act(x)| at most this on the whole tail: 1% of a unit input's output (GELU(1) = 0.84, SiLU(1) = 0.73, ReLU(1) = 1).
OFF_EPS = 0.01
TAIL_FROM = -30.0  # where the scan for the tail starts; every registered activation is flat well before it
GRID = 30001  # scan points on [TAIL_FROM, 0]: steps of 0.001


@functools.lru_cache(maxsize=None)
def off_level(fn: Callable[[Tensor], Tensor], eps: float = OFF_EPS) -> float:
    """The largest x <= 0 with |fn(t)| <= eps for all t <= x (to the grid's 0.001); -inf if fn has no such tail."""
    x = torch.linspace(TAIL_FROM, 0.0, GRID, dtype=torch.float64)
    outside = (fn(x).abs() > eps).nonzero()
    if len(outside) == 0:
        return 0.0
    first = int(outside[0])
    return float("-inf") if first == 0 else float(x[first - 1])


def off_fraction_and_dead(pre: Tensor, fn: Callable[[Tensor], Tensor], eps: float = OFF_EPS) -> tuple[float, int]:
    """pre (tokens, units): pre-activations of real tokens. The fraction of (token, unit) pairs that are off, and
    how many units are off on every token (dead over this batch)."""
    off = pre <= off_level(fn, eps)
    return float(off.double().mean()), int(off.all(dim=0).sum())


def distinct() -> list[tuple[list[str], Callable[[Tensor], Tensor]]]:
    """Every registered activation's function once, with the names using it (a gated one as "swiglu (gate)")."""
    by_fn: dict = {}
    for name in ACTIVATIONS:
        entry = ACTIVATIONS[name]
        by_fn.setdefault(entry.fn, []).append(f"{name} (gate)" if entry.gated else name)
    return [(names, fn) for fn, names in by_fn.items()]


def curves(x: Tensor) -> list[tuple[list[str], Tensor, Tensor]]:
    """(names, fn(x), fn'(x)) for each distinct activation; the derivative by autograd (ReLU's at 0: torch's 0)."""
    out = []
    for names, fn in distinct():
        t = x.detach().double().requires_grad_(True)
        y = fn(t)
        (dy,) = torch.autograd.grad(y.sum(), t)
        out.append((names, y.detach(), dy))
    return out
