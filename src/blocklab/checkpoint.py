"""Reading a run's checkpoint, which may come from anyone: torch's weights-only loader unpickles plain tensors,
containers and numbers only, never arbitrary objects, so a crafted file runs no code. A file that is not a
BlockLab checkpoint is one ConfigError naming the file and what to do."""
import pickle
import zipfile
from pathlib import Path

import torch

from blocklab.errors import ConfigError

# Where a checkpoint carries the run's resolved config, so a resume can be checked without .hydra/config.yaml.
CHECKPOINT_CONFIG_KEY = "blocklab_config"


def load_checkpoint(path: Path, fix: str = "delete it to start over, or choose a new hydra.run.dir") -> dict:
    """The checkpoint's contents, loaded without executing anything; `fix` says what the user can do instead."""
    try:
        damaged = _damaged_entry(path)
        if damaged:
            raise ConfigError(f"checkpoint {path} is damaged ({damaged} fails its checksum); {fix}")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except ConfigError:
        raise
    except Exception as err:  # truncated, flipped, not a zip, a pickle that asks for objects: all unreadable
        reason = ("it asks to build objects a checkpoint never holds" if isinstance(err, pickle.UnpicklingError)
                  else type(err).__name__)
        raise ConfigError(f"checkpoint {path} is unreadable ({reason}); {fix}") from None
    if not isinstance(state, dict) or not isinstance(state.get("state_dict"), dict) \
            or not isinstance(state.get("global_step"), int):
        raise ConfigError(f"checkpoint {path} is not a BlockLab checkpoint (no state_dict or global_step); {fix}")
    return state


def _damaged_entry(path: Path) -> str | None:
    """The first entry of the checkpoint's zip archive whose CRC-32 does not match its bytes, or None. torch writes
    the checksums but does not check them when it reads, so a flipped bit in a weight would load silently."""
    with zipfile.ZipFile(path) as archive:
        return archive.testzip()
