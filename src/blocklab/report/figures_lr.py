"""Plot kinds of a learning-rate sensitivity study (Wortsman et al. 2023, "Small-scale proxies for large-scale
Transformer training instabilities", ICLR 2024):

- `lr_curve`: the final loss against the learning rate per setting (their fig. 1): each rate's loss capped at the
  loss at init (report/lr_sensitivity.py: a diverged run counts as l_0), the mean over seeds, the seed range shaded.
  The note names each setting's LR sensitivity (mean over seeds, with its 95% interval), its best rate and its
  working range: the rates whose mean loss is within `within` nats of its best.
- `over_step`: a quantity recorded at every validation against the training step (results.json
  diagnostics.logit_curve: max_attention_logit, the largest over layers; max_output_logit; mean_log_z;
  probe_loss), one line per setting, the mean over seeds and their range; a `where` picks the learning rate
  (the two instabilities show at the high ones: their figs. 4 and 6).

Study specs: {kind: lr_curve, metric: final_val_loss, by: [modification], within: 0.05}
             {kind: over_step, metric: max_attention_logit, by: [modification], where: {optim.lr: 0.32}}"""
from collections import defaultdict

from blocklab.report import stats
from blocklab.report.common import band, group, label, legend, name, not_recorded, short, takes
from blocklab.report.figures_data import step_curve, value
from blocklab.report.lr_sensitivity import OVER, capped
from blocklab.report.recall import _plain_log, best_named, choices, pooled
from blocklab.schema import Choice, Number, Text

WITHIN = 0.05  # nats: a rate whose mean capped loss is this close to the setting's best is in its working range


def _capped_rows(rows: list[dict], metric: str) -> list[dict]:
    """Rows whose `metric` is capped at their own loss at init (init_loss, from lr_sensitivity.annotate)."""
    out = []
    for r in rows:
        start = value(r, "init_loss")
        if isinstance(start, (int, float)):
            out.append({**r, metric: capped(value(r, metric), r.get("status"), float(start))})
    return out


@takes(over=Text(), within=Number(0, low_open=True))
def plot_lr_curve(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """`metric` (a loss) capped at the loss at init, against `over` (default optim.lr, log axis), per setting."""
    over, within = spec.get("over", OVER), spec.get("within", WITHIN)
    if (note := pooled(rows, [*by, over])) is not None:
        ax.text(0.5, 0.5, "runs differ in a key this plot does not show", ha="center", va="center",
                transform=ax.transAxes)
        return note
    rows = _capped_rows(rows, metric)
    notes, ticks = [], set()
    for key, members in group(rows, by).items():
        options = choices(members, metric, over)
        if not options:
            continue
        xs = [c.value for c in options]
        ticks.update(xs)
        (line,) = ax.plot(xs, [c.mean for c in options], marker="o", label=label(key) or metric)
        band(ax, xs, [min(c.scores) for c in options], [max(c.scores) for c in options], line)
        top = min(c.mean for c in options)
        ok = [f"{c.value:g}" for c in options if c.mean <= top + within]
        e = stats.estimate([m.get("lr_sensitivity") for m in _one_per_seed(members)])
        sens = "not recorded" if e is None else stats.mean_interval(e) if e.has_interval else stats.fmt(e.mean)
        notes.append(f"{name(by, key) or 'all runs'}: LR sensitivity {sens}; best {short(over)} "
                     f"{best_named(options, higher=False)} ({top:.3f}); within {within:g} of it: {', '.join(ok)}")
    if not notes:
        return not_recorded(ax, f"{metric} per {over}")
    _plain_log(ax, sorted(ticks))
    ax.set_xlabel(f"{over} (log; shaded: min to max over seeds)")
    ax.set_ylabel(f"{metric}, capped at the loss at init")
    legend(ax, by)
    return (f"{metric} per {short(over)} (a diverged run counts as the loss at init), mean over seeds; LR "
            f"sensitivity = the mean over the rates of the capped loss minus its lowest (Wortsman et al. 2023, "
            f"sec. 2.2), mean [95% CI] over seeds: " + "; ".join(notes) + ".")


def _one_per_seed(members: list[dict]) -> list[dict]:
    """A curve's rows carry one sensitivity each: one row per seed."""
    first = {}
    for m in members:
        first.setdefault(m.get("seed"), m)
    return list(first.values())


@takes(scale=Choice(("auto", "log", "linear"), noun="a y axis scale"))
def plot_over_step(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """`metric` of each run's logit curve against the step, per setting: the mean over seeds at each step, the seed
    range shaded. `scale`: log, linear, or auto (log where every value is positive and they span over a decade)."""
    lines = []
    for key, members in group(rows, by).items():
        per_step = defaultdict(list)
        for m in members:
            for step, v in step_curve(m, metric):
                per_step[step].append(v)
        if per_step:
            steps = sorted(per_step)
            lines.append((key, steps, [per_step[s] for s in steps]))
    if not lines:
        return not_recorded(ax, f"{metric} against step")
    ends = []
    for key, steps, values in lines:
        means = [sum(v) / len(v) for v in values]
        (line,) = ax.plot(steps, means, marker=".", label=label(key) or metric)
        band(ax, steps, [min(v) for v in values], [max(v) for v in values], line)
        peak = max(range(len(means)), key=means.__getitem__)
        ends.append(f"{name(by, key) or metric}: {means[0]:.3g} at step {steps[0]}, highest {means[peak]:.3g} "
                    f"(step {steps[peak]}), {means[-1]:.3g} at step {steps[-1]}")
    every = [v for _, _, values in lines for vs in values for v in vs]
    scale = spec.get("scale", "auto")
    if scale == "log" or (scale == "auto" and min(every) > 0 and max(every) > 10 * min(every)):
        ax.set_yscale("log")
    ax.set_xlabel("training step (shaded: min to max over seeds)")
    ax.set_ylabel(metric)
    legend(ax, by)
    return f"{metric} on the probe batch against step (mean over seeds): " + "; ".join(ends) + "."
