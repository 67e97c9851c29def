"""The type and range of every config key BlockLab reads, checked before torch is imported.

A key's spec says what values it takes and, in its error, what to type instead. Keys a variant owns
(a position scheme's or attention kind's options, a task's settings, a W&B logger's settings) are
checked by that variant's registry entry (`config_errors` runs both); here each group lists the
keys the framework itself reads. Unknown keys of a closed group get a did-you-mean."""
import difflib
import math
import os
from dataclasses import dataclass
from typing import Any

from blocklab.registry import is_number
from blocklab.schedule import SHAPES, schedule_errors


class Spec:
    """What values one key takes; `expect` completes "must be ..."."""

    expect: str

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError

    def error(self, key: str, value: Any) -> str | None:
        return None if self.accepts(value) else f"{key}={value!r} must be {self.expect}"


@dataclass(frozen=True)
class Int(Spec):
    low: int | None = None  # smallest value allowed
    high: int | None = None  # largest value allowed

    def accepts(self, value):
        return isinstance(value, int) and not isinstance(value, bool) and (self.low is None or value >= self.low) \
            and (self.high is None or value <= self.high)

    @property
    def expect(self):
        if self.high is not None:
            return f"an integer in [{self.low}, {self.high}]"
        return {None: "an integer", 0: "an integer >= 0", 1: "a positive integer"}.get(self.low,
                                                                                        f"an integer >= {self.low}")


@dataclass(frozen=True)
class Number(Spec):
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # True: low itself is not allowed
    high_open: bool = True

    def accepts(self, value):
        if not is_number(value) or value != value:  # NaN compares unequal to itself
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    @property
    def expect(self):
        if self.low == 0 and self.low_open and self.high is None:
            return "a number > 0"
        low = "" if self.low is None else f"{'(' if self.low_open else '['}{self.low}, "
        high = "" if self.high is None else f"{self.high}{')' if self.high_open else ']'}"
        if self.high is None:
            return f"a number {'>' if self.low_open else '>='} {self.low}"
        return f"a number in {low}{high}" if low else f"a number {'<' if self.high_open else '<='} {self.high}"


@dataclass(frozen=True)
class Bool(Spec):
    expect: str = "true or false"

    def accepts(self, value):
        return isinstance(value, bool)


@dataclass(frozen=True)
class Text(Spec):
    """A non-empty string (a registry name: which names exist is the registry's to say)."""

    expect: str = "a non-empty string"

    def accepts(self, value):
        return isinstance(value, str) and bool(value)


@dataclass(frozen=True)
class Keys(Spec):
    """One config key or a list of them (what a report groups runs by; []: all runs as one group)."""

    expect: str = "a key or a list of keys, e.g. [pos, task.index_hints]"

    def accepts(self, value):
        return (isinstance(value, str) and bool(value)) or (
            isinstance(value, list) and all(isinstance(v, str) and v for v in value))


@dataclass(frozen=True)
class Fractions(Spec):
    """A list of fractions in (0, 1] (a wsd trunk's branch points)."""

    expect: str = "a list of fractions of the steps in (0, 1], e.g. [0.25, 0.5, 1.0]"

    def accepts(self, value):
        return isinstance(value, list) and all(is_number(v) and 0 < v <= 1 for v in value)


@dataclass(frozen=True)
class Selection(Spec):
    """Which runs to keep: a mapping of config key to the one value they must have."""

    expect: str = "a mapping of key to value, e.g. {task: copy}"

    def accepts(self, value):
        return isinstance(value, dict) and bool(value) and all(
            isinstance(k, str) and (v is None or isinstance(v, (str, int, float, bool))) for k, v in value.items())


