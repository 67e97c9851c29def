"""python -m blocklab.report SWEEP_DIR: writes SWEEP_DIR/report/{index.html, summary.csv, *.png}."""
import argparse
from pathlib import Path

from blocklab.errors import ConfigError, exit_on
from blocklab.report.collect import collect, study_specs
from blocklab.startup import uncollected_imports


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("sweep_dir", type=Path, help="a sweep directory, or a folder of them")
    parser.add_argument("--bench", type=Path, action="append", default=[], metavar="FILE",
                        help="a JSON `python -m blocklab.bench --out FILE` wrote (repeatable); else the report reads "
                             "outputs/bench/NAME.json")
    args = parser.parse_args(argv)
    # Bad input: one line on stderr naming the problem and the fix, exit 2, before any file is written.
    if not args.sweep_dir.is_dir():
        exit_on(f"{args.sweep_dir} is not a directory; give the sweep's output folder, e.g. outputs/sweeps/pe_copy")
    try:
        rows = collect(args.sweep_dir)
    except ConfigError as err:  # a run's results.json or saved config that cannot be read (collect.UnreadableRun)
        exit_on(str(err))
    if not rows:
        exit_on(f"no results.json under {args.sweep_dir}; run the sweep first (python train.py -m sweep=NAME)")
    missing = [str(f) for f in args.bench if not f.is_file()]
    if missing:
        exit_on(f"--bench {', '.join(missing)}: no such file; write one with python -m blocklab.bench --out FILE")
    with uncollected_imports("blocklab.report.build"):  # torch, scipy, matplotlib: only once the input is good
        from blocklab.report.build import build_report
    try:
        path = build_report(args.sweep_dir, rows, study_specs(args.sweep_dir, rows), args.bench)
    except ConfigError as err:  # a study block or benchmark file the report cannot read (before any file is written)
        exit_on(str(err))
    print(f"wrote {path} ({len(rows)} runs)")


if __name__ == "__main__":
    main()
