"""K models of one architecture run as one: their parameters stacked (K, ...) and one pass over their batches
laid end to end (member k owns rows k*B .. (k+1)*B - 1 of every batch tensor).

Whatever has no parameters (attention, masks, positions, activations, residual sums) already treats rows
independently, so it runs once over all K*B rows. The few operations that read parameters are rewritten as
grouped ones: linear as a batched matmul, embedding as a lookup in the K tables laid end to end, layer and
RMS norm as the plain norm followed by each member's gain and shift. An input with one row (a position
table, a bias over positions shared by the batch) gives each member its own result, broadcast over that
member's rows. Any other use of a stacked parameter raises Unpackable, and so the model is not packed.
`pack_problem` runs a pack against its members run alone on a real batch before training, so a model that
mixes rows of different members (statistics over the batch, a balancing loss) is refused too.

This is what torch.func.vmap would do, at the cost of a single model's operation count: vmap has no CPU
batching rule for scaled_dot_product_attention (it loops over members) and refuses the model's
data-dependent checks (is there padding?)."""
import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from blocklab.tasks.base import IGNORE, model_inputs


class Unpackable(Exception):
    """A model does something with a stacked parameter that has no grouped form here."""


class Stacked(Tensor):
    """K members' values of one parameter on a new first dimension. Outside a grouped pass a plain tensor, as an
    nn.Parameter is (optimizer, clipping, checkpoints pay nothing); inside one, the calls given one of these (and
    only those: calls on activations alone stay in C++) run per member or raise Unpackable."""

    __torch_function__ = torch._C._disabled_torch_function_impl


def _grouped_call(cls, func, types, args=(), kwargs=None):
    """Stacked.__torch_function__ while a grouped pass runs."""
    kwargs = kwargs or {}
    with torch._C.DisableTorchFunctionSubclass():  # results are plain tensors; no recursion
        if func in HARMLESS:
            return func(*args, **kwargs)
        return Grouped.running.call(func, args, kwargs)


def stacked(values: Tensor) -> Stacked:
    """A leaf parameter (K, ...) that grouped passes read per member."""
    return Tensor._make_subclass(Stacked, values, True)


