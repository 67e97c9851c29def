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

The jsonl is written and read by findings_data.py, the claims judged by judge.py, the table of settings built by
page_tables.py, the figures drawn by figures.py; this module renders the page and the index."""
import glob
import json
import re
from collections import Counter
from pathlib import Path

import jinja2
from markupsafe import Markup

from blocklab import folder, study_folder
from blocklab.errors import ConfigError
from blocklab.paths import CONF_DIR
from blocklab.report import figures, stats
from blocklab.report.build import learning_note, metrics_spec
from blocklab.report.collect import RUNNING
from blocklab.report.common import order
from blocklab.report.figures_data import figure_record, lowest_seeds
from blocklab.report.findings_data import (FORMAT, _planned, _results, job_record, meta_record,  # noqa: F401
                                           read_jsonl, studies_error, study_error)
from blocklab.report.judge import KEPT, OUTCOMES, also, judge, judge_page, learned  # noqa: F401 (judge, also: the API)
from blocklab.report.judge import groups_of as _groups, keys_of as _keys
from blocklab.report.page_tables import _against_baseline, _table, _tuned_table, at_best, tuned
from blocklab.report.recall import FRACTION

SWEEPS = CONF_DIR / "sweep"
EXERCISES = [f"1.{i}" for i in range(1, 15)]
PROOF = "1.6"  # a proof, answered by a test (tests/model/test_position.py), not by a sweep
PROOF_TEST = "tests/model/test_position.py"
MAX_PNG_BYTES = 150_000
NUMERIC = re.compile(r"[-+–\d.,\[\]\s%e]*(\(1 seed\))?")
SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


# ---------------------------------------------------------------- Markdown, escaped
def md(value) -> str:
    """Untrusted text as Markdown that shows it literally, on one line (a table cell stays one cell)."""
    if isinstance(value, Markup):
        return value
    if value is None:
        return "–"
    text = " ".join(str(value).split())
    if NUMERIC.fullmatch(text) and "](" not in text:  # a number, interval or count: nothing Markdown reads
        return text
    text = text.replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = re.sub(r"([`*\[\]|#!])", r"\\\1", text)
    return re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", text)  # an intraword _ is never emphasis


def code(value) -> Markup:
    """A code span that holds any text: fenced by one more backtick than its longest run (CommonMark)."""
    text = " ".join(str(value).split())
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return Markup(f"{fence}{pad}{text}{pad}{fence}")


ENV = jinja2.Environment(loader=jinja2.PackageLoader("blocklab.report", "templates"), autoescape=False,
                         finalize=md, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                         keep_trailing_newline=True)
ENV.filters["code"] = code


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
        records = [{**job_record(r, res, keys, metrics), "figure": figure_record(r, plots, r["run"] in maps)}
                   for r, res in zip(members, results)]
        records.sort(key=lambda j: (tuple(order(v) for v in j["setting"].values()), order(j["seed"]), j["job"]))
        extra = _planned([str(j["setting"].get("modification")) for j in records
                          if j.get("status") == "completed"]) if "modification" in keys else {}
        meta = {**meta_record(name, study, members, results, extra), **figures.page_context(study, sweep_dir)}
        stem = meta["sweep"]
        data = folder.write_text(out, f"{stem}.jsonl", "".join(json.dumps(x, sort_keys=True, allow_nan=False) + "\n"
                                                                 for x in [meta, *records]))
        written += write_page(data)
        if (base := out / f"{name}.jsonl") != data and folder.exists(out, base.name):  # the 1x page: this verdict too
            written.append(folder.write_text(out, f"{name}.md", page_text(base)))
    written.append(write_index(out))
    return written


# ---------------------------------------------------------------- from the jsonl to the page
def learning_flag(meta: dict, groups) -> str | None:
    """The flag a page puts before any conclusion: the HTML report's note (build.learning_note), as one line."""
    note = learning_note("", _keys(meta), learned(groups))
    return None if note is None else f"{note.lead} {' '.join(str(p) for p in note.parts)}"


def _study_line(study: dict) -> dict:
    exercise = study.get("exercise")
    exercises = [str(x) for x in (exercise if isinstance(exercise, list) else [exercise] if exercise else [])]
    return {"question": study.get("question") or "", "exercises": exercises, "source": study.get("source"),
            "paper": study.get("paper")}