@dataclass(frozen=True)
class Choice(Spec):
    options: tuple
    described: str = ""  # the options with what each means, where their names do not say it
    noun: str = "an allowed value"
    suggest: bool = True  # False where a close spelling is another thing (16-mixed is not bf16-mixed)

    def accepts(self, value):
        return any(value == o and type(value) is type(o) for o in self.options)

    @property
    def expect(self):
        return self.described or "one of " + ", ".join(dict.fromkeys(map(str, self.options)))

    def error(self, key, value):
        if self.accepts(value):
            return None
        close = difflib.get_close_matches(str(value), [str(o) for o in self.options], n=1) if self.suggest else []
        hint = f"did you mean {close[0]}? " if close else ""
        return f"{key}={value!r} is not {self.noun}; {hint}use {self.expect}"


@dataclass(frozen=True)
class Pair(Spec):
    """Two numbers, each in [low, high) (Adam's betas)."""

    low: float = 0
    high: float = 1

    def accepts(self, value):
        return isinstance(value, list) and len(value) == 2 and all(
            Number(self.low, self.high).accepts(v) for v in value)

    @property
    def expect(self):
        return f"two numbers in [{self.low}, {self.high}), e.g. [0.9,0.99]"


@dataclass(frozen=True)
class Nullable(Spec):
    """null (meaning `null_means`) or a value of `spec`."""

    spec: Spec
    null_means: str

    def accepts(self, value):
        return value is None or self.spec.accepts(value)

    @property
    def expect(self):
        return f"null ({self.null_means}) or {self.spec.expect}"


@dataclass(frozen=True)
class Either(Spec):
    first: Spec
    second: Spec

    def accepts(self, value):
        return self.first.accepts(value) or self.second.accepts(value)

    @property
    def expect(self):
        return f"{self.first.expect} or {self.second.expect}"


@dataclass(frozen=True)
class Study(Spec):
    """Keys a sweep file describes itself with (study: name, question, compare, plots, metrics...), null outside a
    sweep; the report reads them. `metrics` names the result columns its table and findings judge by (which
    columns exist is the report's to say: it checks the names against the runs)."""

    expect: str = "null (not part of a study) or a mapping of keys, as a sweep file sets it"

    def accepts(self, value):
        return value is None or isinstance(value, dict)

    def error(self, key, value):
        metrics = value.get("metrics") if isinstance(value, dict) else None
        if metrics is not None and not (isinstance(metrics, list) and metrics
                                        and all(isinstance(m, str) and m for m in metrics)):
            return (f"{key}.metrics={metrics!r} must be a non-empty list of result columns, "
                    "e.g. [exact_match_in, final_val_loss]")
        return super().error(key, value)


@dataclass(frozen=True)
class Described(Spec):
    """A spec whose error says what the value means (`expect`), not only its type."""

    spec: Spec
    expect: str

    def accepts(self, value):
        return self.spec.accepts(value)


@dataclass(frozen=True)
class Group:
    """The keys of one config group. `owner` names who checks the keys not listed (None: nobody may add any)."""

    keys: dict[str, Spec]
    owner: str | None = None


POSITIVE_INT, POSITIVE = Int(1), Number(0, low_open=True)
# trainer.precision values BlockLab trains correctly (Lightning's spellings) -> the name results.json records.
PRECISIONS = {"32-true": "32-true", "32": "32-true", 32: "32-true", "bf16-mixed": "bf16-mixed",
              "64-true": "64-true", "64": "64-true", 64: "64-true"}

SEED_MAX = 2**32 - 1  # numpy's seed range is [0, 2**32)
SHORT_CONV_MAX = 64  # attn.short_conv: the widest causal convolution on q, k and v (SCHEMA's attn group says why)
# Bytes of training state per parameter: the weight, its gradient and Adam's two moments.
STATE_COPIES = 4

LOGGERS = tuple(f"lightning.pytorch.loggers.{name}" for name in ("WandbLogger", "CSVLogger", "TensorBoardLogger"))

