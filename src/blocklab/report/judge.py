"""The verdicts of a findings page: each claim registered in the sweep file (study.verdict and its `also` list),
judged from the page's jsonl.

A claim names two settings (`better`, `than`, within `where`). Their runs are paired by seed (seed s fixes the
data order of every setting of a task), and by the compare keys the claim leaves open; the statistic is the mean
of the per-seed differences A - B. The deciding rule is the two-sided paired t-test at the Holm-Bonferroni level
over the page's registered claims (family-wise 0.05); the interval shown is drawn at that level, so it excludes 0
exactly when the claim is decided, and the p-value shown is Holm-adjusted. From 6 pairs up the exact sign-flip
p-value is shown too.

A run that diverged, or a seed one setting lacks, is never dropped silently. For a metric better lower (a loss, a
time) it counts as the worst value of that metric on the page, and the sentence says so; for any other metric the
pair is named, left out of the test, and the claim marked. A diverged run stays in the groups (and so in the
table and the figure): it is data. A metric that takes one value on every compared run cannot carry a verdict.

Before any test, the learned gate (learned.py): a claim whose compared settings did not learn their task (on any
metric: in-distribution, training loss, diverged, speed) is not testable, and its sentence says why first. A claim
that one side cannot learn what the other does (`one_side_learns: true`) needs only the winning side to have
learned; a claim about cost alone (`cost_only: true`) has no gate. A claim on a speed (SPEEDS) is not testable
where a compared run was timed beside other jobs of its sweep (`beside_other_jobs`, which results.json records).

A claim (a dict in the sweep file's study.verdict) reads: claim, metric, better, than, where, paper, paper_scale,
paper_tested (false where the cited paper did not test this claim: the page then neither agrees nor contradicts it),
why, min_effect (the smallest difference that matters, in the metric's units: a positive number), one_side_learns,
cost_only and at_best (each side at its own best learning rate of the page's grid, by the verdict's metric, and
paired by seed alone: an optimizer against another, each tuned). With `than_where` it is a claim about a gap
(gap.py): A's advantage over B is larger at `where` than at `than_where`, tested on the per-seed differences of the
two per-seed gaps, under the same Holm step-down.

Outcomes: yes (decided, the claimed way), no (decided, the other way), not distinguishable (at N seeds, whatever
the means say), no difference that matters (decided, but the interval lies inside the claim's ±min_effect), not
testable (a compared setting did not learn, or a constant metric), not measured."""
import math
from dataclasses import dataclass

from blocklab.report import gap, stats
from blocklab.report.build import _direction
from blocklab.report.claims import claims_hash
from blocklab.report.common import SPEEDS, order, timed_beside
from blocklab.report.learned import gate, learned  # noqa: F401 (learned: the pages' API)
# The page's runs by setting (page_runs.py), used here and read from here by the pages.
from blocklab.report.page_runs import (KEPT, OVER, _matches, _settings, at_best_lr, groups_of,  # noqa: F401
                                       higher_is_better, keys_of, metric_of, select, spec_label)

OUTCOMES = {"yes": "yes", "no": "no", "nd": "not distinguishable", "trivial": "no difference that matters",
            "const": "not testable", "learn": "not testable", "beside": "not testable", "none": "not measured"}
# The index's "agrees" column: exactly these four words (a difference inside min_effect is not one that matters;
# a claim not measured cannot be tested yet)
AGREES = {"yes": "yes", "no": "no", "nd": "not distinguishable", "trivial": "not distinguishable",
          "const": "not testable", "learn": "not testable", "beside": "not testable", "none": "not testable"}


def claims(meta: dict) -> list:
    """The page's registered claims: study.verdict, then each of its `also`."""
    v = meta["study"].get("verdict")
    if not isinstance(v, dict):
        return []
    return [v, *(v.get("also") or [])]


# ---------------------------------------------------------------- one claim
@dataclass
class Verdict:
    """A claim's outcome and sentence; its row of the page's comparisons table; the noise floor sentence."""

    outcome: str
    sentence: str
    row: list[str] | None = None
    floor: str | None = None


