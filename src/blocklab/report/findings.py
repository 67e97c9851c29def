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

The jsonl is written and read by findings_data.py, the claims judged by judge.py (whether a setting learned:
learned.py, against the levels its task states), the table of settings built by page_tables.py, the page's words
written by page_text.py and the index by findings_index.py; this module writes them and draws the figure."""
import io
import json
import re
from pathlib import Path

from blocklab import folder
from blocklab.errors import ConfigError
from blocklab.report import stats
from blocklab.report.build import _direction, metrics_spec
from blocklab.report.collect import RUNNING
from blocklab.report.common import name as setting_name, order
from blocklab.report.findings_data import (FORMAT, _planned, _results, job_record, meta_record,  # noqa: F401
                                           read_jsonl, studies_error, study_error)
from blocklab.report.findings_index import (ANSWER_LIMIT, EXERCISES, PROOF, PROOF_TEST, index_rows,  # noqa: F401
                                            render_index, sweep_names, write_index as _write_index)
from blocklab.report.judge import AGREES, KEPT, OUTCOMES, also, judge, judge_page, learned  # noqa: F401 (the API)
from blocklab.report.judge import groups_of as _groups, keys_of as _keys, metric_of as _metric
from blocklab.report.markdown import ENV, code, md  # noqa: F401
from blocklab.report.page_tables import at_best, tuned, verdict_metric
from blocklab.report.page_text import (SWEEPS, other_scales, page_text, render_page,  # noqa: F401
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
    path = _write_index(out)
    for name in sweep_names():  # a sweep without its page gets the unmeasured one
        if not folder.exists(out, f"{name}.md"):
            folder.write_text(out, f"{name}.md", render_unmeasured(name))
    return path
