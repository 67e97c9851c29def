"""A sweep's report: per study, its question and budget, a table of the study's own metrics (mean over seeds and
95% bootstrap interval), findings computed from the numbers (a winner only where the intervals are apart), a
summary table in the layout of Narang et al. 2021, the length tables, the canonical plots with seed bands, and one
self-contained HTML page (images inlined, opens offline). Every column goes to summary.csv.

Every file is written through blocklab.folder (report.output.Out): SWEEP/report, or the folder --out names."""
import csv
import difflib
import hashlib
import io
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from blocklab import folder  # noqa: E402
from blocklab.errors import ConfigError  # noqa: E402
from blocklab.registry import Registry  # noqa: E402
from blocklab.report import length_gen, render, stats, tables  # noqa: E402
from blocklab.report import benches, recall  # noqa: E402
from blocklab.report.activation_curves import plot_activation_functions  # noqa: E402
from blocklab.report.attention_maps import plot_attention_maps  # noqa: E402
from blocklab.report.common import band as _band, group, keys as _keys, label as _label, legend as _legend  # noqa: E402
from blocklab.report.common import WHEN, name as _name, not_recorded, order as _order, plot_errors  # noqa: E402
from blocklab.report.common import short as _short, takes  # noqa: E402
from blocklab.report.collect import HIGHER_IS_BETTER, LOWER_IS_BETTER, METRICS, RUNNING, UnreadableRun  # noqa: E402
from blocklab.report.collect import _count  # noqa: E402
from blocklab.report.output import Out  # noqa: E402
from blocklab.report.per_head import plot_per_head  # noqa: E402
from blocklab.report.spectral import plot_spectral_bounds  # noqa: E402
from blocklab.report.render import Figure, Items, Para, Table, para  # noqa: E402
from blocklab.results import LEARNED_THRESHOLD, RESULTS_FILE  # noqa: E402
from blocklab.schema import Keys, Number, Text  # noqa: E402

# What a study without `study.metrics` is judged on (those its runs record).
DEFAULT_METRICS = ("final_val_loss", "exact_match_in", "exact_match_out")
CSV_SKIP = {"eval", "layers_init", "layers_end", "overrides"}
# Settings every run of a section shares and no setting had tuned for it: the budget names them.
FIXED = ("optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.weight_decay", "task.batch_size",
         "trainer.gradient_clip_val", "model.d_model", "model.n_layers", "model.n_heads")


def mean_std(values: list) -> tuple[float | None, float | None, int]:
    e = stats.estimate(values)
    return (None, None, 0) if e is None else (e.mean, e.sd, e.n)


def _fmt(mean, std, n) -> str:
    if mean is None:
        return "–"
    digits = 0 if abs(mean) >= 1000 else 3
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if n > 1 else "")


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


def _direction(metric: str) -> bool | None:
    """True: higher is better, False: lower is better, None: neither (a diagnostic such as head similarity)."""
    name = metric.split(".")[-1]
    if name in HIGHER_IS_BETTER or name.endswith("_per_s"):
        return True
    if name in LOWER_IS_BETTER or name.endswith("_bytes"):
        return False
    return None


@dataclass
class Finding:
    """One sentence of "What the numbers show", with the comparisons it rests on as sub-items."""

    text: str
    details: list[str] = field(default_factory=list)


