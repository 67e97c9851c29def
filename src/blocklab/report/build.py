"""A sweep's report: per study, its question and budget, a table of the study's own metrics (mean over seeds and
95% bootstrap interval), findings computed from the numbers (among the settings that learned, a winner only where
the paired difference by seed clears Holm's correction), a
summary table in the layout of Narang et al. 2021, the length tables, the sweep's plots with seed bands, and one
self-contained HTML page (images inlined, opens offline). Every column goes to summary.csv.

The plots are report/figures.py's (the findings pages draw the same kinds from their jsonl); the sentences are
report/section_text.py's. Every file is written through blocklab.folder (report.output.Out): SWEEP/report, or the
folder --out names."""
import csv
import difflib
import hashlib
import io
import re
from collections import defaultdict
from pathlib import Path

from blocklab.errors import ConfigError
from blocklab.report import benches, length_gen, render, stats, tables
from blocklab.report.collect import METRICS, RUNNING
from blocklab.report.common import group, keys as _keys
from blocklab.report.figures import PLOTS, check_plots, drawn, plot  # noqa: F401 (the report's plot API)
from blocklab.report.figures_cost import CONTEXT, bench_context
from blocklab.report.figures_data import direction as _direction, value as _value  # noqa: F401 (callers' names)
from blocklab.report.output import Out
from blocklab.report.render import Figure, Items, Para, Table, para  # noqa: F401
from blocklab.report.section_text import (Finding, Learning, _swept, budget, findings, judged,  # noqa: F401
                                          learning, learning_note, machine_caveat, speed_caveat)
from blocklab.schema import Keys

# What a study without `study.metrics` is judged on (those its runs record).
DEFAULT_METRICS = ("final_val_loss", "exact_match_in", "exact_match_out")
CSV_SKIP = {"eval", "layers_init", "layers_end", "overrides", "references"}


def metrics_spec(value, rows: list[dict] = ()) -> list[str]:
    """The study's metrics (`study.metrics`): report columns (collect.METRICS) or results.json fields by dotted
    path. Without the key: the losses and exact match its runs record. Raises ConfigError, one line per problem."""
    if value is None:
        present = [m for m in DEFAULT_METRICS if any(r.get(m) is not None for r in rows)]
        return present or list(DEFAULT_METRICS[:1])
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"study.metrics={value!r} must be a non-empty list of result columns, e.g. "
                          "[exact_match_in, final_val_loss]")
    errors = []
    for name in value:
        if not isinstance(name, str) or not (name in METRICS or "." in name):
            close = difflib.get_close_matches(str(name), METRICS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            errors.append(f"study.metrics: {name!r} is not a report column; {hint}use one of {', '.join(METRICS)}, "
                          "or a results.json field by dotted path (costs.decode_state_bytes)")
    if errors:
        raise ConfigError("\n".join(errors))
    return list(value)



def csv_text(rows: list[dict]) -> str:
    """Every column of every run, as summary.csv holds it."""
    columns = sorted({k for r in rows for k in r if k not in CSV_SKIP})
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k) for k in columns})
    return text.getvalue()


def write_csv(rows: list[dict], out: "Out | Path") -> Path:
    """summary.csv in the report folder `out`, built in memory, then written through blocklab.folder."""
    out = Out.of(out)
    return out.write_text("summary.csv", csv_text(rows))


def pooled(done: list[dict], compare: list[str]) -> list[str]:
    """Swept keys (seed aside) whose value differs between runs of one setting of `compare`: runs the study's
    comparison would pool as if they were seeds of one config (a relaunch with `model.n_layers=3,4` into the
    study's folder, say). The report treats each of their values as a setting of its own."""
    settings = group(done, compare)
    return [key for key in _swept(done) if key != "seed" and key not in compare
            and any(len({str(r.get("overrides", {}).get(key)) for r in members}) > 1 for members in settings.values())]


def _with_keys(by, extra: list[str]) -> list[str]:
    return [*_keys(by), *(k for k in extra if k not in _keys(by))]


def _per_task(rows: list[dict], compare: list[str]) -> list[tuple[str, list[dict], list[str]]]:
    """Losses of different tasks do not compare: a sweep over tasks is judged within each task."""
    tasks = sorted({str(r.get("task")) for r in rows})
    if "task" not in compare or len(tasks) < 2:
        return [("", rows, compare)]
    keys = [k for k in compare if k != "task"]
    return [(f"task={t}: ", [r for r in rows if str(r.get("task")) == t], keys) for t in tasks]


