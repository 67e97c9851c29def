"""Position schemes behind one interface, so attention never asks which scheme it runs.

A scheme implements any of three hooks; the defaults do nothing (NoPE implements none):
  embed(x, positions)          absolute schemes add a vector to the token embeddings
  rotate(q, k, positions)      RoPE rotates queries and keys before attention
  bias(q_positions, k_positions)  additive attention bias (ALiBi, T5 buckets, FIRE), (B|1, H, Tq, Tk)
Positions are explicit integer tensors of shape (B|1, T), so left padding, KV-cache decoding
and evaluation beyond the training length all go through the same code.

Context extension (`pos.scaling`, `pos.scaling_factor`): a scheme with a rotation (RoPE) or a table (learned)
can be stretched past the context it trained at, by the entries of POSITION_SCALINGS (PI, NTK-aware, YaRN, Llama 3),
through the same hooks, so training, evaluation and cached decoding all see the same scaled positions. The scalings
are model/rope_scaling.py's; scaling_errors here says which scheme takes which.
"""
import math
from collections import OrderedDict

import torch
from torch import Tensor, nn

from blocklab.model.rope_scaling import POSITION_SCALINGS, YARN_RAMPS, ScalingSpec, rope_frequencies
from blocklab.registry import Registry

POSITION_SCHEMES: Registry = Registry("pos.name", framework_args=("d_model", "n_heads", "d_head", "causal"))


class PerPositions:
    """Remembers what a scheme derived from the last few position tensors. Every layer of a pass sees
    the same positions object, and default positions are one shared tensor per length
    (`default_positions`), so tables are built once per length, not once per layer and step.
    Keyed by identity and version: a new or modified positions tensor is always recomputed
    (inference tensors, made during decoding, carry no version and are keyed by identity alone)."""

    def __init__(self, size: int = 4):
        self.size, self.entries = size, OrderedDict()

    def get(self, tensors: tuple[Tensor, ...], extra: tuple, make):
        key = tuple((id(t), -1 if t.is_inference() else t._version) for t in tensors) + extra
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key][1]
        with torch.inference_mode(False):  # a table first built during validation must serve training too
            value = make()
        self.entries[key] = (tensors, value)  # holding the tensors keeps their ids from being reused
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


_DEFAULT_POSITIONS: dict = {}


def default_positions(length: int, device) -> Tensor:
    """Positions 0..length-1 as (1, length): one shared, never-modified tensor per length and device."""
    key = (length, str(device))
    if key not in _DEFAULT_POSITIONS:
        with torch.inference_mode(False):
            _DEFAULT_POSITIONS[key] = torch.arange(length, device=device)[None]
    return _DEFAULT_POSITIONS[key]


class PositionScheme(nn.Module):
    """A scheme's options are its constructor's keyword arguments past the four the model supplies. The
    context-extension options (`scaling`, `scaling_factor`, `yarn_alpha`, `yarn_beta`, `yarn_ramp`,
    `llama3_low_freq_factor`, `llama3_high_freq_factor`, `original_context`) are every scheme's; `scalings` says which methods a scheme can apply (none only, unless it rotates or has a table).
    `logit_scale` multiplies every attention logit q.k (YaRN's 1/t; RoPE folds it into its rotation, a kind that
    rotates only part of q and k, MLA, scales the rest itself)."""

    scalings: tuple[str, ...] = ("none",)
    logit_scale = 1.0

    def __init__(self, d_model: int, n_heads: int, d_head: int, causal: bool = True, scaling: str = "none",
                 scaling_factor: float = 1.0, yarn_alpha: float = 1.0, yarn_beta: float = 32.0,
                 yarn_ramp: str = "reference", llama3_low_freq_factor: float = 1.0,
                 llama3_high_freq_factor: float = 4.0, original_context: int | None = None):
        super().__init__()
        self.d_model, self.n_heads, self.d_head, self.causal = d_model, n_heads, d_head, causal
        self.memo = PerPositions()
        self.scaling = ScalingSpec(scaling, float(scaling_factor), float(yarn_alpha), float(yarn_beta),
                                   original_context, yarn_ramp, float(llama3_low_freq_factor),
                                   float(llama3_high_freq_factor))

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return x

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return q, k

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        return None

    @classmethod
    def adds_bias(cls) -> bool:
        """Whether the scheme adds to attention scores (so bounds on q.k alone do not hold)."""
        return cls.bias is not PositionScheme.bias

    @classmethod
    def rotates_only(cls) -> bool:
        """Whether the scheme acts only by rotating queries and keys (RoPE): an attention kind that skips the
        rotation then sees no positions at all."""
        return cls.rotate is not PositionScheme.rotate and cls.embed is PositionScheme.embed and not cls.adds_bias()

    @classmethod
    def derived_options(cls, cfg) -> dict:
        """Values of options left null ('derive it') in the config, from the model config."""
        return {}

    @classmethod
    def errors(cls, cfg, options: dict) -> list[str]:
        """Constraints on the model config and this scheme's (resolved) options, one line each. A subclass
        adds its own to these (the scaling options every scheme takes)."""
        return scaling_errors(cls, options)

    @classmethod
    def old_run_options(cls, options: dict) -> dict:
        """`options` (the pos group of a run saved by an older BlockLab: its .hydra/config.yaml's `pos`, or its
        model.json's pos options) with each key added since given the value that keeps what that run computed.
        pos.yarn_ramp (added with the reference ramp as its default): a YaRN run that lacks it ramped as the paper
        prints it; a run under any other scaling never read it, so it stays unset there."""
        if options.get("scaling") == "yarn" and "yarn_ramp" not in options:
            return {**options, "yarn_ramp": "paper"}
        return options


