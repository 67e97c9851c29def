"""A findings page's table of settings, from its jsonl: one row per setting (its seeds, diverged ones counted,
whether it learned, the study's metrics as mean [95% CI]); per setting at its best learning rate where the sweep
tries several (with the width of its working range); or the modifications layout against the baseline. Where two
settings are compared, the common-language effect size CL (stats.CL_FORMULA), never a probability of being
better."""
import math

from blocklab.report import stats
from blocklab.report.build import _direction
from blocklab.report.common import name as setting_name
from blocklab.report.judge import keys_of as _keys, metric_of as _metric
from blocklab.report.learned import learned
from blocklab.report.lr_sensitivity import CHOSEN_ON
from blocklab.report.recall import FRACTION, OVER, AtChoice, at_choice, best as best_choice, best_named, working


def verdict_metric(meta: dict) -> str:
    study = meta["study"]
    verdict = study.get("verdict") if isinstance(study.get("verdict"), dict) else {}
    metrics = [m for m in study.get("metrics") or [] if isinstance(m, str)]
    return verdict.get("metric") or (metrics[0] if metrics else "final_val_loss")


def rate_metric(meta: dict) -> str:
    """The metric a setting's best learning rate is chosen on: the verdict's, or for a metric of the whole curve
    over the rates (lr_sensitivity: one value on every rate), the loss it is computed from."""
    metric = verdict_metric(meta)
    return CHOSEN_ON.get(metric, metric)


def tuned(meta: dict, groups) -> dict[tuple, list[AtChoice]] | None:
    """Where the sweep tries several learning rates per setting: {setting without the lr: its learning rates, each
    with its jobs' scores on the verdict's metric}; None where it does not."""
    keys = _keys(meta)
    if OVER not in keys:
        return None
    i, metric = keys.index(OVER), rate_metric(meta)
    per: dict[tuple, list[AtChoice]] = {}
    for key, members in groups.items():
        if choice := at_choice(key[i], members, lambda j: _metric(j, metric)):
            per.setdefault(key[:i] + key[i + 1:], []).append(choice)
    if all(len(tried) < 2 for tried in per.values()):
        return None
    return per


def _with_lr(meta: dict, rest: tuple, lr) -> tuple:
    """A setting's group key from its key without the learning rate and the rate."""
    i = _keys(meta).index(OVER)
    return rest[:i] + (lr,) + rest[i:]


def at_best(meta: dict, groups, best: dict | None) -> dict[tuple, list[dict]]:
    """Each setting at its best learning rate (`best`: tuned's answer; all settings where it is None): what the
    learning flag and the figure judge, since a learning rate that failed says nothing about the setting."""
    if best is None:
        return groups
    higher = _direction(rate_metric(meta)) is not False
    return {(key := _with_lr(meta, rest, best_choice(tried, higher).value)): groups[key] for rest, tried in best.items()}


def _tuned_table(meta: dict, groups, best: dict) -> dict:
    """One row per setting at its best learning rate, with how many of the rates tried reach FRACTION of that best:
    the width of the working range (arXiv 2508.19029 found recurrent models recall only inside a narrow one).
    A setting that learned at no rate has none: near chance every rate looks alike."""
    keys = _keys(meta)
    rest_keys = [k for k in keys if k != OVER]
    metric = rate_metric(meta)
    higher = _direction(metric) is not False
    metrics = [m for m in meta["study"].get("metrics") or [] if isinstance(m, str)] or [metric]
    learn = learned(groups)
    header = ["setting", "best lr", "seeds", "learned (seeds)",
              *(f"{m} mean [95% CI]" for m in metrics),
              f"lrs within {FRACTION:g} of best"]
    body = []
    tops = {rest: best_choice(tried, higher) for rest, tried in best.items()}
    for rest, tried in sorted(best.items(), key=lambda kv: (-1 if higher else 1) * tops[kv[0]].mean):
        top = tops[rest]
        members = top.members
        works = sorted(working(tried, FRACTION, higher), key=lambda c: c.value)
        e = learn.get(_with_lr(meta, rest, top.value))
        body.append([setting_name(rest_keys, rest) or "all runs", best_named(tried, higher), _seeds(members),
                     f"{e.learned_seeds} of {e.measured}" if e else "–",
                     *(_cell(members, m) for m in metrics),
                     f"{len(works)} of {len(tried)} ({', '.join(str(c.value) for c in works)})"
                     if e is None or e.learned else "– (not learned at any)"])
    return {"header": header, "body": body, "pairs": [], "cl": False}


