"""A sweep's figures: the plots its `plots:` names, drawn by one registry of plot kinds for both the HTML report
(report/build.py, rows from the sweep folder) and the findings page (report/findings.py, rows from the page's
jsonl: figures_data.page_rows). Each plot is one figure; every line in it has its own colour and style (a cycle of
10 colours x 4 line styles), and legends sit beside the axes, never over the data.

Kinds: the generic ones (figures_kinds.py: bar, by_choice, by_layer, length_curve, by_length, by_position,
tradeoff), cost against length (figures_cost.py, exercise 1.1), the registry's activations (activation_curves.py,
1.9), attention maps (attention_maps.py, 1.2), per head (per_head.py), spectral bounds (spectral.py), and the recall
sweep's two (recall.py), and learning-rate sensitivity's two (figures_lr.py). `figure` returns the matplotlib Figure
itself (what the tests inspect); `drawn` its PNG."""
import io
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from blocklab import folder  # noqa: E402
from blocklab.errors import ConfigError  # noqa: E402
from blocklab.registry import Registry  # noqa: E402
from blocklab.report import benches, figures_kinds as kinds, recall  # noqa: E402
from blocklab.report.activation_curves import plot_activation_functions  # noqa: E402
from blocklab.report.attention_maps import plot_attention_maps  # noqa: E402
from blocklab.report.common import keys as _keys, plot_errors  # noqa: E402
from blocklab.report.figures_cost import CONTEXT, bench_context, plot_cost_scaling  # noqa: E402
from blocklab.report.figures_data import page_rows  # noqa: E402
from blocklab.report.figures_lr import plot_lr_curve, plot_over_step  # noqa: E402
from blocklab.report.figures_kinds import STYLES  # noqa: E402
from blocklab.report.per_head import plot_per_head  # noqa: E402
from blocklab.report.spectral import plot_spectral_bounds  # noqa: E402

PLOTS: Registry = Registry("study.plots[].kind")
PLOTS.register("bar")(kinds.plot_bar)  # the mean per setting, its 95% interval over seeds
PLOTS.register("by_choice")(kinds.plot_by_choice)  # against a numeric choice (log2 axis)
PLOTS.register("by_layer")(kinds.plot_by_layer)  # a per-layer diagnostic (log axis where it spans decades)
PLOTS.register("length_curve")(kinds.plot_length_curve)  # against evaluation length
PLOTS.register("by_length")(kinds.plot_by_length)  # the same, under the position sweeps' name
PLOTS.register("by_position")(kinds.plot_by_position)  # token accuracy by place in the answer
PLOTS.register("tradeoff")(kinds.plot_tradeoff)  # quality against a cost, the Pareto front named
PLOTS.register("cost_scaling")(plot_cost_scaling)  # time and memory against length, log-log, fitted slopes
PLOTS.register("attention_maps")(plot_attention_maps)  # the recorded weights (or saved heatmaps) per setting
PLOTS.register("spectral_bounds")(plot_spectral_bounds)  # ||A||_2 per layer against seed 000's bounds
PLOTS.register("per_head")(plot_per_head)  # every head's entropy or distance
PLOTS.register("activation_functions")(plot_activation_functions)  # the registry's activations and derivatives
PLOTS.register("recall_memory")(recall.plot_recall_memory)  # best over lrs against the decoding state
PLOTS.register("lr_range")(recall.plot_lr_range)  # score per lr, best and working range per setting
PLOTS.register("lr_curve")(plot_lr_curve)  # loss per lr capped at init, LR sensitivity per setting (Wortsman et al.)
PLOTS.register("over_step")(plot_over_step)  # a logit-growth measure against step (diagnostics.logit_curve)

# Labels come from the folder (setting names, metrics): drawn as they are, never parsed as mathtext, where a stray
# `$` would fail the figure.
PLAIN_TEXT = {"text.parse_math": False}
DPI = 90


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


def select(rows: list[dict], where: dict | None) -> list[dict]:
    return [r for r in rows if all(str(r.get(k)) == str(v) for k, v in (where or {}).items())]


def figure(rows: list[dict], spec: dict, context: dict | None = None) -> tuple[str | None, Figure]:
    """One plot of a sweep's `plots:`: the sentence of what it shows (computed from the data) and the Figure.
    `context`: what a kind reads beside the runs (cost_scaling: the attention bench's unfused path)."""
    with matplotlib.rc_context(PLAIN_TEXT):
        return _figure(rows, spec, context or {})