SCHEMA: dict[str, Group] = {
    "model": Group({
        "arch": Text(), "d_model": POSITIVE_INT, "n_layers": POSITIVE_INT, "n_heads": POSITIVE_INT,
        "d_ff": Nullable(POSITIVE_INT, "4 * d_model"), "dropout": Number(0, 1), "bias": Bool(),
        "tie_embeddings": Bool(), "residual": Bool(), "ffn": Bool(), "value_residual": Bool(),
        "value_residual_learned": Bool(), "logit_softcap": Nullable(POSITIVE, "no cap")}),
    "norm": Group({"type": Text(), "placement": Text(),
                   "eps": Described(POSITIVE, "a positive number (it keeps the norm's division finite)"),
                   "affine": Described(Bool(), "true or false (false: no learned gain and shift)")},
                  owner="the norm type (norm.type)"),
    # pos: the scheme's own options, and the settings every scheme shares (tasks/placement.py).
    "pos": Group({"name": Text(), "randomize": Bool(), "random_max": Nullable(POSITIVE_INT, "not set"),
                  "coupled": Bool(), "abacus": Bool(),
                  "abacus_offset": Described(Int(0), "an integer >= 0 (K: training digit indices shift by 0..K)"),
                  "coupled_offset": Described(Int(0), "an integer >= 0 (K: training coupled position ids shift by 0..K)")},
                 owner="the position scheme (pos.name)"),
    "attn": Group({
        "kind": Text(), "pattern": Nullable(Text(), "window if attn.window is set, else full"), "n_kv_heads": Nullable(POSITIVE_INT, "n_heads: MHA"),
        "window": Nullable(POSITIVE_INT, "full attention"), "causal": Bool(),
        "scale": Nullable(Either(Choice(("none", "default")), POSITIVE), "1/sqrt(d_head)"),
        "scale_factor": Described(POSITIVE, "a number > 0 (it multiplies the scale: 0.5 halves 1/sqrt(d_head))"),
        "qk_norm": Bool(),
        "softcap": Described(Number(0), "a number >= 0 (c: scores soft-capped to c tanh(s / c); 0: none; Gemma 2 "
                                        "uses 50)"),
        "output_gate": Choice(("none", "headwise", "elementwise"), noun="an output gate"),
        # A short convolution mixes each token with the few before it (Based and Canon layers use 3-4). 64 is far
        # past any use and keeps its cost bounded: every layer's depthwise conv costs K multiply-adds per channel
        # and token, and pads K-1 zeros in front of every sequence (short_conv=1000 ran for minutes, unrefused).
        "short_conv": Described(Int(0, SHORT_CONV_MAX), f"an integer in [0, {SHORT_CONV_MAX}] (width of the causal "
                                                        "convolution on q, k and v; 0: none; the papers use 3 or 4)")},
        owner="the attention kind (attn.kind)"),
    "act": Group({"name": Text(), "match_params": Bool()}),
    "ffn": Group({"name": Text()}, owner="the FFN kind (ffn.name)"),
    "init": Group({"name": Text(), "std": POSITIVE}),
    "param": Group({"name": Text()}, owner="the parametrization (param.name)"),
    "task": Group({"name": Text()}, owner="the task (task.name)"),
    "optim": Group({
        "name": Text(), "lr": POSITIVE, "min_lr": Number(0), "betas": Pair(), "weight_decay": Described(Number(0), "a number >= 0 (0: no decay)"), "warmup_steps": Int(0),
        "z_loss": Described(Number(0), "a number >= 0 (the weight of log^2 Z in the loss; 0: none; PaLM 1e-4)"),
        # the learning-rate schedule and its options (blocklab/schedule.py checks them: _cross_errors)
        "schedule": Text(), "cooldown": Number(0, 1), "cooldown_shape": Choice(SHAPES),
        "branch_points": Fractions(), "branch_from": Nullable(Text(), "not a branch"),
        "branch_step": Nullable(Int(1), "not a branch")},
        owner="the optimizer (optim.name)"),
    "trainer": Group({
        "_target_": Choice(("lightning.pytorch.Trainer",)), "accelerator": Choice(("cpu", "gpu", "cuda", "mps", "auto")),
        "devices": Either(POSITIVE_INT, Choice(("auto",))), "num_nodes": POSITIVE_INT,
        "strategy": Text(),
        "max_steps": Described(Int(0), "a positive integer (0, no training, evaluates trainer.resume_from's weights)"),
        # The training stream is endless: no epoch for a fraction of one to refer to.
        "val_check_interval": Described(POSITIVE_INT, "a positive integer number of steps between validations"), "check_val_every_n_epoch": Nullable(POSITIVE_INT, "by steps"),
        "limit_val_batches": Nullable(POSITIVE_INT, "every batch (else the first N of each validation)"),
        "limit_eval_examples": Nullable(POSITIVE_INT, "the task's task.eval_examples"),
        "log_every_n_steps": POSITIVE_INT, "gradient_clip_val": Nullable(POSITIVE, "no clipping"),
        "precision": Choice(tuple(PRECISIONS), noun="supported", suggest=False,
                            described="32-true (float32), bf16-mixed (bfloat16 matmuls, float32 weights and "
                                      "attention) or 64-true"), "enable_model_summary": Bool(), "num_sanity_val_steps": Int(0),
        "compile": Bool(), "threads": Nullable(POSITIVE_INT, "the launcher's share of the cores"),
        "data_workers": Described(Int(0), "an integer >= 0 (0: batches built in the training process)"),
        "resume_from": Nullable(Text(), "a fresh start (else a finished run's folder, whose weights it starts from)")}),
    "logger": Group({"_target_": Nullable(Choice(LOGGERS), "no logger"), "name": Text(), "project": Text(),
                     "mode": Choice(("offline", "online", "disabled"), "offline, online or disabled", "a W&B mode")}, owner="the logger class (logger._target_)"),
    "diagnostics": Group({
        "enabled": Bool(), "every_n_steps": POSITIVE_INT, "probe_examples": POSITIVE_INT,
        "sparsity_eps": Number(0), "attention_maps": Choice(("none", "end", "all"), "none, end (init and end) or all (every measurement)")}),
    "": Group({
        "seed": Described(Int(0, SEED_MAX), f"an integer in [0, {SEED_MAX}] (the range numpy seeds from; "
                                            "Lightning seeds numpy with it)"), "max_loss": Described(Nullable(POSITIVE, ""), "null (no ceiling) or a loss > 0"), "target_loss": Nullable(POSITIVE, "none"),
        "checkpoint_every": Described(POSITIVE_INT, "a positive number of steps"), "resume": Bool(), "run_dir": Text(),
        "study": Study()}),
}
GROUPS = tuple(name for name in SCHEMA if name)