@dataclass
class _Pairs:
    """A claim paired by seed, before the page's Holm step-down decides it."""

    claim: dict
    words: dict  # claim, a, b, paper, scale, why, metric
    a: list[float]
    b: list[float]
    notes: list[str]  # a value counted as the page's worst
    worst: float | None
    incomplete: list[str]  # a pair left out of the test (the claim is marked)
    sd_b: float | None
    min_effect: float | None
    paired: stats.Paired | None
    keys: list[str]  # each pair's label (its seed, and the compare keys the claim leaves open), as a, b


def _label(key: tuple, rest: list[str]) -> str:
    return f"seed {key[0]}" + (f" ({', '.join(f'{k.rsplit(chr(46), 1)[-1]}={v}' for k, v in zip(rest, key[1:]))})"
                               if rest else "")


def _side(members: list[dict], metric: str, key_of) -> dict[tuple, tuple[float | None, str]]:
    """Pair key -> (the mean of its runs' finite values, or None with why: diverged / not recorded)."""
    by: dict[tuple, list[dict]] = {}
    for j in members:
        by.setdefault(key_of(j), []).append(j)
    out = {}
    for key, js in by.items():
        values = stats.finite([metric_of(j, metric) for j in js])
        why = "diverged" if any(j.get("status") == "diverged" for j in js) else f"recorded no {metric}"
        out[key] = (sum(values) / len(values), "") if values else (None, why)
    return out


def _pair(meta: dict, jobs: list[dict], claim: dict, words: dict, a: list[dict], b: list[dict]):
    """The claim's pairs, or a Verdict where it cannot be tested."""
    metric = claim["metric"]
    named = {*(claim.get("better") or {}), *(claim.get("than") or {}), *(claim.get("where") or {}),
             *([OVER] if claim.get("at_best") else [])}  # each side at its own best rate: paired by seed alone
    rest = [k for k in keys_of(meta) if k not in named]
    key_of = lambda j: (j.get("seed"), *(str(j["setting"].get(k)) for k in rest))  # noqa: E731
    sa, sb = _side(a, metric, key_of), _side(b, metric, key_of)
    recorded = [stats.finite([metric_of(j, metric) for j in side]) for side in (a, b)]
    if not all(recorded):
        lacking = words["a" if not recorded[0] else "b"]
        return Verdict("none", f"{words['claim']}: {metric} is not recorded for {lacking}.")
    lower = _direction(metric) is False
    seen = stats.finite([metric_of(j, metric) for j in jobs if j.get("status") in KEPT])
    worst = max(seen) if lower and seen else None
    xs, ys, notes, incomplete, labels = [], [], [], [], []
    for key in sorted(set(sa) | set(sb), key=lambda k: tuple(order(v) for v in k)):
        (va, why_a), (vb, why_b) = sa.get(key, (None, "has no run")), sb.get(key, (None, "has no run"))
        gaps = [f"{name} {why}" for name, v, why in ((words["a"], va, why_a), (words["b"], vb, why_b)) if v is None]
        if gaps and worst is None:
            incomplete.append(f"{_label(key, rest)}: {' and '.join(gaps)}")
            continue
        if gaps:
            notes.append(f"{_label(key, rest)}: {' and '.join(gaps)}")
        xs.append(worst if va is None else va)
        ys.append(worst if vb is None else vb)
        labels.append(_label(key, rest))
    if xs and len(set(xs + ys)) == 1 and not incomplete:
        return Verdict("const", f"{words['claim']}: not testable: {metric} is {stats.fmt(xs[0])} on every run of both "
                                f"{words['a']} and {words['b']} ({len(xs)} seeds each), and a constant cannot carry a "
                                "verdict.")
    effect = claim.get("min_effect")
    if effect is not None and not (isinstance(effect, (int, float)) and not isinstance(effect, bool)
                                   and math.isfinite(effect) and effect > 0):
        return Verdict("none", f"{words['claim']}: not judged: its min_effect={str(effect)[:40]!r} is not a positive "
                               f"number (the smallest difference that matters, in {metric}'s units).")
    base = stats.estimate(recorded[1])
    return _Pairs(claim, words, xs, ys, notes, worst, incomplete, base.sd if base.n > 1 else None, effect,
                  stats.paired_t([x - y for x, y in zip(xs, ys)]), labels)


