"""A ladder sweep's section of its findings page: each setting's fitted L(N) = E + A N^-alpha, each claim's gap across
sizes with its transfer verdict, the decision accuracy between the smallest and the largest rung, and the
loss-against-parameters figure (log-log, a fitted line per setting, the rungs' seed means with their range).
Only settings that learned their task at every rung are fitted (report/learned.py's bar, as on every findings page):
the others are listed with the rungs where they did not, and a claim on one of them is not testable across sizes.

Rows are the report's (collect.py): one per run, with its config flattened (`study.rung`), its `params`, `steps` and
`final_val_loss`. N is a rung's parameter count as results.json records it (embeddings included), averaged over
the setting's seeds at that rung (seeds do not change it). A token ladder (blocklab/ladder.py: one model, the
cooldown branches of one wsd trunk per setting and seed) has training tokens D instead: a run's steps times the
ladder's tokens_per_step, the fit L(D) = E + B D^-beta, and its trunk's rows left out of the fit (a trunk does not
decay). The statistics and the axis's words are report/scaling.py's.

A findings page (page_text.py) draws the section from its jsonl (`rows_of` its job lines; the header's study block
keeps `ladder`), its figure beside it as <sweep>.ladder.png, and states the parametrization each run recorded (a run
from before the param group records none: sp). The index's "holds at scale?" cell is `holds`: the transfer verdict
said of the claim ("yes: ..." where the claim's side is ahead at the largest rung, "no: X ahead, ..." where not)."""
import functools
import io
from collections import Counter

from markupsafe import Markup

from blocklab import ladder
from blocklab.report import learned, scaling
from blocklab.report.judge import claims as registered_claims
from blocklab.report.markdown import md
from blocklab.report.scaling import Rung

METRIC = "final_val_loss"
TITLE = "Does it hold at scale?"
ANCHOR = "does-it-hold-at-scale"  # the heading's anchor as GitHub and most renderers make it
LEARNING_KEYS = ("references", "eval", "metrics", "in_distribution_exact_match")  # what report/learned.py reads
DEFAULT_PARAM = "sp"  # a run that records no `param` ran before the group existed: the standard parametrization
# What a token ladder's rungs are, said under its parametrization (the sweep file says the rest).
TOKEN_AXIS = ("The rungs are training budgets of one model: D is a run's steps x {per_step:,} tokens. Each is a "
              "cooldown branch of one warmup-stable-decay trunk per setting and seed (Hägele et al. 2024): it starts "
              "from the trunk's state at its branch point and decays the learning rate over the last part of its own "
              "steps. The rungs of a seed share their trunk's first steps, so they are not independent samples: the "
              "bootstrap draws whole seeds. One width, one data order: this says how the gap moves as the budget "
              "grows at this size, not across sizes.")


def _setting(row: dict, keys: list[str]) -> str:
    """A setting's name: its values, a number with its key (n_heads=4, not 4)."""
    return ",".join(v if not v.replace(".", "").lstrip("-").isdigit() else f"{k.rsplit('.', 1)[-1]}={v}"
                    for k in keys for v in [str(row.get(k))])


def setting_keys(study: dict) -> list[str]:
    """What names a setting: the study's compare keys but the rung."""
    return [k for k in study["compare"] if k != "study.rung"]


def _matches(row: dict, spec: dict) -> bool:
    return all(str(row.get(k)) == str(v) for k, v in spec.items())


def axis_of(study: dict) -> scaling.Axis:
    """The ladder's axis: parameters N, or a token ladder's training tokens D."""
    return scaling.AXES[ladder.axis(study["ladder"])]


def _x(row: dict, study: dict) -> int | None:
    """A run's place on the axis: its parameter count, or its training tokens (steps x tokens per step)."""
    if axis_of(study) is scaling.PARAMS:
        return row.get("params")
    steps = row.get("steps")
    return steps * study["ladder"]["budget"]["tokens_per_step"] if isinstance(steps, int) else None


def ladder_rungs(rows: list[dict], study: dict, metric: str = METRIC) -> dict[str, list[Rung]]:
    """{setting: its rungs, in the ladder's order}, from the finished runs; a setting missing a rung, or a rung
    without a finite loss, leaves that rung out for every setting (the fits compare the same sizes)."""
    keys, order = setting_keys(study), list(study["ladder"]["rungs"])
    first = ladder.rung_names(study["ladder"])[0]  # a job that sets no study.rung: a token ladder's trunk
    cells: dict[str, dict[str, dict[int, tuple[float, float]]]] = {}
    for row in rows:
        loss, x = row.get(metric), _x(row, study)
        if row.get("status") != "completed" or not isinstance(loss, (int, float)) or not isinstance(x, int):
            continue
        rung = str(row.get("study.rung") or first)
        cells.setdefault(_setting(row, keys), {}).setdefault(rung, {})[int(row.get("seed", 0))] = (x, loss)
    complete = [r for r in order if cells and all(cells[s].get(r) for s in cells)]
    return {setting: [Rung(sum(p for p, _ in by_rung[r].values()) / len(by_rung[r]),
                           {seed: loss for seed, (_, loss) in by_rung[r].items()}) for r in complete]
            for setting, by_rung in sorted(cells.items())}