# Options that are not registry entries but ablations of the model: config key -> the values the `modifications`
# sweep tries, one job each against the baseline (modifications.candidates). An option joins it by a line here.
ABLATIONS: dict[str, tuple] = {
    "attn.output_gate": ("headwise", "elementwise"),  # Qiu et al. 2025
    "model.value_residual": (True,),  # Zhou et al. 2024 (ResFormer)
    "model.logit_softcap": (30.0,),  # Gemma 2's final_logit_softcap
    "attn.softcap": (50.0,),  # Gemma 2's attn_logits_soft_cap
    "pos.rotary_fraction": (0.25,),  # p-RoPE at Barbero et al.'s p = 0.25 (Gemma 2B)
    "optim.z_loss": (1e-4,), "attn.qk_norm": (True,),  # PaLM's weight; qk-norm (Dehghani et al. 2023)
}


def ablation_choices(config: dict) -> dict:
    """Each declared ablation's value in a run's config, under its key with '_' for '.' (`attn_output_gate`), so that
    results.json's choices name every option a modification can change."""
    picked = {}
    for key in ABLATIONS:
        group, _, field_name = key.partition(".")
        value = (config.get(group) or {}).get(field_name)
        picked[key.replace(".", "_")] = "none" if value is None else value  # null as TensorBoard can hold it
    return picked


