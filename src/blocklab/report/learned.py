"""Did a setting learn its task? Judged from a findings file's runs against the reference levels each run's task
states (tasks/references.py, carried in the jsonl as `references`): copy and addition at in-distribution exact
match 0.9, an LM below its corpus' bigram loss, MQAR and next-sentence prediction halfway from chance to perfect, a
masked LM below its corpus' unigram loss.

A setting learned when the mean over its seeds of each bar's metric, at the training lengths, clears that bar (the
mark one run is held to). A seed that diverged before recording the metric counts as a seed that did not learn,
and a setting whose every seed diverged did not learn. A run written before runs recorded their levels falls back to
the exact-match bar where it has exact match; with neither, the setting's learning is unknown and not judged.

The learned gate (`gate`): a claim is testable only where its compared settings learned, on any metric. A claim that
one side cannot learn what the other does (`one_side_learns: true`) needs only its winning side (the better mean)
to have learned; a claim about cost alone (`cost_only: true`: speed or memory, no quality) has no gate."""
from dataclasses import dataclass

from blocklab.report import stats
from blocklab.tasks.references import LEARNED_EXACT_MATCH, Level

BAR = "learned"  # the name of a task's own bar (a level named otherwise is a reference model's: "the bigram's")
FALLBACK = (Level(BAR, "exact_match", LEARNED_EXACT_MATCH),)
# A page's metric -> the eval-row metric its task's levels are stated in
ROW_METRIC = {"final_val_loss": "loss", "final_train_loss": "loss"}
WORDS = {"exact_match": "in-distribution exact match", "loss": "validation loss", "token_acc": "token accuracy",
         "next_sentence_acc": "next-sentence accuracy"}


def in_distribution(job: dict, metric: str):
    """A run's eval-row `metric` averaged over its training lengths (exact match: the recorded mean; loss: the
    final validation loss where the rows hold none); None where it has none."""
    if metric == "exact_match" and job.get("in_distribution_exact_match") is not None:
        return job["in_distribution_exact_match"]
    values = stats.finite([e.get(metric) for e in job.get("eval") or [] if e.get("in_distribution")])
    if values:
        return sum(values) / len(values)
    if metric == "loss":
        return job.get("final_val_loss")
    return (job.get("metrics") or {}).get(f"{metric}_in")


def row_metric(metric: str) -> str:
    """The eval-row metric a page's metric is measured in: final_val_loss, loss_out -> loss; exact_match_in ->
    exact_match; token_acc_out -> token_acc."""
    return ROW_METRIC.get(metric) or metric.removesuffix("_in").removesuffix("_out")


def reference_lines(jobs: list[dict], metric: str) -> list[Level]:
    """Every level the page's runs' tasks state on `metric` (bars and lines, each once, by value): what a figure of
    that metric draws as horizontal lines."""
    want, seen = row_metric(metric), {}
    for j in jobs:
        refs = j.get("references") if isinstance(j.get("references"), dict) else {}
        for x in [*(refs.get("learned") or []), *(refs.get("lines") or [])]:
            if isinstance(x, dict) and x.get("metric") == want and isinstance(x.get("value"), (int, float)):
                seen.setdefault((x.get("name"), x["value"]), Level(str(x.get("name")), want, float(x["value"])))
    return sorted(seen.values(), key=lambda x: x.value)


def bars(job: dict) -> tuple[Level, ...]:
    """The bars a run must clear: its recorded references, else exact match where it has one, else none."""
    refs = job.get("references")
    if isinstance(refs, dict) and isinstance(refs.get("learned"), list) and refs["learned"]:
        return tuple(Level(str(x.get("name")), str(x.get("metric")), float(x.get("value"))) for x in refs["learned"]
                     if isinstance(x, dict) and isinstance(x.get("value"), (int, float)))
    return FALLBACK if job.get("in_distribution_exact_match") is not None else ()


