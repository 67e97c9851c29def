"""Checks of a run's config and directory, made before any file is written."""
from pathlib import Path

from blocklab.errors import ConfigError
from blocklab.results import RESULTS_FILE, previous_status

# trainer.precision values BlockLab trains correctly (Lightning's spellings) -> the name results.json records.
PRECISIONS = {"32-true": "32-true", "32": "32-true", 32: "32-true", "bf16-mixed": "bf16-mixed",
              "64-true": "64-true", "64": "64-true", 64: "64-true"}


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def training_errors(groups: dict) -> list[str]:
    errs = []
    steps = groups["trainer"].get("max_steps")
    if not isinstance(steps, int) or steps <= 0:
        errs.append(f"trainer.max_steps={steps!r} must be a positive integer")
    precision = groups["trainer"].get("precision", "32-true")
    if precision not in PRECISIONS:
        errs.append(f"trainer.precision={precision!r} is not supported; use 32-true (float32), bf16-mixed "
                    "(bfloat16 matmuls, float32 weights and attention) or 64-true")
    optim = groups["optim"]
    if not _positive(optim.get("lr")):
        errs.append(f"optim.lr={optim.get('lr')!r} must be a positive number")
    elif not (isinstance(optim.get("min_lr"), (int, float)) and 0 <= optim["min_lr"] <= optim["lr"]):
        errs.append(f"optim.min_lr={optim.get('min_lr')!r} must be between 0 and optim.lr={optim['lr']}")
    if not isinstance(optim.get("warmup_steps"), int) or optim["warmup_steps"] < 0:
        errs.append(f"optim.warmup_steps={optim.get('warmup_steps')!r} must be a non-negative integer")
    diag = groups["diagnostics"]
    if diag.get("enabled"):
        if not isinstance(diag.get("every_n_steps"), int) or diag["every_n_steps"] <= 0:
            errs.append(f"diagnostics.every_n_steps={diag.get('every_n_steps')!r} must be a positive integer")
        if not isinstance(diag.get("probe_examples"), int) or diag["probe_examples"] <= 0:
            errs.append(f"diagnostics.probe_examples={diag.get('probe_examples')!r} must be a positive integer")
        if diag.get("attention_maps") not in ("none", "end", "all"):
            errs.append(f"diagnostics.attention_maps={diag.get('attention_maps')!r} must be none, end or all")
    every = groups.get("checkpoint_every")
    if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
        errs.append(f"checkpoint_every={every!r} must be a positive number of steps")
    if not isinstance(groups.get("seed"), int):
        errs.append(f"seed={groups.get('seed')!r} must be an integer")
    return errs


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
