"""Findings pages: docs/findings/<sweep>.md, its figure and its data, one page per sweep, and the index.

`python -m blocklab.report SWEEP_DIR --findings docs/findings` writes, per study in the folder:
  <sweep>.jsonl   a header line (the setup: command, scale, seeds, model size, steps, machines, summed training
                  time, the commit and date of generation, the study block) then one line per job with only the
                  fields of results.json the page uses;
  <sweep>.md      rendered ONLY from that file through templates/findings.md.j2;
  <sweep>.png     its figure, drawn from that file too.
`--rerender` renders every page (and the index, docs/findings/README.md) again from the committed files, so a page
cannot drift from its data (tests/test_findings.py fails on any difference). A sweep with no committed data gets a
page whose first line says it is not measured yet, built from its sweep file alone: no number is invented.

Everything read from a run or a sweep folder is untrusted: it reaches the Markdown only through the `md` escape
(or as a code span fenced longer than any backtick run in it), never as markup. Runs' results.json are read through
blocklab.folder; the findings folder is the user's own (--findings OUT), and is read and written through
blocklab.folder with OUT as the root, so a link planted below OUT is refused, never followed. A run still training
(its lock held) is left out.

The jsonl is written and read by findings_data.py, the claims judged by judge.py, the table of settings built by
page_tables.py; this module renders the page, its figure and the index."""
import glob
import io
import json
import re
from collections import Counter
from pathlib import Path

import jinja2
from markupsafe import Markup

from blocklab import folder, study_folder
from blocklab.errors import ConfigError
from blocklab.paths import CONF_DIR
from blocklab.report import stats
from blocklab.report.build import _direction, learning_note, metrics_spec
from blocklab.report.collect import RUNNING
from blocklab.report.common import name as setting_name, order
from blocklab.report.findings_data import (FORMAT, _planned, _results, job_record, meta_record,  # noqa: F401
                                           read_jsonl, studies_error, study_error)
from blocklab.report.claims import claims_line
from blocklab.report.judge import (KEPT, OUTCOMES, also, judge, judge_page, learned,  # noqa: F401 (judge, also: the API)
                                   rule)
from blocklab.report.judge import groups_of as _groups, keys_of as _keys, metric_of as _metric
from blocklab.report.page_tables import _against_baseline, _table, _tuned_table, at_best, tuned, verdict_metric
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
        records = [job_record(r, res, keys, metrics) for r, res in zip(members, results)]
        records.sort(key=lambda j: (tuple(order(v) for v in j["setting"].values()), order(j["seed"]), j["job"]))
        extra = _planned([str(j["setting"].get("modification")) for j in records
                          if j.get("status") == "completed"]) if "modification" in keys else {}
        meta = meta_record(name, study, members, results, extra)
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


def render_page(meta: dict, jobs: list[dict], figure: str | None, scales: list[dict] = ()) -> str:
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
        outcome=OUTCOMES[verdicts[0].outcome], figure=figure, failed=failed, diverged=diverged, settings=len(groups),
        time=f"{meta['train_time_s']:,.0f} s" + (f" ({hours:.1f} h)" if hours >= 1 else ""),
        seeds=", ".join(str(s) for s in meta["seeds"]), left_out=meta.get("left_out") or [],
        not_run=meta.get("not_run") or [], scales=list(scales), rule=rule(meta), claims_edited=claims_line(meta, jobs))


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