def _gap_test(meta: dict, jobs: list[dict], claim: dict) -> Verdict | _Pairs:
    """A claim that A's advantage over B is larger at `where` than at `than_where` (gap.py): the gap A - B paired by
    seed at each place, as any claim's (the learned gate holding all four settings), then the two gaps paired."""
    if why := gap.error(claim):
        return Verdict("none", f"{claim.get('claim') or 'A gap claim'}: not judged: {why}.")
    tests = [_test(meta, jobs, c) for c in gap.places(claim)]
    if lost := next((t for t in tests if isinstance(t, Verdict)), None):
        return lost
    at, shown = tests[0], {k: claim["where"][k] for k in claim[gap.KEY]}
    names = [f"({at.words['a']} − {at.words['b']}) at {spec_label(place)}" for place in (shown, claim[gap.KEY])]
    gaps = [{k: x - y for k, x, y in zip(t.keys, t.a, t.b)} for t in tests]
    keys, xs, ys, lacking = gap.pair(*gaps)
    one = [f"{key}: {name} has no pair" for key in lacking for name, g in zip(names, gaps) if key not in g]
    notes = [f"{name}: {note}" for name, t in zip(names, tests) for note in t.notes]
    incomplete = [f"{name}: {x}" for name, t in zip(names, tests) for x in t.incomplete] + one
    base = stats.estimate(ys) if ys else None
    return _Pairs(claim, {**at.words, "a": names[0], "b": names[1]}, xs, ys, notes, at.worst, incomplete,
                  base.sd if base and base.n > 1 else None, at.min_effect,
                  stats.paired_t([x - y for x, y in zip(xs, ys)]), keys)


def sides(meta: dict, jobs: list[dict], claim: dict) -> tuple[tuple[str, list[dict]], tuple[str, list[dict]]]:
    """The claim's two sides within its `where`: (label, runs) of `better`, then of `than`; a gap claim's at both
    its places."""
    if gap.is_gap(claim) and not gap.error(claim):
        (a1, b1), (a2, b2) = (sides(meta, jobs, c) for c in gap.places(claim))
        return (a1[0], a1[1] + a2[1]), (b1[0], b1[1] + b2[1])
    groups = _within(meta, jobs, claim)
    return select(groups, claim.get("better")), select(groups, claim.get("than"))


def _within(meta: dict, jobs: list[dict], claim: dict) -> dict:
    """The page's settings (name -> runs) restricted to the claim's `where`, empty ones dropped; with `at_best`,
    each setting at its own best learning rate only."""
    where = claim.get("where") or {}
    groups = {k: [j for j in m if _matches(j, where)] for k, m in groups_of(meta, jobs).items()}
    groups = {k: m for k, m in groups.items() if m}
    return at_best_lr(meta, groups) if claim.get("at_best") else groups


def differences(meta: dict, jobs: list[dict], claim) -> list[float] | str:
    """The claim's per-seed differences A - B as the page pairs them (the worst value standing in where the
    page's rule says so, incomplete pairs left out), or the sentence saying why it cannot be tested."""
    t = _test(meta, jobs, claim)
    return t.sentence if isinstance(t, Verdict) else [x - y for x, y in zip(t.a, t.b)]


