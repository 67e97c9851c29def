"""Plot kinds for recall sweeps, where every setting is trained at several learning rates and judged at its best
(Zoology, Arora et al. 2024, app. E: "we sweep the learning rate and report the best"):

- `recall_memory`: the score at the best learning rate against the decoding state it needs (results.json
  `decode.state_bytes`: the state one sequence holds after a training-length sequence), one line per setting through
  its `along` values (model.d_model): the recall-memory trade-off as Zoology (fig. 2) and Based (fig. 2) draw it.
- `lr_range`: the score against the learning rate per setting, and in the note each setting's best score and how
  many of the learning rates tried reach `fraction` of it: the width of the working range (a 2025 re-examination,
  arXiv 2508.19029, found recurrent models recall only inside a narrow one).

Study specs: {kind: recall_memory, metric: token_acc_in, by: [attn, attn.short_conv], along: model.d_model}
             {kind: lr_range, metric: token_acc_in, by: [attn, attn.short_conv], fraction: 0.9}
Both choose over `over` (default optim.lr) within each setting, and refuse to pool: runs of one setting and one
`over` value must differ only in their seed (a `where` or a `by` key picks the rest)."""
from collections import defaultdict
from dataclasses import dataclass, field

from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from blocklab.report.collect import LOWER_IS_BETTER
from blocklab.report.common import group, label, legend, name, not_recorded, short as _short, takes
from blocklab.schema import Keys, Number, Text

OVER = "optim.lr"
FRACTION = 0.9  # a value "works" when its mean reaches this share of the setting's best (the working range)
STATE = "state_bytes"  # the report column of results.json's decode.state_bytes (collect.py)


