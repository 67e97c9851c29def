"""The `spectral_bounds` plot kind: seed 000's claim about attention's spectral norm, per layer. Under post-LN ||A||_2
would rise with depth toward sqrt(n); under pre-LN it stays under the bound computed from the weights (Gamma,
sigma_Q, sigma_K: analysis/probe.py, under the model's mask: metrics.prenorm_bound_masked). Per setting: ||A||_2
(max over heads and probe examples; the mean over seeds, the seed range shaded) and, dashed in the same colour, its
pre-norm bound where the layer has one; grey: the generic bounds 1 and sqrt(n) of any row-stochastic matrix.

Study spec: {kind: spectral_bounds, metric: spectral_norm_max, by: [norm], when: init}."""
from matplotlib.ticker import MaxNLocator

from blocklab.report.common import WHEN, band, group, label, legend, name, not_recorded, series, takes

MEASURED, BOUND, GENERIC = "spectral_norm_max", "spectral_prenorm_bound", "spectral_generic_bound"


def _mean(values) -> float:
    return sum(values) / len(values)


@takes(when=WHEN)
def plot_spectral_bounds(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    when, keys = spec.get("when", "init"), by + ["model.n_layers"]
    notes, sqrt_n = [], set()
    for key, members in group(rows, keys).items():
        measured = series(members, when, MEASURED)
        if not measured:
            continue
        per_layer = list(zip(*measured))
        layers = range(len(per_layer))
        mean = [_mean(v) for v in per_layer]
        (line,) = ax.plot(layers, mean, marker="o", markersize=3, label=label(key))
        band(ax, layers, [min(v) for v in per_layer], [max(v) for v in per_layer], line)
        sqrt_n.update(round(v, 3) for s in series(members, when, GENERIC) for v in s)
        peak = max(layers, key=lambda i: mean[i])
        text = (f"{name(keys, key)}: ||A||_2 layer 0 {mean[0]:.3f}, deepest {mean[-1]:.3f}, peak {mean[peak]:.3f} "
                f"at layer {peak}")
        runs = [(m, b) for m, b in zip(members, (m.get(f"layers_{when}", {}).get(BOUND) for m in members))
                if b and None not in b and m.get(f"layers_{when}", {}).get(MEASURED)]
        if runs:
            bounds = [[v for v in b] for _, b in runs]
            ax.plot(layers, [_mean(v) for v in zip(*bounds)], linestyle="--", color=line.get_color(), linewidth=1)
            ratio = max(a / b for m, bs in runs for a, b in zip(m[f"layers_{when}"][MEASURED], bs))
            text += (f"; pre-norm bound {min(map(min, bounds)):.3f}-{max(map(max, bounds)):.3f}, measured/bound at "
                     f"most {ratio:.3f} ({'within it' if ratio <= 1 + 1e-9 else 'ABOVE it'} in all {len(runs)} runs)")
        notes.append(text)
    if not notes:
        return not_recorded(ax, f"{MEASURED} at {when}")
    for value in sorted(sqrt_n):
        ax.axhline(value, color="grey", linestyle="--", linewidth=1)
        ax.annotate(f"√n = {value:.2f}", (0, value), textcoords="offset points", xytext=(2, -10), fontsize=7,
                    color="grey")
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"layer (at {when}; dashed: pre-norm bound; grey: 1 and √n; shaded: min to max over seeds)")
    ax.set_ylabel("‖A‖₂ (max over heads)")
    legend(ax, keys)
    return (f"Attention spectral norm per layer at {when} (mean over seeds; √n = "
            f"{', '.join(f'{v:.3f}' for v in sorted(sqrt_n))}): " + "; ".join(notes) + ".")
