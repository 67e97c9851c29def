"""What a sweep's figures read, from either source: a collected run (report.collect's row, whose results.json may be
read for a dotted field) or a findings page's job line (docs/findings/<sweep>.jsonl, format 2 and older). Both
become the same flat row, so one set of plot kinds (report/figures.py) draws the HTML report and the page alike.

A job line of format 2 carries a `figure` block: what the sweep's `plots:` read that the page's own fields do not
(the values of their `by`/`where`/`x` keys, each plot's metric, the per-layer series and per-head lists of the
diagnostics, and the attention weights of the lowest seed per setting). Only what a run recorded is kept; a line of
format 1 has none, and its figures say what is not recorded."""
from functools import lru_cache
from pathlib import Path

from blocklab import folder
from blocklab.errors import ConfigError
from blocklab.report.collect import HIGHER_IS_BETTER, LOWER_IS_BETTER, UnreadableRun
from blocklab.report.common import keys as _keys
from blocklab.results import RESULTS_FILE

KEPT = ("completed", "diverged")  # a diverged run is data: drawn, as diverged
WHENS = ("init", "end")
# What each kind reads from the per-layer series, beyond its own `metric` (spectral_bounds: the bounds beside it).
SPECTRAL = ("spectral_norm_max", "spectral_prenorm_bound", "spectral_generic_bound")
ATTENTION = ("attention_entropy", "attention_distance", "attention_entropy_answer", "attention_distance_answer")
# Eval columns a job line keeps in every format (findings_data.EVAL_FIELDS); a length plot of another column keeps it.
EVAL_KEPT = ("length", "in_distribution", "exact_match", "token_acc", "loss")
SIGNIFICANT = 5  # significant digits kept of a per-layer value or a curve point: a figure's resolution, a line of a few
# KB, and a loss to 4 decimals, while a gradient of 5e-5 keeps its digits (4 decimals quantized it to 0.0001)
# Columns a kind reads beside its metric and x, kept on a job line for it (lr_curve: the cap and the sensitivity)
EXTRA = {"lr_curve": ("init_loss", "lr_sensitivity")}
CURVE = "logit_curve"  # results.json diagnostics.logit_curve, a collected row's column (the over_step kind)


def direction(metric: str) -> bool | None:
    """True: higher is better, False: lower is better, None: neither (a diagnostic such as head similarity)."""
    name = metric.split(".")[-1]
    if name in HIGHER_IS_BETTER or name.endswith("_per_s"):
        return True
    if name in LOWER_IS_BETTER or name.endswith("_bytes"):
        return False
    return None


def value(row: dict, name: str):
    """A row's column, or else (a collected run) a results.json field of its run by dotted path."""
    if name in row:
        return row[name]
    if "run" not in row:  # a page's row: what its line kept is all there is
        return None
    found = results(row["run"])
    for part in name.split("."):
        found = found.get(part) if isinstance(found, dict) else None
    return found


@lru_cache(maxsize=4096)
def results(run: str) -> dict:
    """The run's results.json, through blocklab.folder (collect read and checked it already)."""
    if not folder.exists(run, RESULTS_FILE):
        return {}
    try:
        return folder.read_json(run, RESULTS_FILE)
    except (OSError, ValueError, RecursionError) as err:  # FolderError, a ConfigError, passes: one line too
        if isinstance(err, ConfigError):
            raise
        raise UnreadableRun(Path(run) / RESULTS_FILE, f"{type(err).__name__}: {err}") from None


def _whens(plot: dict, default: str) -> list[str]:
    when = plot.get("when", default)
    return [when] if isinstance(when, str) else list(when)


def _series_wanted(plots: list[dict]) -> dict[str, set[str]]:
    """Per `when`, the per-layer series the plots draw."""
    wanted = {w: set() for w in WHENS}
    for plot in plots:
        kind, metric = plot.get("kind"), str(plot.get("metric"))
        names = {"by_layer": [metric], "per_head": [f"{metric}_heads"], "spectral_bounds": SPECTRAL,
                 "attention_maps": ATTENTION}.get(kind, [])
        default = "init" if kind in ("by_layer", "spectral_bounds") else "end"
        for when in _whens(plot, default):
            if when in wanted:
                wanted[when].update(names)
    return wanted


def step_curve(row: dict, metric: str) -> list[tuple[int, float]]:
    """[(step, value)] of a run's recorded curve: a page row's kept `curves`, or a collected row's logit_curve (a
    per-layer value as its largest layer's)."""
    kept = (row.get("curves") or {}).get(metric) if isinstance(row.get("curves"), dict) else None
    if kept is not None:
        return [(int(s), float(v)) for s, v in kept if isinstance(s, int) and isinstance(v, (int, float))]
    out = []
    for point in row.get(CURVE) or []:
        found = point.get(metric) if isinstance(point, dict) else None
        if isinstance(found, list):
            found = max((v for v in found if v is not None), default=None)
        if isinstance(found, (int, float)) and isinstance(point.get("step"), int):
            out.append((point["step"], float(found)))
    return out


