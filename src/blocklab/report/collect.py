"""Read every run of a sweep (or of a folder of sweeps) into flat rows.

Everything under the folder may come from anyone: every file is read through blocklab.folder (no link below the
folder followed, no special file, a size cap, YAML as data without aliases or interpolation), the walk follows no
link, and a run whose lock another process holds (folder.is_locked: still training) is listed as running, its files
not read. No lock file is created or taken away."""
import os
import re
from itertools import pairwise
from pathlib import Path

from omegaconf import OmegaConf

from blocklab import folder
from blocklab.errors import ConfigError
from blocklab.folder import FolderError
from blocklab.paths import CONF_DIR
from blocklab.report import lr_sensitivity
from blocklab.report.claims import claims_hash
from blocklab.results import RESULTS_FILE, SAVED_CONFIG, flatten, recorded_references, swept_overrides

RUNNING = "running"  # a row's status for a run still training: its results are not read

HIGHER_IS_BETTER = {"exact_match", "exact_match_given_length", "read_attention", "exact_match_in", "exact_match_out",
                    "token_acc", "token_acc_in", "tokens_per_s",
                    "decode_tokens_per_s", "next_sentence_acc", "next_sentence_acc_in"}
LOWER_IS_BETTER = {"final_val_loss", "final_train_loss", "loss", "loss_out", "perplexity", "ms_per_step",
                   "steps_to_target_loss", "steps_to_target", "diverged", "kv_cache_bytes_per_token", "state_bytes",
                   "early_loss", "flops_per_token", "lr_sensitivity",
                   "first_token_share"}  # the attention sink: what gated attention claims to shrink (Qiu et al. 2025)
# steps_to_target: read off the curves at report time (report/targets.py)
# The metric columns a run's row carries (what study.metrics may name, besides a results.json field by dotted path).
METRICS = ("final_val_loss", "final_train_loss", "early_loss", "exact_match_in", "exact_match_out", "loss_out",
           "token_acc_in", "next_sentence_acc_in",
           "params", "flops_per_token", "tokens_per_s", "ms_per_step", "diverged", "steps_to_target_loss",
           "steps_to_target",  # a findings page's, from study.target and each run's curve (report/targets.py)
           "kv_cache_bytes_per_token", "state_bytes", "decode_tokens_per_s", "head_similarity", "ffn_sparsity",
           "first_token_share", "lr_sensitivity",
           "ffn_off", "ffn_dead", "relative_residual_last")
EARLY = 0.25  # the early loss is read at this fraction of the planned training steps (Narang et al. 2021)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _layers(diag: dict | None, when: str) -> dict[str, list]:
    """Per-layer series from the diagnostics measurement at `when` (init or end)."""
    m = (diag or {}).get(when) or {}
    if not m.get("layers"):  # none measured, or skipped (a diverged model has nothing finite to measure)
        return {}
    series = {
        "activation_rms": [layer["activation_rms"] for layer in m["layers"]],
        "relative_residual": [layer["relative_residual"]["fro"] for layer in m["layers"]],
        "spectral_norm_max": [max(layer["spectral_norm_max"]) for layer in m["layers"]],
        "head_similarity": [layer["head_similarity_mean"] for layer in m["layers"]],
        "ffn_sparsity": [layer["ffn_sparsity"] for layer in m["layers"]],
        # the seed's bounds on ||A||_2 (max over heads; None: the pre-norm bound does not apply to the layer)
        "spectral_prenorm_bound": [max(b) if (b := layer.get("spectral_prenorm_bound")) else None
                                   for layer in m["layers"]],
        "spectral_generic_bound": [(layer.get("spectral_generic_bound") or [None, None])[1] for layer in m["layers"]],
        # units in their activation's flat tail, and units off on every probe token (runs since these existed)
        "ffn_off": [layer.get("ffn_off") for layer in m["layers"]],
        "ffn_dead": [layer.get("ffn_dead") for layer in m["layers"]],
    }
    for part in ("attn", "ffn"):
        series[f"grad_{part}"] = [g[part] for g in m.get("gradients", [])]
    for key in ("attention_entropy", "attention_distance", "attention_entropy_answer", "attention_distance_answer",
                "first_token_share"):
        heads = [layer.get(key) for layer in m["layers"]]  # per head; *_answer: over the answer's queries only
        series[key] = [sum(h) / len(h) if h else None for h in heads]
        series[f"{key}_heads"] = heads  # per layer, one value per head (the per_head plot)
    return series


