"""One experiment's setup, built the same way for training, analysis and generation: its resolved
config (RunConfig), the task and model config they describe, and its run directory."""
import dataclasses
import json
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tokenizers import Tokenizer

from blocklab import folder
from blocklab.checkpoint import check_run_files, load_checkpoint
from blocklab.errors import ConfigError
from blocklab.model import ModelConfig, build_model
from blocklab.model.size import memory_error, model_size, size_keys
from blocklab.model.transformer import ARCHITECTURES
from blocklab.results import CHECKPOINT, MODEL_FILE, SAVED_CONFIG, TOKENIZER_FILE, unfinished_run_error
from blocklab.optim import model_errors, optimizer_errors
from blocklab.schema import schema_errors
from blocklab.tasks import Task, build_task, task_errors
from blocklab.tasks.base import SequenceTask
from blocklab.tasks.placement import Placement


def is_seq2seq(arch: str) -> bool:
    """Whether model.arch reads a separate source (an encoder-decoder), which only some tasks provide."""
    if arch not in ARCHITECTURES:
        raise ConfigError(ARCHITECTURES.unknown(arch))
    return ARCHITECTURES[arch].is_encoder_decoder


# A run's config once Hydra composed it: resolved to plain values, one dict per group (model, pos, task...) beside
# the top-level keys (seed, run_dir...). The one form a run's config takes after Hydra; Setup.config holds it.
RunConfig = dict


def run_config(cfg: RunConfig | DictConfig) -> RunConfig:
    """A config Hydra (or its compose API) made, resolved to the one form that travels; a RunConfig as it is."""
    return cfg if isinstance(cfg, dict) else _eval_limited(OmegaConf.to_container(cfg, resolve=True))


def _eval_limited(config: RunConfig) -> RunConfig:
    """trainer.limit_eval_examples (trainer=debug's) caps task.eval_examples in the config itself, so the saved config
    says what the end's evaluation scored. A value the schema refuses is left for it to name."""
    limit, task = (config.get("trainer") or {}).get("limit_eval_examples"), config.get("task")
    count = task.get("eval_examples") if isinstance(task, dict) else None
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (limit, count)) and count > limit:
        task["eval_examples"] = limit
    return config


def config_errors(config: RunConfig) -> list[str]:
    """Every problem Setup.from_config would find in a resolved config, without reading a task's data
    twice: the schema's, then the task's and the registries' (position scheme, attention kind...)."""
    try:
        _validated(config)
    except ConfigError as err:
        return str(err).splitlines()
    return []


def _validated(config: RunConfig) -> "Setup":
    """The Setup of a resolved config, or ConfigError with every problem (one per line)."""
    errors = schema_errors(config) or optimizer_errors(dict(config["optim"]))
    if errors:
        raise ConfigError("\n".join(errors))
    seq2seq, placement = is_seq2seq(config["model"]["arch"]), Placement.from_pos(config["pos"])
    encoder_only = ARCHITECTURES[config["model"]["arch"]].is_encoder_only
    errors = _task_errors(_frozen(config["task"]), seq2seq, placement, encoder_only)
    if errors:
        raise ConfigError("\n".join(errors))
    task = _task(_frozen(config["task"]), config["seed"], seq2seq, placement)
    model_cfg = _model_config(config, task, placement)
    # The model's own checks, then those between it and the task's training batch (BatchNorm's statistics).
    errors = (model_cfg.errors() or model_cfg.norm.batch_errors(task.batch_size)
              or model_errors(dict(config["optim"]), model_cfg.param.name))
    if errors:
        raise ConfigError("\n".join(errors))
    # The memory bound, from the model itself (built on the meta device: model/size.py).
    sizes = ", ".join([*size_keys(model_cfg), _vocabulary(config["task"], model_cfg.vocab_size)])
    error = memory_error(model_cfg, config["trainer"].get("precision"), sizes, "make the model smaller")
    if error:
        raise ConfigError(error)
    return Setup(config, model_cfg, Path(config["run_dir"]), task)


def _vocabulary(task: dict, vocab_size: int) -> str:
    """The vocabulary's size as the command sets it: task.vocab_size where the task has that key, else the task's."""
    if task.get("vocab_size") == vocab_size:
        return f"task.vocab_size={vocab_size}"
    return f"task={task.get('name')}'s vocabulary of {vocab_size} tokens"


def _frozen(task: dict) -> str:
    return json.dumps(task, sort_keys=True)


