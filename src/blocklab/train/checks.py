"""Checks of a run's config and directory, made before any file is written."""
from pathlib import Path

from blocklab.errors import ConfigError
from blocklab.results import RESULTS_FILE, previous_status

def check_run_dir(run_dir: Path) -> None:
    """Finished results are never overwritten, and the directory must take files."""
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
