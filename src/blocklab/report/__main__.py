"""python -m blocklab.report SWEEP_DIR: writes SWEEP_DIR/report/{index.html, summary.csv, *.png}."""
import argparse
import sys
from pathlib import Path

from blocklab.errors import ConfigError
from blocklab.report.collect import collect, study_specs
from blocklab.startup import uncollected_imports


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("sweep_dir", type=Path, help="a sweep directory, or a folder of them")
    parser.add_argument("--bench", type=Path, action="append", default=[], metavar="FILE",
                        help="a JSON `python -m blocklab.bench --out FILE` wrote (repeatable); else the report reads "
                             "outputs/bench/NAME.json")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        sys.exit(f"error: {args.sweep_dir} is not a directory; give the sweep's output folder, e.g. outputs/sweeps/pe_copy")
    rows = collect(args.sweep_dir)
    if not rows:
        sys.exit(f"error: no results.json under {args.sweep_dir}; run the sweep first (python train.py -m sweep=NAME)")
    missing = [str(f) for f in args.bench if not f.is_file()]
    if missing:
        sys.exit(f"error: --bench {', '.join(missing)}: no such file; write one with python -m blocklab.bench --out FILE")
    with uncollected_imports("blocklab.report.build"):  # torch, scipy, matplotlib: only once the input is good
        from blocklab.report.build import build_report
    try:
        path = build_report(args.sweep_dir, rows, study_specs(args.sweep_dir, rows), args.bench)
    except ConfigError as err:  # a study block the report cannot read (checked before any file is written)
        sys.exit(f"error: {err}")
    print(f"wrote {path} ({len(rows)} runs)")


if __name__ == "__main__":
    main()