@cache
def _task_errors(task: str, seq2seq: bool, placement: Placement, encoder_only: bool) -> list[str]:
    return task_errors(json.loads(task), seq2seq, placement, encoder_only)


@lru_cache(maxsize=8)
def _task(task: str, seed: int, seq2seq: bool, placement: Placement) -> Task:
    """A task built once per process for a given config: the command line's checks and the run share it (an LM
    reads and tokenizes its corpus; a task does not change once built)."""
    return build_task(json.loads(task), seed, seq2seq, placement)


def _model_config(config: RunConfig, task: Task, placement: Placement) -> ModelConfig:
    """The model config for a task: its vocabulary, and room for every position id it can be shown."""
    model_cfg = ModelConfig.from_groups(config, vocab_size=task.vocab_size,
                                        max_len=placement.max_position(task.max_seq_len), segments=task.segments)
    if "original_context" in model_cfg.pos.options and model_cfg.pos.options["original_context"] is None:
        model_cfg.pos.options["original_context"] = trained_context(task)  # null: derived (YaRN's L)
    return model_cfg


def trained_context(task: Task) -> int:
    """The longest model input, in tokens, that the task trains on (a sequence task's prompt and answer)."""
    longest = max(task.train_lengths)
    if isinstance(task, SequenceTask):
        return task.max_prompt_len(longest) + task.max_answer_len(longest) - 1
    return longest


# The groups a saved config must hold for its run to be rebuilt (generate, analyze).
RUN_GROUPS = ("model", "pos", "task")


@dataclass
class Setup:
    config: RunConfig
    model_cfg: ModelConfig
    run_dir: Path
    task: Task | None = None  # None when read back for generation, which needs no data
    start_step: int | None = None  # the step training resumes from; None for a fresh start
    checkpoint: dict | None = field(default=None, repr=False)  # a finished run's, read back (generate, analyze)

    @classmethod
    def from_config(cls, cfg: RunConfig | DictConfig) -> "Setup":
        """Validated task and model config; every problem is a ConfigError (the schema's first, then the
        registries' and the task's). The command line validates a single run before Hydra runs: the Setup it
        built is handed back for the config Hydra composes when that resolves to the same values (run_dir,
        which Hydra fills, aside), so a run is validated once; any other config is validated here."""
        config = run_config(cfg)
        key = _content(config)
        if _LAST_VALIDATED.get("key") != key:
            _LAST_VALIDATED.update(key=key, setup=_validated(config))
        return dataclasses.replace(_LAST_VALIDATED["setup"], config=config, run_dir=Path(config["run_dir"]))

    @classmethod
    def from_run_dir(cls, run_dir: Path, with_task: bool = False) -> "Setup":
        """A finished run, from the files it saved: the model config it trained and its config. The task
        is rebuilt only when asked, since a language-modelling task reads its whole corpus."""
        error = unfinished_run_error(run_dir)
        if error:
            raise ConfigError(error)
        fix = RUN_FILE_FIX
        folder.check_tree(run_dir)
        try:
            model_cfg = ModelConfig.from_dict(folder.read_json(run_dir, MODEL_FILE))
        except folder.FolderError:
            raise
        except Exception as err:  # not JSON, or not a model config BlockLab wrote
            raise ConfigError(damaged(run_dir / MODEL_FILE, err)) from None
        try:  # as data: no alias expanded, no interpolation resolved
            config = folder.read_yaml(run_dir, SAVED_CONFIG)
            if not isinstance(config, dict) or not all(isinstance(config.get(g), dict) for g in RUN_GROUPS):
                raise ValueError(f"not a config with the groups {', '.join(RUN_GROUPS)}")
        except folder.FolderError:
            raise
        except Exception as err:  # truncated or flipped YAML, or a config that lost a group
            raise ConfigError(damaged(run_dir / SAVED_CONFIG, err)) from None
        check_saved_model(run_dir, model_cfg, config)  # before anything is allocated
        # Checksummed: it vouches for the files read above, and is read no larger than model.json's model allows.
        state = load_checkpoint(run_dir, CHECKPOINT, model_size(model_cfg).parameters, fix)
        check_run_files(run_dir, state, fix)
        task = build_task(config["task"], config["seed"], is_seq2seq(config["model"]["arch"]),
                          Placement.from_pos(config["pos"])) if with_task else None
        if task is not None and task.vocab_size != model_cfg.vocab_size:
            raise ConfigError(f"{run_dir / MODEL_FILE} has vocab_size={model_cfg.vocab_size}, but the task of "
                              f"{run_dir / SAVED_CONFIG} has {task.vocab_size} tokens; {RUN_FILE_FIX}")
        return cls(config, model_cfg, run_dir, task, checkpoint=state)

    def save(self) -> None:
        """The resolved config, plus what `from_run_dir` needs to rebuild the model without the data."""
        folder.write_json(self.run_dir, MODEL_FILE, dataclasses.asdict(self.model_cfg))
        folder.write_text(self.run_dir, TOKENIZER_FILE, self.task.tokenizer().to_str())
        folder.write_text(self.run_dir, SAVED_CONFIG, OmegaConf.to_yaml(OmegaConf.create(self.config)))
        if HydraConfig.initialized():
            hydra_cfg = HydraConfig.get()
            config_dir = SAVED_CONFIG.parent
            folder.write_text(self.run_dir, config_dir / "overrides.yaml",
                              OmegaConf.to_yaml(OmegaConf.create(list(hydra_cfg.overrides.task))))
            folder.write_text(self.run_dir, config_dir / "choices.yaml",
                              OmegaConf.to_yaml(OmegaConf.create(dict(hydra_cfg.runtime.choices))))

    def trained_model(self) -> torch.nn.Module:
        """The model with the weights of the run's last checkpoint, in eval mode."""
        model = build_model(self.model_cfg)
        path = self.run_dir / CHECKPOINT
        state = (self.checkpoint or load_checkpoint(self.run_dir, CHECKPOINT, model_size(self.model_cfg).parameters,
                                                    "train the run again in a new hydra.run.dir"))["state_dict"]
        try:
            model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
        except RuntimeError:  # missing, extra or reshaped weights
            raise ConfigError(f"checkpoint {path} does not fit the model that {self.run_dir / MODEL_FILE} "
                              "describes; one of the two is damaged or from another run") from None
        return model.eval()

    def saved_tokenizer(self) -> Tokenizer:
        return read_tokenizer(self.run_dir)


