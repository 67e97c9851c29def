"""The sentences of a study's HTML section (report/build.py): what the numbers show per metric (the best setting
against every other, a winner only where the 95% intervals are apart), whether every setting learned its task
(before any conclusion about one), its budget, and the caveats its runs carry (jobs side by side, several machines).
Computed from the collected rows; the findings pages judge claims in judge.py."""
from collections import Counter
from dataclasses import dataclass, field

from blocklab.report import stats
from blocklab.report.collect import _count
from blocklab.report.common import group, name as _name, order as _order
from blocklab.report.figures_data import direction as _direction, value as _value
from blocklab.report.render import Para
from blocklab.results import LEARNED_THRESHOLD

# Settings every run of a section shares and no setting had tuned for it: the budget names them.
FIXED = ("optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.weight_decay", "task.batch_size",
         "trainer.gradient_clip_val", "model.d_model", "model.n_layers", "model.n_heads")


@dataclass
class Finding:
    """One sentence of "What the numbers show", with the comparisons it rests on as sub-items."""

    text: str
    details: list[str] = field(default_factory=list)


def findings(rows: list[dict], keys: list[str], metric: str) -> list[Finding]:
    """The setting with the best mean (the highest, for a metric with no better direction) against every other:
    its mean [95% CI], the common-language effect size CL over seed pairs, and "not distinguishable at N seeds" where the intervals
    overlap. Degenerate cases read as sentences: every run scores the same, one seed per setting, one setting."""
    estimates = [(key, stats.estimate([_value(m, metric) for m in members])) for key, members in
                 group(rows, keys).items()]
    estimates = [(key, e) for key, e in estimates if e is not None]
    if not estimates:
        return []
    values = [v for _, e in estimates for v in e.values]
    if min(values) == max(values):
        who = "every setting scores" if len(estimates) > 1 else "every run scores"
        return [Finding(f"{who} {stats.fmt(values[0])} on {metric} ({len(values)} runs): it does not tell the settings "
                        "apart.")]
    if len(estimates) == 1:
        (key, e), = estimates
        return [Finding(f"{metric}: {_name(keys, key) or 'all runs'} {stats.mean_interval(e)} over {e.n} seeds.")]
    higher = _direction(metric)
    ordered = sorted(estimates, key=lambda ke: ke[1].mean, reverse=higher is not False)
    (best_key, best), (worst_key, worst) = ordered[0], ordered[-1]
    word, low_word = ("best", "worst") if higher is not None else ("highest", "lowest")
    how = {True: "higher is better", False: "lower is better", None: "no better direction"}[higher]
    if all(e.n < 2 for _, e in estimates):
        return [Finding(f"{metric} ({how}): {word} mean {_name(keys, best_key)} ({stats.fmt(best.mean)}), {low_word} "
                        f"{_name(keys, worst_key)} ({stats.fmt(worst.mean)}); one run each, so the seed spread is "
                        "unknown and no winner is named (add seeds).")]
    better = "better" if higher is not None else "higher"
    details, apart, tied = [], [], []
    for key, e in ordered[1:]:
        if sorted(e.values) == sorted(best.values):  # the same score on every seed: one line for all of them
            tied.append(_name(keys, key))
            continue
        p = stats.common_language(best.values, e.values, higher_is_better=higher is not False)
        apart += [key] if not stats.overlap(best, e) else []
        details.append(f"{_name(keys, key)}: {stats.mean_interval(e)}; CL({word} over it) = {p:.2f}; "
                       f"{stats.verdict(best, e, better=f'the {word} is {better} (intervals apart)')}.")
    if tied:
        details.insert(0, f"{len(tied)} other setting{'s' if len(tied) > 1 else ''} score exactly as the {word} does "
                          f"on every seed ({stats.fmt(best.mean)}): {'; '.join(tied)}.")
    others, seeds, setting = len(ordered) - 1, f"{best.n} seed{'s' if best.n > 1 else ''}", _name(keys, best_key)
    mean = stats.mean_interval(best)
    if not apart:
        text = (f"{metric} ({how}): not distinguishable at {seeds}: the {word} mean, {setting} {mean}, overlaps "
                "every other setting's 95% interval, so no winner is named.")
    elif len(apart) == others:
        text = (f"{metric} ({how}): {setting} is {word}, {mean} (mean [95% CI] over {seeds}); its interval is "
                "apart from every other setting's.")
    else:
        text = (f"{metric} ({how}): {word} mean {setting} {mean} over {seeds}; {better} than {len(apart)} of "
                f"{others} other settings (intervals apart), not distinguishable from the rest at {seeds}.")
    return [Finding(text, details)]



