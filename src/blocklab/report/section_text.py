"""The sentences of a study's HTML section (report/build.py): whether every setting learned its task (before any
conclusion about one: only the settings that learned are compared, on every metric), what the numbers show per
metric (the best setting against every other, paired by seed, a winner only where the paired t-test rejects under
Holm's correction over those comparisons), its budget, and the caveats its runs carry (jobs side by side, several
machines).
Computed from the collected rows; the findings pages judge claims in judge.py."""
from collections import Counter
from dataclasses import dataclass, field

from blocklab.report import stats
from blocklab.report.collect import _count
from blocklab.report.common import SPEEDS, group, name as _name, order as _order, timed_beside
from blocklab.report.figures_data import direction as _direction, value as _value
from blocklab.report.render import Para
from blocklab.report.learned import Learning, learned as learned_by_setting

# Settings every run of a section shares and no setting had tuned for it: the budget names them.
FIXED = ("optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.weight_decay", "task.batch_size",
         "trainer.gradient_clip_val", "model.d_model", "model.n_layers", "model.n_heads")


@dataclass
class Finding:
    """One sentence of "What the numbers show", with the comparisons it rests on as sub-items."""

    text: str
    details: list[str] = field(default_factory=list)


def findings(rows: list[dict], keys: list[str], metric: str) -> list[Finding]:
    """The setting with the best mean (the highest, for a metric with no better direction) against every other,
    paired by seed: the mean per-seed difference, its paired t-interval at the Holm level over these comparisons,
    and the Holm-adjusted p. A winner is named only where Holm rejects "no difference". Degenerate cases read as
    sentences: every run scores the same, one seed per setting, one setting."""
    groups = group(rows, keys)
    estimates = [(key, stats.estimate([_value(m, metric) for m in members])) for key, members in groups.items()]
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
    tied = [key for key, e in ordered[1:] if sorted(e.values) == sorted(best.values)]
    def score(m):
        return _value(m, metric)
    compared = [(key, e, stats.paired_by_seed(groups[best_key], groups[key], score))
                for key, e in ordered[1:] if key not in tied]
    levels = stats.holm([p.p if p else None for _, _, p in compared])
    details, apart = [], []
    for (key, e, p), h in zip(compared, levels):
        if p is None:
            details.append(f"{_name(keys, key)}: {stats.mean_interval(e)}; fewer than 2 seeds shared with the {word}, "
                           "so not tested.")
            continue
        low, high = p.interval(h.level)
        apart += [key] if h.rejected else []
        said = f"the {word} is {better}" if h.rejected else f"not distinguishable at {p.n} paired seeds"
        details.append(f"{_name(keys, key)}: {stats.mean_interval(e)}; {word} − it, paired over {p.n} seeds: "
                       f"{stats.signed(p.mean)} [{stats.fmt(low, p.mean)}, {stats.fmt(high, p.mean)}] "
                       f"({stats.confidence(h.level)}, Holm), p {stats.p_is(h.adjusted)} (Holm); {said}.")
    if tied:
        details.insert(0, f"{len(tied)} other setting{'s' if len(tied) > 1 else ''} score exactly as the {word} does "
                          f"on every seed ({stats.fmt(best.mean)}): {'; '.join(_name(keys, k) for k in tied)}.")
    others, seeds, setting = len(ordered) - 1, f"{best.n} seed{'s' if best.n > 1 else ''}", _name(keys, best_key)
    mean = stats.mean_interval(best)
    if not apart:
        text = (f"{metric} ({how}): not distinguishable at {seeds}: the {word} mean is {setting} {mean}, and no "
                "paired difference from it clears Holm's correction, so no winner is named.")
    elif len(apart) == others:
        text = (f"{metric} ({how}): {setting} is {word}, {mean} (mean [95% CI] over {seeds}); its paired difference "
                "from every other setting excludes 0 (Holm).")
    else:
        text = (f"{metric} ({how}): {word} mean {setting} {mean} over {seeds}; {better} than {len(apart)} of "
                f"{others} other settings (paired, Holm), not distinguishable from the rest.")
    return [Finding(text, details)]


def speed_caveat(rows: list[dict]) -> str | None:
    """Runs that trained while other jobs of the sweep ran on the same machine share its cores and memory
    bandwidth with them: their speeds measure the pairing as well as the setting."""
    beside = timed_beside(rows)
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


def learning(groups: dict[tuple, list[dict]]) -> dict[tuple, Learning]:
    """Per setting whose runs state how their task is learned (report/learned.py's bars): its Learning."""
    return learned_by_setting(groups)


def learning_note(prefix: str, keys: list[str], learned: dict[tuple, Learning]) -> Para | None:
    """The flag every conclusion comes after: which settings did not learn their task in distribution."""
    if not learned:
        return None
    failed = [f"{_name(keys, k) or 'all runs'} ({e.why()})" for k, e in learned.items() if not e.learned]
    partly = [f"{_name(keys, k) or 'all runs'} ({e.learned_seeds} of {e.measured} seeds clear it)"
              for k, e in learned.items() if e.learned and e.learned_seeds < e.measured]
    lead = f"{prefix}Did every setting learn its task?"
    rule = ("A setting counts as learned when the mean over its seeds clears its task's bar on the training lengths "
            "(tasks/references.py: copy and addition exact match 0.9, an LM below its corpus' bigram loss, MQAR and "
            "next-sentence accuracy halfway from chance to perfect), the mark a single run is held to.")
    if not failed and not partly:
        return Para(lead, ("Yes: every seed of every setting clears its task's bar on the training lengths, so "
                           "every setting is compared below. " + rule,))
    text = []
    if failed:
        text.append(f"No: {len(failed)} of {len(learned)} setting{'s' if len(learned) > 1 else ''} did not learn "
                    f"in distribution: {'; '.join(failed)}. They are left out of every comparison below: a setting "
                    "that never learned its training distribution says nothing about the component.")
    if partly:
        text.append(f"Learned, but not on every seed: {'; '.join(partly)}.")
    return Para(lead, (" ".join([*text, rule]),), "not-learned")


def judged(subset: list[dict], keys: list[str], metric: str, learned: dict[tuple, Learning]) -> list[Finding]:
    """The findings on `metric` among the settings that learned their task (every metric: a setting that did not
    learn is no evidence about its component); says which it left out. A speed timed beside other jobs is not
    compared at all."""
    if metric in SPEEDS and (beside := timed_beside(subset)):
        return [Finding(f"{metric}: not compared: {beside} of {len(subset)} runs were timed while other jobs ran "
                        "beside them, so each speed measures its neighbour too (the caveat below says how to rerun).")]
    left_out = [key for key, e in learned.items() if not e.learned]
    if not left_out:
        return findings(subset, keys, metric)
    names = "; ".join(_name(keys, key) or "all runs" for key in left_out)
    kept = [r for r in subset if tuple(r.get(k) for k in keys) not in left_out]
    if not kept:
        return [Finding(f"{metric}: no setting learned its task in distribution ({names}), so none is judged.")]
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
