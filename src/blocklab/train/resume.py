"""Resuming an interrupted run from its last checkpoint, safely: the checkpoint must be readable
and come from the same config; anything else is a clear error, never a silent restart."""
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from blocklab import folder
from blocklab.checkpoint import CHECKPOINT_CONFIG_KEY, load_checkpoint
from blocklab.errors import ConfigError
from blocklab.model import ModelConfig
from blocklab.naming import job_name_excluded_keys, override_key
from blocklab.results import CHECKPOINT, SAVED_CONFIG, flatten

# What a user can do about a checkpoint that cannot be resumed.
RESUME_FIX = "delete it to start over, or run with resume=false (it is then kept aside)"
# The sweep file's description of itself: never what a job trains (changes_results). A key BlockLab removed from it
# still resumes so: study.pack_seeds trained a setting's seeds as one batched model (docs/decisions/seed-packing.md).
STUDY = "study"


def changes_results(key: str) -> bool:
    """Whether a config key (`optim.lr`) can change what a run computes, so that changing it refuses a resume.
    The rule is the one that keeps keys out of sweep job names (logger, diagnostics, checkpoint_every, resume,
    run_dir do not change results); a group listed there takes all its keys with it, `+logger.entity` too.
    Configs are compared resolved, so a listed knob that other keys derive from (study.scale) still refuses
    through them (trainer.max_steps). Hydra's own settings are not in the config. No `study.*` key changes results:
    the study block describes the sweep for its page (question, claims, paper, notes, plots, seeds), and what a job
    trains from it reaches the job through an interpolation (trainer.max_steps: ${mul:200,${study.scale}}, attn.window:
    ${study.window...}), whose resolved value is compared; so editing a claim or a note leaves a sweep folder fresh."""
    parts = key.split(".")
    if parts[0] == STUDY:
        return False
    return not any(".".join(parts[:depth]) in job_name_excluded_keys() for depth in range(1, len(parts) + 1))


def config_differences(saved: dict, current: dict, set_now: frozenset[str] = frozenset()) -> list[str]:
    """Every key that changes results and differs, as `optim.lr: 0.003 -> 0.01`. A key the saved config lacks
    was added to BlockLab after the run started, with a default that keeps the old behaviour: it differs only
    where this command sets it (`set_now`: the keys of its overrides, `trainer.compile`). A key added with a default
    that changes the behaviour reads, where the saved config lacks it, as the old behaviour (`with_old_behaviour`),
    so it differs from the new default: the run resumes only as it started, and a finished sweep job is not
    taken for the new setting."""
    old, new = flatten(with_old_behaviour(saved)), flatten(current)
    keys = sorted(k for k in set(old) | set(new) if changes_results(k) and (k in old or k in set_now))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def with_old_behaviour(saved: dict) -> dict:
    """A saved run config with each key added since it was saved whose new default changes what a run computes
    given the old behaviour's value, by the variant the run chose (its `old_run_options`): pos.yarn_ramp=paper for
    a YaRN run, attn.latent_norm=false for MLA."""
    from blocklab.model.attention import ATTENTION_KINDS
    from blocklab.model.config import old_run_options
    from blocklab.model.position import POSITION_SCHEMES

    filled = dict(saved)
    for group, registry, choice in (("pos", POSITION_SCHEMES, "name"), ("attn", ATTENTION_KINDS, "kind")):
        if isinstance(saved.get(group), dict):
            filled[group] = old_run_options(registry, saved[group].get(choice), saved[group])
    return filled


def keys_set_now() -> frozenset[str]:
    """The keys this command's overrides set (`trainer.compile=true` -> trainer.compile); none outside Hydra."""
    if not HydraConfig.initialized():
        return frozenset()
    return frozenset(override_key(o) for o in HydraConfig.get().overrides.task)