def file_stem(text: str) -> str:
    """A name from the folder (a study, a metric) as one safe file name part: `a/b` must not become a folder."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", text).lstrip(".") or "_"
    return safe if safe == text else f"{safe}-{hashlib.sha1(text.encode()).hexdigest()[:6]}"


def section_data(name: str, spec: dict, rows: list[dict], out: "Out | Path", context: dict | None = None
                 ) -> render.Section:
    """A study's section, the answer first: the question; whether every setting learned its task (before any
    conclusion about one); what the numbers show and the figures that carry it; then the setup and the tables
    the findings are read from; failed runs, and runs still training, last. Figures go to `out`; `context`: what
    a plot kind reads beside the runs (figures.figure)."""
    out = Out.of(out)
    done = [r for r in rows if r["status"] in ("completed", "diverged")]
    running = [r for r in rows if r["status"] == RUNNING]
    failed = [r for r in rows if r["status"] == "failed"]
    invalid = [r for r in rows if r["status"] == "invalid"]
    compare = _keys(spec.get("compare", []))
    extra = pooled(done, compare)
    compare = [*compare, *extra]
    length_table = length_gen.table_spec(spec.get("length_table"))  # a bad spec fails before anything is drawn
    metrics = metrics_spec(spec.get("metrics"), done)
    threshold = (length_table or length_gen.DEFAULTS)["threshold"]
    answer, setup, tables_, failures = [], [], [], []
    question = spec.get("question")
    head = [Para("Question.", (str(question if question is not None else ""),), "question")]
    swept = "; ".join(f"{k} ∈ {{{', '.join(v)}}}" for k, v in _swept(done).items())
    task = sorted({str(r.get("task.name")) for r in done})
    still = f", {len(running)} still running" if running else ""
    setup.append(para("Setup.", f"{len(rows)} runs ({len(done)} finished, {len(failed)} failed, {len(invalid)} "
                                f"invalid configurations not run{still}); task {', '.join(task)}; swept: "
                                f"{swept or '–'}."))
    if extra:
        setup.append(para("Also varied.", f"Runs of one {', '.join(_keys(spec.get('compare', []))) or 'setting'} "
                                          f"differ in {', '.join(extra)}, which the study does not compare: each "
                                          "value is a setting of its own below, in the tables and the plots, not "
                                          "pooled as seeds."))
    if done:
        setup.append(para("Budget.", budget(done, compare)))
        per_task = _per_task(done, compare)
        learned = {prefix: learning(group(subset, keys)) for prefix, subset, keys in per_task}
        head += filter(None, [learning_note(prefix, keys, learned[prefix]) for prefix, _, keys in per_task])
        figures, notes = [], []
        for i, spec_plot in enumerate(spec.get("plots") or []):
            path = Path(f"{file_stem(name)}_{i}_{file_stem(str(spec_plot['metric']))}.png")
            if extra:
                spec_plot = {**spec_plot, "by": [k for k in _with_keys(spec_plot.get("by", []), extra)
                                                  if k != spec_plot.get("x")]}
            note, png = drawn(done, spec_plot, context)
            out.write_bytes(path.name, png)
            notes.append(note)
            figures.append(Figure(render.png_uri(png), path.stem, path.name))
        shown = []
        for prefix, subset, keys in per_task:
            for metric in metrics:
                shown += [Finding(prefix + f.text, f.details) for f in judged(subset, keys, metric, learned[prefix])]
            shown += [Finding(prefix + n) for n in length_gen.degenerate_notes(subset, threshold=threshold)]
        shown += [Finding(n) for n in dict.fromkeys(notes) if n]
        shown += [Finding(caveat) for caveat in (speed_caveat(done), machine_caveat(done)) if caveat]
        if any(r["diverged"] for r in done):
            shown.append(Finding(f"{sum(int(r['diverged']) for r in done)} of {len(done)} runs diverged."))
        answer.append(para("What the numbers show.", "Per metric, the best setting against every other, paired by "
                           "seed (seed s fixes the data order of every setting): the mean per-seed difference with its "
                           "paired t-interval at the Holm level over that metric's comparisons, and the Holm-adjusted "
                           "p. A winner is named only where Holm rejects \"no difference\"."))
        answer += [Items(shown), *figures]
        tables_.append(para("Results", f"on the study's metrics ({', '.join(metrics)}): the mean over each "
                            "setting's seeds and its 95% bootstrap confidence interval (scipy.stats.bootstrap, "
                            "percentile, each setting resampled on its own). With 2-3 seeds the interval spans about "
                            "the seeds' range: it shows how far the seeds fell apart, not where more seeds would "
                            "settle."))
        marks = {key: (e.learned_seeds, e.measured, e.learned) for key, e in learning(group(done, compare)).items()}
        tables_.append(Table(*tables.metrics_table(group(done, compare), compare, metrics, _value, marks,
                                                   "learned (seeds that clear their task's bar)"),
                             "metrics"))
        tables_.append(para("Summary", "in the layout of Narang et al. 2021: costs, the training loss early on (the "
                            "mean over the steps logged around that point), the final validation loss and exact "
                            "match (mean [95% CI] over seeds). FLOPs: one forward pass per input token, as counted "
                            "by torch on a training batch."))
        header, body, missing = tables.summary_table(group(done, compare), compare)
        tables_.append(Table(header, body, "summary"))
        if missing:
            tables_.append(para("", f"Not recorded by these runs, so not shown: {', '.join(missing)} (runs whose "
                                "results.json predates train_loss_curve and costs.forward_flops_per_token, or a "
                                "task without exact match)."))
        if length_table:
            keys = _with_keys(length_table["by"], extra) if "by" in length_table else compare  # by: [] is one row
            lead, text, header, body = length_gen.length_table(group(done, keys), keys, length_table)
            tables_ += [para(lead, text), Table(header, body, "length-gen")]
        for prefix, subset, keys in per_task:
            reach = length_gen.reach_table(group(subset, keys), keys, threshold=threshold)
            if reach:
                lead, text, header, body = reach
                tables_ += [para(prefix + lead, text), Table(header, body, "reach")]
    for title, runs in (("Failed runs.", failed), ("Invalid configurations (not run).", invalid),
                        ("Still running (their lock is held: not read; report again when they finish).", running)):
        if runs:
            failures += [para(title), Items([Path(r["run"]).name + ("" if r["status"] == RUNNING else
                                                                    f": {r.get('error')}") for r in runs])]
    return render.Section(name, name, [*head, *answer, *setup, *tables_, *failures])


def section(name: str, spec: dict, rows: list[dict], out: "Out | Path") -> str:
    """A study's section as HTML (see section_data)."""
    return render.section(section_data(name, spec, rows, out))