def speed_caveat(rows: list[dict]) -> str | None:
    """Runs that trained while other jobs of the sweep ran on the same machine share its cores and memory
    bandwidth with them: their speeds measure the pairing as well as the setting."""
    beside = sum(bool(r.get("beside_other_jobs")) for r in rows)
    if not beside:
        return None
    return (f"Speeds (tokens/s, ms per step, decoding tokens/s) of {beside} of {len(rows)} runs were measured while "
            "other jobs ran beside them on the same machine, so each depends on its neighbour as well as on its own "
            "setting. For a speed comparison, rerun with hydra.launcher.n_jobs=1 (one job at a time, every core).")


def machine_caveat(rows: list[dict]) -> str | None:
    """Runs from more than one machine (a sweep resumed elsewhere, folders merged): their kernels round
    differently, so a seed need not end as it would have on the other machine, and their speeds do not compare."""
    counts = Counter(r["machine"] for r in rows if r.get("machine"))  # runs from before it was recorded: unknown
    if len(counts) < 2:
        return None
    listed = "; ".join(f"{label}: {n} run{'s' if n > 1 else ''}" for label, n in counts.most_common())
    return (f"These runs come from {len(counts)} machines ({listed}). Different kernels round differently, and "
            "a seed's score beyond the training lengths can move with that: a seed rerun on another machine need not "
            "end where it did here, and speeds do not compare across machines.")



def _words(values: list) -> str:
    return ", ".join(str(v) for v in values)


def budget(done: list[dict], compare: list[str]) -> str:
    """Steps, seeds and what no setting had tuned for it, read from the runs (the "Budget." paragraph)."""
    planned = sorted({r["trainer.max_steps"] for r in done if r.get("trainer.max_steps") is not None}, key=_order)
    # Short of its own planned steps: with max_steps swept, a 500-step run beside 1500-step runs is not short.
    short = [r for r in done if _count(r.get("steps")) and _count(r.get("trainer.max_steps"))
             and r["steps"] < r["trainer.max_steps"]]
    steps = f"{'/'.join(map(str, planned))} training steps per run" if planned else "training steps not recorded"
    if short:
        steps += f" ({len(short)} of {len(done)} runs stopped early, at {min(r['steps'] for r in short)} steps or more)"
    settings = group(done, compare)
    counts = Counter(len(members) for members in settings.values())
    seeds = sorted({r.get("seed") for r in done if r.get("seed") is not None}, key=_order)
    per = (f"{min(counts)} seed{'s' if min(counts) > 1 else ''}" if len(counts) == 1 else
           f"{min(counts)} to {max(counts)} seeds")
    seeds_text = f"{per} per setting ({len(settings)} setting{'s' if len(settings) > 1 else ''}{'; seeds ' + _words(seeds) if seeds else ''})"
    swept = set(_swept(done)) | set(compare)
    fixed = []
    for knob in FIXED:
        values = {str(r.get(knob)) for r in done}
        if knob not in swept and len(values) == 1 and all(r.get(knob) is not None for r in done):
            fixed.append(f"{knob}={values.pop()}")
    untuned = (f"; one value for every setting, not tuned per setting: {', '.join(fixed)}" if fixed else "")
    return f"{steps}; {seeds_text}{untuned}."