def _test(meta: dict, jobs: list[dict], claim) -> Verdict | _Pairs:
    study = meta["study"]
    if not isinstance(claim, dict) or not isinstance(claim.get("metric"), str):
        return Verdict("none", "The sweep file states no claim to test (study.verdict).")
    if gap.is_gap(claim):
        return _gap_test(meta, jobs, claim)
    metric = claim["metric"]
    (a_name, a), (b_name, b) = sides(meta, jobs, claim)
    words = {"claim": claim.get("claim") or f"{a_name} beats {b_name} on {metric}", "a": a_name, "b": b_name,
             "paper": claim.get("paper") or study.get("paper") or "the paper", "metric": metric,
             "scale": claim.get("paper_scale") or "a larger scale",
             "why": f" ({claim['why']})" if claim.get("why") else ""}  # what the sweep found out about why
    words.update(_cited(words, claim.get("paper_tested", True) is not False))
    if not a or not b:
        return Verdict("none", f"{words['claim']}: no completed or diverged run of {a_name if not a else b_name} here.")
    groups = _within(meta, jobs, claim)
    compared = [(a_name, _settings(groups, claim.get("better"))), (b_name, _settings(groups, claim.get("than")))]
    if why := gate(claim, compared, lambda j: metric_of(j, metric), _direction(metric)):
        return Verdict("learn", f"Not testable: {why}. The claim, {words['claim']}, is not judged here"
                                f"{'' if words['paper'] == 'the paper' else '; ' + words['saw']}"
                                f"{words['why']}.")
    if metric in SPEEDS and (beside := timed_beside(a + b)):
        return Verdict("beside", f"Not testable: {metric} is a speed, and {beside} of the {len(a) + len(b)} compared "
                                 "runs were timed while other jobs of the sweep ran beside them on the same cores, so "
                                 "each speed measures its neighbour too. The claim, " + words["claim"] + ", is not "
                                 "judged here; rerun the sweep with hydra.launcher.n_jobs=1, or read the bench.")
    return _pair(meta, jobs, claim, words, a, b)


def _cited(w: dict, tested: bool) -> dict:
    """How a verdict names its paper: agreeing, contradicting or where the paper saw it; where the paper did not test
    the claim (`paper_tested: false`), none of these: the sentence says the comparison is this sweep's own."""
    if not tested:
        own = f"not a claim the cited work tested: {w['paper']}"
        return {"agrees": own, "contradicts": own, "saw": own}
    return {"agrees": f"agrees with {w['paper']}", "contradicts": f"contradicts {w['paper']} at this scale",
            "saw": f"{w['paper']} saw it at {w['scale']}"}


