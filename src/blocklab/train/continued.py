"""Continued training (`trainer.resume_from=RUN`): a new run, in its own folder, that starts from a finished run's
final weights, typically at a longer context and with a position scaling (pos.scaling), as Chen et al. 2023 (PI,
§3.2: about 1000 steps at the new context) and Peng et al. 2023 (YaRN, §4.1) fine-tune. Weights only: the
optimizer, the step count and the schedule start afresh; the source folder is only read."""
import dataclasses
from pathlib import Path

import torch

from blocklab.errors import ConfigError
from blocklab.experiment import Setup, trained_context
from blocklab.model.size import meta_model
from blocklab.results import CHECKPOINT


def continued_setup(setup: Setup) -> Setup:
    """The setup of a run that continues `trainer.resume_from` (unchanged without it). Every check before
    anything is written: a finished, intact source run (its checkpoint verified),
    not this run's own folder, and a model of the same shapes. pos.original_context left null (YaRN's L) is the
    context the source trained at, not this task's."""
    source = setup.config["trainer"].get("resume_from")
    if source is None:
        return setup
    source_dir = Path(source)
    if source_dir.resolve() == setup.run_dir.resolve():
        raise ConfigError(f"trainer.resume_from={source} is this run's own folder; continued training writes a new "
                          "run: choose another hydra.run.dir (to resume an interrupted run, leave resume_from unset)")
    try:
        origin = Setup.from_run_dir(source_dir)
    except ConfigError as err:
        raise ConfigError(f"trainer.resume_from={source}: {err}") from None
    model_cfg = setup.model_cfg
    if model_cfg.pos.options.get("original_context") is not None and setup.config["pos"].get("original_context") is None:
        context = origin.model_cfg.pos.options.get("original_context")
        if context is None:  # a source run from before pos.scaling: the context its task trained at
            context = trained_context(Setup.from_run_dir(source_dir, with_task=True).task)
        pos = dataclasses.replace(model_cfg.pos, options={**model_cfg.pos.options, "original_context": context})
        model_cfg = dataclasses.replace(model_cfg, pos=pos)
    weights = model_weights(origin.checkpoint)
    if name := next((k for k, v in weights.items() if not isinstance(v, torch.Tensor)), None):
        raise ConfigError(f"trainer.resume_from={source}: checkpoint {source_dir / CHECKPOINT} holds its weight "
                          f"model.{name} as a {type(weights[name]).__name__}, not a tensor; restore the run from a "
                          "copy, or continue another")
    expected = {k: tuple(v.shape) for k, v in meta_model(model_cfg).state_dict().items()}  # nothing allocated
    given = {k: tuple(v.shape) for k, v in weights.items()}
    if given != expected:
        differ = sorted(k for k in set(given) | set(expected) if given.get(k) != expected.get(k))
        shown = ", ".join(f"{k} {given.get(k, 'missing')} -> {expected.get(k, 'missing')}" for k in differ[:3])
        raise ConfigError(f"trainer.resume_from={source} holds a model of other shapes than this config's ({shown}"
                          f"{', ...' if len(differ) > 3 else ''}); continue it with its model, attn and vocabulary "
                          "settings (a learned position table: the same pos.max_len)")
    return dataclasses.replace(setup, model_cfg=model_cfg)


def model_weights(checkpoint: dict) -> dict:
    return {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items()
            if isinstance(k, str) and k.startswith("model.")}


def load_source_weights(model: torch.nn.Module, setup: Setup) -> None:
    """trainer.resume_from's final weights into a freshly built model (shapes checked by continued_setup); nothing
    without it. Read through load_checkpoint (weights only, checksums verified), never a pickle."""
    source = setup.config["trainer"].get("resume_from")
    if source is not None:
        model.load_state_dict(model_weights(Setup.from_run_dir(Path(source)).checkpoint))
