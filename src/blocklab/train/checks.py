"""Checks of a run's config and directory, made before any file is written."""
import difflib
from pathlib import Path

from blocklab.errors import ConfigError
from blocklab.registry import is_number
from blocklab.results import RESULTS_FILE, previous_status

# trainer.precision values BlockLab trains correctly (Lightning's spellings) -> the name results.json records.
PRECISIONS = {"32-true": "32-true", "32": "32-true", 32: "32-true", "bf16-mixed": "bf16-mixed",
              "64-true": "64-true", "64": "64-true", 64: "64-true"}
WANDB_MODES = ("offline", "online", "disabled")


def _positive(value) -> bool:
    return is_number(value) and value > 0


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def training_errors(groups: dict) -> list[str]:
    errs = []
    steps = groups["trainer"].get("max_steps")
    if not _positive_int(steps):
        errs.append(f"trainer.max_steps={steps!r} must be a positive integer")
    precision = groups["trainer"].get("precision", "32-true")
    if precision not in PRECISIONS:
        errs.append(f"trainer.precision={precision!r} is not supported; use 32-true (float32), bf16-mixed "
                    "(bfloat16 matmuls, float32 weights and attention) or 64-true")
    optim = groups["optim"]
    if not _positive(optim.get("lr")):
        errs.append(f"optim.lr={optim.get('lr')!r} must be a positive number")
    elif not (is_number(optim.get("min_lr")) and 0 <= optim["min_lr"] <= optim["lr"]):
        errs.append(f"optim.min_lr={optim.get('min_lr')!r} must be between 0 and optim.lr={optim['lr']}")
    if not isinstance(optim.get("warmup_steps"), int) or optim["warmup_steps"] < 0:
        errs.append(f"optim.warmup_steps={optim.get('warmup_steps')!r} must be a non-negative integer")
    betas = optim.get("betas")
    if not (isinstance(betas, list) and len(betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in betas)):
        errs.append(f"optim.betas={betas!r} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.99]")
    if not (is_number(optim.get("weight_decay")) and optim["weight_decay"] >= 0):
        errs.append(f"optim.weight_decay={optim.get('weight_decay')!r} must be a number >= 0 (0: no decay)")
    clip = groups["trainer"].get("gradient_clip_val")
    if clip is not None and not _positive(clip):
        errs.append(f"trainer.gradient_clip_val={clip!r} must be null (no clipping) or a number > 0")
    # The training stream is endless: there is no epoch for a fraction of one to refer to.
    interval = groups["trainer"].get("val_check_interval")
    if not _positive_int(interval):
        errs.append(f"trainer.val_check_interval={interval!r} must be a positive integer number of steps "
                    "between validations")
    diag = groups["diagnostics"]
    if diag.get("enabled"):
        if not _positive_int(diag.get("every_n_steps")):
            errs.append(f"diagnostics.every_n_steps={diag.get('every_n_steps')!r} must be a positive integer")
        if not _positive_int(diag.get("probe_examples")):
            errs.append(f"diagnostics.probe_examples={diag.get('probe_examples')!r} must be a positive integer")
        if diag.get("attention_maps") not in ("none", "end", "all"):
            errs.append(f"diagnostics.attention_maps={diag.get('attention_maps')!r} must be none, end or all")
    errs += _logger_errors(groups["logger"])
    max_loss = groups.get("max_loss")
    if max_loss is not None and not _positive(max_loss):
        errs.append(f"max_loss={max_loss!r} must be null (no ceiling) or a loss > 0")
    every = groups.get("checkpoint_every")
    if not _positive_int(every):
        errs.append(f"checkpoint_every={every!r} must be a positive number of steps")
    if not isinstance(groups.get("seed"), int):
        errs.append(f"seed={groups.get('seed')!r} must be an integer")
    return errs


def _logger_errors(logger: dict) -> list[str]:
    if not str(logger.get("_target_")).endswith("WandbLogger"):
        return []  # only the W&B logger has a mode
    mode = logger.get("mode", "offline")
    if mode in WANDB_MODES:
        return []
    close = difflib.get_close_matches(str(mode), WANDB_MODES, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return [f"logger.mode={mode!r} is not a W&B mode; {hint}use offline, online or disabled"]


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
