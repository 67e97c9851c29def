"""Checkpoint files that are whole or absent: a full disk, or a kill mid-write, leaves the previous checkpoint in
place, so the run resumes from it once the cause is gone. Lightning's own writer copies a temporary file over the
checkpoint, and a disk that fills during the copy leaves a truncated last.ckpt that no resume can read."""
import errno
import io
import os
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from blocklab.errors import RunFolderError

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(RunFolderError):
    """The disk filled while a checkpoint was written; the previous checkpoint is intact."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes the checkpoint beside its destination, then renames it into place (atomic on POSIX)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        partial = path.with_name(path.name + ".partial")
        try:
            write_durably(partial, buffer.getbuffer())
            os.replace(partial, path)
        except OSError as err:
            partial.unlink(missing_ok=True)
            if err.errno in DISK_FULL:
                kept = "the previous checkpoint is kept" if path.exists() else "no checkpoint was saved yet"
                raise DiskFull(f"no space left on the disk of {path} while saving a checkpoint ({kept}); free "
                               "space and run the same command again to resume") from None
            raise


def write_durably(path: Path, data) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