def _figure(rows: list[dict], spec: dict, context: dict) -> tuple[str | None, Figure]:
    kind, metric, by = spec["kind"], spec["metric"], _keys(spec.get("by", []))
    rows = select(rows, spec.get("where"))
    fig = Figure(figsize=(6.4, 3.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.set_prop_cycle(STYLES)
    where = ", ".join(f"{k}={v}" for k, v in (spec.get("where") or {}).items())  # which runs a plot shows
    draw = PLOTS[kind]
    if rows or not getattr(draw, "needs_runs", True):
        note = draw(ax, rows, spec, metric, by, context) if getattr(draw, "takes_context", False) else \
            draw(ax, rows, spec, metric, by)
    else:  # the sweep ran without the runs this plot shows
        ax.text(0.5, 0.5, f"no runs with {where}", ha="center", va="center", transform=ax.transAxes)
        note = "no runs here to show."
    for each in fig.axes:
        _plain_log_ticks(each)
    if not ax.get_ylabel():  # a kind may name its axis better than the metric's column does
        ax.set_ylabel(metric)
    if not ax.get_title():
        ax.set_title(f"{metric} ({kind.replace('_', ' ')}{', ' + where if where else ''})", fontsize=10)
    return (f"{where}: {note}" if note and where else note), fig


def _plain_log_ticks(ax) -> None:
    """Log axes' ticks as plain numbers (256, 0.001): matplotlib writes them as mathtext, which PLAIN_TEXT turns
    off, so they would print as raw TeX."""
    for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
        if scale == "log":
            if axis is ax.yaxis:  # 1, 2, 5 per decade: an axis spanning less than a decade still has labels
                low, high = ax.get_ylim()
                # over many decades LogLocator thins to every k-th decade, and then draws no tick at all where
                # it has several subs: powers of ten alone there (a 48-layer activation grows 10 decades)
                wide = low > 0 and math.log10(high / low) > 4
                axis.set_major_locator(LogLocator(base=10, subs=(1.0,) if wide else (1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())


def png(fig: Figure) -> bytes:
    """The figure's PNG bytes, with no software or date stamp (the same data draws the same bytes)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})  # tight: legends in
    return buffer.getvalue()


def drawn(rows: list[dict], spec: dict, context: dict | None = None) -> tuple[str | None, bytes]:
    """One plot: the sentence of what it shows, and the PNG's bytes."""
    note, fig = figure(rows, spec, context)
    with matplotlib.rc_context(PLAIN_TEXT):
        return note, png(fig)


def plot(rows: list[dict], spec: dict, path: Path | None = None) -> str | None:
    """Draw one plot (to `path`, through blocklab.folder, if given); returns a sentence of what it shows."""
    note, data = drawn(rows, spec)
    if path is not None:
        folder.write_bytes(Path(path).parent, Path(path).name, data)
    return note


def page_figures(meta: dict, jobs: list[dict], plots: list[dict]) -> list[tuple[str | None, Figure]]:
    """A findings page's figures, from its jsonl (header `meta`, job lines `jobs`): one per entry of `plots` (its
    sweep's `plots:`), in that order, each with the sentence of what it shows."""
    rows = page_rows(jobs)
    plots = [p for p in plots if isinstance(p, dict) and p.get("kind") in PLOTS]
    drawn = [figure(rows, spec, meta.get("figure_context")) for spec in plots]
    for spec, (_, fig) in zip(plots, drawn):
        if spec["kind"] in LEVELLED:
            _reference_lines(fig, select_jobs(jobs, spec.get("where")), str(spec["metric"]))
    return drawn


# Kinds whose y axis is the plot's metric: the levels the runs' tasks state on it are drawn across them.
LEVELLED = ("bar", "by_choice", "length_curve", "by_length", "tradeoff")


def select_jobs(jobs: list[dict], where: dict | None) -> list[dict]:
    return [j for j in jobs if all(str((j.get("setting") or {}).get(k, ((j.get("figure") or {}).get("keys") or {})
                                                                      .get(k))) == str(v) for k, v in (where or {}).items())]


def _reference_lines(fig: Figure, jobs: list[dict], metric: str) -> None:
    """The reference levels the runs' tasks state on `metric` (learned.reference_lines: chance loss, the bigram
    loss, the exact-match bar...), grey dotted across the axes, each named at its right end."""
    from blocklab.report.learned import reference_lines

    axes = [ax for ax in fig.axes if ax.get_visible()]
    if len(axes) != 1:
        return
    ax = axes[0]
    for level in reference_lines(jobs, metric):
        ax.axhline(level.value, color="grey", linestyle=":", linewidth=1, label="_reference", zorder=3)
        ax.annotate(f"{level.name} {level.value:g}", (1.0, level.value), xycoords=("axes fraction", "data"),
                    xytext=(-2, 2), textcoords="offset points", ha="right", fontsize=7, color="dimgrey", zorder=3)


def page_pngs(meta: dict, jobs: list[dict], plots: list[dict]) -> list[tuple[str | None, bytes]]:
    """page_figures as PNG bytes."""
    out = []
    for note, fig in page_figures(meta, jobs, plots):
        with matplotlib.rc_context(PLAIN_TEXT):
            out.append((note, png(fig)))
    return out


def page_png_name(stem: str, i: int) -> str:
    """The file of a page's i-th figure: <sweep>.png, then <sweep>.1.png, <sweep>.2.png..."""
    return f"{stem}.png" if i == 0 else f"{stem}.{i}.png"


def page_context(study: dict, root: Path) -> dict:
    """What a findings page's header keeps for its figures beside the runs: for a study whose `bench` names the
    attention benchmark, the fused and unfused full attention it measured (figures_cost.bench_context), where
    outputs/bench/attention.json is found (benches.find). Empty where there is none."""
    if "attention" not in benches.names(study.get("bench")):
        return {}
    found = benches.load("attention", root)
    context = bench_context((found or {}).get("benchmarks", {}).get("attention"))
    return {"figure_context": {CONTEXT: context}} if context else {}
