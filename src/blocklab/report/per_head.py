"""The `per_head` plot kind: a per-head diagnostic (attention entropy or mean |query - key| distance, all queries or
the answer's) of every head, per setting: one point per head, layer and seed, layers side by side in their own
colour. How far the heads of one layer fall apart is what more heads buy (exercise 1.4); the note gives, per
setting and layer, the heads' range (mean over seeds of max - min over heads).

Study spec: {kind: per_head, metric: attention_entropy, by: n_heads, when: end} (reads <metric>_heads)."""
from matplotlib import colormaps

from blocklab.report.common import WHEN, group, label, legend, name, not_recorded, takes

WIDTH = 0.8  # of one setting's slot on the x axis, shared by its layers


def _runs(members: list[dict], when: str, metric: str) -> list[list[list[float]]]:
    """Per run: per layer, the values of its heads (runs lacking the measurement left out)."""
    found = [m.get(f"layers_{when}", {}).get(f"{metric}_heads") for m in members]
    return [r for r in found if r and all(r)]


@takes(when=WHEN)
def plot_per_head(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    when = spec.get("when", "end")
    settings = [(key, _runs(members, when, metric)) for key, members in group(rows, by).items()]
    settings = [(key, runs) for key, runs in settings if runs]
    if not settings:
        return not_recorded(ax, f"{metric} per head at {when}")
    n_layers = max(len(run) for _, runs in settings for run in runs)
    colours = colormaps["viridis"].resampled(max(n_layers, 2))
    notes = []
    for x, (key, runs) in enumerate(settings):
        spreads = []
        for layer in range(n_layers):
            offset = x + WIDTH * ((layer + 0.5) / n_layers - 0.5)
            values = [v for run in runs if layer < len(run) for v in run[layer]]
            heads = max(len(run[layer]) for run in runs if layer < len(run))
            # heads spread across the layer's slot so a layer's points do not sit on one another
            xs = [offset + 0.6 * WIDTH / n_layers * ((i % heads + 0.5) / heads - 0.5) for i in range(len(values))]
            ax.scatter(xs, values, s=9, color=colours(layer), label=f"layer {layer}" if x == 0 else None)
            ranges = [max(run[layer]) - min(run[layer]) for run in runs if layer < len(run)]
            spreads.append(f"{sum(ranges) / len(ranges):.3g}")
        notes.append(f"{name(by, key)}: {', '.join(spreads)}")
    ax.set_xticks(range(len(settings)), [label(key) for key, _ in settings], fontsize=7)
    ax.set_xlabel(f"{', '.join(by)} (one point per head, layer and seed; at {when})")
    legend(ax, ["layer"])
    return (f"{metric} at {when}, range over heads (max - min, mean over seeds) per layer: " + "; ".join(notes)
            + ".")