class Grouped:
    """One grouped pass: K members over a batch whose first dimension is `rows` (their rows laid end to end).
    An input with 1 row is shared by all rows."""

    running: "Grouped | None" = None

    def __init__(self, k: int, rows: int):
        self.k, self.rows = k, rows

    @contextlib.contextmanager
    def active(self):
        Grouped.running = self
        Stacked.__torch_function__ = classmethod(_grouped_call)
        try:
            yield
        finally:
            Stacked.__torch_function__ = torch._C._disabled_torch_function_impl
            Grouped.running = None

    def call(self, func, args: tuple, kwargs: dict):
        if func in ELEMENTWISE:
            return _elementwise(self, func, args, kwargs)
        rule = RULES.get(func)
        if rule is None:
            raise Unpackable(f"{getattr(func, '__qualname__', func)} reads a parameter directly")
        return rule(self, *args, **kwargs)

    @staticmethod
    def adopt(t: Tensor) -> Stacked:
        """A stacked value made inside (a view of a stacked weight, a gain's absolute value): itself stacked."""
        return t.as_subclass(Stacked)

    @staticmethod
    def is_stacked(t) -> bool:
        return isinstance(t, Stacked)

    def shared(self, x: Tensor) -> bool:
        """Whether x holds one row shared by the batch (True) or the K members' rows (False)."""
        if x.shape[0] == self.rows:
            return False
        if x.shape[0] == 1:
            return True
        raise Unpackable(f"an input of {x.shape[0]} rows meets a parameter (the batch has {self.rows})")

    def broadcast(self, per_member: Tensor) -> Tensor:
        """(K, ...) results of a shared input -> (rows, ...): member k's result on each of its rows."""
        k, rest = self.k, per_member.shape[1:]
        return per_member.unsqueeze(1).expand(k, self.rows // k, *rest).reshape(self.rows, *rest)


def _narrow(g: Grouped, t: Tensor, dim: int, start, length) -> Tensor:
    """Rows of a stacked weight (W_q of a stacked qkv_proj): a stacked view, itself a parameter to the rules."""
    return Grouped.adopt(t.narrow(dim + 1 if dim >= 0 else dim, start, length))


def _elementwise(g: Grouped, func, args: tuple, kwargs: dict) -> Tensor:
    """An elementwise op on stacked values (and numbers) is stacked; with one activation, each member's
    parameter meets that member's rows (a ReZero gain times a branch, FIRE's c times distances)."""
    activations = [a for a in args if torch.is_tensor(a) and not g.is_stacked(a)]
    if not activations:
        return Grouped.adopt(func(*args, **kwargs))
    if len(activations) > 1 or kwargs:
        raise Unpackable(f"{getattr(func, '__qualname__', func)} of a parameter with several inputs")
    x, k = activations[0], g.k
    shared = g.shared(x)
    xk = x.unsqueeze(1).expand(k, 1, *x.shape[1:]) if shared else x.reshape(k, -1, *x.shape[1:])

    def per_member(a):
        if a is x:
            return xk
        if not g.is_stacked(a):
            return a
        if a.dim() - 1 > x.dim():
            raise Unpackable("a parameter with more dimensions than the input it meets")
        return a.view(k, *[1] * (x.dim() + 1 - a.dim()), *a.shape[1:])

    out = func(*(per_member(a) for a in args))
    if shared:
        out = out.expand(k, g.rows // k, *out.shape[2:])
    return out.reshape(g.rows, *out.shape[2:])


def _linear(g: Grouped, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    shared, k = g.shared(x), g.k
    xk = (x.expand(k, *x.shape[1:]) if shared else x).reshape(k, -1, x.shape[-1])
    wt = weight.transpose(1, 2)
    y = torch.bmm(xk, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), xk, wt)
    if shared:
        return g.broadcast(y.view(k, *x.shape[1:-1], y.shape[-1]))
    return y.view(*x.shape[:-1], y.shape[-1])


def _embedding(g: Grouped, idx: Tensor, weight: Tensor, padding_idx=None, max_norm=None, norm_type=2.0,
               scale_grad_by_freq=False, sparse=False) -> Tensor:
    if padding_idx is not None or max_norm is not None or scale_grad_by_freq or sparse:
        raise Unpackable("an embedding with padding_idx, max_norm, scale_grad_by_freq or sparse")
    shared, (k, size) = g.shared(idx), weight.shape[:2]
    rows = k if shared else idx.shape[0]
    offsets = (torch.arange(k, device=idx.device) * size).repeat_interleave(rows // k)
    ids = (idx.expand(k, *idx.shape[1:]) if shared else idx) + offsets.view(-1, *[1] * (idx.dim() - 1))
    y = F.embedding(ids, weight.reshape(k * size, *weight.shape[2:]))
    return g.broadcast(y) if shared else y


def _gain_and_shift(g: Grouped, y: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    k, d = g.k, y.shape[-1]
    yk = y.reshape(k, -1, d)
    if weight is None:
        out = yk + bias.view(k, 1, d)
    elif bias is None:
        out = yk * weight.view(k, 1, d)
    else:
        out = torch.addcmul(bias.view(k, 1, d), yk, weight.view(k, 1, d))
    return out.view(y.shape)


def _layer_norm(g: Grouped, x: Tensor, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    if len(normalized_shape) != 1 or g.shared(x):
        raise Unpackable("a layer norm over more than the last dimension, or over a shared input")
    return _gain_and_shift(g, F.layer_norm(x, normalized_shape, None, None, eps), weight, bias)


def _rms_norm(g: Grouped, x: Tensor, normalized_shape, weight=None, eps=None) -> Tensor:
    if len(normalized_shape) != 1 or g.shared(x):
        raise Unpackable("an RMS norm over more than the last dimension, or over a shared input")
    return _gain_and_shift(g, F.rms_norm(x, normalized_shape, None, eps), weight, None)


RULES = {F.linear: _linear, F.embedding: _embedding, F.layer_norm: _layer_norm, F.rms_norm: _rms_norm,
         Tensor.narrow: _narrow}
ELEMENTWISE = {Tensor.__mul__, Tensor.__rmul__, Tensor.mul, torch.mul, Tensor.__add__, Tensor.__radd__, Tensor.add,
               torch.add, Tensor.__sub__, Tensor.__rsub__, Tensor.sub, torch.sub, Tensor.__truediv__,
               Tensor.__rtruediv__, Tensor.div, torch.div, torch.maximum, torch.minimum, Tensor.abs, torch.abs,
               Tensor.exp, torch.exp, Tensor.neg, Tensor.__neg__, torch.neg, Tensor.sigmoid, torch.sigmoid,
               Tensor.tanh, torch.tanh, F.softplus, Tensor.square, torch.square}
# Reading these of a stacked parameter does not depend on its shape.
HARMLESS = {Tensor.dtype.__get__, Tensor.device.__get__, Tensor.requires_grad.__get__, Tensor.is_floating_point}


def fold(batches: list[dict], pad_id: int) -> dict:
    """The members' batches laid end to end, each right-padded to the widest (padding as the task pads: the
    pad token, no target, not valid). Right padding changes nothing a real token computes: causal attention
    never sees later keys, and every other attention masks invalid keys."""
    folded = {}
    for key, first in batches[0].items():
        if not torch.is_tensor(first):
            folded[key] = first
            continue
        parts = [b[key] for b in batches]
        if first.dim() == 2:
            fill = IGNORE if key == "target" else False if first.dtype == torch.bool else \
                pad_id if key in ("input", "source") else 0
            width = max(p.shape[1] for p in parts)
            parts = [F.pad(p, (0, width - p.shape[1]), value=fill) for p in parts]
        folded[key] = torch.cat(parts)
    return folded


class GroupedModel:
    """K members' parameters stacked (leaves, what the optimizer steps) and the one forward pass over them.
    `base` supplies the code and the buffers, which the members must share. A pack of one runs the base
    model's own operations on its parameters, so it computes exactly what the member alone would."""

    def __init__(self, models: list[nn.Module]):
        self.base, self.k = models[0], len(models)
        problem = _buffer_problem(models)
        if problem:
            raise Unpackable(problem)
        names = [name for name, _ in self.base.named_parameters()]  # a tied parameter once (tok_emb = head)
        self.params = {n: stacked(torch.stack([dict(m.named_parameters())[n].detach() for m in models]))
                       for n in names}
        self.slots = _slots(self.base)

    def parameters_of(self, k: int) -> dict[str, Tensor]:
        return {name: p[k] for name, p in self.params.items()}

    def apply(self, x: Tensor, *args, **kwargs):
        """The base module's forward over x (the K members' rows laid end to end), each row by its member."""
        params = self.parameters_of(0) if self.k == 1 else self.params
        bound = {slot: params[name] for slot, name in self.slots.items()}
        if self.k == 1:
            return functional_call(self.base, bound, (x, *args), kwargs, tie_weights=False)
        with Grouped(self.k, x.shape[0]).active():
            return functional_call(self.base, bound, (x, *args), kwargs, tie_weights=False)

    def forward(self, batch: dict) -> Tensor:
        """Logits (K*B, T, vocab) of a folded batch."""
        return self.apply(batch["input"], **model_inputs(batch))

    def losses(self, batch: dict) -> Tensor:
        """(K,) each member's mean cross-entropy over its own scored tokens, as LitTransformer.batch_loss."""
        logits, rows = self.forward(batch), batch["input"].shape[0] // self.k
        return torch.stack([F.cross_entropy(logits[k * rows:(k + 1) * rows].flatten(0, 1),
                                            batch["target"][k * rows:(k + 1) * rows].flatten(), ignore_index=IGNORE)
                            for k in range(self.k)])

    @torch.no_grad()
    def load_into(self, k: int, model: nn.Module) -> nn.Module:
        """Copy member k's parameters into a plain model of the same config."""
        for name, p in model.named_parameters():
            p.copy_(self.params[name][k])
        return model


def _slots(model: nn.Module) -> dict[str, str]:
    """Each place a parameter sits (module path + attribute, once per module object) -> the parameter's own name.
    functional_call's weight tying would set a module reached by two paths (a block's attention is also its
    residual's sublayer) twice and then restore it wrongly; a tied weight (head = tok_emb) sits in two modules."""
    names = {id(p): name for name, p in model.named_parameters()}
    slots, seen = {}, set()
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and (id(module), attr) not in seen:
                seen.add((id(module), attr))
                slots[f"{path}.{attr}" if path else attr] = names[id(p)]
    return slots


def _buffer_problem(models: list[nn.Module]) -> str | None:
    """The members run on the first model's buffers: they must all hold the same."""
    others = [dict(m.named_buffers()) for m in models[1:]]
    for name, buffer in models[0].named_buffers():
        if not all(torch.equal(buffer, o[name]) for o in others):
            return f"buffer {name} differs between members (drawn from the seed)"
    return None


class NoDropout(TorchFunctionMode):
    """Dropout off inside it (the pack check compares passes that would otherwise draw different masks)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.dropout, torch.dropout):
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:
            kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


TOLERANCE = 1e-3  # relative: float32 round-off is ~1e-6 here; members mixing rows differ by far more


def pack_problem(grouped: GroupedModel, alone: list, batches: list[dict], pad_id: int) -> str | None:
    """Why this pack does not compute what its members compute alone, or None. `alone[k]` is member k's
    training module (LitTransformer: its `batch_loss` is the loss a plain run trains on) with the same
    parameters as the pack, `batches[k]` a training batch of member k. Compares each member's loss and
    gradient in training mode, dropout off; also refuses buffers a training pass changes (running statistics)."""
    state = torch.get_rng_state()
    buffers = {name: b._version for name, b in grouped.base.named_buffers()}
    try:
        with NoDropout():
            losses = grouped.losses(fold(batches, pad_id))
            values = losses.tolist()
            grads = torch.autograd.grad(losses.sum(), list(grouped.params.values()), allow_unused=True)
            changed = [n for n, b in grouped.base.named_buffers() if b._version != buffers[n]]
            if changed:
                return f"training changes buffer {changed[0]} (statistics over the batch)"
            for k, lit in enumerate(alone):
                loss = lit.batch_loss(batches[k])
                named = dict(lit.model.named_parameters())
                ref = torch.autograd.grad(loss, [named[n] for n in grouped.params], allow_unused=True)
                alone_loss = float(loss.detach())
                if not abs(values[k] - alone_loss) <= TOLERANCE * max(1.0, abs(alone_loss)):
                    return f"member {k}'s loss is {values[k]} packed and {alone_loss} alone"
                mine = torch.cat([(g[k] if g is not None else torch.zeros_like(p[k])).flatten()
                                  for g, p in zip(grads, grouped.params.values())])
                theirs = torch.cat([(r if r is not None else torch.zeros_like(p[k])).flatten()
                                    for r, p in zip(ref, grouped.params.values())])
                if float((mine - theirs).norm()) > TOLERANCE * float(theirs.norm()) + 1e-12:
                    return f"member {k}'s gradient differs packed and alone"
    except Unpackable as err:
        return str(err)
    finally:
        torch.set_rng_state(state)
    return None

