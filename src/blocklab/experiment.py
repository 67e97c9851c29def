"""One experiment's setup, built the same way for training, analysis and generation: its resolved
config groups, the task and model config they describe, and its run directory."""
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tokenizers import Tokenizer

from blocklab.errors import ConfigError
from blocklab.model import ModelConfig, build_model
from blocklab.model.transformer import ARCHITECTURES
from blocklab.results import CHECKPOINT, MODEL_FILE, TOKENIZER_FILE
from blocklab.tasks import Task, build_task, task_errors

SAVED_CONFIG = Path(".hydra") / "config.yaml"


def is_seq2seq(arch: str) -> bool:
    """Whether model.arch reads a separate source (an encoder-decoder), which only some tasks provide."""
    if arch not in ARCHITECTURES:
        raise ConfigError(ARCHITECTURES.unknown(arch))
    return ARCHITECTURES[arch].is_encoder_decoder


@dataclass
class Setup:
    groups: dict  # the resolved config, a plain dict per group
    model_cfg: ModelConfig
    run_dir: Path
    task: Task | None = None  # None when read back for generation, which needs no data
    start_step: int | None = None  # the step training resumes from; None for a fresh start

    @classmethod
    def from_config(cls, cfg: DictConfig, checks: tuple[Callable[[dict], list[str]], ...] = ()) -> "Setup":
        """Validated task and model config; every problem is a ConfigError. `checks` are the caller's
        own checks of the groups, reported together with the task's."""
        groups = OmegaConf.to_container(cfg, resolve=True)
        seq2seq = is_seq2seq(groups["model"]["arch"])
        errors = task_errors(groups["task"], seq2seq) + [err for check in checks for err in check(groups)]
        if errors:
            raise ConfigError("\n".join(errors))
        task = build_task(groups["task"], groups["seed"], seq2seq)
        model_cfg = ModelConfig.from_groups(groups, vocab_size=task.vocab_size, max_len=task.max_seq_len)
        errors = model_cfg.errors()
        if errors:
            raise ConfigError("\n".join(errors))
        return cls(groups, model_cfg, Path(groups["run_dir"]), task)

    @classmethod
    def from_run_dir(cls, run_dir: Path, with_task: bool = False) -> "Setup":
        """A finished run, from the files it saved: the model config it trained and its config. The task
        is rebuilt only when asked, since a language-modelling task reads its whole corpus."""
        missing = [name for name in (MODEL_FILE, TOKENIZER_FILE, CHECKPOINT, SAVED_CONFIG)
                   if not (run_dir / name).exists()]
        if missing:
            raise ConfigError(f"{run_dir} is not a finished BlockLab run (missing {', '.join(map(str, missing))})")
        groups = OmegaConf.to_container(OmegaConf.load(run_dir / SAVED_CONFIG), resolve=True)
        model_cfg = ModelConfig.from_dict(json.loads((run_dir / MODEL_FILE).read_text()))
        task = build_task(groups["task"], groups["seed"], is_seq2seq(groups["model"]["arch"])) if with_task else None
        return cls(groups, model_cfg, run_dir, task)

    def save(self, cfg: DictConfig) -> None:
        """The resolved config, plus what `from_run_dir` needs to rebuild the model without the data."""
        (self.run_dir / MODEL_FILE).write_text(json.dumps(dataclasses.asdict(self.model_cfg), indent=2) + "\n")
        self.task.tokenizer().save(str(self.run_dir / TOKENIZER_FILE))
        config_dir = self.run_dir / SAVED_CONFIG.parent
        config_dir.mkdir(exist_ok=True)
        OmegaConf.save(cfg, self.run_dir / SAVED_CONFIG, resolve=True)
        if HydraConfig.initialized():
            hydra_cfg = HydraConfig.get()
            OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)), config_dir / "overrides.yaml")
            OmegaConf.save(OmegaConf.create(dict(hydra_cfg.runtime.choices)), config_dir / "choices.yaml")

    def trained_model(self) -> torch.nn.Module:
        """The model with the weights of the run's last checkpoint, in eval mode."""
        model = build_model(self.model_cfg)
        state = torch.load(self.run_dir / CHECKPOINT, map_location="cpu", weights_only=True)["state_dict"]
        model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
        return model.eval()

    def saved_tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(str(self.run_dir / TOKENIZER_FILE))
