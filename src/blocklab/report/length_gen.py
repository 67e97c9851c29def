"""Length generalization over seeds (train short, test long), from results.json's per-length `eval` rows.

Single seeds mislead on length generalization (Zhou et al. 2024: the same recipe extrapolates for some
seeds and not others), so everything here is per setting *over its seeds*:

- `curve`: the metric against evaluation length, mean and min-max over seeds (the `length_curve` plot);
- `position_curve`: token accuracy against the place in the answer at one evaluated length (the `by_position`
  plot), which shows where extrapolation breaks: at the answer's start, its end, or evenly;
- `summarize` / `length_table`: the "Length generalization" table a sweep enables with
  `study.length_table: {metric: exact_match, threshold: 0.9, at: 2}` (one row per compared setting):
  the mean in-distribution score (did the model learn the task at all), the longest evaluated length whose
  mean over seeds reaches the threshold, and how many seeds reach it at `at` x their longest training length
  (results.json's `train_lengths`; a length that was not evaluated is said to be, never interpolated).

- `reach_table`: for every sweep whose runs score exact match per length, the fraction of seeds reaching the
  threshold at each evaluated length; `degenerate_notes`: the sentences for the cases where there is nothing to
  compare ("no setting generalizes beyond the training length").

No plotting library and no report module is imported here: build.py groups the runs and owns the axes."""
import difflib
import math
from collections import defaultdict
from dataclasses import dataclass

from blocklab.errors import ConfigError
from blocklab.schema import Choice, Keys, Number, Spec

KEY = "study.length_table"
METRICS = ("exact_match", "exact_match_given_length", "token_acc")  # per-length scores in [0, 1], higher better
DEFAULTS = {"metric": "exact_match", "threshold": 0.9, "at": 2}
EXAMPLE = "{metric: exact_match, threshold: 0.9, at: 2}"


SPECS: dict[str, Spec] = {
    "metric": Choice(METRICS, noun="a per-length score in [0, 1]"),
    "threshold": Number(0, 1, low_open=True, high_open=False),
    "at": Number(0, low_open=True),
    "by": Keys("a key or a list of keys, e.g. [pos, task.index_hints] (default: study.compare)"),
}


def table_errors(value) -> list[str]:
    """One line per problem of a `study.length_table` value (None, false: no table; true: the defaults)."""
    if value is None or isinstance(value, bool):
        return []
    if not isinstance(value, dict):
        return [f"{KEY}={value!r} must be a mapping such as {EXAMPLE}, or true for those defaults"]
    errors = []
    for key, item in value.items():
        if key in SPECS:
            errors += filter(None, [SPECS[key].error(f"{KEY}.{key}", item)])
        else:
            close = difflib.get_close_matches(str(key), list(SPECS), n=1)
            hint = f"did you mean {KEY}.{close[0]}? " if close else ""
            errors.append(f"{KEY}.{key} is not a key of {KEY}; {hint}its keys are {sorted(SPECS)}")
    return errors


def table_spec(value) -> dict | None:
    """The validated table spec with its defaults filled in, None when the study asks for no table.
    Raises ConfigError, one line per problem."""
    errors = table_errors(value)
    if errors:
        raise ConfigError("\n".join(errors))
    if value is None or value is False:
        return None
    spec = {**DEFAULTS, **(value if isinstance(value, dict) else {})}
    if isinstance(spec.get("by"), str):
        spec["by"] = [spec["by"]]
    return spec


