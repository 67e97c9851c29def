"""Checkpoint files that are whole or absent, written and read through the folder module: a full disk, or a kill
mid-write, leaves the previous checkpoint in place, so the run resumes from it once the cause is gone (Lightning's
own writer copies a temporary file over the checkpoint, and a disk that fills during the copy leaves a truncated
last.ckpt that no resume can read). A resume reads the checkpoint as every other tool does (checkpoint.py): no
link, no special file, no more bytes than the model's size allows, weights only."""
import errno
import io
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from blocklab import folder
from blocklab.checkpoint import load_checkpoint
from blocklab.errors import RunFolderError

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(RunFolderError):
    """The disk filled while a checkpoint was written; the previous checkpoint is intact."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes the checkpoint to a new temporary beside its destination, then renames it into place (atomic on
    POSIX). `parameters`: the model's size, which bounds the bytes a resume reads."""

    def __init__(self, parameters: int | None = None):
        self.parameters = parameters

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        path = Path(path)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        try:  # the run folder is the checkpoint folder's parent
            folder.write_bytes(path.parent.parent, Path(path.parent.name) / path.name, buffer.getbuffer(),
                               durable=True)
        except OSError as err:
            if err.errno in DISK_FULL:
                kept = "the previous checkpoint is kept" if path.exists() else "no checkpoint was saved yet"
                raise DiskFull(f"no space left on the disk of {path} while saving a checkpoint ({kept}); free "
                               "space and run the same command again to resume") from None
            raise

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        path = Path(path)
        return load_checkpoint(path.parent.parent, Path(path.parent.name) / path.name, self.parameters,
                               "delete it to start over, or run with resume=false (it is then kept aside)")
