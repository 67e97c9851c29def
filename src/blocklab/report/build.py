"""Tables (mean ± std over seeds), the canonical plot of each exercise, findings computed from the
numbers, and one self-contained HTML page (images inlined, opens offline)."""
import base64
import csv
import html
import json
import math
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from blocklab.registry import Registry  # noqa: E402
from blocklab.report import length_gen  # noqa: E402
from blocklab.report.attention_costs import BENCH_JSON, attention_costs_section  # noqa: E402
from blocklab.report.collect import HIGHER_IS_BETTER, LOWER_IS_BETTER  # noqa: E402
from blocklab.results import RESULTS_FILE  # noqa: E402

TABLE_METRICS = ["final_val_loss", "final_train_loss", "exact_match_in", "exact_match_out", "params",
                 "tokens_per_s", "diverged", "steps_to_target_loss", "kv_cache_bytes_per_token",
                 "decode_tokens_per_s", "head_similarity", "ffn_sparsity"]
CSV_SKIP = {"eval", "layers_init", "layers_end", "overrides"}


def _keys(spec_by) -> list[str]:
    return [spec_by] if isinstance(spec_by, str) else list(spec_by)


def _label(row: dict, keys: list[str]) -> str:
    return ", ".join(f"{k}={row.get(k)}" for k in keys)


def mean_std(values: list) -> tuple[float | None, float | None, int]:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return None, None, 0
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std, len(values)


def group(rows: list[dict], keys: list[str]) -> dict[tuple, list[dict]]:
    groups = defaultdict(list)
    for row in rows:
        groups[tuple(row.get(k) for k in keys)].append(row)
    return dict(sorted(groups.items(), key=lambda kv: tuple(_order(v) for v in kv[0])))


