"""The model's configuration, mirrored by the yaml groups model/ norm/ pos/ attn/ act/ init/.

Validation lives here, once: `ModelConfig.errors()` lists every problem as one line that names
the offending key and the fix, before anything is built or written."""
import inspect
from dataclasses import dataclass, field
from typing import Any

from blocklab.model.ffn import ACTIVATIONS
from blocklab.model.norm import NORM_TYPES, PLACEMENTS, deepnorm_alpha, norm_name
from blocklab.model.position import POSITION_SCHEMES

from blocklab.model.init import INIT_FUNCTIONS

INIT_SCHEMES = tuple(INIT_FUNCTIONS)
ARCHS = ("decoder", "encoder_decoder")


@dataclass
class NormConfig:
    type: str = "layernorm"
    placement: str = "pre"
    eps: float = 1e-5

    @property
    def name(self) -> str:
        return norm_name(self.type, self.placement)


@dataclass
class PosConfig:
    name: str = "rope"
    options: dict[str, Any] = field(default_factory=dict)  # scheme-specific keyword arguments


@dataclass
class AttnConfig:
    n_kv_heads: int | None = None  # None: one K/V head per query head (MHA)
    window: int | None = None  # local attention: each query sees this many keys back (itself included)
    causal: bool = True
    scale: float | str | None = None  # None: 1/sqrt(d_head); "none": 1 (unscaled); a number: that number
    qk_norm: bool = False

    def scale_value(self, d_head: int) -> float | None:
        if self.scale is None or self.scale == "default":
            return None
        return 1.0 if self.scale == "none" else float(self.scale)

    def name(self, n_heads: int) -> str:
        if self.window is not None:
            return "local"
        kv = self.n_kv_heads or n_heads
        return "mha" if kv == n_heads else "mqa" if kv == 1 else "gqa"


@dataclass
class ActConfig:
    name: str = "gelu"
    match_params: bool = True  # gated variants: hidden = 2/3 d_ff, same parameters as the plain MLP


@dataclass
class InitConfig:
    name: str = "normal"
    std: float = 0.02