def _decide(t: _Pairs, h: stats.Holm, number: int) -> Verdict:
    """The claim's verdict under its Holm level `h`."""
    w, p = t.words, t.paired
    n, metric = len(t.a), w["metric"]
    seeds = f"{n} seed{'s' if n != 1 else ''}"
    ma, mb = (sum(t.a) / n, sum(t.b) / n) if n else (None, None)
    worst = (f" ({'; '.join(t.notes)}: counted as the worst {metric} on this page, {stats.fmt(t.worst)})"
             if t.notes else "")
    marked = (f" Marked: {len(t.incomplete)} pair{'s' if len(t.incomplete) > 1 else ''} left out of the test "
              f"({'; '.join(t.incomplete)})." if t.incomplete else "")
    pairs = str(n) + (f" ({len(t.notes)} at the worst)" if t.notes else "") + \
        (f" (+{len(t.incomplete)} incomplete)" if t.incomplete else "")
    row = [str(number), f"{w['a']} − {w['b']}", metric, pairs]
    if p is None:
        sentence = (f"{w['claim']}? Not distinguishable at {seeds}: {n} complete pair{'s' if n != 1 else ''} cannot "
                    f"be tested{worst}; {w['saw']}{w['why']}.{marked}")
        return Verdict("nd", sentence, row + ["–"] * 7 + [OUTCOMES["nd"]])
    low, high = p.interval(h.level)
    said = (f"{w['a']} {stats.fmt(ma)} against {w['b']} {stats.fmt(mb)} on {metric}; paired difference over {seeds} "
            f"{stats.signed(p.mean)} [{stats.fmt(low, p.mean)}, {stats.fmt(high, p.mean)}] "
            f"({stats.confidence(h.level)}, Holm), p {stats.p_is(h.adjusted)} (Holm){worst}")
    higher = _direction(metric) is not False
    if not h.rejected:
        outcome, sentence = "nd", (f"{w['claim']}? Not distinguishable at {seeds}: {said}; {w['saw']}"
                                   f"{w['why']}.")
    elif t.min_effect is not None and -t.min_effect <= low and high <= t.min_effect:
        outcome, sentence = "trivial", (f"{w['claim']}? No difference that matters: {said}, inside ±{t.min_effect:g} "
                                        f"(the claim's min_effect){w['why']}.")
    elif (p.mean > 0) == higher:
        outcome, sentence = "yes", f"{w['claim']}: {said}: {w['agrees']}."
    else:
        outcome, sentence = "no", (f"{w['claim']}? {said}, the other way: {w['contradicts']}"
                                   f"{w['why']}.")
    flip = stats.sign_flip_p(p.diffs) if n >= stats.MIN_FLIP_PAIRS else None
    flip = (stats.fmt_p(flip) if flip is not None else f"– (< {stats.MIN_FLIP_PAIRS} pairs)"
            if n < stats.MIN_FLIP_PAIRS else "– (too many pairs to enumerate)")
    mde = stats.detectable(p.sd, n, h.level)
    row += [f"{stats.signed(p.mean)} [{stats.fmt(low, p.mean)}, {stats.fmt(high, p.mean)}]",
            stats.confidence(h.level), stats.fmt_p(p.p), stats.fmt_p(h.adjusted), flip, stats.fmt(t.sd_b), stats.fmt(mde, p.sd or None), OUTCOMES[outcome]]
    floor = (f"{w['b']}'s seed sd on {metric} is {stats.fmt(t.sd_b)}; with {seeds} paired, the smallest difference "
             f"the paired t-test at its Holm level (α = {h.level:.3g}) detects with {stats.POWER:.0%} power is "
             f"{stats.fmt(mde, p.sd or None)} ((t_(1−α/2, n−1) + t_(0.8, n−1)) · sd / √n, from the observed sd "
             f"of the per-seed differences, {stats.fmt(p.sd)})")
    return Verdict(outcome, sentence + marked, row, floor)


# ---------------------------------------------------------------- claims python -m blocklab.decide decided
SEQUENTIAL = {"yes": "yes", "no": "no", "no difference that matters": "trivial", "not distinguishable": "nd"}


def decided(meta: dict) -> dict | None:
    """The decide record the page's jsonl carries (findings_data: the sweep folder's decide.json), where it was made
    for the page's claims as they read now (their fingerprint); else None and the fixed-sample rule decides."""
    record = meta.get("decide")
    if not isinstance(record, dict) or not isinstance(record.get("claims"), list):
        return None
    return record if record.get("claims_hash") == claims_hash(meta["study"].get("verdict")) else None


def rule(meta: dict) -> str | None:
    """The page's line naming the design that decided its claims, where decide did."""
    record = decided(meta)
    if record is None:
        return None
    seeds = record.get("seeds") or {}
    return (f"The claims were decided by python -m blocklab.decide: a {record.get('design')} (family-wise "
            f"{record.get('alpha')}; {seeds.get('min')} to {seeds.get('max')} seeds, {record.get('seeds_run')} run). "
            "Each claim was looked at after every round of seeds; its interval is the repeated confidence interval "
            "at that look's nominal level, so looking again did not inflate the error rate. A claim it decided "
            "shows that design's numbers, not the fixed-sample test's.")


