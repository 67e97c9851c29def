"""Findings pages: docs/findings/<sweep>.md, its figure and its data, one page per sweep, and the index.

`python -m blocklab.report SWEEP_DIR --findings docs/findings` writes, per study in the folder:
  <sweep>.jsonl   a header line (the setup: command, scale, seeds, model size, steps, machines, summed training
                  time, the commit and date of generation, the study block) then one line per job with only the
                  fields of results.json the page uses;
  <sweep>.md      rendered ONLY from that file through templates/findings.md.j2;
  <sweep>.png     its figures (then <sweep>.1.png, ...), one per plot its sweep's `plots:` names, drawn from that file
                  too by report/figures.py, the HTML report's plot kinds.
`--rerender` renders every page (and the index, docs/findings/README.md) again from the committed files, so a page
cannot drift from its data (tests/test_findings.py fails on any difference). A sweep with no committed data gets a
page whose first line says it is not measured yet, built from its sweep file alone: no number is invented.

Everything read from a run or a sweep folder is untrusted: it reaches the Markdown only through the `md` escape
(or as a code span fenced longer than any backtick run in it), never as markup. Runs' results.json are read through
blocklab.folder; the findings folder is the user's own (--findings OUT), and is read and written through
blocklab.folder with OUT as the root, so a link planted below OUT is refused, never followed. A run still training
(its lock held) is left out.

The jsonl is written and read by findings_data.py, the claims judged by judge.py (whether a setting learned:
learned.py, against the levels its task states), the table of settings built by page_tables.py, the page's words
written by page_text.py, the index by findings_index.py and the figures drawn by figures.py; this module writes
them."""
import io
import json
import re
from pathlib import Path

import numpy as np
from matplotlib import image

from blocklab import folder
from blocklab.errors import ConfigError
from blocklab.report import figures
from blocklab.report.build import metrics_spec
from blocklab.report.collect import RUNNING
from blocklab.report.common import order
from blocklab.report.figures_data import figure_record, lowest_seeds
from blocklab.report.findings_data import (FORMAT, _planned, _results, job_record, meta_record,  # noqa: F401
                                           names_its_rows, read_jsonl, studies_error, study_error, sweep_plots)
from blocklab.report.findings_index import (ANSWER_LIMIT, EXERCISES, PROOF, PROOF_TEST, index_rows,  # noqa: F401
                                            render_index, sweep_names, write_index as _write_index)
from blocklab.report.judge import AGREES, KEPT, OUTCOMES, also, judge, judge_page, learned  # noqa: F401 (the API)
from blocklab.report.judge import groups_of as _groups, keys_of as _keys  # noqa: F401 (the API)
from blocklab.report.markdown import ENV, code, md  # noqa: F401
from blocklab.report.page_tables import at_best, tuned  # noqa: F401 (the API)
from blocklab.report import ladder_page, verdict_guide
from blocklab.report.page_text import (GUIDE, SWEEPS, ladder_links, other_scales, page_text, render_page,  # noqa: F401
                                       render_unmeasured, sweep_study)

MAX_PNG_BYTES = 150_000
SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


# ---------------------------------------------------------------- from a sweep folder to the jsonl
def write_findings(sweep_dir: Path, rows: list[dict], specs: dict[str, dict], out: Path) -> list[Path]:
    """Per study in the folder: its jsonl, page and figure under `out`; then the index. Raises ConfigError (one
    line) for a study name that cannot name a file, or a scale that is not one, before anything is written. Runs
    still training are left out."""
    plans = []
    for name, study in specs.items():
        if not (isinstance(name, str) and SAFE_NAME.fullmatch(name)):
            raise ConfigError(f"study.name={str(name)[:60]!r} cannot name a findings page; use letters, digits, _ - .")
        members = [r for r in rows if r.get("study") == name and r.get("status") != RUNNING]
        if error := study_error(name, study, members):
            raise ConfigError(error)
        keys = [k for k in study.get("compare") or [] if isinstance(k, str)]
        metrics = metrics_spec(study.get("metrics"), members)
        verdict = study.get("verdict") or {}
        claims = [verdict, *(verdict.get("also") or [])] if isinstance(verdict, dict) else []
        for claim in claims:
            if isinstance(claim, dict) and isinstance(claim.get("metric"), str) and claim["metric"] not in metrics:
                metrics = [*metrics, claim["metric"]]
        plans.append((name, study, members, keys, metrics))
    folder.make_dirs(out)
    written = []
    for name, study, members, keys, metrics in plans:
        results = [_results(r["run"]) for r in members]
        plots, maps = study.get("plots") or [], lowest_seeds(members, keys)
        curve = isinstance(study.get("target"), dict)  # steps to it are read off each run's curve (targets.py)
        records = [{**job_record(r, res, keys, metrics, curve), "figure": figure_record(r, plots, r["run"] in maps)}
                   for r, res in zip(members, results)]
        records.sort(key=lambda j: (tuple(order(v) for v in j["setting"].values()), order(j["seed"]), j["job"]))
        extra = _planned([str(j["setting"].get("modification")) for j in records
                          if j.get("status") == "completed"]) \
            if "modification" in keys and not names_its_rows(name) else {}
        meta = {**meta_record(name, study, members, results, extra), **figures.page_context(study, sweep_dir)}
        stem = meta["sweep"]
        data = folder.write_text(out, f"{stem}.jsonl", "".join(json.dumps(x, sort_keys=True, allow_nan=False) + "\n"
                                                                 for x in [meta, *records]))
        written += write_page(data)
        if (base := out / f"{name}.jsonl") != data and folder.exists(out, base.name):  # the 1x page: this verdict too
            written.append(folder.write_text(out, f"{name}.md", page_text(base)))
        of = sweep_study(name).get("ladder_of") if (SWEEPS / f"{name}.yaml").is_file() else None
        if isinstance(of, str) and SAFE_NAME.fullmatch(of) and folder.exists(out, f"{of}.jsonl"):  # its claim's page
            written.append(folder.write_text(out, f"{of}.md", page_text(out / f"{of}.jsonl")))  # links its verdict
    written.append(write_index(out))
    return written