@POSITION_SCHEMES.register("none")
class NoPE(PositionScheme):
    """No positional information; a causal mask still breaks permutation symmetry."""


def base_errors(base: float) -> list[str]:
    """The frequencies base^(-2i/d) fall from 1 towards 1/base only for base > 1: base 1 gives every pair the same
    frequency, below 1 they grow past 1 radian per position, and base <= 0 is NaN at the first step."""
    if base > 1:
        return []
    return [f"pos.base={base!r} must be > 1 (frequencies base^(-2i/d) fall from 1 to 1/base; "
            "the papers use 10000)"]


def _angles(positions: Tensor, dim: int, base: float) -> Tensor:
    """positions (B, T) -> angles (B, T, dim/2) with frequencies base^(-2i/dim)."""
    return positions.to(torch.float32)[..., None] * rope_frequencies(base, dim, positions.device)


# ------------------------------------------------------------------------------ context extension

def scaling_errors(scheme: type, options: dict, d_head: int | None = None) -> list[str]:
    """The scaling options of `scheme` (a PositionScheme class) with its resolved `options`, one line each."""
    context = options.get("original_context")
    if context is not None and not (isinstance(context, int) and not isinstance(context, bool) and context > 0):
        # checked whatever pos.scaling is: analyze --eval-scaling applies a scaling to the trained run later, and
        # reads the context it trained at from here
        return [f"pos.original_context={context!r} must be null (derived from the task) or a positive integer: the "
                "context the model trained at, in tokens (YaRN's L, which --eval-scaling uses too)"]
    method = options.get("scaling", "none")
    if method not in POSITION_SCALINGS:
        return [POSITION_SCALINGS.unknown(method)]
    ramp = options.get("yarn_ramp", "reference")
    if ramp not in YARN_RAMPS:
        return [f"pos.yarn_ramp={ramp!r} is unknown; use reference (linear in the pair index, as YaRN's code and "
                "transformers) or paper (linear in r, as §3.2 prints it)"]
    if method not in scheme.scalings:
        able = [name for name in POSITION_SCHEMES if method in getattr(POSITION_SCHEMES[name], "scalings", ())]
        return [f"pos.scaling={method} {POSITION_SCALINGS[method].what}, which "
                f"pos={getattr(scheme, 'registry_name', scheme.__name__)} does not have; use pos.scaling=none, or "
                f"pos={' or pos='.join(able)}"]
    return POSITION_SCALINGS[method].errors(options, d_head)


@POSITION_SCHEMES.register("sinusoidal")
class Sinusoidal(PositionScheme):
    """Vaswani et al.: PE[p, 2i] = sin(p w_i), PE[p, 2i+1] = cos(p w_i), w_i = base^(-2i/d), added to
    the token embeddings multiplied by sqrt(d) as in the paper (scale_embeddings). Unscaled, a
    small-init embedding is drowned by the unit-amplitude PE and a model barely learns."""

    def __init__(self, d_model, n_heads, d_head, causal=True, base: float = 10000.0, scale_embeddings: bool = True,
                 **scaling):
        super().__init__(d_model, n_heads, d_head, causal, **scaling)
        self.base = base
        self.embed_scale = math.sqrt(d_model) if scale_embeddings else 1.0

    @classmethod
    def errors(cls, cfg, options):
        errs = [f"pos=sinusoidal needs an even model.d_model (got {cfg.d_model})"] if cfg.d_model % 2 else []
        return scaling_errors(cls, options) + errs + base_errors(options["base"])

    def table(self, positions: Tensor) -> Tensor:
        return self.memo.get((positions,), (), lambda: self._table(positions))

    def _table(self, positions: Tensor) -> Tensor:
        angles = _angles(positions, self.d_model, self.base)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)

    def embed(self, x, positions):
        return x * self.embed_scale + self.table(positions).to(x.dtype)