def findings(rows: list[dict], keys: list[str], metric: str) -> list[Finding]:
    """The setting with the best mean (the highest, for a metric with no better direction) against every other:
    its mean [95% CI], the common-language effect size CL over seed pairs, and "not distinguishable at N seeds" where the intervals
    overlap. Degenerate cases read as sentences: every run scores the same, one seed per setting, one setting."""
    estimates = [(key, stats.estimate([_value(m, metric) for m in members])) for key, members in
                 group(rows, keys).items()]
    estimates = [(key, e) for key, e in estimates if e is not None]
    if not estimates:
        return []
    values = [v for _, e in estimates for v in e.values]
    if min(values) == max(values):
        who = "every setting scores" if len(estimates) > 1 else "every run scores"
        return [Finding(f"{who} {stats.fmt(values[0])} on {metric} ({len(values)} runs): it does not tell the settings "
                        "apart.")]
    if len(estimates) == 1:
        (key, e), = estimates
        return [Finding(f"{metric}: {_name(keys, key) or 'all runs'} {stats.mean_interval(e)} over {e.n} seeds.")]
    higher = _direction(metric)
    ordered = sorted(estimates, key=lambda ke: ke[1].mean, reverse=higher is not False)
    (best_key, best), (worst_key, worst) = ordered[0], ordered[-1]
    word, low_word = ("best", "worst") if higher is not None else ("highest", "lowest")
    how = {True: "higher is better", False: "lower is better", None: "no better direction"}[higher]
    if all(e.n < 2 for _, e in estimates):
        return [Finding(f"{metric} ({how}): {word} mean {_name(keys, best_key)} ({stats.fmt(best.mean)}), {low_word} "
                        f"{_name(keys, worst_key)} ({stats.fmt(worst.mean)}); one run each, so the seed spread is "
                        "unknown and no winner is named (add seeds).")]
    better = "better" if higher is not None else "higher"
    details, apart, tied = [], [], []
    for key, e in ordered[1:]:
        if sorted(e.values) == sorted(best.values):  # the same score on every seed: one line for all of them
            tied.append(_name(keys, key))
            continue
        p = stats.common_language(best.values, e.values, higher_is_better=higher is not False)
        apart += [key] if not stats.overlap(best, e) else []
        details.append(f"{_name(keys, key)}: {stats.mean_interval(e)}; CL({word} over it) = {p:.2f}; "
                       f"{stats.verdict(best, e, better=f'the {word} is {better} (intervals apart)')}.")
    if tied:
        details.insert(0, f"{len(tied)} other setting{'s' if len(tied) > 1 else ''} score exactly as the {word} does "
                          f"on every seed ({stats.fmt(best.mean)}): {'; '.join(tied)}.")
    others, seeds, setting = len(ordered) - 1, f"{best.n} seed{'s' if best.n > 1 else ''}", _name(keys, best_key)
    mean = stats.mean_interval(best)
    if not apart:
        text = (f"{metric} ({how}): not distinguishable at {seeds}: the {word} mean, {setting} {mean}, overlaps "
                "every other setting's 95% interval, so no winner is named.")
    elif len(apart) == others:
        text = (f"{metric} ({how}): {setting} is {word}, {mean} (mean [95% CI] over {seeds}); its interval is "
                "apart from every other setting's.")
    else:
        text = (f"{metric} ({how}): {word} mean {setting} {mean} over {seeds}; {better} than {len(apart)} of "
                f"{others} other settings (intervals apart), not distinguishable from the rest at {seeds}.")
    return [Finding(text, details)]


def _select(rows, where: dict | None):
    return [r for r in rows if all(str(r.get(k)) == str(v) for k, v in (where or {}).items())]


PLOTS: Registry = Registry("study.plots[].kind")
PLOTS.register("attention_maps")(plot_attention_maps)  # its own module: a figure of saved heatmaps
PLOTS.register("spectral_bounds")(plot_spectral_bounds)  # ||A||_2 per layer against seed 000's bounds
PLOTS.register("per_head")(plot_per_head)  # every head's entropy or distance
PLOTS.register("activation_functions")(plot_activation_functions)  # the registry's activations and derivatives
PLOTS.register("recall_memory")(recall.plot_recall_memory)  # best over lrs against the decoding state
PLOTS.register("lr_range")(recall.plot_lr_range)  # score per lr, best and working range per setting