# ---------------------------------------------------------------- the figures
def draw(meta: dict, jobs: list[dict]) -> list[tuple[str | None, bytes]]:
    """The page's figures from its jsonl (report/figures.py: one per plot its sweep's `plots:` names, as the sweep
    file names them now: a plot is presentation, not what a job trains), each with the sentence of what it shows.
    Deterministic PNG bytes (no software or date stamp)."""
    return figures.page_pngs(meta, jobs, sweep_plots(meta["study"].get("name")) or meta["study"].get("plots") or [])


def _figures(data: Path, drawn: list) -> list[tuple[str, str | None]]:
    """The page's figure files and captions, in the order of its `plots:`."""
    return [(figures.page_png_name(data.stem, i), note) for i, (note, _) in enumerate(drawn)]


def pngs(data: Path, meta: dict, jobs: list[dict], drawn: list | None = None) -> list[tuple[str, bytes]]:
    """Every figure file of a page and its bytes: its plots' (`drawn`, where already drawn), then its ladder
    section's (<sweep>.ladder.png)."""
    drawn = draw(meta, jobs) if drawn is None else drawn
    out = [(name, png) for (name, _), (_, png) in zip(_figures(data, drawn), drawn)]
    if (ladder := ladder_page.page_png(meta, jobs)) is not None:
        out.append((ladder_page.figure_name(data.stem), ladder))
    return out


# ---------------------------------------------------------------- writing and re-rendering
def write_page(data: Path) -> list[Path]:
    """The page and figure of one findings file, beside it (through blocklab.folder, its folder the root)."""
    meta, jobs = read_jsonl(data)
    drawn = draw(meta, jobs)
    written = [folder.write_bytes(data.parent, name, png) for name, png in pngs(data, meta, jobs, drawn)]
    page = folder.write_text(data.parent, data.with_suffix(".md").name,
                             render_page(meta, jobs, _figures(data, drawn), other_scales(data, meta),
                                         ladder_links(data, meta)))
    return [data, page, *written]


def expected(out: Path) -> dict[Path, str]:
    """Every page's text as its data renders it now: the measured pages (each jsonl), the unmeasured sweeps'
    pages, and the index."""
    pages = {data.with_suffix(".md"): page_text(data) for data in sorted(out.glob("*.jsonl"))}
    for name in sweep_names():
        if (out / f"{name}.md") not in pages:
            pages[out / f"{name}.md"] = render_unmeasured(name)
    pages[out / "README.md"] = render_index(out)
    pages[out / GUIDE] = verdict_guide.render_guide(out)  # how to read a ladder's verdict, its example from data
    return pages


def _differs(out: Path, name: str, content: bytes) -> bool:
    return not folder.exists(out, name) or folder.read_bytes(out, name) != content


def same_drawing(committed: bytes, drawn: bytes) -> bool:
    """Whether two PNGs show one figure: the same bytes, or the same size with at most 0.1% of the pixels apart. A
    ladder's fit and bootstrap run through BLAS, whose last bits differ between CPU models (Zen 4, AVX2, AMX) and move
    an error bar's end by a pixel (at most 0.05% of a figure, measured 2026-11-29); a figure that draws other data or
    another plot differs in far more. The page's text, whose numbers come from the same data, is compared exactly."""
    if committed == drawn:
        return True
    try:
        a, b = (image.imread(io.BytesIO(png), format="png") for png in (committed, drawn))
    except (OSError, ValueError, SyntaxError):
        return False
    return a.shape == b.shape and float((np.abs(a - b).max(axis=-1) > 0).mean()) <= 1e-3


def rerender(out: Path, figures: bool = True) -> list[Path]:
    """Write every page (and figure) again from its data; the paths whose content changed. Every file is read and
    written through blocklab.folder, `out` the root."""
    changed = []
    for data in sorted(out.glob("*.jsonl")) if figures else []:
        meta, jobs = read_jsonl(data)
        for name, png in pngs(data, meta, jobs):
            if not folder.exists(out, name) or not same_drawing(folder.read_bytes(out, name), png):
                changed.append(folder.write_bytes(out, name, png))
    for path, text in expected(out).items():
        if _differs(out, path.name, text.encode("utf-8")):
            changed.append(folder.write_text(out, path.name, text))
    return changed


def write_index(out: Path) -> Path:
    path = _write_index(out)
    folder.write_text(out, GUIDE, verdict_guide.render_guide(out))  # its worked example may read this sweep
    for name in sweep_names():  # a sweep without its page gets the unmeasured one
        if not folder.exists(out, f"{name}.md"):
            folder.write_text(out, f"{name}.md", render_unmeasured(name))
    return path
