"""Learning-rate sensitivity (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities", ICLR 2024, sec. 2.2): for one setting trained at each learning rate eta of a grid,

    LR sensitivity = E_eta [ min(l(eta), l_0) - l* ],   l* = min_eta l(eta)

l(eta) the final loss at rate eta, l_0 the loss at initialization; a run that diverged (or ended above l_0) counts
as l_0, so one bad rate costs at most the whole of what training gains. The paper averages over its grid of rates
(log-spaced); so does this, over the rates a sweep ran. Here l is the final validation loss, l_0 the probe batch's
loss at step 0 (results.json diagnostics.logit_curve, recorded by train/diagnostics.py), and l* the lowest capped
loss (the paper's l* where any rate ends below l_0, as every rate here that learned does).

`annotate` gives each run's row the sensitivity of its setting and seed: the runs a sweep folder holds that differ
only in `optim.lr` form one curve. The same number stands on each of the curve's rows, so a claim about it picks
one rate with `where` (its pairs are then the seeds)."""
import math
from collections import defaultdict

OVER = "optim.lr"
KEPT = ("completed", "diverged")
# A metric of a whole curve -> the per-run loss a setting's best rate is chosen on (report/page_tables.py)
CHOSEN_ON = {"lr_sensitivity": "final_val_loss"}


def capped(loss, status: str, init_loss: float) -> float:
    """min(l, l_0): a diverged run, or a loss that is not a finite number, is l_0."""
    finite = isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss)
    return min(float(loss), init_loss) if finite and status == "completed" else init_loss


def sensitivity(losses: list[float]) -> float | None:
    """The mean over the grid of each rate's capped loss minus the lowest: None for fewer than two rates."""
    return sum(losses) / len(losses) - min(losses) if len(losses) >= 2 else None


def init_loss(row: dict) -> float | None:
    """The probe loss at step 0 a run recorded (diagnostics.logit_curve's first point), else None."""
    curve = row.get("logit_curve") or []
    first = curve[0] if curve and isinstance(curve[0], dict) else {}
    value = first.get("probe_loss") if first.get("step") == 0 else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def curves(rows: list[dict], over: str = OVER) -> dict[tuple, list[dict]]:
    """The runs of each curve: same study and swept values but `over` (the seed included), those that ran to an
    end (completed or diverged) and swept `over`."""
    found = defaultdict(list)
    for row in rows:
        swept = row.get("overrides") or {}
        if row.get("status") in KEPT and over in swept:
            found[(row.get("study"), tuple(sorted((k, str(v)) for k, v in swept.items() if k != over)))].append(row)
    return dict(found)


def curve_sensitivity(members: list[dict], over: str = OVER) -> float | None:
    """One curve's LR sensitivity, None where a run lacks its l_0 or the curve has one rate."""
    starts = [init_loss(m) for m in members]
    if not members or None in starts:
        return None
    start = sum(starts) / len(starts)  # one init per seed: every rate starts from the same weights
    per_rate = defaultdict(list)
    for m in members:
        per_rate[float(m[over])].append(capped(m.get("final_val_loss"), m["status"], start))
    return sensitivity([sum(v) / len(v) for v in per_rate.values()])


def annotate(rows: list[dict], over: str = OVER) -> list[dict]:
    """Each row of a curve gets `lr_sensitivity` (its curve's) and `init_loss` (its own l_0); rows of no curve get
    neither."""
    for members in curves(rows, over).values():
        value = curve_sensitivity(members, over)
        for m in members:
            m["init_loss"] = init_loss(m)
            m["lr_sensitivity"] = value
    return rows
