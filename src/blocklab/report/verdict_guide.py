"""docs/findings/transfer_verdicts.md: how to read a ladder page's "Does it hold at scale?" section, with one worked
example generated from a committed ladder's jsonl (EXAMPLE), so none of its numbers is typed by hand.

The words explain report/scaling.py (the fit, the gap and its bootstrap interval, N_x, the four verdicts in the order
they are checked, decision accuracy) and read its constants; the example walks the same checks as
`scaling.Comparison.kind` on the example's fitted gaps, step by step, each with the numbers it reads."""
from pathlib import Path

from markupsafe import Markup

from blocklab import folder, ladder
from blocklab.report import ladder_page, scaling
from blocklab.report.findings_data import read_jsonl
from blocklab.report.ladder_page import _fmt
from blocklab.report.markdown import ENV, md

EXAMPLE = "activations_ladder"  # the committed ladder the worked example reads


def steps(comparison: scaling.Comparison) -> list[Markup]:
    """The verdict reached step by step: each check of Comparison.kind, in its order, with the numbers it reads
    (Markdown: the settings' names escaped)."""
    return [Markup(s) for s in _steps(comparison)]


def _steps(comparison: scaling.Comparison) -> list[str]:
    small, large = comparison.measured[0], comparison.measured[-1]
    gap_small, gap_large = comparison.gaps[small], comparison.gaps[large]
    said = [f"At the largest rung, N = {large:,.0f}, the fitted gap L({md(comparison.a)}) - L({md(comparison.b)}) "
            f"is {_fmt(gap_large, 4)}."]
    if not gap_large.excludes_zero():
        return said + [f"Its interval holds 0: the verdict is **{scaling.UNDETERMINED}**; nothing further is read."]
    ahead = comparison.ahead
    said.append(f"Its interval excludes 0, so the ladder orders the two at its top: {md(ahead)} is ahead (a "
                f"{'negative' if gap_large.value < 0 else 'positive'} gap). Not {scaling.UNDETERMINED}.")
    flips = gap_small.excludes_zero() and (gap_small.value < 0) != (gap_large.value < 0)
    said.append(f"At the smallest rung, N = {small:,.0f}, the gap is {_fmt(gap_small, 4)}: "
                + ("its interval excludes 0 with the opposite sign, so the order flips inside the measured range: "
                   f"**{comparison.verdict}**." if flips else
                   "it does not exclude 0 with the opposite sign, so the order does not flip inside the measured "
                   f"range. Not {scaling.REVERSES}."))
    if flips:
        return said
    ten = large * scaling.EXTRAPOLATE[0]
    gap_ten = comparison.gaps[ten]
    grows = comparison.kind == scaling.GROWS
    said.append(f"At {scaling.EXTRAPOLATE[0]}x the largest rung, N = {ten:,.0f}, the fitted gap is "
                f"{gap_ten.value:.4f}: " + ("as large or larger, in the same direction, so the leader's lead grows: "
                                             f"**{scaling.GROWS}**." if grows else
                                             "smaller in size (or of the other sign), so the lead shrinks: "
                                             f"**{comparison.verdict}**."))
    return said


def example(out: Path) -> dict | None:
    """The worked example's parts, from `out`/EXAMPLE.jsonl (None: not committed, or no claim to compare)."""
    if not folder.exists(out, f"{EXAMPLE}.jsonl"):
        return None
    meta, jobs = read_jsonl(out / f"{EXAMPLE}.jsonl")
    rows = ladder_page.rows_of(jobs)
    found = ladder_page.analysis(rows, meta["study"])
    if found is None or found[2][0] is None:
        return None
    settings, fitted, (comparison, *_), accuracy = found
    laws = []
    for name in (comparison.a, comparison.b):
        point, boot = fitted[name]
        p = scaling.parameter_intervals(point, boot)
        laws.append(Markup(f"{md(name)}: E = {_fmt(p['e'])}, A = {point.a:.3g}, alpha = {_fmt(p['alpha'])}"
                    + (" (at a bound)" if point.at_bound else "")))
    pairs = len(settings) * (len(settings) - 1) // 2
    return {"name": EXAMPLE, "claim": (meta["study"].get("verdict") or {}).get("claim"),
            "settings": [Markup(md(s)) for s in settings], "rungs": len(next(iter(settings.values()))),
            "seeds": ", ".join(str(s) for s in meta["seeds"]), "laws": laws, "steps": steps(comparison),
            "for_claim": ladder_page.for_the_claim(comparison, comparison.a), "accuracy": _fmt(accuracy, 2),
            "bound": any(fitted[name][0].at_bound for name in (comparison.a, comparison.b)), "pairs": pairs,
            "param": Markup(ladder_page.parametrization(rows)), "anchor": ladder_page.ANCHOR}


def render_guide(out: Path) -> str:
    return ENV.get_template("transfer_verdicts.md.j2").render(
        example=example(out), example_name=EXAMPLE, resamples=f"{scaling.RESAMPLES:,}",
        confidence=f"{scaling.CONFIDENCE:.0%}", tail=f"{(1 - scaling.CONFIDENCE) / 2:.1%}",
        ladder_rungs=ladder.MIN_RUNGS,
        low=scaling.ALPHA_LOW, high=scaling.ALPHA_HIGH, ten=scaling.EXTRAPOLATE[0],
        hundred=scaling.EXTRAPOLATE[-1], span=scaling.CROSS_SPAN, min_rungs=scaling.MIN_RUNGS,
        verdicts={"grows": scaling.GROWS, "shrinks": scaling.SHRINKS, "reverses": scaling.REVERSES,
                  "undetermined": scaling.UNDETERMINED})