# ---------------------------------------------------------------- the figure
def draw(meta: dict, jobs: list[dict]) -> bytes | None:
    """The figure that answers the question, from the jsonl: the verdict's metric against length per setting
    (exact match, or loss for an LM) where the jobs were evaluated at several lengths and the metric is one beyond
    training, else each setting's mean and 95% interval. Deterministic PNG bytes (no software or date stamp)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(meta, jobs)
    groups = at_best(meta, groups, tuned(meta, groups))
    if not groups:
        return None
    keys, study = _keys(meta), meta["study"]
    verdict = study.get("verdict") if isinstance(study.get("verdict"), dict) else {}
    metric = verdict_metric(meta)
    learn = learned(groups)
    lengths = sorted({e["length"] for j in jobs for e in j["eval"] if e.get("length") is not None})
    column = "exact_match" if "exact_match" in metric else "loss" if "loss" in metric else None
    with plt.rc_context({"svg.hashsalt": "blocklab", "font.size": 9}):
        curves, split = metric.endswith("_out") or verdict.get("figure") == "by_length", None
        if curves and column and len(lengths) > 2 and not study.get("baseline"):
            # verdict.figure=by_length: one panel per value of the verdict's `where` key (zero-shot, fine-tuned...)
            split = next((k for k in verdict.get("where") or {} if k in keys), None) if not metric.endswith("_out") else None
            panels = sorted({key[keys.index(split)] for key in groups}, key=order) if split else [None]
            fig, axes = plt.subplots(1, len(panels), figsize=(9 if split is None else 6 * len(panels), 4.2), dpi=100,
                                     squeeze=False, sharey=True)
            named = [k for k in keys if k != split]
            for ax, panel in zip(axes[0], panels):
                for key, members in groups.items():
                    if split is not None and key[keys.index(split)] != panel:
                        continue
                    xs, means, lows, highs = [], [], [], []
                    for n in lengths:
                        values = stats.finite([e.get(column) for j in members for e in j["eval"] if e.get("length") == n])
                        if values:
                            xs.append(n), means.append(sum(values) / len(values)), lows.append(min(values)), highs.append(max(values))
                    not_learned = key in learn and not learn[key].learned
                    shown = tuple(v for k, v in zip(keys, key) if k != split)
                    label = (setting_name(named, shown) or "all runs") + (" (not learned)" if not_learned else "")
                    line, = ax.plot(xs, means, marker="o", markersize=3, linestyle="--" if not_learned else "-", label=label)
                    ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.15, linewidth=0)
                trained = [e["length"] for j in jobs for e in j["eval"] if e.get("in_distribution")]
                if trained:
                    ax.axvline(max(trained), color="grey", linewidth=0.8, linestyle=":")
                ax.set_xlabel("length (dotted: longest trained)")
                ax.legend(fontsize=7, ncol=2)
                if split is not None:
                    ax.set_title(f"{meta['sweep']}: {setting_name([split], (panel,))}", fontsize=9)
                    ax.grid(alpha=0.3)
            axes[0][0].set_ylabel(f"{column}, mean over seeds (band: seed range)")
        else:
            estimates = [(setting_name(keys, k) or "all runs", stats.estimate([_metric(j, metric) for j in m]))
                         for k, m in groups.items()]
            estimates = [(label, e) for label, e in estimates if e is not None]
            if not estimates:
                return None
            estimates.sort(key=lambda le: le[1].mean, reverse=_direction(metric) is False)
            against = verdict.get("against")  # a second panel: the metric against this one (memory, state)
            state = isinstance(against, str) and any(_metric(j, against) is not None for m in groups.values() for j in m)
            fig, axes = plt.subplots(1, 2 if state else 1, figsize=(14 if state else 9, max(3.4, 1.6 + 0.28 * len(estimates)) if state else 1.2 + 0.28 * len(estimates)),
                                     dpi=100, squeeze=False, width_ratios=[3, 2] if state else None)
            ax = axes[0][0]
            if state:
                _against(axes[0][1], keys, groups, metric, against)
            ys = range(len(estimates))
            for y, (label, e) in zip(ys, estimates):
                if e.has_interval:
                    ax.plot([e.low, e.high], [y, y], color="C0", linewidth=2, alpha=0.5)
                ax.plot(e.values, [y] * e.n, "|", color="C0", markersize=7)
                ax.plot([e.mean], [y], "o", color="C1", markersize=4)
            ax.set_yticks(list(ys), [label for label, _ in estimates], fontsize=7)
            ax.set_xlabel(f"{metric}: mean (dot), 95% interval (bar), seeds (ticks)")
        if split is None:
            ax.set_title(meta["sweep"], fontsize=9)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None})
        plt.close(fig)
    return buf.getvalue()


def _against(ax, keys: list[str], groups, metric: str, x_metric: str) -> None:
    """The metric against another per setting (study.verdict.against; log scale), e.g. against the decoding state
    or cache each setting needs: the recall-memory trade-off as Zoology (Arora et al. 2024, fig. 2) and Based draw
    it. One point per setting, a hollow marker where it did not learn."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    learn = learned(groups)
    for i, (key, members) in enumerate(groups.items()):
        e, x = stats.estimate([_metric(j, metric) for j in members]), stats.estimate([_metric(j, x_metric) for j in members])
        if e is None or x is None:
            continue
        ok = key not in learn or learn[key].learned
        ax.plot([x.mean], [e.mean], "osD^v<>ph*"[i % 10], color=f"C{i % 10}", markersize=6,
                fillstyle="full" if ok else "none", label=setting_name(keys, key) or "all runs")
    ax.set_xscale("log", base=2)  # ticks at powers of two: 16, 32, 64 KiB...
    if "bytes" in x_metric:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1024:g} KiB" if v >= 1024 else f"{v:g} B"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(f"{x_metric} (log)")
    ax.set_ylabel(f"{metric} (hollow: not learned)")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(alpha=0.3)


# ---------------------------------------------------------------- writing and re-rendering
def write_page(data: Path) -> list[Path]:
    """The page and figure of one findings file, beside it (through blocklab.folder, its folder the root)."""
    meta, jobs = read_jsonl(data)
    png = draw(meta, jobs)
    written = []
    figure = None
    if png is not None:
        written.append(folder.write_bytes(data.parent, data.with_suffix(".png").name, png))
        figure = written[0].name
    page = folder.write_text(data.parent, data.with_suffix(".md").name,
                             render_page(meta, jobs, figure, other_scales(data, meta)))
    return [data, page, *written]


def page_text(data: Path) -> str:
    """A measured page as its data renders it now, with the figure already beside it (if any)."""
    meta, jobs = read_jsonl(data)
    figure = data.with_suffix(".png").name if folder.exists(data.parent, data.with_suffix(".png").name) else None
    return render_page(meta, jobs, figure, other_scales(data, meta))


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
        png, name = draw(meta, jobs), data.with_suffix(".png").name
        if png is not None and _differs(out, name, png):
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
