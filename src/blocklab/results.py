"""results.json, the contract that sweeps, reports and other tools read, and its console summary."""
import errno
import math
import os
import sys
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from blocklab import folder
from blocklab.errors import ConfigError, RunFolderError
from blocklab.naming import names_the_job

# What every run directory holds besides results.json: enough to rebuild and use the model.
RESULTS_FILE, MODEL_FILE, TOKENIZER_FILE = "results.json", "model.json", "tokenizer.json"
CHECKPOINT = Path("checkpoints") / "last.ckpt"
SAVED_CONFIG = Path(".hydra") / "config.yaml"
STATUSES = ("completed", "diverged", "failed")
METRICS = ("exact_match", "token_acc", "loss", "perplexity", "bits_per_char",  # shown when a task reports them
           "next_sentence_acc", "exact_match_given_length", "read_attention")


def unfinished_run_error(run_dir: Path) -> str | None:
    """Why `run_dir` is not a finished run that a model can be rebuilt from (generate, analyze), or None. It reads
    no file, so a tool can say it before importing torch."""
    missing = [str(name) for name in (MODEL_FILE, TOKENIZER_FILE, CHECKPOINT, SAVED_CONFIG)
               if not folder.exists(run_dir, name)]
    return f"{run_dir} is not a finished BlockLab run (missing {', '.join(missing)})" if missing else None


def swept_overrides(overrides: list[str]) -> list[str]:
    """A sweep job's overrides that say what it varied (not which sweep it is, nor where it writes):
    its W&B tags, and what the report lists as swept. The same rule names the job's directory."""
    return [o for o in overrides if names_the_job(o)]


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _fmt_rate(value) -> str:
    return "-" if value is None else f"{value:,.0f}"  # None: no step was trained (trainer.max_steps=0)


def json_safe(value):
    """JSON has no NaN/Infinity: a diverged loss (or an activation that overflowed) is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def recorded_references(results: dict) -> dict | None:
    """results.json `references`: the task's chance levels and the bar at which it is learned (Task.references,
    tasks/references.py). None in a folder written before runs recorded them (the report computes them then)."""
    value = results.get("references")
    return value if isinstance(value, dict) else None


def write_results(run_dir: Path, results: dict) -> Path:
    """Write atomically, so a reader never sees half a file; a full disk is a clear error."""
    path = Path(run_dir) / RESULTS_FILE
    try:
        folder.write_json(run_dir, RESULTS_FILE, json_safe(results))
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ConfigError(f"cannot write {path}: {os.strerror(err.errno)}; free disk space or set "
                              "hydra.run.dir to another disk") from None
        raise
    return path


def read_results(run_dir: Path) -> dict:
    """The run's results.json (a FolderError for a link or special file; ValueError for one that is not JSON)."""
    return folder.read_json(run_dir, RESULTS_FILE)


def previous_status(run_dir: Path) -> str | None:
    """The status a run directory's results record, None where there are none yet. Results that cannot be read,
    or that record no known status, are damage: a RunFolderError, never a reason to train or evaluate again."""
    path = run_dir / RESULTS_FILE
    if not folder.exists(run_dir, RESULTS_FILE):
        return None
    try:
        status = read_results(run_dir).get("status")
    except folder.FolderError:
        raise
    except (OSError, ValueError, AttributeError) as err:  # truncated, not UTF-8 or JSON, not an object
        status = err
    if status not in (*STATUSES, "invalid"):
        raise RunFolderError(f"{path} is damaged (not a results file BlockLab wrote); delete it to evaluate the "
                             "run again from its checkpoint, or choose a new hydra.run.dir")
    return status


def flatten(tree: dict, prefix: str = "") -> dict:
    """A nested config as dotted keys (`optim.lr`), the way overrides name them: W&B hyperparameters,
    resume's config differences and the report's columns."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        flat.update(flatten(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return flat


def console_kwargs() -> dict:
    """Written to a file or pipe, Rich assumes 80 columns and wraps a run's lines mid-value: allow 120."""
    return {} if sys.stdout.isatty() else {"width": 120}