def _finite(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")
    return float(value) if ok else None


def higher_is_better(metric: str) -> bool:
    last = metric.rsplit(".", 1)[-1]
    return not (last in LOWER_IS_BETTER or last.endswith(("_bytes", "loss")))


@dataclass
class AtChoice:
    """One value of the `over` key within a setting: its runs' scores (one per seed) and their mean. `seeds` is the
    seed of each score: rates are compared on the seeds they share (best, working)."""

    value: float
    scores: list[float]
    members: list[dict]
    seeds: list = field(default_factory=list)

    @property
    def mean(self) -> float:
        return sum(self.scores) / len(self.scores)

    def mean_on(self, seeds: set) -> float:
        """The mean over the scores of these seeds (all scores where `seeds` is empty)."""
        kept = [s for s, seed in zip(self.scores, self.seeds) if seed in seeds] if seeds else self.scores
        return sum(kept) / len(kept)


def at_choice(value, members: list[dict], score) -> AtChoice | None:
    """The runs of one `over` value with their finite scores (score(run) -> number or None) and seeds; None where no
    run has one."""
    scored = [(s, m) for m in members if (s := _finite(score(m))) is not None]
    if not scored:
        return None
    return AtChoice(value, [s for s, _ in scored], [m for _, m in scored], [m.get("seed") for _, m in scored])


def choices(members: list[dict], metric: str, over: str) -> list[AtChoice]:
    """A setting's runs per value of `over` (numeric order), each with the finite scores of its seeds."""
    per = defaultdict(list)
    for m in members:
        if _finite(m.get(over)) is not None:
            per[float(m[over])].append(m)
    return [c for value in sorted(per) if (c := at_choice(value, per[value], lambda m: m.get(metric)))]


def shared_seeds(options: list[AtChoice]) -> set:
    """The seeds every option was run at: a stage 2 that adds seeds at the best rate alone must not decide the best
    again, since a rate's mean over more seeds regresses where one seed's does not (the winner's curse). Empty where
    the options share none, or a score's seed is unknown."""
    seen = [set(c.seeds) for c in options]
    if not seen or any(None in s or len(s) != len(c.scores) for s, c in zip(seen, options)):
        return set()
    return set.intersection(*seen)


def best(options: list[AtChoice], higher: bool = True) -> AtChoice:
    """The option with the best mean on the seeds all options share (stage 1's); its own mean is over all its seeds."""
    seeds = shared_seeds(options)
    return max(options, key=lambda c: c.mean_on(seeds) if higher else -c.mean_on(seeds))


def best_named(options: list[AtChoice], higher: bool = True) -> str:
    """The best value, where values were tried on both sides of it; else "not bracketed" at the grid's edge: a
    better rate may lie past it, so none is named the best."""
    top, values = best(options, higher), [c.value for c in options]
    if len(values) >= 3 and min(values) < top.value < max(values):
        return f"{top.value:g}"
    return f"{top.value:g} (the {'lowest' if top.value == min(values) else 'highest'} tried: not bracketed)"


def working(options: list[AtChoice], fraction: float, higher: bool = True) -> list[AtChoice]:
    """The values whose mean reaches `fraction` of the best mean (none where the best is not above 0); for a metric
    better lower, those within best / fraction. Means on the seeds all options share, as `best` chooses."""
    seeds = shared_seeds(options)
    top = best(options, higher).mean_on(seeds)
    return [c for c in options
            if top > 0 and (c.mean_on(seeds) >= fraction * top if higher else c.mean_on(seeds) <= top / fraction)]


def pooled(rows: list[dict], keys: list[str]) -> str | None:
    """A sentence naming a group of `keys` that holds two runs of one seed (runs that differ in a key the plot
    neither draws nor fixes), None where every group's runs are seeds."""
    for key, members in group(rows, keys).items():
        seeds = [m.get("seed") for m in members]
        if len(seeds) != len(set(seeds)):
            n = len(set(seeds))
            return (f"not drawn: {name(keys, key)} holds {len(members)} runs of {n} seed{'s' if n > 1 else ''}, so "
                    "they differ in another key; add it to `by` or fix it with `where`.")
    return None


def _refuse(ax, note: str) -> str:
    ax.text(0.5, 0.5, "runs differ in a key this plot does not show", ha="center", va="center", transform=ax.transAxes)
    return note


@takes(x=Text(), over=Text(), along=Keys("a key or list of keys, e.g. model.d_model"))
def plot_recall_memory(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """Per setting of `by` and value of `along`: the metric at the best `over` value (mean over its seeds; bars:
    min to max over those seeds) against `x` (default state_bytes), log axis; one line per setting of `by`."""
    x, over = spec.get("x", STATE), spec.get("over", OVER)
    along = [spec["along"]] if isinstance(spec.get("along"), str) else list(spec.get("along") or [])
    if (note := pooled(rows, [*by, *along, over])) is not None:
        return _refuse(ax, note)
    higher = higher_is_better(metric)
    lines, listed = [], []
    for key, members in group(rows, by).items():
        points = []
        for where, runs in group(members, along).items():
            options = choices(runs, metric, over)
            states = [s for m in runs if (s := _finite(m.get(x))) is not None]
            if not options or not states:
                continue
            top = best(options, higher)
            points.append((sum(states) / len(states), top))
            listed.append(f"{name([*by, *along], (*key, *where))}: {top.mean:.3f} at {_short(over)}="
                          f"{best_named(options, higher)}, "
                          f"{x} {sum(states) / len(states):,.0f}")
        if points:
            lines.append((key, sorted(points, key=lambda p: p[0])))
    if not lines:
        return not_recorded(ax, f"{metric} against {x}")
    for key, points in lines:
        xs = [p for p, _ in points]
        ys = [c.mean for _, c in points]
        errors = [[c.mean - min(c.scores) for _, c in points], [max(c.scores) - c.mean for _, c in points]]
        ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=label(key) or metric)
    _plain_log(ax)
    ax.set_xlabel(f"{x} (log){' along ' + ', '.join(map(_short, along)) if along else ''}; "
                  f"each point at its best {_short(over)}, bars: min to max over seeds")
    ax.set_ylabel(f"{metric}, best over {_short(over)}")
    legend(ax, by)
    return f"{metric} at the best {_short(over)} (mean over seeds) against {x}: " + "; ".join(listed) + "."


@takes(over=Text(), fraction=Number(0, 1, low_open=True))
def plot_lr_range(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """The metric against `over` (default optim.lr, log axis) per setting: the mean over seeds, the seed range
    shaded. The note gives each setting's best mean and its working range: the `over` values whose mean reaches
    `fraction` (default 0.9) of that best, k of the n tried."""
    over, fraction = spec.get("over", OVER), spec.get("fraction", FRACTION)
    if not higher_is_better(metric):
        ax.text(0.5, 0.5, f"{metric}: lower is better", ha="center", va="center", transform=ax.transAxes)
        return f"not drawn: a working range is a share of the best score, and {metric} is better lower; use a score."
    if (note := pooled(rows, [*by, over])) is not None:
        return _refuse(ax, note)
    notes = []
    for key, members in group(rows, by).items():
        options = choices(members, metric, over)
        if not options:
            continue
        xs = [c.value for c in options]
        (line,) = ax.plot(xs, [c.mean for c in options], marker="o", label=label(key) or metric)
        ax.fill_between(xs, [min(c.scores) for c in options], [max(c.scores) for c in options],
                        color=line.get_color(), alpha=0.2, linewidth=0)
        top, ok = best(options), working(options, fraction)
        span = f" ({', '.join(f'{c.value:g}' for c in ok)})" if ok else ""
        notes.append(f"{name(by, key) or 'all runs'}: best {top.mean:.3f} at {_short(over)}={best_named(options)}, "
                     f"{len(ok)} of {len(options)} reach {fraction:g} x best{span}")
    if not notes:
        return not_recorded(ax, f"{metric} per {over}")
    _plain_log(ax, sorted({c.value for key, members in group(rows, by).items()
                           for c in choices(members, metric, over)}))
    ax.set_xlabel(f"{over} (log; shaded: min to max over seeds)")
    legend(ax, by)
    return (f"{metric} per {_short(over)}, mean over seeds; working range = the {_short(over)} values whose mean "
            f"reaches {fraction:g} x the setting's best: " + "; ".join(notes) + ".")


def _plain_log(ax, ticks: list[float] | None = None) -> None:
    """A log x axis labelled in plain numbers (the report draws text without mathtext), at `ticks` if given."""
    ax.set_xscale("log")
    if ticks:
        ax.set_xticks(ticks)
    else:  # 1, 2 and 5 in every decade: a span narrower than a decade still shows numbers
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1000 else f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