def _sequential(t: _Pairs, c: dict, number: int) -> Verdict:
    """A claim's verdict as decide's design reached it (its record `c`)."""
    w, outcome, mean, level = t.words, SEQUENTIAL[c["outcome"]], c["mean"], c["nominal_level"]
    low, high = c["interval"]
    said = (f"paired difference over {c['pairs']} seeds {stats.signed(mean)} [{stats.fmt(low, mean)}, "
            f"{stats.fmt(high, mean)}] (repeated {stats.confidence(level)} interval), p {stats.p_is(c['p'])} against "
            f"the look's nominal level {level:.3g}")
    sentence = {"yes": f"{w['claim']}: {said}: {w['agrees']}.",
                "no": f"{w['claim']}? {said}, the other way: {w['contradicts']}{w['why']}.",
                "trivial": f"{w['claim']}? No difference that matters: {said}, inside ±{c.get('min_effect')} (the "
                           f"claim's min_effect){w['why']}.",
                "nd": f"{w['claim']}? Not distinguishable at {c['pairs']} seeds, the most study.seeds allows: {said}; "
                      f"{w['saw']}{w['why']}."}[outcome]
    sd = c.get("sd") if isinstance(c.get("sd"), (int, float)) else None
    mde = stats.detectable(sd, c["pairs"], level) if sd is not None and level > 0 else None
    row = [str(number), f"{w['a']} − {w['b']}", w["metric"], str(c["pairs"]),
           f"{stats.signed(mean)} [{stats.fmt(low, mean)}, {stats.fmt(high, mean)}]",
           f"{stats.confidence(level)} (sequential)", stats.fmt_p(c["p"]), "– (sequential)", "–", stats.fmt(t.sd_b),
           stats.fmt(mde, sd or None), OUTCOMES[outcome]]
    floor = (f"{w['b']}'s seed sd on {w['metric']} is {stats.fmt(t.sd_b)}; with {c['pairs']} seeds paired, the smallest "
             f"difference a paired t-test at the last look's nominal level (α = {level:.3g}) detects with "
             f"{stats.POWER:.0%} power is {stats.fmt(mde, sd or None)} ((t_(1−α/2, n−1) + t_(0.8, n−1)) · sd / √n, from "
             f"the observed sd of the per-seed differences, {stats.fmt(sd)})") if mde is not None else None
    return Verdict(outcome, sentence + " Decided by the group-sequential design (python -m blocklab.decide).", row,
                   floor)


def _from_decide(record: dict | None, number: int, claim) -> dict | None:
    if record is None or number > len(record["claims"]) or not isinstance(claim, dict):
        return None
    c = record["claims"][number - 1]
    usable = (isinstance(c, dict) and c.get("claim") == claim.get("claim") and c.get("outcome") in SEQUENTIAL
              and isinstance(c.get("interval"), list) and None not in c["interval"]
              and all(isinstance(c.get(k), (int, float)) for k in ("pairs", "mean", "p", "nominal_level")))
    return c if usable else None


def judge_page(meta: dict, jobs: list[dict]) -> list[Verdict]:
    """Every registered claim of the page, decided together: Holm over all of them (a claim not tested counts in
    m and is never rejected); a claim python -m blocklab.decide decided, by its group-sequential design."""
    tests = [_test(meta, jobs, claim) for claim in claims(meta)]
    if not tests:
        return [Verdict("none", "The sweep file states no claim to test (study.verdict).")]
    holm = stats.holm([t.paired.p if isinstance(t, _Pairs) and t.paired else None for t in tests])
    record, out = decided(meta), []
    for number, (t, h) in enumerate(zip(tests, holm), 1):
        if isinstance(t, _Pairs) and (c := _from_decide(record, number, t.claim)):
            out.append(_sequential(t, c, number))
        elif isinstance(t, _Pairs):
            out.append(_decide(t, h, number))
        else:
            c = claims(meta)[number - 1]
            c = c if isinstance(c, dict) else {}
            out.append(Verdict(t.outcome, t.sentence, [str(number), f"{spec_label(c.get('better'))} − "
                                                       f"{spec_label(c.get('than'))}", str(c.get("metric", "–"))]
                               + ["–"] * 8 + [OUTCOMES[t.outcome]]))
    return out


def judge(meta: dict, jobs: list[dict]) -> tuple[str, str]:
    """(outcome, sentence) of the study's first claim, decided with the page's others (Holm)."""
    v = judge_page(meta, jobs)[0]
    return v.outcome, v.sentence


def also(meta: dict, jobs: list[dict]) -> list[tuple[str, str]]:
    """The study's further claims (study.verdict.also: each with its own `paper` where it tests another), decided
    with the first; the index carries the first alone."""
    return [(v.outcome, v.sentence) for v in judge_page(meta, jobs)[1:]]