@dataclass(frozen=True)
class Learning:
    """How a setting's seeds did on their training lengths: seeds measured, seeds at or above LEARNED_THRESHOLD
    (results.learned_in_distribution, per run), and the mean over seeds of in-distribution exact match. A setting
    counts as learned when that mean reaches the threshold a single run is held to."""

    measured: int
    learned_seeds: int
    mean: float

    @property
    def learned(self) -> bool:
        return self.mean >= LEARNED_THRESHOLD


def learning(groups: dict[tuple, list[dict]]) -> dict[tuple, Learning]:
    """Per setting whose runs score exact match on their training lengths (not an LM): its Learning."""
    out = {}
    for key, members in groups.items():
        scores = stats.finite([m.get("exact_match_in") for m in members])
        if scores:
            out[key] = Learning(len(scores), sum(x >= LEARNED_THRESHOLD for x in scores), sum(scores) / len(scores))
    return out


def beyond_training(metric: str) -> bool:
    """A metric measured beyond the training lengths (exact_match_out, loss_out): what says whether a setting
    extrapolates, and so says nothing about a setting that never learned the lengths it trained on."""
    return metric.split(".")[-1].endswith("_out")


def learning_note(prefix: str, keys: list[str], learned: dict[tuple, Learning]) -> Para | None:
    """The flag every conclusion comes after: which settings did not learn their task in distribution."""
    if not learned:
        return None
    threshold = f"{LEARNED_THRESHOLD:g}"

    def who(key, e):
        return (f"{_name(keys, key) or 'all runs'} (mean {stats.fmt(e.mean)}; {e.learned_seeds} of {e.measured} "
                f"seed{'s' if e.measured > 1 else ''} ≥ {threshold})")

    failed = [who(k, e) for k, e in learned.items() if not e.learned]
    partly = [who(k, e) for k, e in learned.items() if e.learned and e.learned_seeds < e.measured]
    lead = f"{prefix}Did every setting learn its task?"
    rule = (f"A setting counts as learned when the mean over its seeds of exact match on the training lengths "
            f"reaches {threshold}, the mark a single run is held to.")
    if not failed and not partly:
        return Para(lead, (f"Yes: every seed of every setting reaches exact match ≥ {threshold} on its training "
                           "lengths, so its scores beyond them measure extrapolation.",))
    text = []
    if failed:
        text.append(f"No: {len(failed)} of {len(learned)} setting{'s' if len(learned) > 1 else ''} did not learn "
                    f"in distribution: {'; '.join(failed)}. Their scores beyond the training lengths say little "
                    "about extrapolation, so they are left out of every comparison beyond training below.")
    if partly:
        text.append(f"Learned, but not on every seed: {'; '.join(partly)}.")
    return Para(lead, (" ".join([*text, rule]),), "not-learned")


def judged(subset: list[dict], keys: list[str], metric: str, learned: dict[tuple, Learning]) -> list[Finding]:
    """The findings on `metric`; one beyond the training lengths compares only the settings that learned in
    distribution, and says which it left out."""
    left_out = [key for key, e in learned.items() if not e.learned] if beyond_training(metric) else []
    if not left_out:
        return findings(subset, keys, metric)
    names = "; ".join(_name(keys, key) or "all runs" for key in left_out)
    kept = [r for r in subset if tuple(r.get(k) for k in keys) not in left_out]
    if not kept:
        return [Finding(f"{metric}: no setting learned its task in distribution ({names}), so none is judged "
                        "beyond the training lengths.")]
    among = f"Among the settings that learned in distribution (left out as not learned: {names}): "
    return [Finding(among + f.text, f.details) for f in findings(kept, keys, metric)]


def _swept(rows: list[dict]) -> dict[str, list]:
    """What the sweep varied: the command-line overrides that take more than one value across the runs."""
    keys = sorted({k for r in rows for k in r.get("overrides", {})})
    varied = {}
    for k in keys:
        values = sorted({r["overrides"].get(k, "–") for r in rows}, key=lambda v: _order(_number(v)))
        if len(values) > 1:
            varied[k] = values
    return varied



def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text
