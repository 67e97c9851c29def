"""`python -m blocklab.bench [step overhead startup attention decode activations launch malloc kernels masked
debug_mqar] [--quick] [--out PATH]`:
runs the named benchmarks (all by default), prints a table per benchmark (or the tables it asks for),
its notes and targets, and writes everything to one JSON file (default outputs/bench/bench-<time>.json,
and each benchmark's latest result to outputs/bench/<name>.json, where the report looks for it)."""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from blocklab import hardware
from blocklab.bench.suites import BENCHMARKS
from blocklab.results import console_kwargs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blocklab.bench", description=__doc__.split(":")[0])
    parser.add_argument("names", nargs="*", choices=[[], *BENCHMARKS], metavar="NAME",
                        help=f"benchmarks to run (default: all): {' '.join(BENCHMARKS)}")
    parser.add_argument("--size", choices=["full", "tiny"], default="full", help="tiny: a smoke test, figures meaningless")
    parser.add_argument("--quick", dest="size", action="store_const", const="tiny", help="the same as --size tiny")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    hardware.keep_freed_memory()  # as every run does: in-process step figures are a run's
    names = args.names or list(BENCHMARKS)
    console = Console(**console_kwargs())
    machine = hardware.describe()
    results = {"machine": {**machine, "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                           "python": platform.python_version(), "command": " ".join(["python -m blocklab.bench", *(argv or sys.argv[1:])])},
               "benchmarks": {}}
    # Figures mean little without the CPU: bfloat16 and even float32 ratios change with its kernels.
    cpu_line = (f"machine: {machine['cpu']}, torch CPU kernels {machine['torch_cpu_capability']}, flags "
                f"{' '.join(machine['flags']) or 'unknown'}, native bf16 {machine['native_bf16']}, "
                f"{machine['threads']} threads, torch {torch.__version__}"
                + (f"; GPU {machine['gpu']} (figures measured on it say so)" if machine["gpu"] else ""))
    console.print(cpu_line, soft_wrap=True, markup=False)
    for name in names:
        start = time.perf_counter()
        with console.status(f"running {name}..."):
            result = BENCHMARKS[name](args.size)
        result["wall_s"] = round(time.perf_counter() - start, 1)
        results["benchmarks"][name] = result
        head = f"{name} ({result['wall_s']} s)"
        for title, rows in result.get("tables", {"": result["rows"]}).items():
            console.print(_table(f"{head}: {title}" if title else head, rows))
        console.print(cpu_line, soft_wrap=True, markup=False)
        for note in result.get("notes", []):
            console.print(f"note: {note}", soft_wrap=True, markup=False)
        console.print(_targets(name, result["targets"]))
    outs = {args.out: results} if args.out else {
        Path("outputs") / "bench" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json": results,
        **{Path("outputs") / "bench" / f"{name}.json": {**results, "benchmarks": {name: result}}
           for name, result in results["benchmarks"].items()}}
    for out, content in outs.items():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(content, indent=2) + "\n")
        console.print(f"wrote {out}")
    return 0


def _table(title: str, rows: list[dict]) -> Table:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if isinstance(rows[0].get(column), str) else "right")
    for row in rows:
        table.add_row(*("" if row.get(c) is None else str(row[c]) for c in columns))
    return table


def _targets(name: str, targets: dict) -> Table:
    table = Table(title=f"{name} targets", show_header=True)
    for column in ("target", "value", "limit", "met", "off by"):
        table.add_column(column)
    for key, v in targets.items():
        met = "[green]PASS[/green]" if v["met"] else "[red]MISS[/red]"
        limit = f"{v['target']} ± {v['tolerance']}" if "tolerance" in v else str(v["target"])
        table.add_row(key, str(v["value"]), limit, met, "" if v["met"] else f"{100 * v['off_by']:.1f}%")
    return table


if __name__ == "__main__":
    sys.exit(main())