def read_tokenizer(run_dir: Path) -> Tokenizer:
    try:
        return Tokenizer.from_str(folder.read_text(run_dir, TOKENIZER_FILE))
    except folder.FolderError:
        raise
    except Exception as err:  # the tokenizers library raises its own exception type for a bad file
        raise ConfigError(damaged(run_dir / TOKENIZER_FILE, err)) from None


RUN_FILE_FIX = "restore the run from a copy, or train it again in a new hydra.run.dir"


def check_saved_model(run_dir: Path, model_cfg: ModelConfig, config: RunConfig) -> None:
    """A run's model.json checked as the command line checks a model (ModelConfig.errors(), then the memory bound),
    and its tokenizer.json's ids against that vocabulary, before anything is allocated: a folder may come from
    anyone, with a checkpoint that carries no digests to vouch for these files. One ConfigError line naming the
    file and the fix."""
    path, trainer = run_dir / MODEL_FILE, config.get("trainer")
    try:
        problems = model_cfg.errors()
        too_big = None if problems else memory_error(
            model_cfg, trainer.get("precision") if isinstance(trainer, dict) else None,
            f"{path} sets {', '.join([*size_keys(model_cfg), f'vocab_size={model_cfg.vocab_size}'])}, which",
            RUN_FILE_FIX)
    except Exception as err:  # values of types no command line gives (a list where a number goes)
        raise ConfigError(damaged(path, err)) from None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(f"{path} describes no model BlockLab can build: {problems[0]}{more}; {RUN_FILE_FIX}")
    if too_big:
        raise ConfigError(too_big)
    ids = read_tokenizer(run_dir).get_vocab().values()
    if ids and max(ids) >= model_cfg.vocab_size:
        raise ConfigError(f"{run_dir / TOKENIZER_FILE} has token id {max(ids)}, past the vocabulary of {path} "
                          f"(vocab_size={model_cfg.vocab_size}); {RUN_FILE_FIX}")


# The Setup validated last, by its config's content (_content): what the command line built, for its run.
_LAST_VALIDATED: dict = {}


def _content(config: RunConfig) -> str:
    """A config's values but run_dir, exactly (1, 1.0 and true differ), as a key."""
    return json.dumps({k: v for k, v in config.items() if k != "run_dir"}, sort_keys=True, default=repr)


def damaged(path: Path, err: Exception) -> str:
    """One line for a run file that cannot be read: which file, and what the user can do."""
    return (f"{path} is unreadable or damaged ({type(err).__name__}); restore it from a copy of the run, or "
            "train the run again in a new hydra.run.dir")