def resume_step(run_dir: Path, config: dict, model_cfg: ModelConfig | None = None) -> tuple[int | None, dict]:
    """The step to resume from (None for a fresh start), and the keys the run must take to resume as it started:
    those an older BlockLab's saved config lacks whose new default would change what the run computes, at the old
    behaviour's values (`with_old_behaviour`), unless this command sets them. Checks before anything is written.
    The checkpoint is read without unpickling objects, no larger than the model allows, and its config is compared
    with this command's: the saved .hydra/config.yaml's, or, where that file is gone, the one the checkpoint
    carries. With the model config this command built, the checkpoint must also hold all that Lightning restores,
    fitting that model (restore_error); the caller checks that again once the adopted keys are in (check_restorable)."""
    ckpt = run_dir / CHECKPOINT
    if not folder.exists(run_dir, CHECKPOINT) or not config.get("resume", True):
        return None, {}
    from blocklab.model.size import model_size

    parameters = model_size(model_cfg).parameters if model_cfg is not None else None
    state = load_checkpoint(run_dir, CHECKPOINT, parameters, RESUME_FIX)
    saved, set_now = saved_config(run_dir, state), keys_set_now()
    known = flatten(saved)
    adopted = {k: v for k, v in flatten(with_old_behaviour(saved)).items() if k not in known and k not in set_now}
    diffs = config_differences(saved, with_keys(config, adopted), set_now)
    if diffs:
        raise ConfigError(f"{ckpt} was trained with a different config ({'; '.join(diffs)}); "
                          "use another hydra.run.dir, or resume=false to start this one afresh")
    if model_cfg is not None and not adopted:
        check_restorable(run_dir, state, model_cfg)
    return state["global_step"], adopted


def check_restorable(run_dir: Path, state: dict, model_cfg: ModelConfig) -> None:
    """A ConfigError where the checkpoint lacks what Lightning restores, or does not fit `model_cfg`'s model."""
    from blocklab.train.module import restore_error  # Lightning's import: not in a sweep's checks (config_differences)

    if error := restore_error(state, model_cfg):
        raise ConfigError(f"checkpoint {run_dir / CHECKPOINT} cannot be resumed: {error}; {RESUME_FIX}")


def with_keys(config: dict, flat: dict) -> dict:
    """`config` with each dotted key of `flat` (`pos.yarn_ramp`) set to its value."""
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for key, value in flat.items():
        group, _, name = key.partition(".")
        config[group][name] = value
    return config


def guard_restore(trainer, ckpt: Path, step: int) -> None:
    """Lightning's restore of `ckpt` in `trainer`'s next fit, with any failure inside it one ConfigError naming the
    file: restore_error checked the checkpoint first, and this is for whatever a crafted file can still break there
    (random states, a callback's state). Restored, the loops must stand at the checkpoint's step, or the run would
    count its steps, and its schedule, from another one. GracefulInterrupt saves nothing before a step trains, so
    the file stays as it was."""
    connector = trainer._checkpoint_connector

    def guarded(restore, check_step: bool):
        def run(*args, **kwargs):
            try:
                restore(*args, **kwargs)
            except Exception as err:
                raise ConfigError(f"checkpoint {ckpt} cannot be resumed: Lightning could not restore it "
                                  f"({type(err).__name__}); {RESUME_FIX}") from None
            if check_step and trainer.global_step != step:
                raise ConfigError(f"checkpoint {ckpt} cannot be resumed: its loops stand at step "
                                  f"{trainer.global_step}, its global_step is {step}; {RESUME_FIX}")
        return run

    connector._restore_modules_and_callbacks = guarded(connector._restore_modules_and_callbacks, False)
    connector.restore_training_state = guarded(connector.restore_training_state, True)


def saved_config(run_dir: Path, state: dict) -> dict:
    """The config a run was trained with: its .hydra/config.yaml, else the copy in its checkpoint. One that cannot
    be read, or neither, is a ConfigError: resuming without knowing the config could mix two experiments."""
    path = run_dir / SAVED_CONFIG
    if folder.exists(run_dir, SAVED_CONFIG):
        try:  # as data: no alias expanded, no interpolation resolved
            saved = folder.read_yaml(run_dir, SAVED_CONFIG)
        except folder.FolderError:
            raise
        except Exception as err:  # truncated or flipped YAML, or YAML that is not a mapping
            raise ConfigError(f"saved config {path} is unreadable ({type(err).__name__}); restore it, or use "
                              "another hydra.run.dir") from None
        if not isinstance(saved, dict):
            raise ConfigError(f"saved config {path} is not a config; restore it, or use another hydra.run.dir")
        return saved
    saved = state.get(CHECKPOINT_CONFIG_KEY)
    if not isinstance(saved, dict):
        raise ConfigError(f"{path} is missing and {run_dir / CHECKPOINT} does not carry its config, so the resume "
                          "cannot be checked; restore the file, or use another hydra.run.dir")
    return saved


def set_aside_checkpoints(run_dir: Path) -> None:
    """resume=false: keep the old checkpoints under a new name rather than deleting them."""
    if folder.exists(run_dir, CHECKPOINT.parent):
        folder.rename(run_dir, CHECKPOINT.parent, f"{CHECKPOINT.parent}.old-{int(time.time())}")