@dataclass
class ModelConfig:
    arch: str = "decoder"  # or encoder_decoder
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
    max_len: int = 512  # longest sequence the model must handle (sizes learned position tables)
    norm: NormConfig = field(default_factory=NormConfig)
    pos: PosConfig = field(default_factory=PosConfig)
    attn: AttnConfig = field(default_factory=AttnConfig)
    act: ActConfig = field(default_factory=ActConfig)
    init: InitConfig = field(default_factory=InitConfig)

    def __post_init__(self):
        if self.d_ff is None and isinstance(self.d_model, int) and self.d_model > 0:
            self.d_ff = 4 * self.d_model

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def residual_alpha(self) -> float:
        return deepnorm_alpha(self.n_layers) if self.norm.placement == "deepnorm" else 1.0

    @classmethod
    def from_groups(cls, groups: dict, vocab_size: int, max_len: int) -> "ModelConfig":
        """Build from the plain dicts of the yaml groups: model, norm, pos, attn, act, init."""
        model = dict(groups["model"])
        pos = dict(groups["pos"])
        return cls(
            vocab_size=vocab_size,
            max_len=max_len,
            norm=NormConfig(**groups["norm"]),
            pos=PosConfig(name=pos.pop("name"), options=pos),
            attn=AttnConfig(**groups["attn"]),
            act=ActConfig(**groups["act"]),
            init=InitConfig(**groups["init"]),
            **model,
        )

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        """Inverse of dataclasses.asdict (how runs save model.json)."""
        parts = {"norm": NormConfig, "pos": PosConfig, "attn": AttnConfig, "act": ActConfig, "init": InitConfig}
        return cls(**{k: parts[k](**v) if k in parts else v for k, v in data.items()})

    def position_options(self) -> dict:
        """Scheme options with `None` meaning 'derive it': a learned table covers max_len."""
        options = {k: v for k, v in self.pos.options.items() if v is not None}
        if self.pos.name == "learned":
            options.setdefault("max_len", self.max_len)
        return options

    def errors(self) -> list[str]:
        errs = []
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, key)
            if key == "d_ff" and value is None:
                continue  # derived from an invalid d_model, reported above
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                errs.append(f"model.{key}={value!r} must be a positive integer")
        if errs:
            return errs  # the checks below divide by these
        if self.d_model % self.n_heads:
            divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
            errs.append(f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}; "
                        f"use one of {divisors}")
        if self.arch not in ARCHS:
            errs.append(f"model.arch={self.arch!r} is unknown; use one of {list(ARCHS)}")
        if not 0 <= self.dropout < 1:
            errs.append(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.norm.type not in NORM_TYPES:
            errs.append(f"norm.type={self.norm.type!r} is unknown; use one of {list(NORM_TYPES)}")
        if self.norm.placement not in PLACEMENTS:
            errs.append(f"norm.placement={self.norm.placement!r} is unknown; use one of {list(PLACEMENTS)}")
        if self.act.name not in ACTIVATIONS:
            errs.append(f"act.name={self.act.name!r} is unknown; use one of {list(ACTIVATIONS)}")
        if self.init.name not in INIT_SCHEMES:
            errs.append(f"init.name={self.init.name!r} is unknown; use one of {list(INIT_SCHEMES)}")
        errs += self._attention_errors() + self._position_errors()
        return errs

    def _attention_errors(self) -> list[str]:
        errs, kv = [], self.attn.n_kv_heads
        if kv is not None and (not isinstance(kv, int) or kv <= 0 or self.n_heads % kv):
            errs.append(f"attn.n_kv_heads={kv} must divide model.n_heads={self.n_heads}; "
                        f"use one of {[k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]}")
        if self.attn.window is not None and (not isinstance(self.attn.window, int) or self.attn.window <= 0):
            errs.append(f"attn.window={self.attn.window} must be a positive integer, or null for full attention")
        scale = self.attn.scale
        if not (scale is None or scale in ("default", "none")
                or (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0)):
            errs.append(f"attn.scale={scale!r} must be null (1/sqrt(d_head)), 'none' (1) or a positive number")
        return errs

    def _position_errors(self) -> list[str]:
        scheme = POSITION_SCHEMES.get(self.pos.name)
        if scheme is None:
            return [f"pos.name={self.pos.name!r} is unknown; use one of {list(POSITION_SCHEMES)}"]
        errs = []
        params = inspect.signature(scheme.__init__).parameters
        accepted = set(params) - {"self", "d_model", "n_heads", "d_head", "causal"}
        for key in sorted(set(self.pos.options) - accepted):
            errs.append(f"pos.{key} is not an option of pos={self.pos.name}; its options are {sorted(accepted)}")
        for key, value in sorted(self.pos.options.items()):
            default = params[key].default if key in accepted else None
            if value is not None and default is not None and not _same_kind(value, default):
                errs.append(f"pos.{key}={value!r} must be {'true or false' if isinstance(default, bool) else 'a number'}")
        if errs:
            return errs  # the checks below compute with the options
        if self.pos.name == "rope" and self.d_model % self.n_heads == 0 and self.d_head % 2:
            errs.append(f"pos=rope needs an even head dimension, but model.d_model/model.n_heads = {self.d_head}; "
                        "change model.n_heads or model.d_model")
        if self.pos.name == "sinusoidal" and self.d_model % 2:
            errs.append(f"pos=sinusoidal needs an even model.d_model (got {self.d_model})")
        options = self.position_options()
        if self.pos.name == "learned" and options["max_len"] < self.max_len:
            errs.append(f"pos.max_len={options['max_len']} is shorter than the longest sequence to train or evaluate "
                        f"({self.max_len} tokens); raise pos.max_len or set it to null (auto)")
        if self.pos.name == "t5_bias":
            buckets, distance = options.get("num_buckets", 32), options.get("max_distance", 128)
            exact = buckets // (2 if not self.attn.causal else 1) // 2
            if buckets < 4 or distance <= exact:
                errs.append(f"pos.num_buckets={buckets} / pos.max_distance={distance}: need num_buckets >= 4 and "
                            f"max_distance > {exact} (the exact-bucket range)")
        return errs


def _same_kind(value, default) -> bool:
    """A bool option takes a bool; a numeric one any number but a bool."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True
