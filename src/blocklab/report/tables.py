"""A section's two tables, one row per compared setting (`groups`: setting -> its runs, in order):

- `metrics_table`: the study's own metrics (`study.metrics`), each as the mean over seeds and its 95% bootstrap
  interval in a column of its own: what answers the section's question;
- `summary_table`: every sweep in the layout of Narang et al. 2021 ("Do Transformer Modifications Transfer..."),
  so sweeps read alike: params, forward FLOPs per token, training tokens/s, the early training loss (mean ± sd at
  25% of training), the final validation loss and exact match in / beyond the training lengths (mean [95% CI]).
  A column no run records is left out; one a run lacks reads "–".

Every other column goes to summary.csv. Values come from the rows of collect.py (`value` reads a column, or a
results.json field by dotted path)."""
from collections.abc import Callable

from blocklab.report import stats
from blocklab.report.collect import EARLY

# (header, column, how a group's values are written)
SUMMARY: list[tuple[str, str, Callable]] = [
    ("params", "params", lambda e: stats.fmt(e.mean) if e.sd == 0 else stats.mean_sd(e)),
    ("FLOPs/token (forward)", "flops_per_token", lambda e: stats.fmt(e.mean) if e.sd == 0 else stats.mean_sd(e)),
    ("tokens/s (training)", "tokens_per_s", stats.mean_sd),
    (f"early train loss ({EARLY:.0%} of steps, mean ± sd)", "early_loss", stats.mean_sd),
    ("final val loss [95% CI]", "final_val_loss", stats.mean_interval),
    ("exact match in distribution [95% CI]", "exact_match_in", stats.mean_interval),
    ("exact match beyond training [95% CI]", "exact_match_out", stats.mean_interval),
]


def _seeds(members: list[dict]) -> str:
    return str(len(members))


def metrics_table(groups: dict[tuple, list[dict]], keys: list[str], metrics: list[str],
                  value: Callable[[dict, str], object], learned: dict | None = None,
                  learned_header: str = "learned") -> tuple[list[str], list[list[str]]]:
    """`learned`: setting -> (seeds that learned, seeds measured, whether the setting counts as learned); where
    given, a last column marks each setting, so no row of a setting that did not learn reads as a result."""
    header = [*keys, "seeds"]
    for metric in metrics:
        header += [f"{metric} (mean)", f"{metric} 95% CI"]
    header += [learned_header] if learned else []
    body = []
    for key, members in groups.items():
        cells = [str(v) for v in key] + [_seeds(members)]
        for metric in metrics:
            e = stats.estimate([value(m, metric) for m in members])
            missing = f" ({e.n} of {len(members)} seeds)" if e is not None and e.n < len(members) else ""
            cells += [stats.fmt(None if e is None else e.mean), stats.interval(e) + missing]
        if learned:
            k, n, ok = learned.get(key, (None, None, None))
            cells.append("–" if k is None else f"{k}/{n} seeds" + ("" if ok else ", not learned"))
        body.append(cells)
    return header, body


def summary_table(groups: dict[tuple, list[dict]], keys: list[str]) -> tuple[list[str], list[list[str]], list[str]]:
    """The header, the rows, and the headers of the columns left out because no run records them."""
    rows = [m for members in groups.values() for m in members]
    columns = [c for c in SUMMARY if any(stats.finite([r.get(c[1])]) for r in rows)]
    missing = [c[0] for c in SUMMARY if c not in columns]
    header = [*keys, "seeds", *(c[0] for c in columns)]
    body = []
    for key, members in groups.items():
        cells = [str(v) for v in key] + [_seeds(members)]
        for _, column, write in columns:
            e = stats.estimate([m.get(column) for m in members])
            cells.append("–" if e is None else write(e))
        body.append(cells)
    return header, body, missing