def other_scales(data: Path, meta: dict) -> list[dict]:
    """For a 1x page (`data`, whose header is `meta`), its sweep measured at other `study.scale`s
    (`<sweep>-scale<K>.jsonl` beside it, by study_folder): scale, machines, steps and the verdict there, so the page
    answers at each scale it was run at."""
    if meta.get("scale") != 1:
        return []
    rows = []
    for other in sorted(data.parent.glob(f"{glob.escape(data.stem)}-scale*.jsonl")):
        their, jobs = read_jsonl(other)
        scale = their.get("scale")
        if not isinstance(scale, (int, float)) or their.get("sweep") != study_folder(meta["sweep"], scale) \
                or other.stem != their["sweep"]:
            continue  # another sweep's name that only starts alike
        outcome, verdict = judge(their, jobs)
        rows.append({"scale": scale, "stem": other.stem, "machines": ", ".join(their["machines"]) or None,
                     "steps": "/".join(str(x) for x in their["steps"]), "outcome": OUTCOMES[outcome],
                     "verdict": verdict})
    return sorted(rows, key=lambda r: r["scale"])


def render_page(meta: dict, jobs: list[dict], figure: list | None, scales: list[dict] = ()) -> str:
    """A measured page, from its jsonl (and, for a 1x page, the verdicts of its other scales' jsonl)."""
    groups = _groups(meta, jobs)
    verdicts = judge_page(meta, jobs)
    best = tuned(meta, groups)
    table = (_against_baseline(meta, groups) if meta["study"].get("baseline") else
             _tuned_table(meta, groups, best) if best else _table(meta, groups))
    failed = [j for j in jobs if j.get("status") not in KEPT]
    diverged = [j for j in jobs if j.get("status") == "diverged"]
    rows = [v.row for v in verdicts if v.row]
    hours = meta["train_time_s"] / 3600
    return ENV.get_template("findings.md.j2").render(
        meta=meta, study=_study_line(meta["study"]), flag=learning_flag(meta, at_best(meta, groups, best)), table=table,
        tuned=best is not None, range_fraction=f"{FRACTION:g}", verdict=verdicts[0].sentence,
        also=[(OUTCOMES[v.outcome], v.sentence) for v in verdicts[1:]], comparisons=rows,
        claims=len(rows), floor=verdicts[0].floor, flips=stats.MIN_FLIP_PAIRS, cl_formula=stats.CL_FORMULA,
        outcome=OUTCOMES[verdicts[0].outcome], figures=figure or [], failed=failed, diverged=diverged, settings=len(groups),
        time=f"{meta['train_time_s']:,.0f} s" + (f" ({hours:.1f} h)" if hours >= 1 else ""),
        seeds=", ".join(str(s) for s in meta["seeds"]), left_out=meta.get("left_out") or [],
        not_run=meta.get("not_run") or [], scales=list(scales))


def sweep_study(name: str) -> dict:
    """A sweep file's study block, unresolved (interpolations stay text): the package's own config, not a folder's."""
    from omegaconf import OmegaConf

    study = OmegaConf.load(SWEEPS / f"{name}.yaml").get("study") or {}
    return OmegaConf.to_container(study, resolve=False)


def render_unmeasured(name: str) -> str:
    """The page of a sweep with no committed data: its first line says so; no number on it."""
    study = sweep_study(name)
    return ENV.get_template("findings_unmeasured.md.j2").render(name=name, study=_study_line(study),
                                                                verdict=study.get("verdict") or {})


# ---------------------------------------------------------------- the figures
def draw(meta: dict, jobs: list[dict]) -> list[tuple[str | None, bytes]]:
    """The page's figures from its jsonl (report/figures.py: one per plot its sweep's `plots:` names, as the sweep
    file names them now: a plot is presentation, not what a job trains), each with the sentence of what it shows.
    Deterministic PNG bytes (no software or date stamp)."""
    return figures.page_pngs(meta, jobs, sweep_plots(meta["study"].get("name")) or meta["study"].get("plots") or [])


def sweep_plots(name) -> list:
    """A sweep file's `plots:`, or those of the sweep its defaults extend (init_depth_rezero: init_depth's)."""
    from omegaconf import OmegaConf

    if name not in sweep_names():
        return []
    config = OmegaConf.to_container(OmegaConf.load(SWEEPS / f"{name}.yaml"), resolve=False)
    if (config.get("study") or {}).get("plots"):
        return config["study"]["plots"]
    bases = [d for d in config.get("defaults") or [] if isinstance(d, str) and d != name and d in sweep_names()]
    return sweep_plots(bases[0]) if bases else []


