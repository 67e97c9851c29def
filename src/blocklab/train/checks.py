"""Checks of a run's config and directory, made before any file is written, and the lock that makes one process
the owner of a run directory while it runs."""
import os
from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only

from blocklab.errors import ConfigError, RunFolderError
from blocklab.results import RESULTS_FILE, previous_status

LOCK_FILE = ".lock"


@contextmanager
def own_run_dir(run_dir: Path):
    """Hold an OS lock on `run_dir` for the whole run, or refuse at once: two commands on one folder would mix
    their files. The kernel drops the lock when its process dies, so a killed run never blocks the next one. The
    lock file is removed, while still held, when the run ends, so a folder keeps no trace of it. DDP's other ranks
    are the same run: only rank zero takes it."""
    if rank_zero_only.rank != 0:
        yield
        return
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = _locked(run_dir / LOCK_FILE)
    except BlockingIOError:
        raise RunFolderError(f"{run_dir} is in use by another BlockLab process; wait for it to finish, or choose "
                             "another hydra.run.dir") from None
    except OSError as err:
        raise ConfigError(f"cannot create or lock run directory {run_dir} ({err.strerror}); set hydra.run.dir to "
                          "a writable place") from None
    try:
        yield
    finally:
        (run_dir / LOCK_FILE).unlink(missing_ok=True)  # before the release: a waiter then locks a file of its own
        os.close(fd)
        if created and not any(run_dir.iterdir()):  # refused before writing anything: leave no trace
            run_dir.rmdir()


def _locked(path: Path) -> int:
    """A descriptor holding an exclusive flock on `path` (BlockingIOError when another process holds it). Where the
    owner removed the file between our open and our lock, the lock is on a file nobody else will open: try again."""
    import fcntl  # POSIX only: importing a run's modules needs no lock

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


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
