"""The generic plot kinds of a sweep's `plots:` (report/figures.py registers them): a metric per setting (bar),
against a numeric choice (by_choice), against evaluation length (length_curve, by_length) or place in the answer
(by_position), per layer (by_layer), and quality against a cost (tradeoff). Each draws one axes from rows that a
collected run and a findings page's job line both give (figures_data.page_rows); lines take their colour and style
from the figure's cycle, so no two share both, and legends sit beside the axes."""
from cycler import cycler
from matplotlib import colormaps
from matplotlib.ticker import MaxNLocator

from blocklab.report import length_gen, stats
from blocklab.report.common import WHEN, band as _band, group, label as _label, legend as _legend, name as _name
from blocklab.report.common import not_recorded, short as _short, takes
from blocklab.report.figures_data import direction as _direction, value as _value
from blocklab.schema import Choice, Number, Text

# 40 (colour, line style) pairs, the colour changing first: two lines of one figure never look alike.
STYLES = cycler(linestyle=["-", "--", "-.", ":"]) * cycler(color=list(colormaps["tab10"].colors))


def mean_std(values: list) -> tuple[float | None, float | None, int]:
    e = stats.estimate(values)
    return (None, None, 0) if e is None else (e.mean, e.sd, e.n)


def _fmt(mean, std, n) -> str:
    if mean is None:
        return "–"
    digits = 0 if abs(mean) >= 1000 else 3
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if n > 1 else "")


def plot_length_curve(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """The metric against evaluation length per setting: the mean over seeds, the seed range (min to max)
    shaded; dashed: the longest trained length. The note names the widest seed range beyond training."""
    groups = group(rows, by)
    curves = [(_label(key) or metric, length_gen.curve(members, metric)) for key, members in groups.items()]
    names = [_name(by, key) or metric for key in groups]
    note = length_gen.draw(ax, curves, sorted({r["train_max_length"] for r in rows}), metric, names)
    _legend(ax, by)
    return note


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


def plot_by_length(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """The length curve under the name the position-scheme sweeps use."""
    return plot_length_curve(ax, rows, spec, metric, by)


@takes(required=("x",), x=Text())
def plot_by_choice(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """The metric against a numeric choice `x` (log2 axis), one line per setting: the mean over seeds, the seed
    range shaded. `metric` (and `x`) is a report column or a results.json field by dotted path."""
    shown: set[float] = set()
    for key, members in group(rows, by).items():
        points = [(_value(m, spec["x"]), _value(m, metric)) for m in members]  # each run's fields read once
        xs = sorted(set(stats.finite(x for x, _ in points)))  # a dotted results.json field may hold anything
        per_x = [stats.finite([y for px, y in points if px == x]) for x in xs]
        xs, per_x = [x for x, v in zip(xs, per_x) if v], [v for v in per_x if v]
        if not xs:
            continue
        (line,) = ax.plot(xs, [sum(v) / len(v) for v in per_x], marker="o", label=_label(key) or metric)
        _band(ax, xs, [min(v) for v in per_x], [max(v) for v in per_x], line)
        shown.update(xs)
    if not shown:
        return not_recorded(ax, metric)
    ax.set_xscale("log", base=2)
    # Ticks at the values the sweep chose (1e-3, 3e-3), not at powers of 2 (0.0019531)
    ax.set_xticks(sorted(shown), minor=False)
    ax.set_xticks([], minor=True)
    ax.set_xlabel(f"{spec['x']} (shaded: min to max over seeds)")
    _legend(ax, by)
    return None


@takes(when=WHEN, scale=Choice(("auto", "log", "linear"), noun="a y axis scale"), panels=Text())
def plot_by_layer(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """A per-layer diagnostic (at init or at the end, `when`), one line per setting and depth: the mean over
    seeds, the seed range shaded. `scale`: log (a decay over decades, e.g. rank collapse: zeros are left off),
    linear, or auto (log where every value is positive). `panels`: a key whose values each get a panel of their
    own, side by side on one y axis (init_depth: one per norm, so 6 inits x 2 depths stay readable). The note
    gives each line's first and last layer."""
    key = spec.get("panels")
    if not key:
        return _layers(ax, rows, spec, metric, by)
    values = list(group(rows, [key]))
    fig = ax.figure
    ax.set_visible(False)  # kept, hidden: the figure gets a panel per value
    fig.set_size_inches(4.2 * len(values) + 1.6, 3.8)
    panels = fig.subplots(1, len(values), squeeze=False, sharey=True)[0]
    # one style per line across the panels, so the last panel's legend names the lines of every panel
    styles = dict(zip(group(rows, by + ["model.n_layers"]), STYLES()))
    notes = []
    for (value,), panel in zip(values, panels):
        note = _layers(panel, [r for r in rows if r.get(key) == value], spec, metric, by, panel is panels[-1], styles)
        panel.set_title(f"{_short(key)}={value}", fontsize=9)
        notes.append(f"{_short(key)}={value}: {note}")
    panels[0].set_ylabel(metric)
    for panel in panels[1:]:
        panel.set_ylabel("")
    return " ".join(notes)


def _layers(ax, rows: list[dict], spec: dict, metric: str, by: list[str], legend: bool = True,
            styles: dict | None = None) -> str:
    when, keys = spec.get("when", "init"), by + ["model.n_layers"]
    drawn, ends = [], []
    for key, members in group(rows, keys).items():
        series = [m[f"layers_{when}"].get(metric) for m in members if m.get(f"layers_{when}")]
        series = [s for s in series if s and None not in s]
        if not series:
            continue
        per_layer = list(zip(*series))
        (line,) = ax.plot(range(len(per_layer)), [sum(v) / len(v) for v in per_layer], label=_label(key),
                          **(styles or {}).get(key, {}))
        _band(ax, range(len(per_layer)), [min(v) for v in per_layer], [max(v) for v in per_layer], line)
        drawn += [x for v in per_layer for x in v]
        means = [sum(v) / len(v) for v in per_layer]
        ends.append(f"{_name(keys, key)}: {stats.fmt(means[0])} → {stats.fmt(means[-1])}")
    if not drawn:
        return not_recorded(ax, f"{metric} at {when}")
    scale = spec.get("scale", "auto")
    if scale == "log" or (scale == "auto" and min(drawn) > 0):  # norms span decades; a fraction at 0 stays linear
        ax.set_yscale("log", nonpositive="mask")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"layer (at {when}; shaded: min to max over seeds)")
    ax.set_ylabel(metric)
    if legend:
        _legend(ax, keys)
    return f"{metric} at {when}, first layer → last (mean over seeds): " + "; ".join(ends) + "."


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
