"""The `activation_functions` plot kind (exercise 1.9): every registered FFN activation (model/ffn.py ACTIVATIONS;
a gated one by its gate) and its derivative, by torch autograd, with the level below which each counts as off in
the FFN sparsity measure (analysis/activations.py). Independent of the runs: the functions the sweep compares.

Study spec: {kind: activation_functions, metric: activation}."""
import math

import torch

from blocklab.analysis.activations import OFF_EPS, curves, distinct, off_level
from blocklab.report.figures_kinds import STYLES

RANGE = (-4.0, 4.0)


def plot_activation_functions(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """Hides the one axes the report hands over and draws two panels: the functions and their derivatives."""
    fig = ax.figure
    ax.set_visible(False)
    fig.set_size_inches(11, 3.8)
    values, slopes = fig.subplots(1, 2)
    values.set_prop_cycle(STYLES)  # the figure's one cycle: no two functions alike
    x = torch.linspace(*RANGE, 801, dtype=torch.float64)
    for (names, y, dy), (_, fn) in zip(curves(x), distinct()):
        (line,) = values.plot(x, y, label=" / ".join(names), linewidth=1.2)
        slopes.plot(x, dy, color=line.get_color(), linestyle=line.get_linestyle(), linewidth=1.2)
        level = off_level(fn)
        if RANGE[0] <= level < 0:  # where the flat tail begins (ReLU's, at 0, is its kink)
            values.plot([level], [float(fn(torch.tensor(level)))], marker="|", markersize=12, color=line.get_color())
    values.set_ylim(-1, 4)
    values.axhspan(-OFF_EPS, OFF_EPS, color="grey", alpha=0.3, linewidth=0)
    for panel, title in ((values, "act(x)  (grey band: |act| ≤ ε; |: the tail's start)"), (slopes, "act'(x) (torch autograd)")):
        panel.set_title(title, fontsize=9)
        panel.set_xlabel("pre-activation x")
        panel.axhline(0, color="black", linewidth=0.5)
        panel.axvline(0, color="black", linewidth=0.5)
        panel.grid(alpha=0.3)
    slopes.legend(*values.get_legend_handles_labels(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  frameon=False)
    levels = []
    for names, fn in distinct():
        level = off_level(fn)
        where = "never" if math.isinf(level) else f"x ≤ {level:.3f}"
        levels.append(f"{' / '.join(names)}: {where}")
    return (f"A unit counts as off (ffn_off, and dead if off on every probe token) where its activation's whole lower "
            f"tail is within ε = {OFF_EPS} of zero: " + "; ".join(levels) + ". ReLU's zeros are exact; GELU and "
            "SiLU reach ε only far below 0, so at small pre-activations they are not sparse at all.")


plot_activation_functions.needs_runs = False  # drawn from the registry: a page with no runs still shows it
