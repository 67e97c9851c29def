"""What a model config costs in memory, from the model itself: build_model on the meta device, where tensors have
shapes but no storage, so the count allocates nothing and takes milliseconds whatever the sizes. It runs the code
training runs, so no size key, embedding or registry entry can be left out of it (tests/test_model_size.py checks
the count against real models of every registry entry)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch.overrides import TorchFunctionMode

from blocklab.schema import PRECISIONS, STATE_COPIES, physical_memory

if TYPE_CHECKING:
    from blocklab.model.config import ModelConfig

# In-place ops that change a tensor's shape or metadata, which a count must see. Every other in-place op (an init
# scheme's normal_, uniform_, zero_, mul_...) only writes values, which a meta tensor does not have.
_SHAPE_OPS = frozenset({"resize_", "resize_as_", "set_", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_",
                        "swapaxes_", "as_strided_", "requires_grad_", "share_memory_"})


class _NoValues(TorchFunctionMode):
    """Inside a count (the default device is meta): skips in-place writes to meta tensors and makes random tensors
    empty ones. Neither has values to compute, and their meta kernels run in Python (the first imports
    torch._dynamo or sympy, seconds; each costs milliseconds): an init scheme would cost more than the count."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.randn, torch.rand):
            kwargs.pop("generator", None)
            return torch.empty(*args, **kwargs)
        name = getattr(func, "__name__", "")
        # The tensor written: a method's self, or torch.nn.init's first argument (passed on by keyword).
        target = args[0] if args else next(iter(kwargs.values()), None)
        if (name.endswith("_") and not name.endswith("__") and name not in _SHAPE_OPS
                and isinstance(target, torch.Tensor) and target.is_meta):
            return target
        return func(*args, **kwargs)


