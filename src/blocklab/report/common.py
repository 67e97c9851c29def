"""What every plot kind shares: settings grouped in a stable order, their labels, seed bands, legends beside the
axes. Plot kinds in their own modules (spectral.py, per_head.py...) use these without importing build.py."""
from collections import defaultdict


def keys(spec_by) -> list[str]:
    return [spec_by] if isinstance(spec_by, str) else list(spec_by)


def short(key: str) -> str:
    """A key as a label names it: its last part (task.reverse_answer -> reverse_answer)."""
    return key.rsplit(".", 1)[-1]


def label(values: tuple) -> str:
    """A setting as a plot labels it: its swept values (the legend's title names the keys)."""
    return ", ".join(str(v) for v in values)


def name(keys: list[str], values: tuple) -> str:
    """A setting as a sentence names it: short key=value pairs."""
    return ", ".join(f"{short(k)}={v}" for k, v in zip(keys, values))


def order(value) -> tuple:
    """Numbers in numeric order (2 before 16), then everything else by name."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value, "")
    return (1, 0, str(value))


def group(rows: list[dict], keys: list[str]) -> dict[tuple, list[dict]]:
    groups = defaultdict(list)
    for row in rows:
        groups[tuple(row.get(k) for k in keys)].append(row)
    return dict(sorted(groups.items(), key=lambda kv: tuple(order(v) for v in kv[0])))


def band(ax, xs, lows, highs, line) -> None:
    """The seed range (lowest to highest seed) behind a mean line, in its colour."""
    ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.2, linewidth=0)


def legend(ax, keys: list[str]) -> None:
    """Beside the axes, never over the data; titled with the keys the labels give the values of."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                  title=", ".join(map(short, keys)) or None, title_fontsize=7, frameon=False)


def not_recorded(ax, what: str) -> str:
    """An empty figure that says so, and the note that says which runs would have it."""
    ax.text(0.5, 0.5, f"{what}: not recorded by these runs", ha="center", va="center", transform=ax.transAxes)
    return f"{what} is not recorded by these runs (their results.json predates it): rerun the sweep to measure it."


def series(members: list[dict], when: str, metric: str) -> list[list]:
    """Each run's whole per-layer series of `metric` at `when` (init, end); runs lacking it are left out."""
    found = [m.get(f"layers_{when}", {}).get(metric) for m in members]
    return [s for s in found if s and None not in s]