def not_learned(rows: list[dict], study: dict) -> dict[str, list[tuple[str, learned.Learning]]]:
    """{setting: [(rung, its Learning)] for each rung where it did not learn its task} (report/learned.py's bar, as
    every findings page judges it). A fit of a setting that did not learn at some size describes no model of its
    task, and a gap against it measures the failure, so such a setting is left out of the fits and the verdict."""
    keys, order = setting_keys(study), ladder.rung_names(study["ladder"])
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        rung = str(row.get("study.rung") or order[0])
        if row.get("status") in ("completed", "diverged") and rung in order:
            groups.setdefault((_setting(row, keys), rung), []).append(row)
    failed: dict[str, list[tuple[str, learned.Learning]]] = {}
    for (setting, rung), members in sorted(groups.items(), key=lambda g: (g[0][0], order.index(g[0][1]))):
        if (e := learned.learning(members)) is not None and not e.learned:
            failed.setdefault(setting, []).append((rung, e))
    return failed


def claims(study: dict) -> list[dict]:
    """The study's registered claims: its verdict, then each of its `also` (as every page reads them)."""
    return registered_claims({"study": study})


def claim_sides(rows: list[dict], study: dict, claim: dict | None = None) -> tuple[str | None, str | None]:
    """The settings a claim (default: the study's first) names: (better, than), each None where no row matches."""
    claim, keys = claim if claim is not None else (study.get("verdict") or {}), setting_keys(study)
    return tuple(next((_setting(r, keys) for r in rows if _matches(r, spec)), None)
                 if isinstance(spec := claim.get(side), dict) and spec else None for side in ("better", "than"))


def untestable(rows: list[dict], study: dict, claim: dict | None = None) -> str | None:
    """Why a claim's transfer verdict is not testable (a side did not learn at some rung), or None."""
    failed = not_learned(rows, study)
    lost = [f"{side} did not learn its task at {', '.join(rung for rung, _ in failed[side])}"
            for side in claim_sides(rows, study, claim) if side in failed]
    return "; ".join(lost) or None


def _fmt(interval: scaling.Interval, digits: int = 3) -> str:
    if interval.value is None:
        return "-"
    span = f" [{interval.low:.{digits}f}, {interval.high:.{digits}f}]" if interval.low is not None else ""
    return f"{interval.value:.{digits}f}{span}"


@functools.lru_cache(maxsize=8)
def _analysis(frozen: tuple, sides: tuple, resamples: int, axis: scaling.Axis):
    """The fits, each claim's comparison (None without both sides) and the decision accuracy of one ladder: computed
    once per ladder and bootstrap size (a page, its figure and the index all read them)."""
    settings = {name: [Rung(n, dict(losses)) for n, losses in rungs] for name, rungs in frozen}
    fitted = scaling.fits(settings, resamples, axis=axis)
    comparisons = tuple(scaling.compare(settings, better, than, fitted=fitted, axis=axis)
                        if better in settings and than in settings else None for better, than in sides)
    return settings, fitted, comparisons, scaling.decision_accuracy(settings, resamples, axis=axis)


def analysis(rows: list[dict], study: dict, resamples: int = scaling.RESAMPLES):
    """(settings, fits, each claim's Comparison or None, in `claims` order, decision accuracy), or None below
    MIN_RUNGS complete rungs. A setting that did not learn at some rung (`not_learned`) is left out of all of them."""
    failed, keys = not_learned(rows, study), setting_keys(study)
    settings = ladder_rungs([r for r in rows if _setting(r, keys) not in failed], study)
    if len(next(iter(settings.values()), [])) < scaling.MIN_RUNGS:
        return None
    frozen = tuple((name, tuple((r.n, tuple(sorted(r.losses.items()))) for r in rungs))
                   for name, rungs in settings.items())
    sides = tuple(claim_sides(rows, study, claim) for claim in claims(study))
    return _analysis(frozen, sides, resamples, axis_of(study))


def for_the_claim(comparison: scaling.Comparison, better: str) -> str:
    """The transfer verdict said of the claim (`better` beats the other): "yes: ..." where the claim's side is ahead
    at the largest rung, "no: X ahead, ..." where the other is, else the verdict (undetermined)."""
    if comparison.ahead is None:
        return comparison.verdict
    return f"yes: {comparison.verdict}" if comparison.ahead == better else \
        f"no: {comparison.ahead} ahead, {comparison.verdict}"