@dataclass(frozen=True)
class ModelSize:
    """What build_model(cfg) holds: its parameters, and its buffers (floating ones follow the model's dtype)."""

    parameters: int
    float_buffers: int  # elements
    other_buffer_bytes: int  # integer buffers (counters), at their own width

    def training_bytes(self, precision) -> int:
        """The bytes training holds: each parameter with its gradient and Adam's two moments (STATE_COPIES), at
        the precision's weight width (bf16-mixed keeps float32 weights), and the buffers once."""
        width = 8 if isinstance(precision, (str, int)) and PRECISIONS.get(precision) == "64-true" else 4
        return (self.parameters * STATE_COPIES + self.float_buffers) * width + self.other_buffer_bytes

    def __add__(self, other: ModelSize) -> ModelSize:
        return ModelSize(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __sub__(self, other: ModelSize) -> ModelSize:
        return ModelSize(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __mul__(self, times: int) -> ModelSize:
        return ModelSize(*(a * times for a in dataclasses.astuple(self)))


class TooLargeToCount(ValueError):
    """A tensor of the model would hold more than 2**63 bytes: torch cannot even describe it."""


def meta_model(cfg: ModelConfig) -> torch.nn.Module:
    """build_model(cfg) on the meta device, uninitialised: its shapes, in milliseconds, with nothing allocated."""
    from blocklab.model.transformer import build_model

    with torch.device("meta"), _NoValues():
        return build_model(cfg)


def _built(cfg: ModelConfig) -> ModelSize:
    try:
        model = meta_model(cfg)
    except RuntimeError as err:
        if "overflow" in str(err):  # "Storage size calculation overflowed with sizes=[...]"
            raise TooLargeToCount(str(err)) from None
        raise
    buffers = list(model.buffers())
    return ModelSize(sum(p.numel() for p in model.parameters()),
                     sum(b.numel() for b in buffers if b.is_floating_point()),
                     sum(b.numel() * b.element_size() for b in buffers if not b.is_floating_point()))


def model_size(cfg: ModelConfig) -> ModelSize:
    """The exact size of build_model(cfg) for a valid config; TooLargeToCount where a tensor is past what torch can
    describe. Layers are copies built from one config (periods of a hybrid schedule, attn.layers), and so are the
    submodules a variant's `repeated_by` option counts (MoE's experts): the size is affine in each such count, so a
    model of thousands of layers or experts is counted from models of one and two, not built module by module
    (seconds per thousand, even on meta)."""
    return _extrapolated(cfg, _repeat_axes(cfg))


def _repeat_axes(cfg: ModelConfig) -> list[tuple[int, Callable[[ModelConfig, int], ModelConfig]]]:
    """(count, the config with that count replaced) for n_layers and each variant's `repeated_by` option."""
    from blocklab.model.ffn import FFN_KINDS

    period = len(cfg.attn.layers or [None])  # a hybrid stack repeats its schedule: affine in the repeats
    axes = [(cfg.n_layers // period, lambda c, n: dataclasses.replace(c, n_layers=n * period))]
    key = getattr(FFN_KINDS.get(cfg.ffn_kind.name), "repeated_by", None)
    if key is not None:
        count = cfg.ffn_kind.options.get(key, FFN_KINDS.options(cfg.ffn_kind.name).get(key))
        axes.append((count, lambda c, n: dataclasses.replace(
            c, ffn_kind=dataclasses.replace(c.ffn_kind, options={**c.ffn_kind.options, key: n}))))
    return axes


def _extrapolated(cfg: ModelConfig, axes: list) -> ModelSize:
    if not axes:
        return _built(cfg)
    (count, at), rest = axes[0], axes[1:]
    if count <= 2:
        return _extrapolated(cfg, rest)
    one, two = (_extrapolated(at(cfg, n), rest) for n in (1, 2))
    return one + (two - one) * (count - 1)


def memory_error(cfg: ModelConfig, precision, sizes: str, fix: str) -> str | None:
    """One line where training cfg's model would need more memory than this machine has (None: it fits, or the
    OS does not say how much it has). `sizes` names the keys that set the model's size, `fix` what to do."""
    memory = physical_memory()
    if memory is None:
        return None
    try:
        size = model_size(cfg)
    except TooLargeToCount:
        return (f"{sizes} make a model with a tensor of more than 2**63 bytes, past any machine's memory (this one "
                f"has {memory / 2**30:.3g} GiB); {fix}")
    needed = size.training_bytes(precision)
    if needed <= memory:
        return None
    return (f"{sizes} make a model of {size.parameters:,} parameters, which needs {needed / 2**30:.3g} GiB to train "
            f"(weights, gradients and Adam's two moments) and this machine has {memory / 2**30:.3g} GiB; {fix}")


def size_keys(cfg: ModelConfig) -> list[str]:
    """The keys that set cfg's size, as a command spells them: model.d_model, model.n_layers, model.d_ff (with an
    FFN), and each integer option of the attention kind, position scheme and FFN kind set above its default or in
    place of a derived one (a null default: MLA's ranks). The vocabulary comes from the task; the caller names it."""
    from blocklab.model.attention import ATTENTION_KINDS
    from blocklab.model.ffn import FFN_KINDS
    from blocklab.model.position import POSITION_SCHEMES

    keys = [f"model.{key}={getattr(cfg, key)}" for key in ("d_model", "n_layers", "d_ff") if key != "d_ff" or cfg.ffn]
    if cfg.attn.short_conv:
        keys.append(f"attn.short_conv={cfg.attn.short_conv}")
    for group, registry, name, options in (("attn", ATTENTION_KINDS, cfg.attn.kind, cfg.attn.options),
                                           ("pos", POSITION_SCHEMES, cfg.pos.name, cfg.pos.options),
                                           ("ffn", FFN_KINDS, cfg.ffn_kind.name, cfg.ffn_kind.options)):
        defaults = registry.options(name)
        shared = POSITION_SCHEMES.options("none") if group == "pos" else {}  # scaling options: no size
        keys += [f"{group}.{key}={value}" for key, value in options.items()
                 if key not in shared and isinstance(value, int) and not isinstance(value, bool)
                 and (defaults.get(key) is None or isinstance(defaults[key], int) and value > defaults[key])]
    return keys
