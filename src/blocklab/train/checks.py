"""Checks of a run's config and directory, made before any file is written, and the lock that makes one process
the owner of a run directory while it runs."""
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout
from lightning.pytorch.utilities import rank_zero_only

from blocklab.errors import ConfigError, RunFolderError
from blocklab.results import RESULTS_FILE, previous_status

LOCK_FILE = ".lock"


@contextmanager
def own_run_dir(run_dir: Path):
    """Hold an OS lock on `run_dir` for the whole run, or refuse at once: two commands on one folder would mix
    their files. The kernel drops the lock when its process dies, so a killed run never blocks the next one.
    DDP's other ranks are the same run: only rank zero takes it."""
    if rank_zero_only.rank != 0:
        yield
        return
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create run directory {run_dir} ({err.strerror}); set hydra.run.dir to a "
                          "writable place") from None
    lock = FileLock(run_dir / LOCK_FILE, blocking=False)
    try:
        lock.acquire()
    except Timeout:
        raise RunFolderError(f"{run_dir} is in use by another BlockLab process; wait for it to finish, or choose "
                             "another hydra.run.dir") from None
    except OSError as err:
        raise ConfigError(f"cannot lock run directory {run_dir} ({err.strerror}); set hydra.run.dir to a "
                          "writable place") from None
    try:
        yield
    finally:
        lock.release()
        if [p.name for p in run_dir.iterdir()] == [LOCK_FILE]:  # refused before writing anything: leave no trace
            (run_dir / LOCK_FILE).unlink(missing_ok=True)
            if created:
                run_dir.rmdir()


def check_run_dir(run_dir: Path) -> None:
    """Finished results are never overwritten, damaged ones are refused, and the directory must take files."""
    if previous_status(run_dir) in ("completed", "diverged"):
        raise ConfigError(f"{run_dir / RESULTS_FILE} already exists; choose a new hydra.run.dir (or run_dir) "
                          "so finished results are never overwritten")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write_test"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write to run directory {run_dir} ({err.strerror}); set hydra.run.dir to a "
                          "writable place") from None
