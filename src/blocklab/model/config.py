"""The model's configuration, mirrored by the yaml groups model/ norm/ pos/ attn/ act/ ffn/ init/.

Validation lives here, once: `ModelConfig.errors()` lists every problem as one line that names
the offending key and the fix, before anything is built or written."""
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from blocklab.errors import ConfigError
from blocklab.model.architectures import ARCHITECTURES
from blocklab.model.attention import ATTENTION_KINDS
from blocklab.model.ffn import ACTIVATIONS, FFN_KINDS
from blocklab.model.init import INIT_SCHEMES, scheme_errors
from blocklab.model.norm import NORM_TYPES, PLACEMENTS, batch_size_errors, norm_name
from blocklab.model.param import PARAMETRIZATIONS
from blocklab.model.patterns import ATTENTION_PATTERNS
from blocklab.model.position import POSITION_SCHEMES, PositionScheme
from blocklab.model.schedule import layer_attn, schedule_errors
from blocklab.schema import POSITIVE_INT, SCHEMA, group_errors, unknown_key

# ModelConfig fields filled from their own yaml groups
SUBGROUPS = ("norm", "pos", "attn", "act", "ffn_kind", "init", "param")


@dataclass
class NormConfig:
    type: str = "layernorm"
    placement: str = "pre"
    eps: float = 1e-5
    affine: bool = True  # False: norms without the learned gain and shift
    options: dict[str, Any] = field(default_factory=dict)  # the type's own keyword arguments (DyT's alpha_init)

    @property
    def name(self) -> str:
        return norm_name(self.type, self.placement, self.affine)

    def batch_errors(self, batch_size: int) -> list[str]:
        """What the norm type says of the task's training batch size (BatchNorm needs more than one sequence)."""
        return batch_size_errors(self.type, batch_size)


@dataclass
class PosConfig:
    name: str = "rope"
    options: dict[str, Any] = field(default_factory=dict)  # scheme-specific keyword arguments
    # Shared by every scheme (tasks/placement.py); the model itself reads only `abacus` and its offset.
    randomize: bool = False
    random_max: int | None = None
    coupled: bool = False
    abacus: bool = False
    abacus_offset: int = 0
    coupled_offset: int = 0

    @classmethod
    def shared_keys(cls) -> list[str]:
        """The keys every scheme shares: each field but the scheme's name and its own options."""
        return [f.name for f in fields(cls) if f.name not in ("name", "options")]