def build_report(root: Path, rows: list[dict], specs: dict[str, dict], bench_files: list[Path] = (),
                 out: Out | None = None) -> Path:
    """The report of the sweep folder `root`, written to `out` (default: root/report, checked from root);
    bench_files: JSON files `python -m blocklab.bench --out` wrote, searched first for the studies' `bench`."""
    out = out or Out.for_sweep(root)
    by_study = defaultdict(list)
    for row in rows:
        by_study[row.get("study") or "runs"].append(row)
    for name, spec in specs.items():  # every study's specs are checked before any file is written
        errors = [e for key in ("compare",) if key in spec and (e := Keys().error(f"study.{key}", spec[key]))]
        errors += [f"study.{key}={spec[key]!r} must be text" for key in ("question",)
                   if spec.get(key) is not None and not isinstance(spec[key], (str, int, float))]
        if errors:
            raise ConfigError("\n".join(errors))
        length_gen.table_spec(spec.get("length_table"))
        metrics_spec(spec.get("metrics"), by_study.get(name, []))
        check_plots(spec)
        bad = [b for b in benches.names(spec.get("bench")) if b not in benches.BENCH_SECTIONS]
        if bad:
            raise ConfigError("\n".join(benches.BENCH_SECTIONS.unknown(b) for b in bad))
    wanted = dict.fromkeys(b for name in sorted(specs) for b in benches.names(specs[name].get("bench")))
    found = {bench: benches.load(bench, root, list(bench_files)) for bench in wanted}  # unreadable: fails here
    out.check()  # a link planted at the report folder or its files: one line, nothing written
    out.make()
    write_csv(rows, out)
    context = {CONTEXT: bench_context((found.get("attention") or {}).get("benchmarks", {}).get("attention"))}
    sections = [section_data(name, specs.get(name, {}), members, out, context)
                for name, members in sorted(by_study.items())]
    # a study that weighs quality against cost: the side-by-side benchmark beside it
    sections += [benches.section_data(bench, found[bench], out) for bench in wanted]
    intro = (f"{len(rows)} runs from {root}. The answer comes first in each section: whether every setting learned "
             "its task, what the numbers show and the figures that carry it; then the tables they are read from. "
             "Tables give the mean over seeds with its 95% bootstrap confidence interval (or ± the standard "
             "deviation where marked); every column of every run is in summary.csv.")
    page = render.page(f"BlockLab report: {root.name}", intro, sections)
    return out.write_text("index.html", page)
