"""Figures of the diagnostics: attention maps, per-layer measurements, and their course over training.

Built on Figure + the Agg canvas directly (no pyplot): no display, no global figure state to leak.
Constrained layout keeps every label inside the figure, except in the attention grid: it is written at every
measurement of every run, where the layout search costs more than the drawing, and its fixed margins suffice."""
import io
import math
from pathlib import Path

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import BoundaryNorm, PowerNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from blocklab import folder

NAN = float("nan")


def new_figure(width: float, height: float, layout: str | None = "constrained") -> Figure:
    fig = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: Path) -> Path:
    """The figure as a PNG at `path`, written through the folder module into `path`'s folder (no link followed)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return folder.write_bytes(path.parent, path.name, buffer.getvalue())


def attention_figure(weights: list, title: str) -> Figure:
    """A grid of layers (rows) x heads (columns) of (Tq, Tk) maps, one colour scale and one colorbar."""
    n_layers, n_heads = len(weights), weights[0].shape[0]
    width, height = 1.9 * n_heads + 1.6, 1.9 * n_layers + 1.0
    fig = new_figure(width, height, layout=None)
    # Fixed margins in inches: the axis labels on the left and bottom, the titles above, the colorbar on the right.
    fig.subplots_adjust(left=0.75 / width, right=1 - 1.1 / width, bottom=0.55 / height, top=1 - 0.55 / height,
                        wspace=0.15, hspace=0.3)
    # Not shared axes: each gets its own (few, fixed) ticks, and the inner ones none. Tick objects and the title
    # placement that measures them are most of this figure's drawing time, paid at every measurement of every run.
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    # sqrt scale: causal rows spread weight ~1/t, which a linear scale shows as one dark triangle
    norm = PowerNorm(0.5, vmin=0, vmax=max(float(w.max()) for w in weights))
    for layer, w in enumerate(weights):
        for head, ax in enumerate(axes[layer]):
            image = ax.imshow(w[head].numpy(), cmap="viridis", norm=norm, interpolation="nearest")
            ax.set_title(f"layer {layer}, head {head}", fontsize=8, y=1.0, pad=3)  # a fixed y: no placement search
            outer_x, outer_y = layer == n_layers - 1, head == 0
            ax.set_xticks(_position_ticks(w.shape[-1]) if outer_x else [])
            ax.set_yticks(_position_ticks(w.shape[-2]) if outer_y else [])
            ax.tick_params(labelsize=6)
            if outer_x:
                ax.set_xlabel("key position", fontsize=8)
            if outer_y:
                ax.set_ylabel("query position", fontsize=8)
    bar = fig.add_axes((1 - 0.95 / width, 0.55 / height, 0.15 / width, 1 - 1.1 / height))
    fig.colorbar(image, cax=bar, label="attention weight (√ scale)")
    fig.suptitle(title, fontsize=10)
    return fig


def _position_ticks(n: int) -> list[int]:
    """At most 4 integer positions from 0 to n - 1."""
    return sorted({round(i * (n - 1) / 3) for i in range(4)}) if n > 1 else [0]


def attention_heatmaps(weights: list, out_dir: Path, tag: str) -> list[Path]:
    """The attention figure of one measurement (first probe example) as one PNG. Returns [its path]."""
    fig = attention_figure(weights, f"attention weights, first probe example ({tag})")
    return [save(fig, out_dir / f"attention_{tag}.png")]


def _values(rows: list, key) -> list[float]:
    """One value per layer, NaN where a layer has none (no FFN, no gradient): a gap in the line."""
    return [NAN if (v := key(r)) is None else float(v) for r in rows]


def _scale_y(ax, log: bool, *series) -> None:
    """Gradient norms span orders of magnitude across depth: a log axis, if they are all positive.
    Every other measure is >= 0 and gets an axis from 0, so noise in the 4th digit does not look like a trend."""
    values = [v for s in series for v in s if math.isfinite(v)]  # a diverged run may hold inf or NaN
    if log and values and min(values) > 0:
        ax.set_yscale("log")
    elif values:
        ax.set_ylim(0, 1.08 * max(values) or 1)


def layer_panels(stats: dict) -> list[tuple]:
    """(title, y label, [(label, values per layer)], [(label, reference value)]) for each measure present."""
    layers, grads = stats["layers"], stats.get("gradients") or []

    def heads(key, reduce):  # one number per layer from a per-head list
        return _values(layers, lambda r: None if r[key] is None else reduce(r[key]))

    def mean(values):
        return sum(values) / len(values)

    n_keys = stats.get("n_keys")
    panels = [
        ("gradient norm per sublayer", "‖∇W‖ (Frobenius)",
         [("attention", _values(grads, lambda g: g["attn"])), ("FFN", _values(grads, lambda g: g["ffn"]))], []),
        ("activation RMS (block output)", "RMS",
         [("block output", _values(layers, lambda r: r["activation_rms"]))],
         [("embedding", stats.get("embedding_rms"))]),
        ("rank collapse", "‖X − 1x̄ᵀ‖ / ‖X‖",
         [("Frobenius", _values(layers, lambda r: r["relative_residual"]["fro"])),
          ("ℓ1,∞ composite", _values(layers, lambda r: r["relative_residual"]["l1_inf"]))],
         [("embedding (Frobenius)", (stats.get("embedding_relative_residual") or {}).get("fro"))]),
        ("attention entropy", "entropy (nats)",
         [("mean over heads", heads("attention_entropy", mean)), ("min over heads", heads("attention_entropy", min))],
         [("log n (uniform)", math.log(n_keys) if n_keys else None)]),
        ("attention distance", "mean |query − key| (tokens)",
         [("mean over heads", heads("attention_distance", mean)), ("max over heads", heads("attention_distance", max))],
         []),
        ("attention spectral norm", "‖A‖₂ (max over heads)",
         [("measured", heads("spectral_norm_max", max)),
          ("pre-norm bound", heads("spectral_prenorm_bound", max))],
         [("√n (generic bound)", math.sqrt(n_keys) if n_keys else None)]),
        ("head similarity", "mean cosine between heads",
         [("mean over head pairs", _values(layers, lambda r: r["head_similarity_mean"]))], []),
        ("FFN sparsity", "fraction |h| ≤ ε",
         [("FFN hidden", _values(layers, lambda r: r["ffn_sparsity"]))], []),
    ]
    present = []
    for title, ylabel, lines, refs in panels:
        lines = [(label, v) for label, v in lines if not all(math.isnan(x) for x in v)]
        if lines:
            present.append((title, ylabel, lines, [(label, v) for label, v in refs if v is not None]))
    return present


def layer_figure(stats: dict, title: str) -> Figure:
    """One panel per measure: its value against layer index (one point per layer)."""
    panels = layer_panels(stats)
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = new_figure(3.6 * cols, 3.0 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    x = [r["layer"] for r in stats["layers"]]
    for ax, (name, ylabel, lines, refs) in zip(axes, panels):
        for label, values in lines:
            ax.plot(x, values, marker="o", label=label, linestyle="--" if "bound" in label else "-")
        for label, value in refs:
            ax.axhline(value, color="grey", linestyle="--", linewidth=1, label=label)
        _scale_y(ax, name.startswith("gradient"), *(v for _, v in lines), [v for _, v in refs])
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("layer", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(which="both", labelsize=7)
        ax.grid(alpha=0.3)
        if len(lines) + len(refs) > 1:
            ax.legend(fontsize=6)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    return fig


HISTORY_PANELS = [  # (title, y label, value of one layer in one measurement)
    ("attention gradient norm", "‖∇W‖ (Frobenius)", lambda m, i: m["gradients"][i]["attn"]),
    ("FFN gradient norm", "‖∇W‖ (Frobenius)", lambda m, i: m["gradients"][i]["ffn"]),
    ("activation RMS (block output)", "RMS", lambda m, i: m["layers"][i]["activation_rms"]),
    ("rank collapse", "‖X − 1x̄ᵀ‖_F / ‖X‖_F", lambda m, i: m["layers"][i]["relative_residual"]["fro"]),
    ("attention entropy", "mean over heads (nats)",
     lambda m, i: sum(e := m["layers"][i]["attention_entropy"]) / len(e)),
    ("attention spectral norm", "‖A‖₂ (max over heads)", lambda m, i: max(m["layers"][i]["spectral_norm_max"])),
]


def history_figure(history: list[dict]) -> Figure | None:
    """Each measure against training step, one line per layer (colour = depth). None with < 2 measurements."""
    measured = [m for m in history if m.get("layers")]  # skipped measurements (diverged) have none
    if len(measured) < 2:
        return None
    n_layers = len(measured[-1]["layers"])
    steps = [m["step"] for m in measured]
    cmap = colormaps["viridis"].resampled(n_layers)
    fig = new_figure(12, 6.4)
    axes = fig.subplots(2, 3, squeeze=False)
    for ax, (name, ylabel, value) in zip(axes.flat, HISTORY_PANELS):
        series = [[NAN if (v := value(m, i)) is None else float(v) for m in measured] for i in range(n_layers)]
        for i, values in enumerate(series):
            ax.plot(steps, values, marker=".", color=cmap(i), label=f"layer {i}")
        _scale_y(ax, "gradient" in name, *series)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("training step", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(which="both", labelsize=7)
        ax.grid(alpha=0.3)
    if n_layers <= 8:
        axes[0, 0].legend(fontsize=6)
    else:  # a legend of many layers would cover the data: a colour scale of depth instead
        bar = fig.colorbar(ScalarMappable(BoundaryNorm([i - 0.5 for i in range(n_layers + 1)], n_layers), cmap),
                           ax=axes, label="layer", shrink=0.6)
        bar.locator = MaxNLocator(integer=True)
        bar.update_ticks()
    fig.suptitle("diagnostics over training (gradients: probe loss at init and end, training batch between)",
                 fontsize=10)
    return fig