def _finite(value) -> float | None:
    """A score as recorded, or None where it is missing or not a finite number (non-finite ones are written null)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def _score(entry: dict, metric: str) -> float | None:
    return _finite(entry.get(metric))


@dataclass
class Curve:
    """Per evaluated length: the mean, lowest and highest score over the seeds that have one, and their count."""

    lengths: list[int]
    mean: list[float]
    low: list[float]
    high: list[float]
    seeds: list[int]


def curve(members: list[dict], metric: str) -> Curve:
    per_length = defaultdict(list)
    for run in members:
        for entry in run.get("eval") or []:
            score = _score(entry, metric)
            if score is not None:
                per_length[entry["length"]].append(score)
    return _over_seeds(per_length)


def _over_seeds(per_x: dict[int, list[float]]) -> Curve:
    """The Curve of scores gathered per x (a length or a place), one score per seed."""
    xs = sorted(per_x)
    scores = [per_x[x] for x in xs]
    return Curve(xs, [sum(s) / len(s) for s in scores], [min(s) for s in scores], [max(s) for s in scores],
                 [len(s) for s in scores])


def position_curve(members: list[dict], length: int) -> Curve:
    """Per place in the answer (1-based; the last is the end-of-answer token): the mean, lowest and highest
    teacher-forced token accuracy over the seeds whose eval row at `length` records it."""
    per_place = defaultdict(list)
    for run in members:
        for entry in run.get("eval") or []:
            if entry["length"] == length:
                for place, score in enumerate(entry.get("token_acc_by_position") or [], start=1):
                    if _finite(score) is not None:
                        per_place[place].append(score)
    return _over_seeds(per_place)


def draw(ax, curves: list[tuple[str, Curve]], train_max: list[int], metric: str,
         names: list[str] | None = None) -> str:
    """One line per setting at the seed means, its seed range (min to max) shaded in the line's colour, a
    dashed vertical line at each longest training length. Returns a sentence on the widest seed range, naming
    settings by `names` (default: their labels)."""
    for label, c in curves:
        (line,) = ax.plot(c.lengths, c.mean, marker="o", label=label)
        ax.fill_between(c.lengths, c.low, c.high, color=line.get_color(), alpha=0.2, linewidth=0)
    for length in train_max:
        ax.axvline(length, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("length (dashed: longest trained; shaded: min to max over seeds)")
    if all(n < 2 for _, c in curves for n in c.seeds):
        return (f"{metric}: one seed per setting, so no seed range to shade; single seeds mislead on length "
                "generalization (add seeds).")
    beyond = max(train_max) if train_max else -math.inf
    named = zip(names or [label for label, _ in curves], (c for _, c in curves))
    spreads = [(c.high[i] - c.low[i], label, c.lengths[i], c.low[i], c.high[i], c.seeds[i])
               for label, c in named for i in range(len(c.lengths)) if c.lengths[i] > beyond and c.seeds[i] > 1]
    text = f"{metric}: mean over seeds per setting, shaded from the lowest to the highest seed"
    if not spreads:
        return text + "."
    if max(s[0] for s in spreads) == 0:
        return text + "; beyond the trained lengths every setting's seeds score the same."
    _, label, length, low, high, n = max(spreads, key=lambda s: s[0])
    return (f"{text}; the widest seed range beyond the trained lengths: {label} at length {length} "
            f"({low:.2f} to {high:.2f} over {n} seeds).")


@dataclass
class Summary:
    """One setting's row of the length generalization table."""

    seeds: int
    in_distribution: tuple[float | None, float | None, int]  # mean, std over seeds, seeds measured
    longest: int | None  # longest evaluated length whose mean over seeds >= threshold
    targets: list  # at x each seed's longest training length (distinct, sorted)
    reached: int  # seeds with score >= threshold at their target length
    evaluated: int  # seeds that evaluated their target length


def _whole(x: float):
    return int(x) if float(x).is_integer() else x


def summarize(members: list[dict], spec: dict) -> Summary:
    metric, threshold, at = spec["metric"], spec["threshold"], spec["at"]
    c = curve(members, metric)
    passing = [n for n, mean in zip(c.lengths, c.mean) if mean >= threshold]
    inside = []
    targets, reached, evaluated = set(), 0, 0
    for run in members:
        scores = [_score(e, metric) for e in run.get("eval") or [] if e.get("in_distribution")]
        scores = [s for s in scores if s is not None]
        if scores:
            inside.append(sum(scores) / len(scores))
        target = _whole(at * run["train_max_length"])
        targets.add(target)
        at_target = [_score(e, metric) for e in run.get("eval") or [] if e["length"] == target]
        at_target = [s for s in at_target if s is not None]
        if at_target:
            evaluated += 1
            reached += at_target[0] >= threshold
    return Summary(len(members), _mean_std(inside), max(passing) if passing else None, sorted(targets),
                   reached, evaluated)


def _mean_std(values: list[float]) -> tuple[float | None, float | None, int]:
    if not values:
        return None, None, 0
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std, len(values)


def header(keys: list[str], spec: dict) -> list[str]:
    metric, threshold, at = spec["metric"], f"{spec['threshold']:g}", f"{spec['at']:g}"
    return [*keys, "seeds", f"{metric} in distribution", f"longest length with mean ≥ {threshold}",
            f"seeds ≥ {threshold} at {at}× longest train length"]


