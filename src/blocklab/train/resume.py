"""Resuming an interrupted run from its last checkpoint, safely: the checkpoint must be readable
and come from the same config; anything else is a clear error, never a silent restart."""
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from blocklab.errors import ConfigError
from blocklab.results import CHECKPOINT, flatten

IGNORED_KEYS = {"run_dir", "resume"}  # may differ between the interrupted and the resumed command


def config_differences(saved: dict, current: dict) -> list[str]:
    old, new = flatten(saved), flatten(current)
    keys = sorted((set(old) | set(new)) - IGNORED_KEYS)
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def resume_step(run_dir: Path, groups: dict) -> int | None:
    """The step to resume from, or None for a fresh start. Checks before anything is written."""
    ckpt = run_dir / CHECKPOINT
    if not ckpt.exists() or not groups.get("resume", True):
        return None
    saved_path = run_dir / ".hydra" / "config.yaml"
    if saved_path.exists():
        saved = OmegaConf.to_container(OmegaConf.load(saved_path))
        diffs = config_differences(saved, groups)
        if diffs:
            raise ConfigError(f"{ckpt} was trained with a different config ({'; '.join(diffs[:3])}); "
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
