"""Reading a run's checkpoint, which may come from anyone: torch's weights-only loader unpickles plain tensors,
containers and numbers only, never arbitrary objects, so a crafted file runs no code. A file that is not a
BlockLab checkpoint is one ConfigError naming the file and what to do."""
import hashlib
import io
import pickle
import zipfile
from pathlib import Path

import torch

from blocklab import folder
from blocklab.errors import ConfigError

# Where a checkpoint carries the run's resolved config, so a resume can be checked without .hydra/config.yaml, and
# the SHA-256 of the run's other files (its saved config, model.json, tokenizer.json): the checkpoint's zip is
# checksummed, so it vouches for files that a flipped bit could leave readable but wrong.
CHECKPOINT_CONFIG_KEY, CHECKPOINT_FILES_KEY = "blocklab_config", "blocklab_files"


def file_digests(run_dir: Path, names: list[Path | str]) -> dict[str, str]:
    """SHA-256 of each of the run's files that exists, keyed by its path inside the run directory."""
    return {str(name): hashlib.sha256(folder.read_bytes(run_dir, name)).hexdigest()
            for name in names if folder.is_file(run_dir, name)}


def check_run_files(run_dir: Path, state: dict, fix: str) -> None:
    """A ConfigError naming the first file whose bytes differ from what the checkpoint recorded (a checkpoint from
    before the record, which has none, vouches for nothing and refuses nothing)."""
    recorded = state.get(CHECKPOINT_FILES_KEY)
    if not isinstance(recorded, dict):
        return
    for name, digest in recorded.items():
        try:
            differs = file_digests(run_dir, [name]).get(name) != digest
        except folder.FolderError:  # a path that leaves the folder, a link, a special or oversize file
            differs = True
        if differs:
            raise ConfigError(f"{run_dir / name} is damaged or was edited (it differs from what "
                              f"{run_dir / 'checkpoints'} recorded of it); {fix}")


def load_checkpoint(root: Path, name: Path | str, parameters: int | None,
                    fix: str = "delete it to start over, or choose a new hydra.run.dir") -> dict:
    """The checkpoint `root / name`, loaded without executing anything, through the folder module (no link, no
    special file, at most `folder.checkpoint_cap(parameters)` bytes where the model's size is known); `fix` says
    what the user can do instead."""
    path = Path(root) / name
    cap = folder.checkpoint_cap(parameters) if parameters is not None else None
    try:
        data = io.BytesIO(folder.read_bytes(root, name, cap if cap is not None else folder.MAX_CHECKPOINT))
        damaged = _damaged_entry(data)
        if damaged:
            raise ConfigError(f"checkpoint {path} is damaged ({damaged} fails its checksum); {fix}")
        data.seek(0)  # the checksum test read the archive to its end
        state = torch.load(data, map_location="cpu", weights_only=True)
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


def _damaged_entry(path) -> str | None:
    """The first entry of the checkpoint's zip archive whose CRC-32 does not match its bytes, or None. torch writes
    the checksums but does not check them when it reads, so a flipped bit in a weight would load silently."""
    with zipfile.ZipFile(path) as archive:
        return archive.testzip()