def cells(s: Summary) -> list[str]:
    mean, std, n = s.in_distribution
    inside = "–" if mean is None else f"{mean:.3f}" + (f" ± {std:.3f}" if n > 1 else "")
    where = f"length{'s' if len(s.targets) > 1 else ''} {', '.join(map(str, s.targets))}"
    if s.evaluated == 0:
        reach = f"{where} not evaluated"
    else:
        reach = f"{s.reached}/{s.evaluated} at {where}"
        if s.evaluated < s.seeds:
            reach += f" ({s.seeds - s.evaluated} of {s.seeds} seeds not evaluated there)"
    return [str(s.seeds), inside, "none" if s.longest is None else str(s.longest), reach]


def rows(groups: dict[tuple, list[dict]], keys: list[str], spec: dict) -> tuple[list[str], list[list[str]]]:
    """The table's header and one row of cells per setting (`groups`: setting -> its runs, in order)."""
    return header(keys, spec), [[str(v) for v in key] + cells(summarize(members, spec))
                                for key, members in groups.items()]


def length_table(groups: dict[tuple, list[dict]], keys: list[str], spec: dict) -> tuple[str, str, list, list]:
    """The "Length generalization" table: (its lead, the sentence under it, its header, its rows)."""
    head, body = rows(groups, keys, spec)
    threshold, at = f"{spec['threshold']:g}", f"{spec['at']:g}"
    intro = (f"Per setting, over its seeds: the mean {spec['metric']} on the trained lengths (whether the task was "
             f"learned at all); the longest evaluated length whose mean over seeds is ≥ {threshold}; and how many "
             f"seeds (k/n) reach ≥ {threshold} at {at}× their longest training length, where single seeds mislead "
             "(Zhou et al. 2024).")
    return "Length generalization.", intro, head, body


def reached(members: list[dict], metric: str, threshold: float) -> dict[int, tuple[int, int]]:
    """Per evaluated length: (seeds scoring >= threshold there, seeds that evaluated it)."""
    counts = defaultdict(lambda: [0, 0])
    for run in members:
        for entry in run.get("eval") or []:
            score = _score(entry, metric)
            if score is not None:
                counts[entry["length"]][0] += score >= threshold
                counts[entry["length"]][1] += 1
    return {n: tuple(c) for n, c in sorted(counts.items())}


def reach_table(groups: dict[tuple, list[dict]], keys: list[str], metric: str = "exact_match",
                threshold: float = DEFAULTS["threshold"]) -> tuple[str, str, list, list] | None:
    """The table of seeds reaching `threshold` at each length (k/n), one row per setting, as (lead, sentence,
    header, rows); None when no run scores `metric` per length (an LM)."""
    per_group = {key: reached(members, metric, threshold) for key, members in groups.items()}
    lengths = sorted({n for counts in per_group.values() for n in counts})
    if not lengths:
        return None
    trained = sorted({run["train_max_length"] for members in groups.values() for run in members
                      if run.get("train_max_length") is not None})
    head = [*keys, *(str(n) for n in lengths)]
    body = [[str(v) for v in key] + [f"{counts[n][0]}/{counts[n][1]}" if n in counts else "–" for n in lengths]
            for key, counts in per_group.items()]
    intro = (f"at each evaluated length (k of n seeds; trained up to length {', '.join(map(str, trained)) or '?'}: "
             "the columns beyond it are extrapolation).")
    return f"Seeds reaching {metric} ≥ {threshold:g}", intro, head, body


def degenerate_notes(runs: list[dict], metric: str = "exact_match",
                     threshold: float = DEFAULTS["threshold"]) -> list[str]:
    """Sentences for what no run achieved: learning the trained lengths, or any length beyond them."""
    scores = {True: [], False: []}
    for run in runs:
        for entry in run.get("eval") or []:
            score = _score(entry, metric)
            if score is not None:
                scores[bool(entry.get("in_distribution"))].append(score)
    notes = []
    if scores[True] and max(scores[True]) < threshold:
        notes.append(f"no setting learns the task on its training lengths: no seed reaches {metric} ≥ {threshold:g} "
                     f"at a trained length (the best single score: {max(scores[True]):.2f}).")
    if scores[False] and max(scores[False]) < threshold:
        notes.append(f"no setting generalizes beyond the training length: no seed reaches {metric} ≥ {threshold:g} "
                     f"at any length beyond it (the best single score there: {max(scores[False]):.2f}).")
    return notes