def _order(value) -> tuple:
    """Numbers in numeric order (2 before 16), then everything else by name."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value, "")
    return (1, 0, str(value))


def _fmt(mean, std, n) -> str:
    if mean is None:
        return "–"
    digits = 0 if abs(mean) >= 1000 else 3
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if n > 1 else "")


def table(rows: list[dict], compare: list[str]) -> tuple[list[str], list[list[str]]]:
    metrics = [m for m in TABLE_METRICS if any(r.get(m) is not None for r in rows)]
    header = [*compare, "runs", *metrics]
    body = []
    for key, members in group(rows, compare).items():
        cells = [str(v) for v in key] + [str(len(members))]
        cells += [_fmt(*mean_std([m.get(metric) for m in members])) for metric in metrics]
        body.append(cells)
    return header, body


def findings(rows: list[dict], compare: list[str], metric: str) -> str:
    """Best and worst setting for a metric, with the spread over seeds, from the data."""
    stats = [(key, *mean_std([m.get(metric) for m in members])) for key, members in group(rows, compare).items()]
    stats = [s for s in stats if s[1] is not None]
    if len(stats) < 2:
        return ""
    ordered = sorted(stats, key=lambda s: s[1])
    if metric in HIGHER_IS_BETTER:
        ordered.reverse()
    best, worst = ordered[0], ordered[-1]
    name = lambda s: ", ".join(f"{k}={v}" for k, v in zip(compare, s[0]))  # noqa: E731
    if metric in HIGHER_IS_BETTER | LOWER_IS_BETTER:
        words = ("best", "worst")
    else:
        words = ("lowest", "highest")
    gap = abs(best[1] - worst[1])
    text = f"{metric}: {words[0]} {name(best)} ({_fmt(*best[1:])}), {words[1]} {name(worst)} ({_fmt(*worst[1:])})"
    if best[3] < 2 or worst[3] < 2:
        return f"{text}; one run each, so the seed spread is unknown (add seeds to judge the gap of {gap:.3g})."
    noise = max(best[2], worst[2])
    verdict = "larger than" if gap > 2 * noise else "within"
    return f"{text}; the gap ({gap:.3g}) is {verdict} twice the seed spread ({noise:.3g})."


def _select(rows, where: dict | None):
    return [r for r in rows if all(str(r.get(k)) == str(v) for k, v in (where or {}).items())]


PLOTS: Registry = Registry("study.plots[].kind")


@PLOTS.register("by_length")
def plot_by_length(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """The metric against evaluation length, one line per setting; dashed: the longest trained length."""
    for key, members in group(rows, by).items():
        lengths = sorted({e["length"] for m in members for e in m["eval"]})
        means = [mean_std([e[metric] for m in members for e in m["eval"] if e["length"] == n])[0] for n in lengths]
        ax.plot(lengths, means, marker="o", label=_label(dict(zip(by, key)), by))
    train_max = max(r["train_max_length"] for r in rows)
    ax.axvline(train_max, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("length (dashed: longest trained)")
    _legend(ax)
    return findings(rows, by, "exact_match_out" if metric == "exact_match" else "loss_out")


@PLOTS.register("length_curve")
def plot_length_curve(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """The metric against evaluation length per setting: the mean over seeds, the seed range (min to max)
    shaded; dashed: the longest trained length. The note names the widest seed range beyond training."""
    curves = [(_label(dict(zip(by, key)), by) or metric, length_gen.curve(members, metric))
              for key, members in group(rows, by).items()]
    note = length_gen.draw(ax, curves, sorted({r["train_max_length"] for r in rows}), metric)
    _legend(ax)
    return note


@PLOTS.register("by_choice")
def plot_by_choice(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """The metric against a numeric choice `x` (log2 axis), one line per setting."""
    for key, members in group(rows, by).items():
        xs = sorted({m.get(spec["x"]) for m in members})
        ys = [mean_std([m.get(metric) for m in members if m.get(spec["x"]) == x])[0] for x in xs]
        ax.plot(xs, ys, marker="o", label=_label(dict(zip(by, key)), by) or metric)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(spec["x"])
    _legend(ax)
    return None


@PLOTS.register("by_layer")
def plot_by_layer(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """A per-layer diagnostic (at init or at the end, `when`), one line per setting and depth."""
    when = spec.get("when", "init")
    for key, members in group(rows, by + ["model.n_layers"]).items():
        series = [m[f"layers_{when}"].get(metric) for m in members if m.get(f"layers_{when}")]
        series = [s for s in series if s and None not in s]
        if not series:
            continue
        ys = [sum(values) / len(values) for values in zip(*series)]
        ax.plot(range(len(ys)), ys, label=_label(dict(zip(by + ["model.n_layers"], key)), by + ["model.n_layers"]))
    ax.set_yscale("log")
    ax.set_xlabel(f"layer (at {when})")
    _legend(ax)
    return None


@PLOTS.register("bar")
def plot_bar(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """Mean and seed spread of the metric per setting."""
    groups = group(rows, by)
    stats = [mean_std([m.get(metric) for m in members]) for members in groups.values()]
    ax.bar(range(len(stats)), [s[0] or 0 for s in stats], yerr=[s[1] or 0 for s in stats], capsize=3)
    ax.set_xticks(range(len(stats)), [_label(dict(zip(by, k)), by) for k in groups], rotation=30, ha="right",
                  fontsize=7)
    return findings(rows, by, metric)


@PLOTS.register("tradeoff")
def plot_tradeoff(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """Quality (`metric`, y) against a cost (`x`), one point per setting at the seed means, seed spread as error
    bars both ways. `x` (and `metric`) is a report column or a results.json field by dotted path
    (costs.decode_state_bytes). The note names the settings no other beats on both axes (the Pareto front)."""
    x = spec["x"]
    points = []
    for key, members in group(rows, by).items():
        (mx, sx, nx), (my, sy, ny) = (mean_std([_value(m, name) for m in members]) for name in (x, metric))
        if mx is not None and my is not None:
            points.append((_label(dict(zip(by, key)), by), mx, sx, my, sy, min(nx, ny)))
    for label, mx, sx, my, sy, _ in points:
        ax.errorbar(mx, my, xerr=sx, yerr=sy, marker="o", capsize=3, label=label)
    xs = [p[1] for p in points]
    if xs and min(xs) > 0 and max(xs) > 10 * min(xs):  # bytes and speeds span orders of magnitude
        ax.set_xscale("log")
    ax.set_xlabel(f"{x} ({'higher' if _higher(x) else 'lower'} is cheaper)")
    _legend(ax)
    if len(points) < 2:
        return None

    def beats(a, b):  # a at least as good as b on both axes and better on one
        ge = [(a[i] >= b[i]) if _higher(name) else (a[i] <= b[i]) for i, name in ((1, x), (3, metric))]
        return all(ge) and (a[1], a[3]) != (b[1], b[3])

    front = [p for p in points if not any(beats(q, p) for q in points)]
    listed = "; ".join(f"{p[0]}: {metric} {_fmt(p[3], p[4], p[5])} at {x} {_fmt(p[1], p[2], p[5])}" for p in points)
    return (f"{metric} against {x} (mean ± std over seeds): {listed}. "
            f"Not beaten on both: {', '.join(p[0] for p in front)}.")


def _higher(name: str) -> bool:
    """Whether more is better: quality scores and speeds; losses, bytes and times are better lower."""
    name = name.split(".")[-1]
    return name in HIGHER_IS_BETTER or name.endswith("_per_s")


def _value(row: dict, name: str):
    """A report column, or else a results.json field of the row's run by dotted path."""
    if name in row:
        return row[name]
    value = _results(row["run"])
    for part in name.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