def parametrization(rows: list[dict]) -> str:
    """Which parametrization the runs trained under, from what each recorded (`param`; none recorded: sp), as
    Markdown (the recorded names escaped)."""
    done = [r for r in rows if r.get("status") == "completed"]
    counts = Counter(str(r.get("param") or DEFAULT_PARAM) for r in done)
    unrecorded = sum(1 for r in done if not r.get("param"))
    said = ", ".join(f"param={md(name)} ({n} of {len(done)} runs)" for name, n in sorted(counts.items()))
    note = (f" ({unrecorded} of them record no `param`: they trained before the param group existed, under the "
            "standard parametrization)" if unrecorded else "")
    if set(counts) == {"mup"}:
        return f"Parametrization: {said}: one learning rate serves every width (µP)."
    return (f"Parametrization: {said}{note}. Not µP: the learning rate, initialization and logit scale do not follow "
            "the width, so a rung's loss also measures how well the one learning rate suits that width; a ladder "
            "under param=mup would separate the two.")


def _claim_lines(claim: dict, comparison: scaling.Comparison | None, why: str | None, axis: scaling.Axis,
                 label: str, first: bool) -> list[str]:
    """One claim's part of the section: its fitted gap across the rungs and its transfer verdict, or why it is not
    testable (a side did not learn at some rung); nothing where the ladder lacks a side."""
    index = " (the findings index's \"holds at scale?\")" if first else ""
    if why is not None:
        return ["", f"{label}: {md(claim.get('claim') or 'the claim')}. **Transfer verdict: not testable**: "
                f"{md(why)}; said of the claim{index}: not testable."]
    if comparison is None:
        return []
    better, than, x = comparison.a, comparison.b, axis.symbol
    lines = ["", f"{label}: {md(claim.get('claim') or f'{better} beats {than}')}. Gap L({md(better)}) - L({md(than)}) "
             "(negative: the claim holds), fitted:", "", f"| {x} | gap |", "|---|---|"]
    for n, gap in comparison.gaps.items():
        measured = "" if n <= comparison.measured[-1] * 1.0001 else " (extrapolated)"
        lines.append(f"| {n:,.0f}{measured} | {_fmt(gap, 4)} |")
    who = f" ({md(comparison.ahead)} ahead at the largest rung)" if comparison.ahead else ""
    return lines + ["", f"**Transfer verdict: {comparison.verdict}**{who}. Said of the claim{index}: "
                    f"{md(for_the_claim(comparison, better))}."]


def ladder_section(rows: list[dict], study: dict, figure: str | None = None, resamples: int = scaling.RESAMPLES,
                   guide: str | None = None, png: bool = True) -> tuple[Markup, bytes | None]:
    """The section's markdown (untrusted names escaped) and, given the figure's file name (which the markdown
    links), its PNG bytes for the caller to write beside the page (through blocklab.folder; png=False: the text
    alone). `guide`: the page that explains how to read the section, linked under its title."""
    found = analysis(rows, study, resamples)
    axis = axis_of(study)
    x, c, e = axis.symbol, axis.coefficient, axis.exponent
    lines = [f"### {TITLE}", ""]
    if guide:
        lines += [f"How to read this section: [reading a transfer verdict]({guide}).", ""]
    lines += [parametrization(rows), ""]
    if axis is scaling.TOKENS:
        lines += [TOKEN_AXIS.format(per_step=study["ladder"]["budget"]["tokens_per_step"]), ""]
    failed = not_learned(rows, study)
    if failed:
        lines += ["Left out of the fits, the verdict and the decision accuracy: the settings that did not learn their "
                  "task at some rung (a fit of them describes no model of the task).", "",
                  "| setting | rung | seeds that learned | why |", "|---|---|---|---|"]
        lines += [f"| {md(name)} | {md(rung)} | {e.learned_seeds} of {e.measured} | {md(e.why())} |"
                  for name, at in failed.items() for rung, e in at]
        lines.append("")
    if found is None:
        told = "No setting learned at every rung: nothing to fit." if failed and not ladder_rungs(
            [r for r in rows if _setting(r, setting_keys(study)) not in failed], study) else \
            f"Fewer than {scaling.MIN_RUNGS} rungs have every setting finished: no fit yet."
        for i, claim in enumerate(claims(study)):
            if (why := untestable(rows, study, claim)) is not None:
                lines += _claim_lines(claim, None, why, axis, f"Claim {i + 1}" if len(claims(study)) > 1 else
                                      "Claim", first=i == 0)[1:] + [""]
        return Markup("\n".join(lines + [told]) + "\n"), None
    settings, fitted, comparisons, accuracy = found
    drawn_seeds = "whole seeds resampled, the same at every rung" if axis.whole_seeds else \
        "seeds resampled within rungs"
    lines += [f"L({x}) = E + {c} {x}^-{e} per setting, fitted to the mean {METRIC} of each rung (variable "
              f"projection); intervals: {scaling.CONFIDENCE:.0%} bootstrap over {drawn_seeds} ({resamples} times).",
              "", f"| setting | E | {e} | {c} | rungs |", "|---|---|---|---|---|"]
    for name, (point, boot) in fitted.items():
        p = scaling.parameter_intervals(point, boot)
        bound = f" (at a bound: E = 0 or {e} at its grid's end)" if point.at_bound else ""
        lines.append(f"| {md(name)} | {_fmt(p['e'])} | {_fmt(p['alpha'])}{bound} | {point.a:.3g} | "
                     f"{len(settings[name])} |")
    registered = claims(study)
    for i, (claim, comparison) in enumerate(zip(registered, comparisons)):
        lines += _claim_lines(claim, comparison, untestable(rows, study, claim), axis,
                              f"Claim {i + 1}" if len(registered) > 1 else "Claim", first=i == 0)
    if accuracy.value is not None:
        lines += ["", f"Decision accuracy, smallest against largest rung (the share of setting pairs in the same "
                  f"order at both; DataDecide, Magnusson et al. 2025): {_fmt(accuracy, 2)}."]
    drawn = None
    if figure is not None:
        drawn = draw(settings, fitted, axis) if png else None
        lines += ["", f"![loss against {axis.words}]({figure})", "",
                  f"*Loss against {axis.words}, log-log: each rung's mean over seeds with the seeds' range, and each "
                  f"setting's fitted L({x}), dashed beyond the largest rung to {scaling.EXTRAPOLATE[-1]}x it.*"]
    return Markup("\n".join(lines) + "\n"), drawn