def _rounded(x):
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return float(f"{x:.{SIGNIFICANT}g}") if isinstance(x, float) else x


def attention_weights(row: dict, when: str):
    """The first probe example's attention weights a run's diagnostics recorded at `when` (layers x heads x queries
    x keys), or None."""
    if isinstance(row.get("attention_weights"), dict):
        return row["attention_weights"].get(when)
    measured = (value(row, "diagnostics") or {}).get(when) if "run" in row else None
    found = measured.get("attention_weights") if isinstance(measured, dict) else None
    return found if isinstance(found, list) and found else None


def figure_record(row: dict, plots: list[dict], with_maps: bool) -> dict:
    """A job line's `figure` block (format 2): what the sweep's plots read, as this run recorded it. `with_maps`:
    keep its attention weights (the lowest seed of its setting; one run's maps show the pattern)."""
    names = {k for p in plots for k in [*_keys(p.get("by", [])), *(p.get("where") or {}), *_keys(p.get("panels", []))]}
    names |= {"model.n_layers"} if any(p.get("kind") in ("by_layer", "spectral_bounds") for p in plots) else set()
    keys = {k: row.get(k) for k in sorted(names) if isinstance(row.get(k), (str, int, float, bool))}
    values = {}
    curves = {}
    for p in plots:
        if p.get("kind") == "over_step" and isinstance(p.get("metric"), str):
            curves[p["metric"]] = [[s, _rounded(v)] for s, v in step_curve(row, p["metric"])]
        for name in (p.get("metric"), p.get("x"), *EXTRA.get(p.get("kind"), ())):
            found = value(row, name) if isinstance(name, str) else None
            if isinstance(found, (int, float)) and not isinstance(found, bool):
                values[name] = _rounded(float(found))
    layers = {}
    for when, wanted in _series_wanted(plots).items():
        recorded = row.get(f"layers_{when}") or {}
        kept = {m: _rounded(recorded[m]) for m in sorted(wanted) if recorded.get(m)}
        if kept:
            layers[when] = kept
    out = {"keys": keys, "values": values, "layers": layers, **({"curves": curves} if curves else {})}
    extra = sorted({str(p["metric"]) for p in plots if p.get("kind") in ("length_curve", "by_length")
                    and p.get("metric") not in EVAL_KEPT})
    if any(p.get("kind") == "by_position" for p in plots):
        extra.append("token_acc_by_position")
    if extra:
        out["eval"] = [{"length": e.get("length"), **{m: _rounded(e.get(m)) for m in extra if e.get(m) is not None}}
                       for e in row.get("eval") or []]
    if with_maps:
        maps = {w: attention_weights(row, w) for p in plots if p.get("kind") == "attention_maps"
                for w in _whens(p, "end")}
        maps = {w: m for w, m in maps.items() if m}
        if maps:
            out["attention_weights"] = maps
    return out


def lowest_seeds(rows: list[dict], keys: list[str]) -> set[str]:
    """The run of each setting whose maps a page keeps: its lowest seed."""
    first = {}
    for r in rows:
        key = tuple(str(r.get(k)) for k in keys)
        if key not in first or (r.get("seed") or 0) < (first[key].get("seed") or 0):
            first[key] = r
    return {r["run"] for r in first.values()}


def page_rows(jobs: list[dict]) -> list[dict]:
    """A page's job lines as the rows the plot kinds read (failed jobs left out; diverged ones kept)."""
    rows = []
    for job in jobs:
        if job.get("status") not in KEPT:
            continue
        fig = job.get("figure") or {}
        evals = [dict(e) for e in job.get("eval") or []]
        for e, more in zip(evals, fig.get("eval") or []):
            if more.get("length") == e.get("length"):
                e.update(more)
        trained = [e["length"] for e in evals if e.get("in_distribution") and e.get("length") is not None]
        # The setting last of the values: a plot's `x` that is a compare key (by_choice over model.n_layers) is
        # recorded as a float among the values, and a bar's label reads the setting's own value (2, not 2.0)
        rows.append({**fig.get("keys", {}), "seed": job.get("seed"),
                     "status": job.get("status"), "diverged": float(job.get("status") == "diverged"),
                     **(job.get("metrics") or {}), **fig.get("values", {}), **job.get("setting", {}), "eval": evals,
                     "train_max_length": max(trained) if trained else None,
                     **{f"layers_{w}": fig.get("layers", {}).get(w, {}) for w in WHENS},
                     "attention_weights": fig.get("attention_weights") or {}, "curves": fig.get("curves") or {}})
    return rows