# A run whose mean exact match over its training lengths is below this has not learned the task in
# distribution, and its lengths beyond training say little about extrapolation. 0.9 sits well clear of both
# sides measured at the defaults (learned: 0.96-1.00, its weakest length, the longest trained, ~0.95; not
# learned: 0.2-0.55) and of the noise of 128 examples per length (one standard error ~0.02 near 0.95).
LEARNED_THRESHOLD = 0.9


def in_distribution_exact_match(results: dict) -> float | None:
    """Mean greedy exact match over the evaluated training lengths; None for a task without exact match (lm)."""
    values = [row["exact_match"] for row in results["eval"]
              if row.get("in_distribution") and row.get("exact_match") is not None]
    return sum(values) / len(values) if values else None


def learned_in_distribution(results: dict) -> bool | None:
    """Whether the run learned its task on the training lengths (results.json `learned_in_distribution`);
    None where the task reports no exact match."""
    mean = in_distribution_exact_match(results)
    return None if mean is None else mean >= LEARNED_THRESHOLD


def learned_warning(results: dict) -> str | None:
    """The summary's one warning line when the run has not learned its task in distribution, else None."""
    mean = in_distribution_exact_match(results)
    if mean is None or mean >= LEARNED_THRESHOLD:
        return None
    return (f"warning: in-distribution exact match {mean:.3f} < {LEARNED_THRESHOLD:.2f}: the model has not learned "
            "the task, so the columns beyond the training lengths say little (README: Do the defaults learn?)")


# Column headers that say what a metric is where its name alone would not (LM runs have no exact match).
METRIC_HEADERS = {"exact_match": "exact match (greedy)", "token_acc": "token acc", "bits_per_char": "bits/char",
                  "exact_match_given_length": "exact (end given)", "read_attention": "read attn"}


def print_summary(results: dict, path: Path, console: Console | None = None) -> None:
    """The run's result table and one status line: a dozen lines, so a run's console stays readable."""
    console = console or Console(**console_kwargs())
    choices = results["choices"]
    lo, hi = results["train_lengths"]
    trained = f"{lo}-{hi}" if lo != hi else str(lo)
    title = (f"{results['task']} (trained on length {trained}): norm={choices['norm']} pos={choices['pos']} "
             f"act={choices['act']} attn={choices['attn']} heads={choices['n_heads']} init={choices['init']}")
    metrics = [m for m in METRICS if any(row.get(m) is not None for row in results["eval"])]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("length", "trained on", *(METRIC_HEADERS.get(m, m.replace("_", " ")) for m in metrics), "n"):
        table.add_column(column, justify="right")
    for row in results["eval"]:
        cells = [_fmt(row.get(m)) for m in metrics]
        table.add_row(str(row["length"]), "yes" if row["in_distribution"] else "no", *cells, str(row["n"]),
                      style=None if row["in_distribution"] else "yellow")
    console.print(title, soft_wrap=True)  # the table's own title would wrap at the table's width
    console.print(table)
    diverged = f" at step {results['diverged_at_step']}" if results["diverged_at_step"] is not None else ""
    console.print(f"status: {results['status']}{diverged} | params {results['params']:,} | steps {results['steps']} | "
                  f"{results['train_time_s']:.1f} s | {_fmt_rate(results['tokens_per_s'])} tokens/s | "
                  f"final train loss {_fmt(results['final_train_loss'])} | results: {path}", soft_wrap=True)
    warning = learned_warning(results)
    if warning:
        console.print(warning, style="bold yellow", soft_wrap=True, markup=False, highlight=False)


def val_loss_curve(results: dict) -> list[tuple[int, float]]:
    """The run's [step, validation loss] points, one per validation during training (trainer.val_check_interval),
    finite ones only. A run folder written before the field existed has none: []."""
    return [(int(step), float(loss)) for step, loss in results.get("val_loss_curve") or []
            if isinstance(loss, (int, float)) and math.isfinite(loss)]