def _figures(data: Path, drawn: list) -> list[tuple[str, str | None]]:
    """The page's figure files and captions, in the order of its `plots:`."""
    return [(figures.page_png_name(data.stem, i), note) for i, (note, _) in enumerate(drawn)]


# ---------------------------------------------------------------- writing and re-rendering
def write_page(data: Path) -> list[Path]:
    """The page and figure of one findings file, beside it (through blocklab.folder, its folder the root)."""
    meta, jobs = read_jsonl(data)
    drawn = draw(meta, jobs)
    written = [folder.write_bytes(data.parent, name, png) for (name, _), (_, png) in zip(_figures(data, drawn), drawn)]
    page = folder.write_text(data.parent, data.with_suffix(".md").name,
                             render_page(meta, jobs, _figures(data, drawn), other_scales(data, meta)))
    return [data, page, *written]


def page_text(data: Path) -> str:
    """A measured page as its data renders it now, with the figure already beside it (if any)."""
    meta, jobs = read_jsonl(data)
    return render_page(meta, jobs, _figures(data, draw(meta, jobs)), other_scales(data, meta))


def sweep_names() -> list[str]:
    return sorted(p.stem for p in SWEEPS.glob("*.yaml"))


def expected(out: Path) -> dict[Path, str]:
    """Every page's text as its data renders it now: the measured pages (each jsonl), the unmeasured sweeps'
    pages, and the index."""
    pages = {data.with_suffix(".md"): page_text(data) for data in sorted(out.glob("*.jsonl"))}
    for name in sweep_names():
        if (out / f"{name}.md") not in pages:
            pages[out / f"{name}.md"] = render_unmeasured(name)
    pages[out / "README.md"] = render_index(out)
    return pages


def _differs(out: Path, name: str, content: bytes) -> bool:
    return not folder.exists(out, name) or folder.read_bytes(out, name) != content


def rerender(out: Path, figures: bool = True) -> list[Path]:
    """Write every page (and figure) again from its data; the paths whose content changed. Every file is read and
    written through blocklab.folder, `out` the root."""
    changed = []
    for data in sorted(out.glob("*.jsonl")) if figures else []:
        meta, jobs = read_jsonl(data)
        drawn = draw(meta, jobs)
        for (name, _), (_, png) in zip(_figures(data, drawn), drawn):
            if _differs(out, name, png):
                changed.append(folder.write_bytes(out, name, png))
    for path, text in expected(out).items():
        if _differs(out, path.name, text.encode("utf-8")):
            changed.append(folder.write_text(out, path.name, text))
    return changed


def write_index(out: Path) -> Path:
    path = folder.write_text(out, "README.md", render_index(out))
    for name in sweep_names():  # a sweep without its page gets the unmeasured one
        if not folder.exists(out, f"{name}.md"):
            folder.write_text(out, f"{name}.md", render_unmeasured(name))
    return path


def _exercise_key(row: dict):
    first = row["exercises"][0] if row["exercises"] else "9"
    return tuple(int(x) if x.isdigit() else 99 for x in re.findall(r"\w+", first)), row["name"]


def index_rows(out: Path) -> list[dict]:
    """One row per page: every sweep file's, and any other measured page (another scale)."""
    stems = {p.stem for p in out.glob("*.jsonl")} | set(sweep_names())
    rows = []
    for stem in sorted(stems):
        data = out / f"{stem}.jsonl"
        if folder.exists(out, data.name):
            meta, jobs = read_jsonl(data)
            outcome, verdict = judge(meta, jobs)
            study = _study_line(meta["study"])
            seeds = Counter(len(m) for m in _groups(meta, jobs).values())
            seeds = "–" if not seeds else str(min(seeds)) if len(seeds) == 1 else f"{min(seeds)}-{max(seeds)}"
        else:
            study, outcome, verdict, seeds = _study_line(sweep_study(stem)), "none", "Not measured yet.", "–"
        rows.append({"name": stem, **study, "answer": verdict, "agrees": OUTCOMES[outcome], "seeds": seeds})
    return sorted(rows, key=_exercise_key)


def render_index(out: Path) -> str:
    rows = index_rows(out)
    named = {x for r in rows for x in r["exercises"]}
    return ENV.get_template("findings_index.md.j2").render(
        rows=rows, missing=[x for x in EXERCISES if x not in named and x != PROOF], proof=PROOF, proof_test=PROOF_TEST)