@lru_cache(maxsize=4096)
def _results(run: str) -> dict:
    path = Path(run) / RESULTS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, ncol=2)


def plot(rows: list[dict], spec: dict, path: Path) -> str | None:
    """Draw one canonical plot; returns a sentence of what it shows, computed from the data."""
    kind, metric, by = spec["kind"], spec["metric"], _keys(spec.get("by", []))
    rows = _select(rows, spec.get("where"))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    note = PLOTS[kind](ax, rows, spec, metric, by)
    where = ", ".join(f"{k}={v}" for k, v in (spec.get("where") or {}).items())  # which runs a plot shows
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} ({kind.replace('_', ' ')}{', ' + where if where else ''})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"{where}: {note}" if note and where else note


def write_csv(rows: list[dict], path: Path) -> None:
    columns = sorted({k for r in rows for k in r if k not in CSV_SKIP})
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in columns})


def _swept(rows: list[dict]) -> dict[str, list]:
    """What the sweep varied: the command-line overrides that take more than one value across the runs."""
    keys = sorted({k for r in rows for k in r.get("overrides", {})})
    varied = {}
    for k in keys:
        values = sorted({r["overrides"].get(k, "–") for r in rows}, key=lambda v: _order(_number(v)))
        if len(values) > 1:
            varied[k] = values
    return varied


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def _per_task(rows: list[dict], compare: list[str]) -> list[tuple[str, list[dict], list[str]]]:
    """Losses of different tasks do not compare: a sweep over tasks is judged within each task."""
    tasks = sorted({str(r.get("task")) for r in rows})
    if "task" not in compare or len(tasks) < 2:
        return [("", rows, compare)]
    keys = [k for k in compare if k != "task"]
    return [(f"task={t}: ", [r for r in rows if str(r.get("task")) == t], keys) for t in tasks]