@dataclass
class AttnConfig:
    kind: str = "softmax"  # attn.kind: how queries meet keys (attention.ATTENTION_KINDS)
    pattern: str | None = None  # attn.pattern: which keys each query sees (patterns.ATTENTION_PATTERNS); None: derived
    n_kv_heads: int | None = None  # None: one K/V head per query head (MHA)
    window: int | None = None  # the local window of a pattern: each query sees this many keys back (itself included)
    causal: bool = True
    scale: float | str | None = None  # None: 1/sqrt(d_head); "none": 1 (unscaled); a number: that number
    scale_factor: float = 1.0  # multiplies the scale: 0.5 with scale null is 1/(2 sqrt(d_head))
    qk_norm: bool = False
    short_conv: int = 0  # width of a depthwise causal convolution on q, k, v (model/short_conv.py); 0: none
    softcap: float = 0.0  # > 0: softmax scores soft-capped to c tanh(s / c) (Attention.caps_scores); 0: none
    output_gate: str = "none"  # sigmoid gate on each head's output: none, headwise, elementwise (attention.OutputGate)
    options: dict[str, Any] = field(default_factory=dict)  # the kind's own keyword arguments
    pattern_options: dict[str, Any] = field(default_factory=dict)  # the pattern's own (stride, dilation...)
    layers: list[dict] | None = None  # attn.layers: a per-layer schedule of kinds (model/schedule.py); None: alike

    @property
    def pattern_name(self) -> str:
        """The pattern; unset, `window` alone makes it local (as before patterns existed), else full."""
        if self.pattern is not None:
            return self.pattern
        return "full" if self.window is None else "window"

    @property
    def pattern_args(self) -> dict[str, Any]:
        """The pattern's constructor keywords: the window if set, and its own options."""
        return {**({} if self.window is None else {"window": self.window}), **self.pattern_options}

    @classmethod
    def split_options(cls, kind: str, pattern: str, extra: dict[str, Any]) -> tuple[dict, dict]:
        """The attn keys no field takes -> (the kind's options, the pattern's options). A key goes to the
        pattern if the chosen pattern takes it, or if only patterns do (so its error names the pattern);
        a key both the pattern and the kind take is reported by ModelConfig.errors()."""
        taken = ATTENTION_PATTERNS.options(pattern) if pattern in ATTENTION_PATTERNS else {}
        kind_takes = ATTENTION_KINDS.options(kind) if kind in ATTENTION_KINDS else {}
        any_pattern = {key for name in ATTENTION_PATTERNS for key in ATTENTION_PATTERNS.options(name)}
        to_pattern = {key for key in extra if key in taken or (key in any_pattern and key not in kind_takes)}
        return ({k: v for k, v in extra.items() if k not in to_pattern},
                {k: v for k, v in extra.items() if k in to_pattern})

    def scale_value(self, d_head: int) -> float | None:
        """The softmax temperature: scale_factor times 1/sqrt(d_head) (scale null), 1 (none) or the number.
        None for the plain 1/sqrt(d_head), which the attention layer computes itself."""
        if self.scale is None or self.scale == "default":
            return None if self.scale_factor == 1 else self.scale_factor / math.sqrt(d_head)
        return self.scale_factor * (1.0 if self.scale == "none" else float(self.scale))


@dataclass
class ActConfig:
    name: str = "gelu"
    match_params: bool = True  # gated variants: hidden = 2/3 d_ff, same parameters as the plain MLP


@dataclass
class FfnConfig:
    """The `ffn` group: which FFN kind every block has (model.ffn=false: none at all)."""

    name: str = "dense"  # ffn.name: ffn.FFN_KINDS
    options: dict[str, Any] = field(default_factory=dict)  # the kind's own keyword arguments (experts, top_k...)


@dataclass
class InitConfig:
    name: str = "normal"
    std: float = 0.02


@dataclass
class ParamConfig:
    """The `param` group: how init, learning rates and multipliers scale with width (param.PARAMETRIZATIONS). A
    model.json saved before the group existed has none: the default, sp, is what those runs trained."""

    name: str = "sp"
    options: dict[str, Any] = field(default_factory=dict)  # the parametrization's own (mup: base_width)

    def rule(self):
        """The parametrization with its options (one object: attention scale, readout, init, lr multipliers)."""
        entry = PARAMETRIZATIONS[self.name]
        return entry(**{**PARAMETRIZATIONS.options(self.name), **self.options})


def old_run_options(registry, name, options: dict) -> dict:
    """A variant's options as saved by an older BlockLab, each key added since given the value that keeps what the
    run computed (the entry's classmethod `old_run_options`; unchanged where it has none)."""
    fill = getattr(registry.get(name), "old_run_options", None)
    return options if fill is None else fill(options)


def _recorded(registry, name, options: dict) -> dict:
    """`options` with every key whose absence would read as an older run's behaviour (`old_run_options`) written
    out at its present default, so that the model.json a run saves says which behaviour it ran."""
    missing = set(old_run_options(registry, name, options)) - set(options)
    defaults = registry.options(name) if name in registry else {}
    return {**options, **{key: defaults[key] for key in missing if key in defaults}}


def _one_of_divisors(n: int) -> str:
    """'one of [1, 2, ...]', n's divisors found by trial up to its square root (a million trials at most: a larger n
    gets 'a divisor of n', so a huge value is refused at once, not after a loop over all of it)."""
    if n > 10 ** 12:
        return f"a divisor of {n}"
    small = [h for h in range(1, math.isqrt(n) + 1) if n % h == 0]
    return f"one of {sorted(set(small + [n // h for h in small]))}"


