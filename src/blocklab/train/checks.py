"""Checks of a run's config and directory, made before any file is written, and the lock that makes one process
the owner of a run directory while it runs."""
import shutil
from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only

from blocklab import folder
from blocklab.errors import ConfigError, RunFolderError
from blocklab.results import RESULTS_FILE, previous_status


@contextmanager
def own_run_dir(run_dir: Path):
    """Hold the folder module's OS lock on `run_dir` for the whole run, or refuse at once: two commands on one
    folder would mix their files. A folder refused before anything was written is left as it was found (not
    created). DDP's other ranks are the same run: only rank zero takes it."""
    if rank_zero_only.rank != 0:
        yield
        return
    created = not run_dir.exists()
    try:
        with folder.lock(run_dir):
            try:
                yield
            finally:
                if created and not any(p.name != folder.LOCK_FILE for p in run_dir.iterdir()):
                    shutil.rmtree(run_dir, ignore_errors=True)  # refused before writing anything: leave no trace
    except folder.FolderInUse:
        raise RunFolderError(f"{run_dir} is in use by another BlockLab process; wait for it to finish, or choose "
                             "another hydra.run.dir") from None
    except OSError as err:
        raise ConfigError(f"cannot create or lock run directory {run_dir} ({err.strerror}); set hydra.run.dir to "
                          "a writable place") from None


def check_run_dir(run_dir: Path) -> None:
    """Finished results are never overwritten, damaged ones are refused, no link or special file is followed, and
    the directory must take files."""
    if run_dir.exists():
        folder.check_tree(run_dir)
    if previous_status(run_dir) in ("completed", "diverged"):
        raise ConfigError(f"{run_dir / RESULTS_FILE} already exists; choose a new hydra.run.dir (or run_dir) "
                          "so finished results are never overwritten")
    try:
        folder.write_bytes(run_dir, ".write_test", b"")
        folder.remove(run_dir, ".write_test")
    except OSError as err:
        raise ConfigError(f"cannot write to run directory {run_dir} ({err.strerror}); set hydra.run.dir to a "
                          "writable place") from None