def _seeds(members: list[dict]) -> str:
    """A setting's run count, and how many of them diverged (kept: a diverged run is data)."""
    diverged = sum(j.get("status") == "diverged" for j in members)
    return f"{len(members)}" + (f" ({diverged} diverged)" if diverged else "")


def _cell(members: list[dict], metric: str) -> str:
    """A setting's mean [95% CI] on a metric; "– (diverged)" where its runs diverged before recording it."""
    e = stats.estimate([_metric(j, metric) for j in members])
    if e is None and any(j.get("status") == "diverged" for j in members):
        return "– (diverged)"
    return stats.mean_interval(e)


def _table(meta: dict, groups) -> dict:
    metrics = [m for m in meta["study"].get("metrics") or [] if isinstance(m, str)] or ["final_val_loss"]
    learn = learned(groups)
    header = ["setting", "seeds", "learned (seeds)", *(f"{m} mean [95% CI]" for m in metrics)]
    body = []
    for key, members in groups.items():
        e = learn.get(key)
        body.append([setting_name(_keys(meta), key) or "all runs", _seeds(members),
                     f"{e.learned_seeds} of {e.measured}" if e else "–",
                     *(_cell(members, m) for m in metrics)])
    pairs = []
    if len(groups) == 2:  # two settings: the common-language effect size on every metric with a better direction
        (ka, a), (kb, b) = groups.items()
        for m in metrics:
            if (higher := _direction(m)) is not None:
                p = stats.common_language([_metric(j, m) for j in a], [_metric(j, m) for j in b], higher)
                if p is not None:
                    pairs.append(f"Common-language effect size of {setting_name(_keys(meta), ka)} over "
                                 f"{setting_name(_keys(meta), kb)} on {m}: CL = {p:.2f}")
    return {"header": header, "body": body, "pairs": pairs, "cl": bool(pairs)}


def _context_loss(job: dict, times: int = 4):
    """The loss at `times` the longest trained length (an LM's context), None where not evaluated there."""
    trained = [e["length"] for e in job["eval"] if e.get("in_distribution") and e.get("length")]
    if not trained:
        return None
    return next((e.get("loss") for e in job["eval"] if e.get("length") == times * max(trained)), None)


def _against_baseline(meta: dict, groups) -> dict:
    """The modifications table (Narang et al. 2021's, with intervals): params, tokens/s, final validation loss,
    Δ against the baseline with the common-language effect size, loss at 4x the context; sorted by loss, the
    baseline marked."""
    keys, base = _keys(meta), meta["study"].get("baseline") or {}
    is_base = lambda key: all(str(dict(zip(keys, key)).get(k)) == str(v) for k, v in base.items())  # noqa: E731
    base_jobs = next((m for k, m in groups.items() if is_base(k)), [])
    b = stats.estimate([j.get("final_val_loss") for j in base_jobs])
    rows = []
    for key, members in groups.items():
        e = stats.estimate([j.get("final_val_loss") for j in members])
        delta = None if e is None or b is None else e.mean - b.mean
        p = None if is_base(key) else stats.common_language([j.get("final_val_loss") for j in members],
                                                              [j.get("final_val_loss") for j in base_jobs], False)
        label = setting_name(keys, key).split("=", 1)[-1] if len(keys) == 1 else setting_name(keys, key)
        rows.append((e.mean if e else math.inf, [
            f"**{label}** (baseline)" if is_base(key) else label, _seeds(members),
            stats.fmt(stats.estimate([j.get("params") for j in members]).mean if members else None),
            stats.mean_interval(stats.estimate([j.get("tokens_per_s") for j in members])),
            stats.mean_interval(e), "–" if delta is None or is_base(key) else f"{delta:+.3f}",
            "–" if p is None else f"{p:.2f}",
            stats.mean_interval(stats.estimate([_context_loss(j) for j in members]))]))
    rows.sort(key=lambda r: (r[0], r[1][0]))
    return {"header": ["modification", "seeds", "params", "tokens/s mean [95% CI]", "final val loss mean [95% CI]",
                       "Δ vs baseline", "CL vs baseline", "loss at 4x context mean [95% CI]"],
            "body": [r for _, r in rows], "pairs": [], "cl": True}
