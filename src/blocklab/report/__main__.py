"""python -m blocklab.report SWEEP_DIR: writes SWEEP_DIR/report/{index.html, summary.csv, *.png}, or, with --out
DIR, the same files into DIR (a sweep folder that is read-only, or not yours to write in).
With --findings DIR (docs/findings): also the sweep's findings page, its figure and its data (NAME.md, .png, .jsonl)
and the index DIR/README.md; --findings DIR --rerender (no SWEEP_DIR): every page again from its committed data."""
import argparse
from pathlib import Path

from blocklab.errors import ConfigError, exit_on
from blocklab.report.collect import RUNNING, collect, study_specs
from blocklab.report.output import Out
from blocklab.startup import uncollected_imports


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("sweep_dir", type=Path, nargs="?", help="a sweep directory, or a folder of them")
    parser.add_argument("--bench", type=Path, action="append", default=[], metavar="FILE",
                        help="a JSON `python -m blocklab.bench --out FILE` wrote (repeatable); else the report reads "
                             "outputs/bench/NAME.json")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="write the report into DIR instead of SWEEP_DIR/report (for a read-only sweep folder)")
    parser.add_argument("--findings", type=Path, metavar="DIR",
                        help="also write the findings page, figure and data of each study here (docs/findings)")
    parser.add_argument("--rerender", action="store_true",
                        help="with --findings and no SWEEP_DIR: render every page in DIR again from its .jsonl")
    args = parser.parse_args(argv)
    if args.rerender:
        _rerender(args)
        return
    if args.sweep_dir is None:
        exit_on("give the sweep's output folder (python -m blocklab.report outputs/sweeps/NAME), or "
                "--findings docs/findings --rerender")
    if args.findings is not None and args.findings.exists() and not args.findings.is_dir():
        exit_on(f"--findings {args.findings} is not a folder; give the findings folder, e.g. docs/findings")
    # Bad input: one line on stderr naming the problem and the fix, exit 2, before any file is written.
    if not args.sweep_dir.is_dir():
        exit_on(f"{args.sweep_dir} is not a directory; give the sweep's output folder, e.g. outputs/sweeps/pe_copy")
    out = _out(args)
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
    if args.findings is not None:  # a study no findings page can be written for: refused before the report too
        from blocklab.report.findings import studies_error

        try:
            exit_on(studies_error(rows, study_specs(args.sweep_dir, rows)))
        except ConfigError as err:
            exit_on(str(err))
    try:
        path = build_report(args.sweep_dir, rows, study_specs(args.sweep_dir, rows), args.bench, out)
    except ConfigError as err:  # a study block or benchmark file the report cannot read (before any file is written)
        exit_on(str(err))
    print(f"wrote {path} ({len(rows)} runs)")
    running = [Path(r["run"]).name for r in rows if r["status"] == RUNNING]
    if running:
        print(f"{len(running)} run(s) still training (their lock is held), shown as running and not read"
              f"{'' if args.findings is None else ', nor in the findings'}: {', '.join(running)}")
    if args.findings is not None:
        from blocklab.report.findings import write_findings

        try:
            written = write_findings(args.sweep_dir, rows, study_specs(args.sweep_dir, rows), args.findings)
        except ConfigError as err:
            exit_on(str(err))
        print(f"wrote {', '.join(str(p) for p in written)}")


def _out(args) -> Out:
    """Where the report goes, checked before any work: no link planted at SWEEP/report or its files, and a folder
    the user can write (a read-only sweep folder: one line that suggests --out)."""
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        exit_on(f"--out {args.out} is not a folder; give a folder for the report, e.g. --out /tmp/report")
    out = Out.for_sweep(args.sweep_dir, args.out)
    try:
        out.check()
    except ConfigError as err:
        exit_on(f"{err}; or write the report elsewhere with --out DIR" if args.out is None else str(err))
    if (blocked := out.unwritable()) is not None:
        exit_on(f"{blocked} is read-only, so the report cannot be written to {out.path}; write it elsewhere with "
                "--out DIR" if args.out is None else f"--out {args.out}: {blocked} is not writable; give a folder "
                "you can write")
    if args.findings is not None and (blocked := Out(args.findings).unwritable()) is not None:
        exit_on(f"--findings {args.findings}: {blocked} is not writable; give a folder you can write")
    return out


def _rerender(args) -> None:
    if args.findings is None or args.sweep_dir is not None or args.out is not None:
        exit_on("--rerender renders the committed pages again: give --findings DIR and no SWEEP_DIR (nor --out)")
    if not args.findings.is_dir():
        exit_on(f"--findings {args.findings} is not a folder; give the findings folder, e.g. docs/findings")
    with uncollected_imports("matplotlib"):
        from blocklab.report.findings import rerender
    try:
        changed = rerender(args.findings)
    except ConfigError as err:
        exit_on(str(err))
    print(f"re-rendered {args.findings}: {len(changed)} file(s) changed" + "".join(f"\n  {p}" for p in changed))


if __name__ == "__main__":
    main()
