"""`python -m blocklab.bench [step overhead startup attention decode activations] [--out PATH]`:
runs the named benchmarks (all by default), prints a table per benchmark and its targets, and
writes everything to one JSON file (default outputs/bench/bench-<time>.json)."""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from blocklab.bench.suites import BENCHMARKS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blocklab.bench", description=__doc__.split(":")[0])
    parser.add_argument("names", nargs="*", choices=[[], *BENCHMARKS], metavar="NAME",
                        help=f"benchmarks to run (default: all): {' '.join(BENCHMARKS)}")
    parser.add_argument("--size", choices=["full", "tiny"], default="full", help="tiny: a smoke test, figures meaningless")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    names = args.names or list(BENCHMARKS)
    console = Console()
    results = {"machine": {"cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                           "python": platform.python_version(), "command": " ".join(["python -m blocklab.bench", *(argv or sys.argv[1:])])},
               "benchmarks": {}}
    for name in names:
        start = time.perf_counter()
        with console.status(f"running {name}..."):
            result = BENCHMARKS[name](args.size)
        result["wall_s"] = round(time.perf_counter() - start, 1)
        results["benchmarks"][name] = result
        console.print(_table(name, result))
        console.print(_targets(name, result["targets"]))
    out = args.out or Path("outputs") / "bench" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {out}")
    return 0


def _table(name: str, result: dict) -> Table:
    rows = result["rows"]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    table = Table(title=f"{name} ({result['wall_s']} s)")
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
        met = "[green]yes[/green]" if v["met"] else "[red]no[/red]"
        table.add_row(key, str(v["value"]), str(v["target"]), met, "" if v["met"] else f"{100 * v['off_by']:.1f}%")
    return table


if __name__ == "__main__":
    sys.exit(main())
