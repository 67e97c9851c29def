"""A ladder sweep's section of its findings page: each setting's fitted L(N) = E + A N^-alpha, the claim's gap across
sizes with its transfer verdict, the decision accuracy between the smallest and the largest rung, and the
loss-against-parameters figure (log-log, a fitted line per setting, the rungs' seed means with their range).

Rows are the report's (collect.py): one per run, with its config flattened (`study.rung`), its `params` and
`final_val_loss`. N is a rung's parameter count as results.json records it (embeddings included), averaged over
the setting's seeds at that rung (seeds do not change it). The statistics are report/scaling.py's."""
import io

from blocklab.report import scaling
from blocklab.report.scaling import Rung

METRIC = "final_val_loss"


def _setting(row: dict, keys: list[str]) -> str:
    return ",".join(str(row.get(k)) for k in keys)


def setting_keys(study: dict) -> list[str]:
    """What names a setting: the study's compare keys but the rung."""
    return [k for k in study["compare"] if k != "study.rung"]


def _matches(row: dict, spec: dict) -> bool:
    return all(str(row.get(k)) == str(v) for k, v in spec.items())


def ladder_rungs(rows: list[dict], study: dict, metric: str = METRIC) -> dict[str, list[Rung]]:
    """{setting: its rungs, in the ladder's order}, from the finished runs; a setting missing a rung, or a rung
    without a finite loss, leaves that rung out for every setting (the fits compare the same sizes)."""
    keys, order = setting_keys(study), list(study["ladder"]["rungs"])
    cells: dict[str, dict[str, dict[int, tuple[float, float]]]] = {}
    for row in rows:
        loss, params = row.get(metric), row.get("params")
        if row.get("status") != "completed" or not isinstance(loss, (int, float)) or not isinstance(params, int):
            continue
        rung = str(row.get("study.rung") or order[0])
        cells.setdefault(_setting(row, keys), {}).setdefault(rung, {})[int(row.get("seed", 0))] = (params, loss)
    complete = [r for r in order if cells and all(cells[s].get(r) for s in cells)]
    return {setting: [Rung(sum(p for p, _ in by_rung[r].values()) / len(by_rung[r]),
                           {seed: loss for seed, (_, loss) in by_rung[r].items()}) for r in complete]
            for setting, by_rung in sorted(cells.items())}


def _fmt(interval: scaling.Interval, digits: int = 3) -> str:
    if interval.value is None:
        return "-"
    span = f" [{interval.low:.{digits}f}, {interval.high:.{digits}f}]" if interval.low is not None else ""
    return f"{interval.value:.{digits}f}{span}"


def ladder_section(rows: list[dict], study: dict, figure: str | None = None, resamples: int = scaling.RESAMPLES
                   ) -> tuple[str, bytes | None]:
    """The section's markdown and, given the figure's file name (which the markdown links), its PNG bytes for the
    caller to write beside the page (through blocklab.folder)."""
    settings = ladder_rungs(rows, study)
    title = "## Does it hold at scale?"
    if len(next(iter(settings.values()), [])) < scaling.MIN_RUNGS:
        return f"{title}\n\nFewer than {scaling.MIN_RUNGS} rungs have every setting finished: no fit yet.\n", None
    fitted = scaling.fits(settings, resamples)
    lines = [title, "", f"L(N) = E + A N^-alpha per setting, fitted to the mean {METRIC} of each rung (variable "
             f"projection); intervals: {scaling.CONFIDENCE:.0%} bootstrap over seeds resampled within rungs "
             f"({resamples} times).", "", "| setting | E | alpha | A | rungs |", "|---|---|---|---|---|"]
    for name, (point, boot) in fitted.items():
        p = scaling.parameter_intervals(point, boot)
        bound = " (at a bound: E = 0 or alpha at its grid's end)" if point.at_bound else ""
        lines.append(f"| {name} | {_fmt(p['e'])} | {_fmt(p['alpha'])}{bound} | {point.a:.3g} | "
                     f"{len(settings[name])} |")
    verdict = study.get("verdict") or {}
    keys = setting_keys(study)
    better, than = (next((_setting(r, keys) for r in rows if _matches(r, verdict.get(side, {}))), None)
                    for side in ("better", "than"))
    comparison = None
    if better in settings and than in settings:
        comparison = scaling.compare(settings, better, than, fitted=fitted)
        lines += ["", f"Claim: {verdict.get('claim', f'{better} beats {than}')}. Gap L({better}) - L({than}) "
                  "(negative: the claim holds), fitted:", "", "| N | gap |", "|---|---|"]
        for n, gap in comparison.gaps.items():
            measured = "" if n <= comparison.measured[-1] * 1.0001 else " (extrapolated)"
            lines.append(f"| {n:,.0f}{measured} | {_fmt(gap, 4)} |")
        ahead = comparison.ahead
        who = f" ({ahead} ahead at the largest rung)" if ahead else ""
        lines += ["", f"**Transfer verdict: {comparison.verdict}**{who}."]
    accuracy = scaling.decision_accuracy(settings, resamples)
    if accuracy.value is not None:
        lines += ["", f"Decision accuracy, smallest against largest rung (the share of setting pairs in the same "
                  f"order at both; DataDecide, Magnusson et al. 2025): {_fmt(accuracy, 2)}."]
    png = None
    if figure is not None:
        png = draw(settings, fitted)
        lines += ["", f"![loss against parameters]({figure})"]
    return "\n".join(lines) + "\n", png


def draw(settings: dict[str, list[Rung]], fitted: dict) -> bytes:
    """Loss against parameters, log-log: each rung's seed mean with the seeds' range, and the fitted law to 100x
    the largest rung (dashed beyond the measured range)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 4))
    largest = max(r.n for rungs in settings.values() for r in rungs)
    for i, (name, rungs) in enumerate(settings.items()):
        color = f"C{i}"
        ns = np.array([r.n for r in rungs])
        means = np.array([r.mean for r in rungs])
        lows = means - np.array([min(r.losses.values()) for r in rungs])
        highs = np.array([max(r.losses.values()) for r in rungs]) - means
        ax.errorbar(ns, means, yerr=[lows, highs], fmt="o", color=color, label=name, capsize=2)
        point = fitted[name][0]
        inside = np.geomspace(ns.min(), largest, 50)
        beyond = np.geomspace(largest, largest * scaling.EXTRAPOLATE[-1], 50)
        ax.plot(inside, point(inside), color=color)
        ax.plot(beyond, point(beyond), color=color, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # 2.5, not 2.5 x 10^0
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("parameters N")
    ax.set_ylabel(METRIC)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})  # the same bytes on every build
    plt.close(fig)
    return buffer.getvalue()