@dataclass(frozen=True)
class Learning:
    """A setting's seeds against its task's bars: seeds measured, seeds that cleared every bar, the mean over seeds
    per bar, and whether the setting learned (every mean clears its bar)."""

    measured: int
    learned_seeds: int
    means: tuple[tuple[Level, float | None], ...]
    diverged: int = 0

    @property
    def learned(self) -> bool:
        return bool(self.means) and all(m is not None and bar.reached(m) for bar, m in self.means)

    @property
    def mean(self) -> float | None:
        """The first bar's mean (what a table shows)."""
        return self.means[0][1] if self.means else None

    def why(self) -> str:
        """Why it did not learn, in a few words: "in-distribution exact match 0.339 < 0.9, 0 of 3 seeds"."""
        if self.diverged == self.measured:
            return f"every seed diverged ({self.measured})"
        missed = [(bar, m) for bar, m in self.means if m is None or not bar.reached(m)]
        parts = []
        for bar, m in missed:
            sign = "≥" if bar.lower_is_better else "<"
            level = stats.fmt(bar.value) if bar.name == BAR else f"the {bar.name}'s {stats.fmt(bar.value)}"
            parts.append(f"{WORDS.get(bar.metric, bar.metric)} {stats.fmt(m)} {sign} {level}")
        seeds = f"{self.learned_seeds} of {self.measured} seeds clear it" + (f", {self.diverged} diverged"
                                                                               if self.diverged else "")
        return f"{'; '.join(parts)} ({seeds})"


def learning(members: list[dict]) -> Learning | None:
    """A setting's Learning from its runs (completed or diverged); None where no run states a bar."""
    levels = next((b for j in members if (b := bars(j))), ())
    if not levels or not members:
        return None
    values = {bar: [in_distribution(j, bar.metric) for j in members] for bar in levels}
    per_seed = [all(isinstance(v, (int, float)) and bar.reached(v) for bar, v in zip(levels, vs))
                for vs in zip(*values.values())]
    means = []
    for bar in levels:
        finite = stats.finite(values[bar])
        means.append((bar, sum(finite) / len(finite) if finite else None))
    diverged = sum(j.get("status") == "diverged" for j in members)
    return Learning(len(members), sum(per_seed), tuple(means), diverged)


def learned(groups: dict[tuple, list[dict]]) -> dict[tuple, Learning]:
    """Per setting whose runs state a bar: its Learning."""
    return {key: e for key, members in groups.items() if (e := learning(members)) is not None}


def gate(claim: dict, sides: list[tuple[str, list[dict]]], metric_of, higher: bool | None) -> str | None:
    """Why a claim is not testable for want of learning (its reason, first), or None where it may be tested.
    `sides`: (label, the settings' runs, grouped: a list of run lists) for the claim's A and B."""
    if claim.get("cost_only") is True:
        return None
    status = []
    for label, settings in sides:
        learnings = [learning(members) for members in settings]
        failed = [e for e in learnings if e is not None and not e.learned]
        status.append((label, failed, all(e is None for e in learnings)))
    if all(unknown for _, _, unknown in status):
        return None  # no run states how its task is learned: nothing to gate on (said on the page)
    if claim.get("one_side_learns") is True:
        means = []
        for label, settings in sides:
            values = stats.finite([metric_of(j) for members in settings for j in members])
            means.append(sum(values) / len(values) if values else None)
        if None in means or higher is None:
            return None
        winner = 0 if (means[0] >= means[1]) == higher else 1
        label, failed, _ = status[winner]
        if failed:
            return (f"the side that scores better, {label}, did not learn its task "
                    f"({'; '.join(e.why() for e in failed)}), and a claim that one side learns what the other "
                    "cannot needs it to")
        return None
    lost = [(label, failed) for label, failed, _ in status if failed]
    if not lost:
        return None
    said = "; ".join(f"{label}: {', '.join(e.why() for e in failed)}" for label, failed in lost)
    return f"{' and '.join(label for label, _ in lost)} did not learn {'its' if len(lost) == 1 else 'their'} task ({said})"