@PLOTS.register("length_curve")
def plot_length_curve(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """The metric against evaluation length per setting: the mean over seeds, the seed range (min to max)
    shaded; dashed: the longest trained length. The note names the widest seed range beyond training."""
    groups = group(rows, by)
    curves = [(_label(key) or metric, length_gen.curve(members, metric)) for key, members in groups.items()]
    names = [_name(by, key) or metric for key in groups]
    note = length_gen.draw(ax, curves, sorted({r["train_max_length"] for r in rows}), metric, names)
    _legend(ax, by)
    return note


@PLOTS.register("by_position")
@takes(at=Number(0, low_open=True))
def plot_by_position(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """Token accuracy against the place in the answer at `at` x the longest training length (default 2), per
    setting: the mean over seeds, the seed range shaded; dashed: the longest trained answer. It shows where
    extrapolation breaks. The note names each setting's weakest place."""
    at = spec.get("at", 2)
    lengths = sorted({length_gen._whole(at * r["train_max_length"]) for r in rows})
    if len(lengths) > 1:  # places at different lengths do not line up
        ax.text(0.5, 0.5, "runs trained to different lengths", ha="center", va="center", transform=ax.transAxes)
        return (f"not drawn: the runs trained to different lengths, so {at:g}x is {lengths}; add a `where` that "
                "picks one training length.")
    drawn, weakest = False, []
    for key, members in group(rows, by).items():
        c = length_gen.position_curve(members, lengths[0])
        if not c.lengths:
            continue
        (line,) = ax.plot(c.lengths, c.mean, marker=".", label=_label(key) or "token_acc")
        _band(ax, c.lengths, c.low, c.high, line)
        low = min(range(len(c.mean)), key=c.mean.__getitem__)
        weakest.append(f"{_name(by, key) or 'token_acc'}: lowest at place {c.lengths[low]} ({c.mean[low]:.2f})")
        drawn = True
    if not drawn:
        return not_recorded(ax, f"token_acc_by_position at length {lengths[0]}")
    ax.axvline(max(r["train_max_length"] for r in rows), color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel(f"place in the answer at length {lengths[0]} ({at:g}x; dashed: longest trained)")
    ax.set_ylabel("token acc (teacher-forced)")
    _legend(ax, by)
    return f"token accuracy by place in the answer at length {lengths[0]}, mean over seeds; " + "; ".join(weakest) + "."


@PLOTS.register("by_length")
def plot_by_length(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """The length curve under the name the position-scheme sweeps use."""
    return plot_length_curve(ax, rows, spec, metric, by)


@PLOTS.register("by_choice")
@takes(required=("x",), x=Text())
def plot_by_choice(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """The metric against a numeric choice `x` (log2 axis), one line per setting: the mean over seeds, the seed
    range shaded. `metric` (and `x`) is a report column or a results.json field by dotted path."""
    drawn = False
    for key, members in group(rows, by).items():
        points = [(_value(m, spec["x"]), _value(m, metric)) for m in members]  # each run's fields read once
        xs = sorted(set(stats.finite(x for x, _ in points)))  # a dotted results.json field may hold anything
        per_x = [stats.finite([y for px, y in points if px == x]) for x in xs]
        xs, per_x = [x for x, v in zip(xs, per_x) if v], [v for v in per_x if v]
        if not xs:
            continue
        (line,) = ax.plot(xs, [sum(v) / len(v) for v in per_x], marker="o", label=_label(key) or metric)
        _band(ax, xs, [min(v) for v in per_x], [max(v) for v in per_x], line)
        drawn = True
    if not drawn:
        return not_recorded(ax, metric)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{spec['x']} (shaded: min to max over seeds)")
    _legend(ax, by)
    return None


@PLOTS.register("by_layer")
@takes(when=WHEN)
def plot_by_layer(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """A per-layer diagnostic (at init or at the end, `when`), one line per setting and depth: the mean over
    seeds, the seed range shaded."""
    when, keys = spec.get("when", "init"), by + ["model.n_layers"]
    drawn = []
    for key, members in group(rows, keys).items():
        series = [m[f"layers_{when}"].get(metric) for m in members if m.get(f"layers_{when}")]
        series = [s for s in series if s and None not in s]
        if not series:
            continue
        per_layer = list(zip(*series))
        (line,) = ax.plot(range(len(per_layer)), [sum(v) / len(v) for v in per_layer], label=_label(key))
        _band(ax, range(len(per_layer)), [min(v) for v in per_layer], [max(v) for v in per_layer], line)
        drawn += [x for v in per_layer for x in v]
    if not drawn:
        return not_recorded(ax, f"{metric} at {when}")
    if min(drawn) > 0:  # norms and gradients span decades; a fraction that reaches 0 stays on a linear axis
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"layer (at {when}; shaded: min to max over seeds)")
    _legend(ax, keys)
    return None


@PLOTS.register("bar")
def plot_bar(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """The mean of the metric per setting, its 95% bootstrap interval over seeds as the error bar (none for one
    seed)."""
    groups = group(rows, by)
    estimates = [stats.estimate([_value(m, metric) for m in members]) for members in groups.values()]
    if not any(estimates):
        return not_recorded(ax, metric)
    means = [e.mean if e else 0 for e in estimates]
    below = [e.mean - e.low if e and e.has_interval else 0 for e in estimates]
    above = [e.high - e.mean if e and e.has_interval else 0 for e in estimates]
    ax.bar(range(len(means)), means, yerr=[below, above], capsize=3)
    ax.set_xticks(range(len(means)), [_label(k) for k in groups], rotation=30, ha="right", fontsize=7)
    ax.set_xlabel(f"{', '.join(map(_short, by))} (bars: 95% CI over seeds)")
    shown = [f"{_name(by, k)} {stats.mean_interval(e) if e.has_interval else stats.fmt(e.mean)}"
             for k, e in zip(groups, estimates) if e]
    return f"{metric} per setting (mean [95% CI] over seeds): {'; '.join(shown)}."


@PLOTS.register("tradeoff")
@takes(required=("x",), x=Text())
def plot_tradeoff(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """Quality (`metric`, y) against a cost (`x`), one point per setting at the seed means, seed spread as error
    bars both ways. `x` (and `metric`) is a report column or a results.json field by dotted path
    (costs.decode_state_bytes). The note names the settings no other beats on both axes (the Pareto front)."""
    x = spec["x"]
    points = []
    for key, members in group(rows, by).items():
        (mx, sx, nx), (my, sy, ny) = (mean_std([_value(m, name) for m in members]) for name in (x, metric))
        if mx is not None and my is not None:
            points.append((_name(by, key), mx, sx, my, sy, min(nx, ny), _label(key)))
    for _, mx, sx, my, sy, _, label in points:
        ax.errorbar(mx, my, xerr=sx, yerr=sy, marker="o", capsize=3, label=label)
    xs = [p[1] for p in points]
    if xs and min(xs) > 0 and max(xs) > 10 * min(xs):  # bytes and speeds span orders of magnitude
        ax.set_xscale("log")
    ax.set_xlabel(f"{x} ({'higher' if _higher(x) else 'lower'} is cheaper; bars: sd over seeds)")
    _legend(ax, by)
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
    return _direction(name) is True


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
    """The run's results.json, through blocklab.folder (collect read and checked it already)."""
    if not folder.exists(run, RESULTS_FILE):
        return {}
    try:
        return folder.read_json(run, RESULTS_FILE)
    except (OSError, ValueError, RecursionError) as err:  # FolderError, a ConfigError, passes: one line too
        if isinstance(err, ConfigError):
            raise
        raise UnreadableRun(Path(run) / RESULTS_FILE, f"{type(err).__name__}: {err}") from None


def speed_caveat(rows: list[dict]) -> str | None:
    """Runs that trained while other jobs of the sweep ran on the same machine share its cores and memory
    bandwidth with them: their speeds measure the pairing as well as the setting."""
    beside = sum(bool(r.get("beside_other_jobs")) for r in rows)
    if not beside:
        return None
    return (f"Speeds (tokens/s, ms per step, decoding tokens/s) of {beside} of {len(rows)} runs were measured while "
            "other jobs ran beside them on the same machine, so each depends on its neighbour as well as on its own "
            "setting. For a speed comparison, rerun with hydra.launcher.n_jobs=1 (one job at a time, every core).")


def machine_caveat(rows: list[dict]) -> str | None:
    """Runs from more than one machine (a sweep resumed elsewhere, folders merged): their kernels round
    differently, so a seed need not end as it would have on the other machine, and their speeds do not compare."""
    counts = Counter(r["machine"] for r in rows if r.get("machine"))  # runs from before it was recorded: unknown
    if len(counts) < 2:
        return None
    listed = "; ".join(f"{label}: {n} run{'s' if n > 1 else ''}" for label, n in counts.most_common())
    return (f"These runs come from {len(counts)} machines ({listed}). Different kernels round differently, and "
            "a seed's score beyond the training lengths can move with that: a seed rerun on another machine need not "
            "end where it did here, and speeds do not compare across machines.")


# tab10's ten colours, then their light tints: a sweep of 11 methods would otherwise draw its 1st and 11th alike.
LINE_COLOURS = plt.get_cmap("tab20").colors[::2] + plt.get_cmap("tab20").colors[1::2]


def plot(rows: list[dict], spec: dict, path: Path | None = None) -> str | None:
    """Draw one canonical plot (to `path`, through blocklab.folder, if given); returns a sentence of what it shows,
    computed from the data."""
    note, png = drawn(rows, spec)
    if path is not None:
        folder.write_bytes(Path(path).parent, Path(path).name, png)
    return note


def drawn(rows: list[dict], spec: dict) -> tuple[str | None, bytes]:
    """One canonical plot: the sentence of what it shows, and the PNG's bytes."""
    with matplotlib.rc_context(PLAIN_TEXT):
        return _plot(rows, spec)


# Labels come from the folder (setting names, metrics): drawn as they are, never parsed as mathtext, where a stray
# `$` would fail the figure.
PLAIN_TEXT = {"text.parse_math": False}


def _plot(rows: list[dict], spec: dict) -> tuple[str | None, bytes]:
    kind, metric, by = spec["kind"], spec["metric"], _keys(spec.get("by", []))
    rows = _select(rows, spec.get("where"))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.set_prop_cycle(color=LINE_COLOURS)
    where = ", ".join(f"{k}={v}" for k, v in (spec.get("where") or {}).items())  # which runs a plot shows
    if rows:
        note = PLOTS[kind](ax, rows, spec, metric, by)
    else:  # the sweep ran without the runs this plot shows
        ax.text(0.5, 0.5, f"no runs with {where}", ha="center", va="center", transform=ax.transAxes)
        note = "no runs here to show."
    if not ax.get_ylabel():  # a kind may name its axis better than the metric's column does
        ax.set_ylabel(metric)
    ax.set_title(f"{metric} ({kind.replace('_', ' ')}{', ' + where if where else ''})", fontsize=10)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")  # tight: the legend stays in the image
    plt.close(fig)
    return (f"{where}: {note}" if note and where else note), buffer.getvalue()


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


def _swept(rows: list[dict]) -> dict[str, list]:
    """What the sweep varied: the command-line overrides that take more than one value across the runs."""
    keys = sorted({k for r in rows for k in r.get("overrides", {})})
    varied = {}
    for k in keys:
        values = sorted({r["overrides"].get(k, "–") for r in rows}, key=lambda v: _order(_number(v)))
        if len(values) > 1:
            varied[k] = values
    return varied


def pooled(done: list[dict], compare: list[str]) -> list[str]:
    """Swept keys (seed aside) whose value differs between runs of one setting of `compare`: runs the study's
    comparison would pool as if they were seeds of one config (a relaunch with `model.n_layers=3,4` into the
    study's folder, say). The report treats each of their values as a setting of its own."""
    settings = group(done, compare)
    return [key for key in _swept(done) if key != "seed" and key not in compare
            and any(len({str(r.get("overrides", {}).get(key)) for r in members}) > 1 for members in settings.values())]


def _with_keys(by, extra: list[str]) -> list[str]:
    return [*_keys(by), *(k for k in extra if k not in _keys(by))]


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


def _words(values: list) -> str:
    return ", ".join(str(v) for v in values)


def budget(done: list[dict], compare: list[str]) -> str:
    """Steps, seeds and what no setting had tuned for it, read from the runs (the "Budget." paragraph)."""
    planned = sorted({r["trainer.max_steps"] for r in done if r.get("trainer.max_steps") is not None}, key=_order)
    # Short of its own planned steps: with max_steps swept, a 500-step run beside 1500-step runs is not short.
    short = [r for r in done if _count(r.get("steps")) and _count(r.get("trainer.max_steps"))
             and r["steps"] < r["trainer.max_steps"]]
    steps = f"{'/'.join(map(str, planned))} training steps per run" if planned else "training steps not recorded"
    if short:
        steps += f" ({len(short)} of {len(done)} runs stopped early, at {min(r['steps'] for r in short)} steps or more)"
    settings = group(done, compare)
    counts = Counter(len(members) for members in settings.values())
    seeds = sorted({r.get("seed") for r in done if r.get("seed") is not None}, key=_order)
    per = (f"{min(counts)} seed{'s' if min(counts) > 1 else ''}" if len(counts) == 1 else
           f"{min(counts)} to {max(counts)} seeds")
    seeds_text = f"{per} per setting ({len(settings)} setting{'s' if len(settings) > 1 else ''}{'; seeds ' + _words(seeds) if seeds else ''})"
    swept = set(_swept(done)) | set(compare)
    fixed = []
    for knob in FIXED:
        values = {str(r.get(knob)) for r in done}
        if knob not in swept and len(values) == 1 and all(r.get(knob) is not None for r in done):
            fixed.append(f"{knob}={values.pop()}")
    untuned = (f"; one value for every setting, not tuned per setting: {', '.join(fixed)}" if fixed else "")
    return f"{steps}; {seeds_text}{untuned}."


@dataclass(frozen=True)
class Learning:
    """How a setting's seeds did on their training lengths: seeds measured, seeds at or above LEARNED_THRESHOLD
    (results.learned_in_distribution, per run), and the mean over seeds of in-distribution exact match. A setting
    counts as learned when that mean reaches the threshold a single run is held to."""

    measured: int
    learned_seeds: int
    mean: float

    @property
    def learned(self) -> bool:
        return self.mean >= LEARNED_THRESHOLD


def learning(groups: dict[tuple, list[dict]]) -> dict[tuple, Learning]:
    """Per setting whose runs score exact match on their training lengths (not an LM): its Learning."""
    out = {}
    for key, members in groups.items():
        scores = stats.finite([m.get("exact_match_in") for m in members])
        if scores:
            out[key] = Learning(len(scores), sum(x >= LEARNED_THRESHOLD for x in scores), sum(scores) / len(scores))
    return out


def beyond_training(metric: str) -> bool:
    """A metric measured beyond the training lengths (exact_match_out, loss_out): what says whether a setting
    extrapolates, and so says nothing about a setting that never learned the lengths it trained on."""
    return metric.split(".")[-1].endswith("_out")


def learning_note(prefix: str, keys: list[str], learned: dict[tuple, Learning]) -> Para | None:
    """The flag every conclusion comes after: which settings did not learn their task in distribution."""
    if not learned:
        return None
    threshold = f"{LEARNED_THRESHOLD:g}"

    def who(key, e):
        return (f"{_name(keys, key) or 'all runs'} (mean {stats.fmt(e.mean)}; {e.learned_seeds} of {e.measured} "
                f"seed{'s' if e.measured > 1 else ''} ≥ {threshold})")

    failed = [who(k, e) for k, e in learned.items() if not e.learned]
    partly = [who(k, e) for k, e in learned.items() if e.learned and e.learned_seeds < e.measured]
    lead = f"{prefix}Did every setting learn its task?"
    rule = (f"A setting counts as learned when the mean over its seeds of exact match on the training lengths "
            f"reaches {threshold}, the mark a single run is held to.")
    if not failed and not partly:
        return Para(lead, (f"Yes: every seed of every setting reaches exact match ≥ {threshold} on its training "
                           "lengths, so its scores beyond them measure extrapolation.",))
    text = []
    if failed:
        text.append(f"No: {len(failed)} of {len(learned)} setting{'s' if len(learned) > 1 else ''} did not learn "
                    f"in distribution: {'; '.join(failed)}. Their scores beyond the training lengths say little "
                    "about extrapolation, so they are left out of every comparison beyond training below.")
    if partly:
        text.append(f"Learned, but not on every seed: {'; '.join(partly)}.")
    return Para(lead, (" ".join([*text, rule]),), "not-learned")


def judged(subset: list[dict], keys: list[str], metric: str, learned: dict[tuple, Learning]) -> list[Finding]:
    """The findings on `metric`; one beyond the training lengths compares only the settings that learned in
    distribution, and says which it left out."""
    left_out = [key for key, e in learned.items() if not e.learned] if beyond_training(metric) else []
    if not left_out:
        return findings(subset, keys, metric)
    names = "; ".join(_name(keys, key) or "all runs" for key in left_out)
    kept = [r for r in subset if tuple(r.get(k) for k in keys) not in left_out]
    if not kept:
        return [Finding(f"{metric}: no setting learned its task in distribution ({names}), so none is judged "
                        "beyond the training lengths.")]
    among = f"Among the settings that learned in distribution (left out as not learned: {names}): "
    return [Finding(among + f.text, f.details) for f in findings(kept, keys, metric)]


def file_stem(text: str) -> str:
    """A name from the folder (a study, a metric) as one safe file name part: `a/b` must not become a folder."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", text).lstrip(".") or "_"
    return safe if safe == text else f"{safe}-{hashlib.sha1(text.encode()).hexdigest()[:6]}"


def section_data(name: str, spec: dict, rows: list[dict], out: "Out | Path") -> render.Section:
    """A study's section, the answer first: the question; whether every setting learned its task (before any
    conclusion about one); what the numbers show and the figures that carry it; then the setup and the tables
    the findings are read from; failed runs, and runs still training, last. Figures go to `out`."""
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
            note, png = drawn(done, spec_plot)
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
        answer.append(para("What the numbers show.", "CL(best over it), the common-language effect size: "
                           + stats.CL_FORMULA + ", with A the best setting. A winner is named only where the 95% "
                           "intervals do not overlap."))
        answer += [Items(shown), *figures]
        tables_.append(para("Results", f"on the study's metrics ({', '.join(metrics)}): the mean over each "
                            "setting's seeds and its 95% bootstrap confidence interval (scipy.stats.bootstrap, "
                            "percentile, each setting resampled on its own). With 2-3 seeds the interval spans about "
                            "the seeds' range: it shows how far the seeds fell apart, not where more seeds would "
                            "settle."))
        marks = {key: (e.learned_seeds, e.measured, e.learned) for key, e in learning(group(done, compare)).items()}
        tables_.append(Table(*tables.metrics_table(group(done, compare), compare, metrics, _value, marks,
                                                   f"learned (seeds ≥ {LEARNED_THRESHOLD:g} in distribution)"),
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


def check_plots(spec: dict) -> None:
    """Every plot of a study: a known kind, and only keys that kind reads, with values it takes."""
    errors = []
    for i, plot in enumerate(spec.get("plots") or []):
        where = f"study.plots[{i}]"
        if not isinstance(plot, dict):
            errors.append(f"{where}={plot!r} must be a mapping such as {{kind: bar, metric: exact_match_in, by: pos}}")
        elif plot.get("kind") not in PLOTS:
            errors.append(PLOTS.unknown(plot.get("kind")))
        else:
            errors += plot_errors(plot, where, PLOTS[plot["kind"]])
    if errors:
        raise ConfigError("\n".join(errors))


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
    sections = [section_data(name, specs.get(name, {}), members, out) for name, members in sorted(by_study.items())]
    # a study that weighs quality against cost: the side-by-side benchmark beside it
    sections += [benches.section_data(bench, found[bench], out) for bench in wanted]
    intro = (f"{len(rows)} runs from {root}. The answer comes first in each section: whether every setting learned "
             "its task, what the numbers show and the figures that carry it; then the tables they are read from. "
             "Tables give the mean over seeds with its 95% bootstrap confidence interval (or ± the standard "
             "deviation where marked); every column of every run is in summary.csv.")
    page = render.page(f"BlockLab report: {root.name}", intro, sections)
    return out.write_text("index.html", page)
