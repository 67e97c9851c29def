"""results.json, the contract that sweeps, reports and other tools read, and its console summary."""
import json
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS_FILE = "results.json"
STATUSES = ("completed", "diverged", "failed")


def write_results(run_dir: Path, results: dict) -> Path:
    """Write atomically, so a reader never sees half a file."""
    path = Path(run_dir) / RESULTS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_results(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / RESULTS_FILE).read_text())


def print_summary(results: dict, path: Path, console: Console | None = None) -> None:
    console = console or Console()
    choices = results["choices"]
    title = (f"{results['task']}: norm={choices['norm']} pos={choices['pos']} act={choices['act']} "
             f"attn={choices['attn']} heads={choices['n_heads']} init={choices['init']}")
    table = Table(title=title, caption=f"exact match = greedy generation of the whole answer; "
                                       f"trained on lengths {results['train_lengths'][0]}-{results['train_lengths'][1]}")
    for column in ("length", "trained on", "exact match", "token acc", "loss", "n"):
        table.add_column(column, justify="right")
    for row in results["eval"]:
        style = None if row["in_distribution"] else "yellow"
        loss = "nan" if row["loss"] is None else f"{row['loss']:.3f}"
        table.add_row(str(row["length"]), "yes" if row["in_distribution"] else "no", f"{row['exact_match']:.3f}",
                      f"{row['token_acc']:.3f}", loss, str(row["n"]), style=style)
    console.print(table)
    diverged = f" at step {results['diverged_at_step']}" if results["diverged_at_step"] is not None else ""
    console.print(f"status: {results['status']}{diverged} | params {results['params']:,} | steps {results['steps']} | "
                  f"{results['train_time_s']:.1f} s | {results['tokens_per_s']:,.0f} tokens/s | "
                  f"final train loss {results['final_train_loss']:.4f}")
    console.print(f"results: {path}")