@POSITION_SCHEMES.register("learned")
class Learned(PositionScheme):
    """A trained vector per absolute position (GPT-2). Positions past the table are an error. Under
    pos.scaling=pi (Chen et al. 2023, §2.3 "the position embeddings ... interpolated") position p reads the table
    at p/s, linearly between the two rows around it, so a model shown s times its trained length sees only the
    positions it trained."""

    scalings = ("none", "pi")

    def __init__(self, d_model, n_heads, d_head, causal=True, max_len: int = 512, **scaling):
        super().__init__(d_model, n_heads, d_head, causal, **scaling)
        self.max_len = max_len
        self.table = nn.Embedding(max_len, d_model)

    @classmethod
    def derived_options(cls, cfg):
        return {"max_len": cfg.max_len}  # the table covers the longest sequence trained or evaluated

    @classmethod
    def errors(cls, cfg, options):
        errs = scaling_errors(cls, options)
        if options["max_len"] < cfg.max_len:
            errs.append(f"pos.max_len={options['max_len']} is shorter than the longest sequence to train or evaluate "
                        f"({cfg.max_len} tokens); raise pos.max_len or set it to null (auto)")
        return errs

    def embed(self, x, positions):
        scaled = POSITION_SCALINGS[self.scaling.method].positions(positions, self.scaling)
        if positions.numel() and float(scaled.max()) > self.max_len - 1:
            raise ValueError(
                f"position {int(positions.max())} is past the learned table (pos.max_len={self.max_len}); "
                "raise pos.max_len or use shorter sequences"
            )
        if scaled is positions:
            return x + self.table(positions)
        # Interpolated: row floor(p/s) and the next, weighted by the fraction (weight 0: the row itself, exactly).
        low = scaled.floor()
        below = low.long()
        above = (below + 1).clamp(max=self.max_len - 1)
        weight = (scaled - low)[..., None].to(self.table.weight.dtype)
        return x + torch.lerp(self.table(below), self.table(above), weight)


@POSITION_SCHEMES.register("rope")
class RoPE(PositionScheme):
    """Su et al.: rotate each pair (x_2i, x_2i+1) of q and k by angle p * base^(-2i/d_head). Under pos.scaling
    the positions, the frequencies and the logits' temperature are the scaling's (POSITION_SCALINGS); the
    temperature sqrt(1/t) multiplies q and k through the rotation's magnitude, as YaRN's reference code does.
    The rotated width is d_head, or the attention kind's (ModelConfig.kind_rotated_width: MLA's attn.rope_dim)."""

    scalings = ("none", "pi", "ntk", "yarn", "llama3")

    def __init__(self, d_model, n_heads, d_head, causal=True, base: float = 10000.0, rotary_fraction: float = 1.0,
                 rotary_form: str = "frequencies", **scaling):
        super().__init__(d_model, n_heads, d_head, causal, **scaling)
        self.base = base
        self.rotary_fraction, self.rotary_form = float(rotary_fraction), rotary_form
        self.logit_scale = POSITION_SCALINGS[self.scaling.method].temperature(self.scaling) ** 2

    @classmethod
    def errors(cls, cfg, options):
        own = cfg.kind_rotated_width
        errs = scaling_errors(cls, options, d_head=cfg.d_head if own is None else own)
        if own is None and cfg.d_head % 2:  # a kind that rotates a width of its own (MLA) checks it itself
            return errs + [f"pos=rope needs an even head dimension, but model.d_model/model.n_heads = {cfg.d_head}; "
                           "change model.n_heads or model.d_model"]
        return errs + base_errors(options["base"]) + partial_rotary_errors(options, d_head=cfg.d_head if own is None
                                                                          else own)

    def rotate(self, q, k, positions):
        # the rotated width is q's: d_head, or a part of it (MLA's decoupled RoPE dimensions); under
        # rotary_form=dimensions only its first rotary_fraction of it (GPT-NeoX's rotary_pct)
        width = q.shape[-1]
        rotated = rotated_dimensions(width, self.rotary_fraction, self.rotary_form)
        rotation = self.rotations(positions, q.dtype, rotated)
        if rotated == width:
            return _rotate_pairs(q, rotation), _rotate_pairs(k, rotation)
        return tuple(torch.cat([_rotate_pairs(x[..., :rotated], rotation), x[..., rotated:]], dim=-1) for x in (q, k))

    def rotations(self, positions: Tensor, dtype: torch.dtype, dim: int | None = None) -> Tensor:
        """exp(i angle) for every position and frequency, (B|1, 1, T, dim/2), once per positions tensor; dim
        (default d_head) the rotated width, its frequencies base^(-2i/dim)."""
        dim = self.d_head if dim is None else dim

        def make():
            scaling = POSITION_SCALINGS[self.scaling.method]
            frequencies = scaling.frequencies(self.base, dim, self.scaling, positions.device)
            if self.rotary_form == "frequencies" and self.rotary_fraction < 1:
                frequencies = kept_frequencies(frequencies, dim, self.rotary_fraction)
            scaled = scaling.positions(positions, self.scaling)
            angles = (scaled.to(torch.float32)[..., None] * frequencies)[:, None]
            magnitude = torch.full_like(angles, scaling.temperature(self.scaling))  # 1 but under YaRN
            return torch.polar(magnitude, angles).to(_COMPLEX[_rotation_dtype(dtype)])

        return self.memo.get((positions,), (dtype, dim), make)


