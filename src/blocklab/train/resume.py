"""Resuming an interrupted run from its last checkpoint, safely: the checkpoint must be readable
and come from the same config; anything else is a clear error, never a silent restart."""
import time
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from blocklab.errors import ConfigError
from blocklab.overrides import job_name_excluded_keys, override_key
from blocklab.results import CHECKPOINT, flatten

# Keys BlockLab had and removed, which never changed what a run computes: a run saved with them still resumes.
# study.pack_seeds trained a setting's seeds as one batched model (docs/decisions/seed-packing.md).
RETIRED_KEYS = frozenset({"study.pack_seeds"})


def changes_results(key: str) -> bool:
    """Whether a config key (`optim.lr`) can change what a run computes, so that changing it refuses a resume.
    The rule is the one that keeps keys out of sweep job names (logger, diagnostics, checkpoint_every, resume,
    run_dir do not change results); a group listed there takes all its keys with it, `+logger.entity` too.
    Configs are compared resolved, so a listed knob that other keys derive from (study.scale) still refuses
    through them (trainer.max_steps). Hydra's own settings are not in the config."""
    parts = key.split(".")
    return key not in RETIRED_KEYS and not any(".".join(parts[:depth]) in job_name_excluded_keys()
                                               for depth in range(1, len(parts) + 1))


def config_differences(saved: dict, current: dict, set_now: frozenset[str] = frozenset()) -> list[str]:
    """Every key that changes results and differs, as `optim.lr: 0.003 -> 0.01`. A key the saved config lacks
    was added to BlockLab after the run started, with a default that keeps the old behaviour: it differs only
    where this command sets it (`set_now`: the keys of its overrides, `trainer.compile`)."""
    old, new = flatten(saved), flatten(current)
    keys = sorted(k for k in set(old) | set(new) if changes_results(k) and (k in old or k in set_now))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def keys_set_now() -> frozenset[str]:
    """The keys this command's overrides set (`trainer.compile=true` -> trainer.compile); none outside Hydra."""
    if not HydraConfig.initialized():
        return frozenset()
    return frozenset(override_key(o) for o in HydraConfig.get().overrides.task)


def resume_step(run_dir: Path, groups: dict) -> int | None:
    """The step to resume from, or None for a fresh start. Checks before anything is written."""
    ckpt = run_dir / CHECKPOINT
    if not ckpt.exists() or not groups.get("resume", True):
        return None
    saved_path = run_dir / ".hydra" / "config.yaml"
    if saved_path.exists():
        saved = OmegaConf.to_container(OmegaConf.load(saved_path))
        diffs = config_differences(saved, groups, keys_set_now())
        if diffs:
            raise ConfigError(f"{ckpt} was trained with a different config ({'; '.join(diffs)}); "
                              "use another hydra.run.dir, or resume=false to start this one afresh")
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        return int(state["global_step"])
    except Exception as err:  # any unreadable file: truncated, not a checkpoint, wrong format
        raise ConfigError(f"checkpoint {ckpt} is unreadable ({type(err).__name__}); delete it to start over, "
                          "or run with resume=false (it is then kept aside)") from None


def set_aside_checkpoints(run_dir: Path) -> None:
    """resume=false: keep the old checkpoints under a new name rather than deleting them."""
    folder = run_dir / CHECKPOINT.parent
    if folder.exists():
        folder.rename(run_dir / f"{CHECKPOINT.parent}.old-{int(time.time())}")
