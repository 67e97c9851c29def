"""What every plot kind shares: settings grouped in a stable order, their labels, seed bands, legends beside the
axes. Plot kinds in their own modules (spectral.py, per_head.py...) use these without importing build.py."""
import difflib
from collections import defaultdict

from blocklab.schema import Choice, Keys, Selection, Spec, Text

# The keys every plot kind reads (`metric` required; `by` and `where` optional) and the specs of their values.
PLOT_KEYS: dict[str, Spec] = {"kind": Text(), "metric": Text(), "by": Keys(), "where": Selection()}
WHEN = Choice(("init", "end"), noun="a diagnostics measurement")  # results.json's diagnostics.<when>


def takes(required: tuple[str, ...] = (), **specs: Spec):
    """Declares the keys a plot kind reads beyond PLOT_KEYS, each with the spec of its value (`required`: those
    it cannot draw without, besides `metric`). The report checks a sweep's plots against them before it writes
    anything."""
    def declare(draw):
        draw.plot_keys, draw.required_keys = specs, required
        return draw
    return declare


def plot_errors(plot, where: str, draw) -> list[str]:
    """One line per problem of one plot spec drawn by `draw` (a plot kind): a key the kind does not read, a value
    its spec refuses, a key the kind needs that is missing."""
    specs = {**PLOT_KEYS, **getattr(draw, "plot_keys", {})}
    kind = plot.get("kind")
    required = ("metric", *getattr(draw, "required_keys", ()))
    errors = [f"{where}.{key} is missing: plot kind {kind} needs it" for key in required if key not in plot]
    for key, value in plot.items():
        if key not in specs:
            close = difflib.get_close_matches(str(key), list(specs), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            errors.append(f"{where}.{key} is not a key of plot kind {kind}; {hint}its keys are {sorted(specs)}")
        else:
            errors += filter(None, [specs[key].error(f"{where}.{key}", value)])
    return errors


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


# Speeds a job measures of itself: beside other jobs on the same cores they measure the neighbour too, and two runs
# of one model differ in them
SPEEDS = ("tokens_per_s", "ms_per_step", "decode_tokens_per_s", "costs.decode_tokens_per_s", "train_time_s")


def timed_beside(runs: list[dict]) -> int:
    """How many of `runs` trained while other jobs of their sweep ran beside them (results.json's
    `beside_other_jobs`): their SPEEDS measure the neighbour too."""
    return sum(bool(r.get("beside_other_jobs")) for r in runs)


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