def section(name: str, spec: dict, rows: list[dict], out: Path) -> str:
    done = [r for r in rows if r["status"] in ("completed", "diverged")]
    failed = [r for r in rows if r["status"] == "failed"]
    invalid = [r for r in rows if r["status"] == "invalid"]
    compare = spec.get("compare", [])
    length_table = length_gen.table_spec(spec.get("length_table"))  # a bad spec fails before anything is drawn
    parts = [f"<section id='{html.escape(name)}'><h2>{html.escape(name)}</h2>",
             f"<p class='question'><b>Question.</b> {html.escape(spec.get('question', ''))}</p>"]
    swept = "; ".join(f"{k} ∈ {{{', '.join(v)}}}" for k, v in _swept(done).items())
    task = sorted({str(r.get("task.name")) for r in done})
    steps = sorted({str(r.get("trainer.max_steps")) for r in done})
    parts.append(f"<p><b>Setup.</b> {len(rows)} runs ({len(done)} finished, {len(failed)} failed, "
                 f"{len(invalid)} invalid configurations not run); task "
                 f"{', '.join(task)}; {', '.join(steps)} training steps; swept: {html.escape(swept) or '–'}.</p>")
    if done:
        header, body = table(done, compare)
        parts.append("<div class='wide'><table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr></thead><tbody>")
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>" for cells in body]
        parts.append("</tbody></table></div>")
        if length_table:
            keys = length_table.get("by", compare)  # by: [] is one row of all runs
            parts.append(length_gen.section_html(group(done, keys), keys, length_table))
        notes = []
        for i, spec_plot in enumerate(spec.get("plots", [])):
            path = out / f"{name}_{i}_{spec_plot['metric']}.png"
            note = plot(done, spec_plot, path)
            notes.append(note)
            data = base64.b64encode(path.read_bytes()).decode()
            parts.append(f"<figure><img alt='{html.escape(path.stem)}' src='data:image/png;base64,{data}'>"
                         f"<figcaption>{html.escape(path.name)}</figcaption></figure>")
        metric = "final_val_loss" if "final_val_loss" in header else header[len(compare) + 1]
        for prefix, subset, keys in _per_task(done, compare):
            note = findings(subset, keys, metric)
            notes.append(prefix + note if note else None)
        shown = [n for n in dict.fromkeys(notes) if n]
        if any(r["diverged"] for r in done):
            shown.append(f"{sum(int(r['diverged']) for r in done)} of {len(done)} runs diverged.")
        parts.append("<p><b>What the numbers show.</b></p><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in shown)
                     + "</ul>")
    for title, runs in (("Failed runs", failed), ("Invalid configurations (not run)", invalid)):
        if runs:
            parts.append(f"<p><b>{title}.</b></p><ul>" + "".join(
                f"<li>{html.escape(Path(r['run']).name)}: {html.escape(str(r.get('error')))}</li>" for r in runs) + "</ul>")
    parts.append("</section>")
    return "\n".join(parts)


STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:13px;margin:1em 0}th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f3f3f3}figure{margin:1em 0}img{max-width:100%}.question{font-size:1.05em}section{margin-bottom:3em}
.wide{overflow-x:auto}"""


def build_report(root: Path, rows: list[dict], specs: dict[str, dict]) -> Path:
    out = root / "report"
    for spec in specs.values():  # every study's table spec is checked before any file is written
        length_gen.table_spec(spec.get("length_table"))
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "summary.csv")
    by_study = defaultdict(list)
    for row in rows:
        by_study[row.get("study") or "runs"].append(row)
    sections = [section(name, specs.get(name, {}), members, out) for name, members in sorted(by_study.items())]
    toc = "".join(f"<li><a href='#{html.escape(n)}'>{html.escape(n)}</a></li>" for n in sorted(by_study))
    if any(spec.get("bench") == "attention" for spec in specs.values()):  # a study that weighs quality against cost
        sections.append(attention_costs_section(BENCH_JSON, out) if BENCH_JSON.exists() else
                        "<section id='attention_costs'><h2>attention costs</h2><p>No cost curves yet: run "
                        f"<code>python -m blocklab.bench attention</code> (it writes {BENCH_JSON}).</p></section>")
        toc += "<li><a href='#attention_costs'>attention costs</a></li>"
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>BlockLab report: {html.escape(root.name)}</title>"
            f"<style>{STYLE}</style></head><body><h1>BlockLab report: {html.escape(root.name)}</h1>"
            f"<p>{len(rows)} runs from <code>{html.escape(str(root))}</code>. Values are mean ± std over seeds.</p>"
            f"<ul>{toc}</ul>{''.join(sections)}</body></html>")
    (out / "index.html").write_text(page, encoding="utf-8")
    return out / "index.html"