# ModelConfig fields the task sets (the vocabulary, the longest sequence, sentence pairs), not the model group.
TASK_DERIVED = ("vocab_size", "max_len", "segments")


@dataclass
class ModelConfig:
    arch: str = "decoder"  # model.arch: architectures.ARCHITECTURES
    vocab_size: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None  # None: 4 * d_model
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    residual: bool = True  # False removes the skip connections (rank-collapse ablation)
    ffn: bool = True  # False removes the FFN sublayers (rank-collapse ablation)
    logit_softcap: float | None = None  # output logits soft-capped to (-c, c) as c tanh(z / c) (Gemma 2: 30)
    value_residual: bool = False  # later layers mix in the first layer's values (attention.ValueResidual)
    value_residual_learned: bool = False  # with it: a learned mixing weight per layer (else 0.5, the reference's)
    max_len: int = 512  # longest sequence the model must handle (sizes learned position tables)
    segments: int = 0  # set by the task: segment embeddings and a next-sentence head for sentence pairs (0: none)
    norm: NormConfig = field(default_factory=NormConfig)
    pos: PosConfig = field(default_factory=PosConfig)
    attn: AttnConfig = field(default_factory=AttnConfig)
    act: ActConfig = field(default_factory=ActConfig)
    ffn_kind: FfnConfig = field(default_factory=FfnConfig)  # the `ffn` group (model.ffn is whether there is one)
    init: InitConfig = field(default_factory=InitConfig)
    param: ParamConfig = field(default_factory=ParamConfig)

    def __post_init__(self):
        if self.d_ff is None and isinstance(self.d_model, int) and self.d_model > 0:
            self.d_ff = 4 * self.d_model

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def residual_alpha(self) -> float:
        return PLACEMENTS[self.norm.placement].alpha(self.n_layers)

    @property
    def branch_gate(self) -> float | None:
        """The start of a learned scalar on every residual branch, from the placement (ReZero: 0) or else the
        init scheme (Fixup's multiplier: 1); None: no gate."""
        gate = PLACEMENTS[self.norm.placement].gate
        return gate if gate is not None else getattr(INIT_SCHEMES[self.init.name], "branch_gate", None)

    def layer(self, index: int) -> "ModelConfig":
        """The config of layer `index`: this one, with its attn schedule's entry for that layer (model/schedule.py)."""
        return replace(self, attn=layer_attn(self.attn, index)) if self.attn.layers else self

    def _schedule(self) -> list["ModelConfig"]:
        """One config per entry of the attn schedule (this one alone without a schedule)."""
        return [self.layer(index) for index in range(len(self.attn.layers or [None]))]

    @property
    def attn_label(self) -> str:
        """The attention variant by what it computes: mha, gqa, mqa, or the pattern (local, strided...) for
        softmax; else the kind. A schedule: its entries' labels joined by '+' (base_conv+taylor)."""
        return "+".join(ATTENTION_KINDS[cfg.attn.kind].label(cfg) for cfg in self._schedule())

    @property
    def kind_rotated_width(self) -> int | None:
        """The width per head RoPE rotates where the attention kind sets it (MLA: attn.rope_dim), else None (the
        head dimension). The frequencies, and the constraints of NTK and YaRN, are those of this width."""
        for cfg in self._schedule():  # a schedule's layers must agree (errors)
            width = getattr(ATTENTION_KINDS.get(cfg.attn.kind), "rotated_width", None)
            if width is not None:
                return width(cfg)
        return None

    @property
    def positions_applied(self) -> bool:
        """Whether the model sees positions through its scheme: not where pos=none, nor where the scheme only rotates
        queries and keys and the attention kind skips the rotation (GLA, DeltaNet without attn.rotary)."""
        scheme = POSITION_SCHEMES[self.pos.name]
        if scheme.rotates_only():
            return any(ATTENTION_KINDS[cfg.attn.kind].uses_rotation(cfg.attn.options) for cfg in self._schedule())
        return scheme.embed is not PositionScheme.embed or scheme.adds_bias()

    @property
    def ffn_label(self) -> str:
        """What results.json records as `choices.ffn`: the FFN kind, or none where model.ffn=false removes it."""
        return self.ffn_kind.name if self.ffn else "none"

    @classmethod
    def from_groups(cls, groups: dict, vocab_size: int, max_len: int, segments: int = 0) -> "ModelConfig":
        """Build from the plain dicts of the yaml groups: model, norm, pos, attn, act, ffn, init. Keys no field
        takes are a ConfigError naming the closest field (pos, attn and ffn pass theirs to the variant). A
        missing ffn group is the dense FFN."""
        unknown = [line for group in ("model", "act", "init")
                   for line in group_errors(group, groups[group]) if " is not a key of " in line]
        if unknown:
            raise ConfigError("\n".join(unknown))
        model = dict(groups["model"])
        pos = dict(groups["pos"])
        ffn = dict(groups.get("ffn") or {})
        param = dict(groups.get("param") or {})
        attn_fields = {f.name for f in fields(AttnConfig)} - {"options", "pattern_options"}
        attn = {k: v for k, v in groups["attn"].items() if k in attn_fields}
        extra = {k: v for k, v in groups["attn"].items() if k not in attn_fields}
        attn_options, pattern_options = AttnConfig.split_options(attn.get("kind", AttnConfig.kind),
                                                                 AttnConfig(**attn).pattern_name, extra)
        norm_fields = {f.name for f in fields(NormConfig)} - {"options"}
        norm = {k: v for k, v in groups["norm"].items() if k in norm_fields}
        norm_options = {k: v for k, v in groups["norm"].items() if k not in norm_fields}
        name, kind = pos.pop("name"), attn.get("kind", AttnConfig.kind)
        if isinstance(attn.get("layers"), list):  # an entry naming its own kind: its options recorded as the group's
            attn["layers"] = [_recorded(ATTENTION_KINDS, entry["kind"], entry)
                              if isinstance(entry, dict) and entry.get("kind", kind) != kind else entry
                              for entry in attn["layers"]]
        shared = {key: pos.pop(key) for key in PosConfig.shared_keys() if key in pos}
        return cls(
            vocab_size=vocab_size,
            max_len=max_len,
            segments=segments,
            norm=NormConfig(**norm, options=_recorded(NORM_TYPES, norm.get("type", NormConfig.type), norm_options)),
            pos=PosConfig(name=name, **shared, options=_recorded(POSITION_SCHEMES, name, pos)),
            attn=AttnConfig(**attn, options=_recorded(ATTENTION_KINDS, kind, attn_options),
                            pattern_options=pattern_options),
            act=ActConfig(**groups["act"]),
            ffn_kind=FfnConfig(name=ffn.pop("name", FfnConfig.name), options=ffn),
            init=InitConfig(**groups["init"]),
            param=ParamConfig(name=param.pop("name", ParamConfig.name), options=param),
            **model,
        )

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        """Inverse of dataclasses.asdict (how runs save model.json). An option that a model.json written by an
        older BlockLab lacks reads as the behaviour that run trained with (the entry's `old_run_options`)."""
        parts = {"norm": NormConfig, "pos": PosConfig, "attn": AttnConfig, "act": ActConfig, "ffn_kind": FfnConfig,
                 "init": InitConfig, "param": ParamConfig}
        data = dict(data)
        for key, registry, field_name in (("pos", POSITION_SCHEMES, "name"), ("attn", ATTENTION_KINDS, "kind"),
                                          ("norm", NORM_TYPES, "type")):
            group = data.get(key)
            if isinstance(group, dict) and isinstance(group.get("options"), dict):
                data[key] = {**group, "options": old_run_options(registry, group.get(field_name), group["options"])}
        return cls(**{k: parts[k](**v) if k in parts else v for k, v in data.items()})

    def position_options(self) -> dict:
        """The scheme's constructor options: those set, and derived values for those left null."""
        given = {k: v for k, v in self.pos.options.items() if v is not None}
        return {**POSITION_SCHEMES[self.pos.name].derived_options(self), **given}

    def errors(self) -> list[str]:
        """Every problem, one line each: the schema's types and ranges first, then the registries' checks."""
        errs = [] if POSITIVE_INT.accepts(self.vocab_size) else [f"model.vocab_size={self.vocab_size!r} must be "
                                                                 f"{POSITIVE_INT.expect}"]
        errs += [line for group, values in self._fields_by_group() for line in group_errors(group, values)]
        if errs or (errs := schedule_errors(self.attn, self.n_layers)):
            return errs  # the checks below divide by these, and read each layer's kind
        if self.d_model % self.n_heads:
            errs.append(f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}; "
                        f"use {_one_of_divisors(self.d_model)}")
        for registry, name in ((ARCHITECTURES, self.arch), (NORM_TYPES, self.norm.type),
                               (PLACEMENTS, self.norm.placement), (ACTIVATIONS, self.act.name),
                               (INIT_SCHEMES, self.init.name)):
            if name not in registry:
                errs.append(registry.unknown(name))
        if not errs:  # the norm type's options, the placement's and the init scheme's own constraints
            errs += self._norm_option_errors()
            errs += PLACEMENTS[self.norm.placement].errors(self) + scheme_errors(self)
        return (errs + self._attention_errors() + self._ffn_errors() + self._param_errors()
                + self._position_errors(heads_divide=not self.d_model % self.n_heads))

    def _norm_option_errors(self) -> list[str]:
        """A key of the norm group that neither NormConfig nor the norm type takes reads as the schema's unknown key
        (with the closest key of the group), a wrong kind of value as the registry's line."""
        takes = NORM_TYPES.options(self.norm.type)
        keys = sorted({f.name for f in fields(NormConfig)} - {"options"} | set(takes))
        unknown = [key for key in self.norm.options if key not in takes]
        if unknown:
            return [unknown_key("norm.", key, keys, "norm") for key in sorted(unknown)]
        return NORM_TYPES.option_errors(self.norm.type, self.norm.options, "norm")

    def _param_errors(self) -> list[str]:
        if self.param.name not in PARAMETRIZATIONS:
            return [PARAMETRIZATIONS.unknown(self.param.name)]
        return (PARAMETRIZATIONS.option_errors(self.param.name, self.param.options, "param")
                or self.param.rule().errors(self))

    def _fields_by_group(self) -> list[tuple[str, dict]]:
        """This config's fields as the yaml groups hold them, for the schema's checks."""
        model = {f.name: getattr(self, f.name) for f in fields(self)
                 if f.name not in TASK_DERIVED and f.name not in SUBGROUPS}
        attn = {key: getattr(self.attn, key) for key in SCHEMA["attn"].keys}
        norm = {k: v for k, v in asdict(self.norm).items() if k != "options"}
        return [("model", model), ("norm", norm), ("attn", attn), ("act", asdict(self.act)),
                ("ffn", {"name": self.ffn_kind.name}), ("init", asdict(self.init)),
                ("param", {"name": self.param.name})]

    def _ffn_errors(self) -> list[str]:
        name = self.ffn_kind.name
        if name not in FFN_KINDS:
            return [FFN_KINDS.unknown(name)]
        errs = FFN_KINDS.option_errors(name, self.ffn_kind.options, "ffn")
        options = {**FFN_KINDS.options(name), **self.ffn_kind.options}
        return errs or FFN_KINDS[name].errors(self, options)

    def _attention_errors(self) -> list[str]:
        if self.attn.layers is not None:  # a schedule (its shape checked first): each entry's layer on its own
            errs = [f"attn.layers[{index}]: {line}" for index, cfg in enumerate(self._schedule())
                    for line in cfg._attention_errors()]
            widths = {cfg.kind_rotated_width for cfg in self._schedule()}
            return errs or ([] if len(widths) == 1 else [f"attn.layers rotate {sorted(widths, key=str)} dimensions "
                                                         "per head in different layers; one position scheme serves "
                                                         "them all: give its layers one rotated width"])
        errs, kv = [], self.attn.n_kv_heads
        if kv is not None and self.n_heads % kv:
            errs.append(f"attn.n_kv_heads={kv} must divide model.n_heads={self.n_heads}; "
                        f"use {_one_of_divisors(self.n_heads)}")
        if self.attn.kind not in ATTENTION_KINDS:
            return errs + [ATTENTION_KINDS.unknown(self.attn.kind)]
        name = self.attn.pattern_name
        if name not in ATTENTION_PATTERNS:
            return errs + [ATTENTION_PATTERNS.unknown(name)]
        kind, pattern = ATTENTION_KINDS[self.attn.kind], ATTENTION_PATTERNS[name]
        if self.value_residual_learned and not self.value_residual:
            errs.append("model.value_residual_learned=true learns the value residual's mixing weight, and "
                        "model.value_residual=false has none; set model.value_residual=true")
        if self.value_residual and not kind.mixes_values:
            errs.append(f"model.value_residual=true mixes the first layer's values into later layers, and "
                        f"attn.kind={self.attn.kind} has no value projection to mix; use model.value_residual=false")
        errs += ATTENTION_KINDS.option_errors(self.attn.kind, self.attn.options, "attn")
        errs += ATTENTION_PATTERNS.option_errors(name, self.attn.pattern_args, "attn")
        errs += [f"attn.{key} is an option of both attn.pattern={name} and attn.kind={self.attn.kind}, so the "
                 f"config cannot say which it sets; rename one of them"
                 for key in sorted(set(self.attn.pattern_options) & set(ATTENTION_KINDS.options(self.attn.kind)))]
        if pattern.sparse and not kind.honours_patterns:
            honouring = [k for k in ATTENTION_KINDS if ATTENTION_KINDS[k].honours_patterns]
            chosen = f"attn.pattern={name}" if self.attn.pattern is not None else \
                f"attn.window={self.attn.window} (attn.pattern={name})"
            fix = "attn.pattern=full" if self.attn.pattern is not None else "attn.window=null"
            errs.append(f"{chosen} needs a kind that honours sparse patterns ({', '.join(honouring)}); "
                        f"attn.kind={self.attn.kind} cannot: use {fix} or attn.kind={honouring[0]}")
        if self.attn.softcap and not kind.caps_scores:
            errs.append(f"attn.softcap={self.attn.softcap} needs a kind with softmax scores to cap "
                        f"({', '.join(k for k in ATTENTION_KINDS if ATTENTION_KINDS[k].caps_scores)}); "
                        f"attn.kind={self.attn.kind} has none: use attn.softcap=0")
        elif self.attn.softcap and pattern.sparse:
            errs.append(f"attn.softcap={self.attn.softcap} with attn.pattern={name}: soft-capping takes the explicit "
                        f"path, which the sparse patterns' kernels skip; use attn.pattern=full or attn.softcap=0")
        if errs:
            return errs
        options = {**ATTENTION_PATTERNS.options(name), **self.attn.pattern_args}
        return pattern.errors(self, options) + kind.errors(self, self.attn.options)

    def _position_errors(self, heads_divide: bool) -> list[str]:
        if self.pos.name not in POSITION_SCHEMES:
            return [POSITION_SCHEMES.unknown(self.pos.name)]
        errs = POSITION_SCHEMES.option_errors(self.pos.name, self.pos.options, "pos")
        if errs or not heads_divide:
            return errs  # the scheme's own checks compute with its options and the head size
        options = {**POSITION_SCHEMES.options(self.pos.name), **self.position_options()}
        return POSITION_SCHEMES[self.pos.name].errors(self, options)
