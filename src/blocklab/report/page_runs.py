"""A findings page's runs by setting: the jsonl's completed and diverged runs grouped by the study's compare keys,
a claim's side selected by its spec, and each setting at its own best learning rate (`at_best` claims, targets.py).
The judge (judge.py) and the page's tables and text read them from here."""
from blocklab.report.build import _direction
from blocklab.report.common import group
from blocklab.report.recall import OVER, AtChoice, at_choice, best

KEPT = ("completed", "diverged")  # the runs a page shows: a diverged run is data, not a missing row


def keys_of(meta: dict) -> list[str]:
    return [k for k in meta["study"].get("compare") or [] if isinstance(k, str)]


def groups_of(meta: dict, jobs: list[dict]) -> dict[tuple, list[dict]]:
    """Setting -> its runs that completed or diverged (a failed run measured nothing)."""
    keys = keys_of(meta)
    rows = [{**{k: j["setting"].get(k) for k in keys}, "job": j} for j in jobs if j.get("status") in KEPT]
    return {key: [r["job"] for r in members] for key, members in group(rows, keys).items()}


def metric_of(job: dict, metric: str):
    return job["metrics"].get(metric) if metric in job["metrics"] else job.get(metric)


def _matches(job: dict, spec: dict) -> bool:
    return all(str(job["setting"].get(k, job["choices"].get(k))) == str(v) for k, v in spec.items())


def spec_label(spec) -> str:
    return ", ".join(f"{str(k).rsplit('.', 1)[-1]}={v}" for k, v in spec.items()) if isinstance(spec, dict) else ""


def _settings(groups, spec) -> list[list[dict]]:
    """The runs of each setting that matches `spec`, one list per setting."""
    spec = spec if isinstance(spec, dict) else {}
    return [m for m in ([j for j in members if _matches(j, spec)] for members in groups.values()) if spec and m]


def select(groups, spec) -> tuple[str, list[dict]]:
    """The runs of every setting whose compare values (or choices) match `spec` ({key: value}); a label for them."""
    spec = spec if isinstance(spec, dict) else {}
    return spec_label(spec), [j for members in groups.values() for j in members if spec and _matches(j, spec)]


def higher_is_better(metric: str) -> bool:
    return _direction(metric) is not False


def at_best_lr(meta: dict, groups: dict) -> dict:
    """Each setting (the compare keys but the learning rate) at its best learning rate only, chosen on the study's
    verdict metric (mean over seeds): `at_best: true` claims compare two optimizers each at its own best rate. The
    groups unchanged where the study does not sweep the rate."""
    keys = keys_of(meta)
    if OVER not in keys:
        return groups
    i, verdict = keys.index(OVER), meta["study"].get("verdict")
    metric = (verdict.get("metric") if isinstance(verdict, dict) else None) or "final_val_loss"
    tried: dict[tuple, list[AtChoice]] = {}
    for key, members in groups.items():
        if choice := at_choice(key[i], members, lambda j: metric_of(j, metric)):
            tried.setdefault(key[:i] + key[i + 1:], []).append(choice)
    top = {rest: best(options, higher_is_better(metric)) for rest, options in tried.items()}
    return {rest[:i] + (c.value,) + rest[i:]: c.members for rest, c in top.items()}
