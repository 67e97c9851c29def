"""The `cost_scaling` plot kind (exercise 1.1: O(n²d) time, O(n²) memory): a training step's time and its peak
memory against sequence length per setting, on log-log axes, each line labelled with its fitted slope (the
exponent p of y ~ c n^p, least squares through the logs of the seed means); beside them, the attention layer alone
from `python -m blocklab.bench attention`: full attention's memory on the fused path (F.scaled_dot_product_attention,
which never holds the n x n weights) against the unfused path that materialises them, whose memory grows as n².

Study spec: {kind: cost_scaling, metric: ms_per_step, x: task.block_size, memory: costs.step_peak_bytes, by: attn}.
The bench's part comes as context (figures.figure): the report reads outputs/bench/attention.json, a findings page
the summary its header kept (`figure_context`); without it the third panel says how to measure it."""
import math

import numpy as np

from blocklab.bench.attention import reference
from blocklab.report.common import group, name as _name, not_recorded, short, takes
from blocklab.report.figures_data import value
from blocklab.report.figures_kinds import STYLES
from blocklab.schema import Text

MB = 2 ** 20
CONTEXT = "attention_bench"  # the context key: the bench's fused and unfused full attention


def fit_slope(xs: list[float], ys: list[float]) -> float | None:
    """The exponent p of y ~ c x^p: a least-squares line through (log x, log y); None under two points."""
    points = [(x, y) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    if len(points) < 2:
        return None
    return float(np.polyfit(np.log([p[0] for p in points]), np.log([p[1] for p in points]), 1)[0])


def bench_context(result: dict | None) -> dict | None:
    """What the third panel needs of an attention bench result (the `attention` entry of its JSON): per length the
    peak MB and ms of full softmax attention, fused and unfused (explicit). None where the result lacks them."""
    try:
        lengths = [int(n) for n in result["settings"]["lengths"]]
        full = reference()  # the bench's full attention of the default kind, which its ratios are taken against
        rows = {("explicit" if r["explicit"] else "fused"): r for r in result["summary"]
                if r.get("kind") == full.kind and r.get("pattern") == full.pattern}
        paths = {path: {"peak_mb": [float(v) for v in r["peak_mb"]], "ms": [float(v) for v in r["ms"]]}
                 for path, r in rows.items()}
    except (KeyError, TypeError, ValueError):
        return None
    if set(paths) != {"fused", "explicit"} or any(len(p["peak_mb"]) != len(lengths) for p in paths.values()):
        return None
    return {"lengths": lengths, **paths}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _legend_below(ax, title: str) -> None:
    """Under the panel, never over the data nor over the next panel."""
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), borderaxespad=0, frameon=False,
              title=title, title_fontsize=7, ncol=2)


def _panel(ax, rows, by, x, metric, scale, ylabel) -> list[str]:
    """One metric against length per setting (the median over seeds, robust to a seed timed beside another job;
    the seed range as bars); its slopes."""
    slopes = []
    for key, members in group(rows, by).items():
        per_x = {}
        for m in members:
            xv, yv = value(m, x), value(m, metric)
            if isinstance(xv, (int, float)) and isinstance(yv, (int, float)) and math.isfinite(yv) and yv > 0:
                per_x.setdefault(float(xv), []).append(yv / scale)
        if not per_x:
            continue
        xs = sorted(per_x)
        means = [_median(per_x[v]) for v in xs]
        slope = fit_slope(xs, means)
        who = _name(by, key) or metric
        text = f"slope {slope:.2f}" if slope is not None else "one length"
        (line,) = ax.plot(xs, means, marker="o", markersize=3, label=f"{', '.join(map(str, key))} ({text})")
        ax.vlines(xs, [min(per_x[v]) for v in xs], [max(per_x[v]) for v in xs], color=line.get_color(), linewidth=1)
        slopes.append(f"{who} {text}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"{x} (log)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")
    return slopes


@takes(required=("x",), x=Text(), memory=Text())
def plot_cost_scaling(ax, rows: list[dict], spec: dict, metric: str, by: list[str], context: dict) -> str | None:
    fig = ax.figure
    ax.set_visible(False)  # kept, hidden: the figure gets three panels of its own
    fig.set_size_inches(15, 4.2)
    panels = fig.subplots(1, 3, gridspec_kw={"wspace": 0.35})
    for panel in panels:
        panel.set_prop_cycle(STYLES)
    time_slopes = _panel(panels[0], rows, by, spec["x"], metric, 1.0, f"{metric} (log)")
    memory = spec.get("memory")
    memory_slopes = _panel(panels[1], rows, by, spec["x"], memory, MB, f"{memory} in MB (log)") if memory else []
    if not time_slopes:
        return not_recorded(panels[0], metric)
    panels[0].set_title("time per training step (median over seeds)", fontsize=9)
    _legend_below(panels[0], ", ".join(map(short, by)))
    if memory:
        panels[1].set_title("peak memory of a step (median over seeds)", fontsize=9)
        _legend_below(panels[1], ", ".join(map(short, by)))
    else:
        panels[1].set_visible(False)
    bench = (context or {}).get(CONTEXT)
    unfused = _bench_panel(panels[2], bench)
    note = f"Fitted log-log slopes, time: {'; '.join(time_slopes)}"
    if memory_slopes:
        note += f"; memory: {'; '.join(memory_slopes)}"
    return note + ". " + unfused


def _bench_panel(ax, bench: dict | None) -> str:
    ax.set_title("one attention layer (bench): fused vs unfused", fontsize=9)
    if not bench:
        ax.text(0.5, 0.5, "unfused path not measured here:\npython -m blocklab.bench attention", ha="center",
                va="center", transform=ax.transAxes, fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel("sequence length n")
        return ("Fused full attention's memory grows about linearly because its kernel never holds the n×n "
                "weights; the unfused path's n² memory is measured by python -m blocklab.bench attention.")
    lengths, slopes = bench["lengths"], {}
    for path, label in (("fused", "full, fused (SDPA)"), ("explicit", "full, unfused (n×n weights held)")):
        slopes[path] = fit_slope(lengths, bench[path]["peak_mb"])
        ax.plot(lengths, bench[path]["peak_mb"], marker="o", markersize=3, label=f"{label} (slope {slopes[path]:.2f})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length n (log)")
    ax.set_ylabel("peak MB, forward + backward (log)")
    ax.grid(alpha=0.3, which="both")
    _legend_below(ax, "full attention, one layer")
    return (f"Fused full attention's memory grows about linearly (one layer: slope {slopes['fused']:.2f}) because "
            "the fused kernel never holds the n×n weights; the unfused path, which materialises them, grows as n² "
            f"(slope {slopes['explicit']:.2f}, lengths {lengths[0]}-{lengths[-1]}).")


plot_cost_scaling.takes_context = True