# ------------------------------------------------------------------------------ partial rotation

# pos.rotary_form: how pos.rotary_fraction < 1 leaves part of q and k unrotated.
ROTARY_FORMS = {
    # p-RoPE (Barbero et al. 2025, "Round and Round We Go! What makes Rotary Positional Encodings useful?", ICLR;
    # reference: google-deepmind/gemma, gemma/positional_embeddings.py apply_rope's rope_proportion): the first
    # int(p * d // 2) pairs keep their frequencies base^(-2i/d), the lowest ones get frequency 0 (left unrotated).
    "frequencies": "keep the highest fraction of frequencies, leave the lowest pairs unrotated (p-RoPE)",
    # GPT-NeoX's rotary_pct (EleutherAI/gpt-neox, megatron/model/positional_embeddings.py; transformers'
    # GPTNeoXRotaryEmbedding): the first int(d * p) dimensions are rotated with frequencies base^(-2i/(d p)).
    "dimensions": "rotate the first fraction of dimensions with their own frequencies (GPT-NeoX rotary_pct)",
}


def kept_frequencies(frequencies: Tensor, dim: int, fraction: float) -> Tensor:
    """p-RoPE's frequencies: the first int(fraction * dim // 2) kept, the rest 0 (gemma's rope_angles)."""
    kept = int(fraction * dim // 2)
    return torch.cat([frequencies[:kept], frequencies.new_zeros(frequencies.shape[0] - kept)])


def rotated_dimensions(width: int, fraction: float, form: str) -> int:
    """How many leading dimensions of a width-`width` q or k are rotated: all of them, but int(width * fraction)
    under rotary_form=dimensions (GPT-NeoX's rotary_ndims)."""
    return int(width * fraction) if form == "dimensions" and fraction < 1 else width


def partial_rotary_errors(options: dict, d_head: int) -> list[str]:
    fraction, form = options.get("rotary_fraction", 1.0), options.get("rotary_form", "frequencies")
    if form not in ROTARY_FORMS:
        return [f"pos.rotary_form={form!r} is unknown; use one of {sorted(ROTARY_FORMS)}"]
    if not (isinstance(fraction, (int, float)) and 0 <= fraction <= 1):
        return [f"pos.rotary_fraction={fraction!r} must be in [0, 1] (1: every pair rotated, as plain RoPE)"]
    rotated = rotated_dimensions(d_head, fraction, form)
    if rotated != d_head and rotated % 2:  # an odd head width itself is the scheme's or the kind's own error
        return [f"pos.rotary_fraction={fraction} rotates int({d_head} * {fraction}) = {rotated} dimensions, an odd "
                f"number (rotation acts on pairs); choose a fraction giving an even count"]
    if fraction < 1 and options.get("scaling", "none") != "none":
        return [f"pos.rotary_fraction={fraction} with pos.scaling={options['scaling']}: the context-extension "
                "methods are defined (and tested) on every pair; use pos.rotary_fraction=1 or pos.scaling=none"]
    return []


_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def _rotation_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in _COMPLEX else torch.float32  # half precisions rotate in float32


def _rotate_pairs(x: Tensor, rotation: Tensor) -> Tensor:
    """Each pair as one complex number times exp(i angle): one kernel forward and one backward,
    where the same rotation in real arithmetic takes 4-7 (`python -m blocklab.bench step`: rope vs none)."""
    work = x.to(_rotation_dtype(x.dtype))
    if any(stride % 2 for stride in work.stride()[:-1]):  # a slice of an odd-width projection (MLA's k^R)
        work = work.contiguous()
    pairs = torch.view_as_complex(work.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def build_position(name: str, d_model: int, n_heads: int, d_head: int, causal: bool, **options) -> PositionScheme:
    return POSITION_SCHEMES[name](d_model, n_heads, d_head, causal, **options)