# ---------------------------------------------------------------- from a findings page's jsonl
def rows_of(jobs: list[dict]) -> list[dict]:
    """A findings file's job lines as the rows ladder_rungs and not_learned read (setting keys, seed, params, steps,
    loss, param, and what report/learned.py judges learning by)."""
    return [{**(j.get("setting") or {}), "seed": j.get("seed"), "status": j.get("status"), "params": j.get("params"),
             "steps": j.get("steps"), METRIC: j.get(METRIC), "param": (j.get("choices") or {}).get("param"),
             **{k: j.get(k) for k in LEARNING_KEYS}} for j in jobs]


def figure_name(stem: str) -> str:
    return f"{stem}.ladder.png"


def page_section(meta: dict, jobs: list[dict], guide: str | None = None) -> Markup | None:
    """A findings page's ladder section, its figure linked as figure_name (None: its study declares no ladder)."""
    if not isinstance(meta["study"].get("ladder"), dict):
        return None
    return ladder_section(rows_of(jobs), meta["study"], figure_name(meta["sweep"]), guide=guide, png=False)[0]


def page_png(meta: dict, jobs: list[dict]) -> bytes | None:
    """The section's figure (None: no ladder, or too few rungs to fit)."""
    if not isinstance(meta["study"].get("ladder"), dict):
        return None
    return ladder_section(rows_of(jobs), meta["study"], figure_name(meta["sweep"]))[1]


def holds(meta: dict, jobs: list[dict]) -> str | None:
    """The index's "holds at scale?" cell: the first claim's transfer verdict said of it ("not testable: ..." where
    a side did not learn at some rung), then a count of the other claims' verdicts; None where there is none (no
    ladder, too few rungs, or claims whose settings the ladder lacks)."""
    if not isinstance(meta["study"].get("ladder"), dict):
        return None
    rows, study = rows_of(jobs), meta["study"]
    found = analysis(rows, study)
    said = []
    for i, claim in enumerate(claims(study)):
        comparison = found[2][i] if found is not None else None
        if (why := untestable(rows, study, claim)) is not None:
            said.append(f"not testable: {why}")
        elif comparison is not None:
            said.append(for_the_claim(comparison, comparison.a))
    if not said:
        return None
    rest = Counter(s.split(":")[0] for s in said[1:])
    more = ", ".join(f"{n} {verdict}" for verdict, n in sorted(rest.items()))
    others = f"the other {len(said) - 1} claims" if len(said) > 2 else "the other claim"
    return said[0] + (f" ({others}: {more})" if rest else "")


def draw(settings: dict[str, list[Rung]], fitted: dict, axis: scaling.Axis = scaling.PARAMS) -> bytes:
    """Loss against parameters (or training tokens), log-log: each rung's seed mean with the seeds' range, and the
    fitted law to 100x the largest rung (dashed beyond the measured range)."""
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
    ax.set_xlabel(f"{axis.words} {axis.symbol}")
    ax.set_ylabel(METRIC)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})  # the same bytes on every build
    plt.close(fig)
    return buffer.getvalue()