def schema_errors(config: dict) -> list[str]:
    """One line per key whose value its spec refuses, and per unknown key of a group nobody else owns. A number
    that is not finite is refused wherever it is, a variant's own options included: nothing trains with it."""
    top = {key: value for key, value in config.items() if key not in GROUPS and key != "hydra"}
    errors = non_finite_errors({key: value for key, value in config.items() if key != "hydra"})
    if errors:
        return errors
    for name in SCHEMA:
        values = top if not name else config.get(name)
        if not isinstance(values, dict):
            errors.append(f"{name}={values!r} must be a group of keys; choose one of its options ({name}=...)")
            continue
        errors += group_errors(name, values)
    return errors + (_cross_errors(config) if not errors else [])


def group_errors(name: str, values: dict) -> list[str]:
    """The schema's errors for one group's keys ('' for the top-level keys)."""
    group, prefix, errors = SCHEMA[name], f"{name}." if name else "", []
    for key, value in values.items():
        spec = group.keys.get(key)
        if spec is not None:
            errors += filter(None, [spec.error(prefix + key, value)])
        elif group.owner is None:
            errors.append(_unknown(prefix, key, list(group.keys), name or "the config"))
    return errors


def non_finite_errors(values: Any, key: str = "") -> list[str]:
    """One line per key holding inf or NaN (in a list too): a loss computed with one is NaN at the first step,
    which would be recorded as a diverged run rather than a config error."""
    if isinstance(values, dict):
        return [line for name, value in values.items()
                for line in non_finite_errors(value, f"{key}.{name}" if key else str(name))]
    if isinstance(values, list):
        if any(non_finite_errors(value) for value in values):
            return [f"{key}={values!r} must hold finite numbers only (inf and nan cannot train)"]
        return []
    if isinstance(values, float) and not math.isfinite(values):
        return [f"{key}={values!r} must be a finite number (inf and nan cannot train)"]
    return []


def physical_memory() -> int | None:
    """This machine's RAM in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cross_errors(config: dict) -> list[str]:
    """Constraints between keys of the framework's groups. (The memory bound needs the model: experiment.py checks
    it once the model config is valid, from the model built on the meta device.)"""
    optim, pos, errors = config["optim"], config["pos"], []
    if "min_lr" in optim and "lr" in optim and optim["min_lr"] > optim["lr"]:
        errors.append(f"optim.min_lr={optim['min_lr']} must be at most optim.lr={optim['lr']}")
    trainer = config["trainer"]
    if isinstance(trainer.get("max_steps"), int):
        errors += schedule_errors(optim, trainer["max_steps"])
    if optim.get("branch_from") is not None and trainer.get("resume_from") is not None:
        errors.append(f"optim.branch_from={optim['branch_from']} starts from a trunk's whole state, trainer.resume_from "
                      "from a run's weights: set one")
    if trainer.get("max_steps") == 0 and trainer.get("resume_from") is None:
        errors.append("trainer.max_steps=0 trains nothing and needs trainer.resume_from=RUN (whose weights it evaluates "
                      "under this config); set trainer.resume_from or a positive number of steps")
    if pos.get("randomize") and pos.get("random_max") is None:
        errors.append("pos.randomize=true needs pos.random_max: the range [0, L) positions are drawn from, "
                      "several times the longest evaluated sequence (e.g. pos.random_max=256)")
    return errors


def unknown_key(prefix: str, key: str, known: list[str], where: str) -> str:
    """The one line for a key a group does not have, with the closest one first."""
    return _unknown(prefix, key, known, where)


def _unknown(prefix: str, key: str, known: list[str], where: str) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {prefix}{close[0]}? " if close else ""
    return f"{prefix}{key} is not a key of {where}; {hint}its keys are {sorted(known)}"