def early_loss(curve: list | None, planned_steps: int | None, fraction: float = EARLY) -> float | None:
    """The training loss at `fraction` of the planned steps, from results.json's train_loss_curve ([step, mean
    training loss since the previous point]): the point nearest that step, None where the run records no curve
    (results.json before it existed) or stopped (diverged) before it."""
    points = [(step, loss) for step, loss in curve or [] if loss is not None]
    if not points or not planned_steps:
        return None
    target = fraction * planned_steps
    step, loss = min(points, key=lambda p: abs(p[0] - target))
    spacing = max(b[0] - a[0] for a, b in pairwise(points)) if len(points) > 1 else points[0][0]
    return loss if abs(step - target) <= spacing else None


class UnreadableRun(ConfigError):
    """A run's results.json or saved config that the report cannot read: one line naming the file and the fix."""

    def __init__(self, path: Path, why: str):
        why = " ".join(str(why).split())[:300]  # one line, however the parser wrote it
        super().__init__(f"{path}: unreadable ({why}); delete it and rerun the sweep's command to re-evaluate that run, "
                         "or move the run's folder out of the sweep folder")


STATUSES = ("completed", "diverged", "failed", "invalid")  # what a results.json may say (RUNNING: only a row)


def _number(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _scalar(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _problems(results) -> str | None:
    """What in a parsed results.json the report cannot use (a bit flip that kept it JSON), None where nothing."""
    if not isinstance(results, dict):
        return "not a JSON object"
    if results.get("status") not in STATUSES:
        return f"status {repr(results.get('status'))[:40]} is not one of {', '.join(STATUSES)}"
    for key in ("study", "task", "machine"):
        if not (results.get(key) is None or isinstance(results[key], str)):
            return f"{key} is not text"
    if not isinstance(results.get("overrides", []), list) or not all(isinstance(o, str) for o in results.get("overrides", [])):
        return "overrides is not a list of key=value strings"
    if not isinstance(results.get("choices", {}), dict) or not all(
            isinstance(k, str) and _scalar(v) for k, v in results.get("choices", {}).items()):
        return "choices is not a mapping of names to values"
    if results["status"] in ("failed", "invalid"):
        return None
    for key in ("final_val_loss", "final_train_loss", "params", "tokens_per_s", "steps", "ms_per_step",
                "steps_to_target_loss"):
        if not _number(results.get(key)):
            return f"{key} is not a number"
    lengths = results.get("train_lengths")
    if not (isinstance(lengths, list) and len(lengths) == 2 and all(_count(n) for n in lengths)):
        return "train_lengths is not a pair of whole numbers"
    if not isinstance(results.get("eval"), list):
        return "eval is not a list"
    for entry in results["eval"]:
        if not isinstance(entry, dict) or not _count(entry.get("length")) or not isinstance(
                entry.get("in_distribution"), bool):
            return "an eval row lacks its length or in_distribution"
        if not all(_number(entry.get(k)) for k in ("exact_match", "exact_match_given_length", "loss", "token_acc",
                                                   "next_sentence_acc")):
            return f"a score of the eval row at length {entry['length']} is not a number"
        by_position = entry.get("token_acc_by_position")
        if not (by_position is None or isinstance(by_position, list) and all(map(_number, by_position))):
            return f"token_acc_by_position at length {entry['length']} is not a list of numbers"
    for key in ("costs", "decode", "diagnostics"):
        if not (results.get(key) is None or isinstance(results[key], dict)):
            return f"{key} is not a mapping"
    return None


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _series_ok(series: dict) -> bool:
    """Per-layer series are numbers (None: not measured), or per head lists of numbers."""
    return all(isinstance(v, list) and all(_number(x) or (isinstance(x, list) and all(map(_number, x))) for x in v)
               for v in series.values())


def load_run(run_dir: Path) -> dict:
    """A run's row; UnreadableRun (one line) where its results.json or saved config cannot be read: truncated, not
    JSON (NaN included: BlockLab writes null), or JSON of another shape (a bit flip can leave it parseable);
    FolderError (one line) where either is a link, a special file or too large to be one."""
    path = run_dir / RESULTS_FILE
    try:
        results = folder.read_json(run_dir, RESULTS_FILE)
    except FolderError:
        raise
    except (OSError, ValueError, RecursionError) as err:  # ValueError: not JSON, NaN, not UTF-8
        raise UnreadableRun(path, f"{type(err).__name__}: {err}") from None
    if (problem := _problems(results)) is not None:
        raise UnreadableRun(path, problem)
    config = saved_config(run_dir)
    try:
        row = _row(run_dir, results, config)
    except Exception as err:  # noqa: BLE001 - any shape error of an untrusted file is one line
        raise UnreadableRun(run_dir / SAVED_CONFIG, f"{type(err).__name__}: {err}") from None
    try:
        row.update(_measured(results, row))
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise UnreadableRun(path, f"{type(err).__name__}: {err}") from None
    if not all(_series_ok(row.get(f"layers_{when}") or {}) for when in ("init", "end")):
        raise UnreadableRun(path, "diagnostics holds a per-layer value that is not a number")
    return row


def saved_config(run_dir: Path):
    """The run's saved .hydra/config.yaml as plain data ({} where there is none), read through blocklab.folder:
    no alias expanded, no interpolation resolved, a size cap. UnreadableRun or FolderError (one line) where it
    cannot be read."""
    if not folder.exists(run_dir, SAVED_CONFIG):
        return {}
    try:
        text = folder.read_text(run_dir, SAVED_CONFIG)
    except FolderError:
        raise
    except (OSError, ValueError) as err:  # ValueError: not UTF-8
        raise UnreadableRun(run_dir / SAVED_CONFIG, f"{type(err).__name__}: {err}") from None
    try:
        return folder.parse_yaml(text, "it")
    except (ValueError, RecursionError) as err:  # not YAML, an alias, an interpolation, nested past any config
        raise UnreadableRun(run_dir / SAVED_CONFIG, str(err) or type(err).__name__) from None


def running_row(run_dir: Path) -> dict:
    """A run another process holds the lock of (still training): status RUNNING, and what it is (study, task,
    config) where its saved config reads; its results.json, which may be an earlier attempt's, is not read."""
    row = {"run": str(run_dir), "status": RUNNING, "error": None}
    try:
        row.update(_row(run_dir, {"status": RUNNING}, saved_config(run_dir)))
    except Exception:  # noqa: BLE001 - a config being written (Hydra's, before the run saves its own): no details
        pass
    return row


def _row(run_dir: Path, results: dict, config) -> dict:
    """What the run is: its config flattened, study, task, overrides and choices."""
    if not isinstance(config, dict):
        raise ValueError("not a mapping of config keys")
    study = config.get("study") or {}
    if not isinstance(study, dict):
        raise ValueError("study is not a mapping")
    row = {"run": str(run_dir), "status": results["status"], "error": results.get("error")}
    row.update({key: value for key, value in flatten(config).items()
                if not isinstance(value, list)})  # lists (eval lengths, plot specs) make no table column
    row["study"] = results.get("study") or study.get("name")
    if not (row["study"] is None or isinstance(row["study"], str)):
        raise ValueError("study.name is not text")
    row["task"] = results.get("task")
    row["claims"] = claims_hash(study.get("verdict"))  # the registered claims when the run trained
    row["overrides"] = dict(o.partition("=")[::2] for o in swept_overrides(results.get("overrides", [])))
    row.update(results.get("choices", {}))
    for key, value in row["overrides"].items():
        row.setdefault(key, value)  # a swept group's choice (method=coupled) names the job as a compare key can
    return row


def _measured(results: dict, row: dict) -> dict:
    """What the run measured (nothing for a failed or invalid run)."""
    if results["status"] in ("failed", "invalid"):
        return {}
    row = dict(row)
    evals = results["eval"]
    inside = [r for r in evals if r["in_distribution"]]
    beyond = [r for r in evals if not r["in_distribution"]]
    decode = results.get("decode") or {}
    row.update({
        "final_val_loss": results["final_val_loss"], "final_train_loss": results["final_train_loss"],
        "params": results["params"], "tokens_per_s": results["tokens_per_s"], "steps": results["steps"],
        "flops_per_token": (results.get("costs") or {}).get("forward_flops_per_token"),
        "early_loss": early_loss(results.get("train_loss_curve"), row.get("trainer.max_steps") or results["steps"]),
        "ms_per_step": results.get("ms_per_step"), "diverged": float(results["status"] == "diverged"),
        "beside_other_jobs": results.get("beside_other_jobs"), "machine": results.get("machine"),
        "steps_to_target_loss": results.get("steps_to_target_loss"),
        "exact_match_in": _mean([r["exact_match"] for r in inside]),
        "exact_match_out": _mean([r["exact_match"] for r in beyond]),
        # how report/learned.py judges whether the run learned: its task's recorded bars, else exact match
        "references": recorded_references(results),
        "in_distribution_exact_match": results.get("in_distribution_exact_match",
                                                   _mean([r["exact_match"] for r in inside])),
        "loss_out": _mean([r["loss"] for r in beyond]),
        "token_acc_in": _mean([r.get("token_acc") for r in inside]),
        "next_sentence_acc_in": _mean([r.get("next_sentence_acc") for r in inside]),
        "kv_cache_bytes_per_token": decode.get("kv_cache_bytes_per_token"),
        "decode_tokens_per_s": decode.get("tokens_per_s"),
        "state_bytes": decode.get("state_bytes"),  # the decoding state after a training-length sequence
        "eval": evals, "train_max_length": results["train_lengths"][1],
        "layers_init": _layers(results.get("diagnostics"), "init"),
        "layers_end": _layers(results.get("diagnostics"), "end"),
        # max attention and output logit, mean log Z and probe loss at each validation (report/figures_lr.py)
        "logit_curve": (results.get("diagnostics") or {}).get("logit_curve") or [],
    })
    row["head_similarity"] = _mean(row["layers_end"].get("head_similarity", []))
    row["first_token_share"] = _mean(row["layers_end"].get("first_token_share", []))  # the attention sink
    row["ffn_sparsity"] = _mean(row["layers_end"].get("ffn_sparsity", []))
    row["ffn_off"] = _mean(row["layers_end"].get("ffn_off", []))
    dead = row["layers_end"].get("ffn_dead") or [None]
    row["ffn_dead"] = None if None in dead else sum(dead)  # units dead over the probe batch, all layers
    # How far the last layer's output is from rank one at the end (rank collapse drives it to 0).
    row["relative_residual_last"] = (row["layers_end"].get("relative_residual") or [None])[-1]
    return row


def run_dirs(root: Path) -> list[Path]:
    """Every run folder under root, in path order: a folder holding a results.json, or a lock file beside its
    saved config (a run still training has no results yet). The walk follows no link (W&B links `latest-run`; a
    run's files are read only through its own folder) and skips the report itself."""
    root, found, stack = Path(root), [], [Path(root)]
    while stack:  # iterative: a folder nested thousands deep is no RecursionError
        current = stack.pop()
        try:
            with os.scandir(current) as entries:
                entries = list(entries)
        except OSError as err:
            if current == root:
                raise FolderError(f"{root} cannot be read ({err.strerror}); give a sweep folder you can read") \
                    from None
            continue  # a folder of the sweep that cannot be listed holds no run the report can read
        names = {entry.name for entry in entries}
        rel = current.relative_to(root)
        run = RESULTS_FILE in names or (folder.LOCK_FILE in names and ".hydra" in names)  # not another tool's
        if run and "report" not in (rel.parts[-2:] if rel.parts else ()):
            found.append(current)
        stack += [Path(entry.path) for entry in entries if entry.is_dir(follow_symlinks=False)]
    return sorted(found)


def collect(root: Path) -> list[dict]:
    """Every run under root (a sweep directory or a folder of them), skipping the report itself; a run whose lock
    another process holds is a RUNNING row."""
    rows = []
    for run_dir in run_dirs(root):
        if folder.is_locked(run_dir):  # its flock held (train.checks.own_run_dir): still training
            rows.append(running_row(run_dir))
        elif folder.exists(run_dir, RESULTS_FILE):  # a lock file alone: a killed run that wrote no results
            rows.append(load_run(run_dir))
    return lr_sensitivity.annotate(rows)  # across runs: a setting's loss over its learning rates


def study_specs(root: Path, rows: list[dict]) -> dict[str, dict]:
    """The `study` block of each sweep, from any of its finished runs' saved configs (a running run's only where
    no other run has one, and only where it reads); what to draw (PRESENTATION) from the sweep file as it is now,
    where one has the study's name, so finished runs show plots (and compare keys) added since."""
    specs = {}
    for row in sorted(rows, key=lambda r: r.get("status") == RUNNING):
        name = row.get("study")
        if name and name not in specs:
            run_dir = Path(row["run"])
            try:
                study = saved_config(run_dir)["study"]
                if not isinstance(study, dict):
                    raise ValueError("study is not a mapping")
            except ConfigError:
                if row.get("status") == RUNNING:
                    continue
                raise
            except Exception as err:  # noqa: BLE001 - any shape error of an untrusted file is one line
                if row.get("status") == RUNNING:
                    continue
                raise UnreadableRun(run_dir / SAVED_CONFIG, f"{type(err).__name__}: {err}") from None
            specs[name] = {**study, **_presentation(name)}
    return specs


# How a study is shown and judged, not what its runs did: `compare` names the keys a setting is told apart by, so
# jobs added later with a key the sweep file now names (attn.rotary's positions) join the same page.
PRESENTATION = ("plots", "bench", "verdict", "compare")


def _presentation(name: str) -> dict:
    """The packaged sweep file's presentation keys (the package's own config, not a folder's: read with OmegaConf)."""
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", name):  # `a/b`, `../x`: no sweep file of the package
        return {}
    path = CONF_DIR / "sweep" / f"{name}.yaml"
    if not path.exists():
        return {}
    study = OmegaConf.to_container(OmegaConf.load(path).get("study") or {}, resolve=False)
    return {key: study[key] for key in PRESENTATION if key in study} if study.get("name") == name else {}
