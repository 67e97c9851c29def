"""Steps to a target loss read off recorded curves (issue 57, Muon's claim: fewer steps to the AdamW baseline's
final loss, at each learning rate's best).

The target is a page's own number: the mean `metric` (final_val_loss) of the setting `study.target.of` at its best
learning rate (page_runs.at_best_lr), so no run needs it before it trains and no one types it. Each run's
`steps_to_target` is where its validation curve (results.json val_loss_curve, carried in the findings file) first
reaches it, interpolated linearly between the two validations around the crossing; None where it never does."""
from blocklab.report import stats
from blocklab.report.page_runs import at_best_lr, groups_of, metric_of, select

METRIC = "steps_to_target"


def steps_to(curve: list | None, target: float) -> float | None:
    """The first step at which the curve ([step, loss] points, in step order) reaches `target`, linear between the
    validation before and the one at or below it; the first point's own step where it already is; None where the
    curve never reaches it (or there is none)."""
    points = [(float(s), float(v)) for s, v in curve or [] if v is not None]
    for k, (step, loss) in enumerate(points):
        if loss <= target:
            if k == 0:
                return step
            (s0, v0) = points[k - 1]
            return s0 + (step - s0) * (v0 - target) / (v0 - loss)
    return None


def target(meta: dict, jobs: list[dict]) -> tuple[float, str] | None:
    """The page's target loss and a sentence naming where it comes from; None where the study sets none or its
    setting has no finite value."""
    spec = meta["study"].get("target")
    if not isinstance(spec, dict) or not isinstance(spec.get("of"), dict):
        return None
    metric = spec.get("metric", "final_val_loss")
    label, runs = select(at_best_lr(meta, groups_of(meta, jobs)), spec["of"])
    values = stats.finite([metric_of(j, metric) for j in runs])
    if not values:
        return None
    value = sum(values) / len(values)
    lrs = sorted({str(j["setting"].get("optim.lr")) for j in runs})
    return value, (f"{METRIC}: the step at which a run's validation loss first reaches {value:.4f}, the mean "
                   f"{metric} of {label} at its best learning rate ({', '.join(lrs)}; {len(values)} runs), "
                   "interpolated between validations; a run that never reaches it has none.")


def apply(meta: dict, jobs: list[dict]) -> None:
    """Each job's metrics gain steps_to_target, and the page's caveats the sentence, where the study names a
    target."""
    found = target(meta, jobs)
    if found is None:
        return
    value, sentence = found
    for j in jobs:
        if "val_loss_curve" in j:
            j["metrics"][METRIC] = steps_to(j["val_loss_curve"], value)
    meta["target_note"] = sentence  # the page's caveats end with it (page_text.notes)
