"""A findings page's data: from a sweep folder's runs to docs/findings/<sweep>.jsonl (a header line with the
setup and the study block, then one line per job with only the fields of results.json a page uses), and back.

Everything read from a run is untrusted; runs' results.json are read through blocklab.folder."""
import datetime
import functools
import json
import math
from collections import Counter
from pathlib import Path

from blocklab import folder, ladder, study_folder
from blocklab.errors import ConfigError
from blocklab.hardware import source_commit
from blocklab.paths import CONF_DIR
from blocklab.report.build import _value
from blocklab.report import references, targets
from blocklab.report.collect import UnreadableRun, saved_config
from blocklab.report.common import SPEEDS, order
from blocklab.results import RESULTS_FILE, swept_overrides

FORMAT = 2  # the jsonl layout (2: each job's `figure` block, figures_data.figure_record); a page refuses another
READABLE = (1, 2)  # format 1 reads as 2 without figure blocks: its figures say what was not recorded
SWEEPS = CONF_DIR / "sweep"
# A claim's keys that say how its learned gate applies (report/learned.py), not what it claims: where the data's
# claim lacks one its sweep file now declares, the page takes it and says so (GATE_NOTE).
GATE_KEYS = ("one_side_learns", "cost_only")
# How a page words a claim's context (the cited paper, where it measured, why): presentation, not what a job trains
# nor part of the claim's fingerprint (claims.py), so a page takes them from its sweep file now, as it does `notes`.
WORDING_KEYS = ("paper", "paper_scale", "paper_tested", "why")
# The fields of results.json a page uses (and the eval rows' columns it reads); nothing else is kept.
JOB_FIELDS = ("status", "learned_in_distribution", "in_distribution_exact_match", "final_val_loss", "params",
              "tokens_per_s", "train_time_s", "steps", "machine", "commit", "beside_other_jobs")
EVAL_FIELDS = ("length", "in_distribution", "exact_match", "token_acc", "loss", "next_sentence_acc")
STUDY_FIELDS = ("name", "scale", "question", "exercise", "source", "paper", "compare", "metrics", "verdict",
                "baseline", "page", "ladder", "target")  # ladder: its rungs, for the page's fit (ladder_page.py)

def _plain(value):
    """A JSON scalar: a non-finite float is null, anything not a scalar is left out (null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if value is None or isinstance(value, (str, int, float, bool)) else None


def job_record(row: dict, results: dict, keys: list[str], metrics: list[str], curve: bool = False) -> dict:
    """One job's line: its setting (the study's compare keys), seed, what it varied, the fields a page uses, and
    its task's reference levels (chance, and the bar at which it learned: tasks/references.py). `curve`: its
    val_loss_curve too, where the study names a target loss (report/targets.py reads the steps to it)."""
    swept = row.get("overrides") or {}  # a key the sweep adds (+modification=...) is named without its +
    record = {"job": Path(row["run"]).name,
              "setting": {k: _plain(row[k] if k in row else swept.get(f"+{k}")) for k in keys},
              "seed": _plain(row.get("seed")), "choices": {k: _plain(v) for k, v in results.get("choices", {}).items()},
              "overrides": swept_overrides(results.get("overrides", []))}
    record.update({f: _plain(results.get(f)) for f in JOB_FIELDS})
    record["eval"] = [{f: _plain(e.get(f)) for f in EVAL_FIELDS} for e in results.get("eval") or []]
    record["metrics"] = {m: _plain(_value(row, m)) for m in metrics}
    record["claims"] = _plain(row.get("claims"))  # the fingerprint of the claims the run was measured under
    # The task's reference levels: recorded by the run, else computed from its saved task config (older folders)
    record["references"] = references.of_run(results, saved_config(Path(row["run"])))
    if curve:
        record["val_loss_curve"] = [[_plain(step), _plain(loss)] for step, loss in results.get("val_loss_curve") or []]
    return record


def records(study: dict, members: list[dict], metrics: list[str]) -> list[dict]:
    """The job lines of a study's runs (collect's rows), as the page reads them."""
    keys = [k for k in study.get("compare") or [] if isinstance(k, str)]
    lines = [(job_record(r, results := _results(r["run"]), keys, metrics), results) for r in members]
    if isinstance(study.get("target"), dict):  # steps to the page's target loss are read off each curve (targets.py)
        for record, results in lines:
            record["val_loss_curve"] = [[_plain(step), _plain(loss)] for step, loss in results.get("val_loss_curve") or []]
    return [record for record, _ in lines]


def _products(jobs: frozenset[tuple[str, ...]], width: int) -> list[list[set[str]]]:
    """The fewest products of value sets whose union is exactly `jobs` (tuples of one value per key). A launch is one
    product, so jobs that are not one (a stage 2 that reran some settings at one more seed) need several. Splits on
    the key that gives the fewest, joining the values whose jobs agree on every other key; exact, and cheap at a
    sweep's few keys."""
    values = [{job[i] for job in jobs} for i in range(width)]
    if width == 0 or math.prod(map(len, values)) == len(jobs):
        return [values]
    best = None
    for i in range(width):
        rests: dict[str, set[tuple[str, ...]]] = {}
        for job in jobs:
            rests.setdefault(job[i], set()).add(job[:i] + job[i + 1:])
        by_rest: dict[frozenset, set[str]] = {}
        for value, rest in rests.items():
            by_rest.setdefault(frozenset(rest), set()).add(value)
        split = [product[:i] + [shared] + product[i:]
                 for rest, shared in by_rest.items() for product in _products(rest, width - 1)]
        if best is None or len(split) < len(best):
            best = split
    return best


def _command(name: str, scale, records_overrides: list[list[str]]) -> str:
    """The command that reruns these jobs, and only these: the sweep, then every key the jobs set, with the values
    they took. Jobs that set different keys (a sweep's ablation rows, launched with a key of their own), or that do
    not fill the product of their keys' values (a stage 2 at a second seed), get a launch per product, joined by &&
    so that one line reruns them all; one product of every key's values would run jobs that never ran."""
    groups: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
    for overrides in records_overrides:
        pairs = [override.partition("=")[::2] for override in overrides]
        pairs = [(key, value) for key, value in pairs
                 if key not in ("sweep", "study.scale") and not key.lstrip("+~").startswith("hydra")]
        keys = tuple(key for key, _ in pairs)
        group = next((g for g in groups if sorted(g) == sorted(keys)), keys)  # keys in the order first seen
        values = dict(pairs)
        groups.setdefault(group, []).append(tuple(values[key] for key in group))
    head = f"python train.py -m sweep={name}" + (f" study.scale={scale:g}" if scale not in (None, 1) else "")
    commands = []
    for keys in sorted(groups, key=len):  # the sweep's own jobs (fewest keys) first
        products = _products(frozenset(groups[keys]), len(keys))
        for product in sorted(products, key=lambda p: (-math.prod(map(len, p)), str(sorted(map(sorted, p))))):
            parts = [head]
            for key, seen in zip(keys, product):
                seen = sorted(seen, key=lambda v: order(int(v) if v.lstrip("-").isdigit() else v))
                parts.append(f"{key}={','.join(seen)}")
            commands.append(" ".join(parts))
    return " && ".join(commands) or head


def _first_command(name: str, scale, study: dict, results: list[dict]) -> dict:
    """{"first": the launch of a token ladder's trunks, which runs before `command`} (blocklab/ladder.py), or {}."""
    declared = study.get("ladder")
    if not isinstance(declared, dict) or ladder.axis(declared) != "tokens":
        return {}
    trunks = [swept_overrides(r.get("overrides", [])) for r in results
              if f"study.rung={ladder.TRUNK}" in r.get("overrides", [])]
    return {"first": _command(name, scale, trunks)} if trunks else {}


def meta_record(name: str, study: dict, rows: list[dict], results: list[dict], extra: dict | None = None) -> dict:
    """The setup of the runs, as the page states it."""
    import matplotlib

    scale = study.get("scale", 1)
    counts = lambda key: sorted({r.get(key) for r in rows if r.get(key) is not None}, key=order)  # noqa: E731
    machines = Counter(r.get("machine") for r in results if r.get("machine"))
    commits = sorted({r["commit"] for r in results if isinstance(r.get("commit"), str)})
    return {"format": FORMAT, "sweep": study_folder(name, scale), "study": {k: study.get(k) for k in STUDY_FIELDS},
            "command": _command(name, scale, [swept_overrides(r.get("overrides", [])) for r in results]),
            **_first_command(name, scale, study, results),
            "report": f"python -m blocklab.report outputs/sweeps/{study_folder(name, scale)} --findings docs/findings",
            "scale": scale, "seeds": counts("seed"), "jobs": len(rows),
            "d_model": counts("model.d_model"), "n_layers": counts("model.n_layers"), "n_heads": counts("model.n_heads"),
            "task": sorted({str(r.get("task")) for r in rows}), "steps": counts("steps"),
            "machines": dict(sorted(machines.items())),
            "train_time_s": round(sum(r.get("train_time_s") or 0.0 for r in results), 1),
            "commit": ", ".join(commits) if commits else source_commit(),
            "commit_recorded": bool(commits),
            "date": datetime.date.today().isoformat(), "matplotlib": matplotlib.__version__,
            **_decided(rows), **(extra or {})}


DECIDE_FILE = "decide.json"  # python -m blocklab.decide's record, in the sweep folder
DECIDE_KEYS = ("design", "alpha", "seeds", "seeds_run", "claims_hash", "command", "claims")


def _decided(rows: list[dict]) -> dict:
    """{"decide": the sweep folder's decide.json (its keys a page reads)} where there is one, else {}."""
    parents = {str(Path(r["run"]).parent) for r in rows if r.get("run")}
    if len(parents) != 1:
        return {}
    sweep = Path(parents.pop())
    if not folder.exists(sweep, DECIDE_FILE):
        return {}
    try:
        record = folder.read_json(sweep, DECIDE_FILE)
    except ConfigError:
        raise
    except (OSError, ValueError, RecursionError) as err:
        raise UnreadableRun(sweep / DECIDE_FILE, f"{type(err).__name__}: {err}") from None
    return {"decide": {k: record.get(k) for k in DECIDE_KEYS}} if isinstance(record, dict) else {}


def _results(run: str) -> dict:
    """A run's results.json, through blocklab.folder; one line where it cannot be read."""
    try:
        return folder.read_json(run, RESULTS_FILE)
    except ConfigError:
        raise
    except (OSError, ValueError, RecursionError) as err:
        raise UnreadableRun(Path(run) / RESULTS_FILE, f"{type(err).__name__}: {err}") from None

def study_error(name: str, study: dict, members: list[dict]) -> str | None:
    """The one line for a study block (from a run's saved config) no findings page can be written for: a scale
    that is not a positive number names no page (study_folder). Checked before any file is written."""
    scale = study.get("scale", 1)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0:
        return None
    where = f" (in {Path(members[0]['run']) / '.hydra' / 'config.yaml'})" if members else ""
    return (f"study.scale={str(scale)[:40]!r} of study {str(name)[:60]}{where} must be a positive number (1: the "
            "sweep file's size), or no findings page can be named for it; fix the value or move that run away")


def studies_error(rows: list[dict], specs: dict[str, dict]) -> str | None:
    """study_error's line for the first study of the folder that has one, or None."""
    return next(filter(None, (study_error(name, study, [r for r in rows if r.get("study") == name])
                              for name, study in specs.items())), None)


def _planned(measured: list[str]) -> dict:
    """The modifications that do not apply to a decoder LM, with why, and those that apply but have no completed
    run in this folder (blocklab.modifications), so a partial table says what it lacks."""
    from blocklab.modifications import BASELINE, plan

    planned = plan()
    return {"left_out": [[m, why] for m, why in planned.left_out.items()],
            "not_run": [m for m in [BASELINE, *planned.jobs] if m not in set(measured)]}


def names_its_rows(name: str) -> bool:
    """Whether a sweep file picks its modifications by name (`${modifications:a,b}`, as frontier does): its page then
    lists no planned row it did not ask for as "not run" (only `${modifications:}`, every row, plans them all)."""
    from omegaconf import OmegaConf

    if not (SWEEPS / f"{name}.yaml").is_file():
        return False
    config = OmegaConf.to_container(OmegaConf.load(SWEEPS / f"{name}.yaml"), resolve=False)
    rows = (((config.get("hydra") or {}).get("sweeper") or {}).get("params") or {}).get("modification")
    return isinstance(rows, str) and rows.replace(" ", "") != "${modifications:}"


def sweep_study(name: str) -> dict:
    """A sweep file's study block, unresolved (interpolations stay text): the package's own config, not a folder's."""
    from omegaconf import OmegaConf

    study = OmegaConf.load(SWEEPS / f"{name}.yaml").get("study") or {}
    return OmegaConf.to_container(study, resolve=False)


def ladders_of(name: str) -> list[str]:
    """The ladder sweeps that test sweep `name`'s claim across sizes: those whose file's study says `ladder_of: NAME`
    (a description key: read from the sweep files now, as a page's plots and notes are)."""
    return _ladders().get(name, [])


@functools.lru_cache(maxsize=1)
def _ladders() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in sorted(SWEEPS.glob("*.yaml")):
        if isinstance(of := sweep_study(path.stem).get("ladder_of"), str):
            out.setdefault(of, []).append(path.stem)
    return out


def sweep_plots(name) -> list:
    """A sweep file's `plots:`, or those of the sweep its defaults extend (init_depth_rezero: init_depth's); [] for
    a name no sweep file has. A plot is presentation, not what a job trains, so a page draws the file's plots now."""
    from omegaconf import OmegaConf

    names = {p.stem for p in SWEEPS.glob("*.yaml")}
    if name not in names:
        return []
    config = OmegaConf.to_container(OmegaConf.load(SWEEPS / f"{name}.yaml"), resolve=False)
    if (config.get("study") or {}).get("plots"):
        return config["study"]["plots"]
    bases = [d for d in config.get("defaults") or [] if isinstance(d, str) and d != name and d in names]
    return sweep_plots(bases[0]) if bases else []


def _claims(verdict) -> list:
    return [verdict, *(verdict.get("also") or [])] if isinstance(verdict, dict) else []


def with_gate_keys(meta: dict) -> dict:
    """The header with each claim's GATE_KEYS taken from its sweep file where the data's claim (as it was at run
    time) lacks them, matched by the claim's words; `gate_declared_later` lists the claims that took one. The study's
    `paper` and each matched claim's WORDING_KEYS are the sweep file's now."""
    name = meta.get("study", {}).get("name")
    if not isinstance(name, str) or not (SWEEPS / f"{name}.yaml").is_file():
        return meta
    study = sweep_study(name)
    if "paper" in study:
        meta["study"]["paper"] = study["paper"]
    now = {c.get("claim"): c for c in _claims(study.get("verdict")) if isinstance(c, dict)}
    later = []
    for number, claim in enumerate(_claims(meta["study"].get("verdict")), 1):
        current = now.get(claim.get("claim")) if isinstance(claim, dict) else None
        for key in WORDING_KEYS if current else ():
            if key in current:
                claim[key] = current[key]
            else:
                claim.pop(key, None)
        for key in GATE_KEYS if current else ():
            if key not in claim and key in current:
                claim[key] = current[key]
                later.append(f"claim {number}: {key}={str(current[key]).lower()}")
    if later:
        meta["gate_declared_later"] = later
    return meta


def read_jsonl(path: Path) -> tuple[dict, list[dict]]:
    """A findings file: its header (with the gate keys its sweep file declared later: with_gate_keys) and its jobs.
    ConfigError (one line) where it is not one."""
    try:
        lines = [json.loads(line) for line in folder.read_text(path.parent, path.name).splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:  # FolderError: its own line
        raise ConfigError(f"{path}: unreadable ({type(err).__name__}); regenerate it with python -m blocklab.report "
                          "SWEEP_DIR --findings docs/findings") from None
    if not lines or not isinstance(lines[0], dict) or lines[0].get("format") not in READABLE:
        raise ConfigError(f"{path}: not a findings file of format {FORMAT}; regenerate it with python -m "
                          "blocklab.report SWEEP_DIR --findings docs/findings")
    meta, jobs = with_gate_keys(lines[0]), lines[1:]
    name = meta.get("study", {}).get("name") if isinstance(meta.get("study"), dict) else None
    if isinstance(name, str) and jobs and all(isinstance(j, dict) and isinstance(j.get("overrides"), list)
                                              and all(isinstance(o, str) for o in j["overrides"]) for j in jobs):
        meta["command"] = _command(name, meta.get("scale", 1), [j["overrides"] for j in jobs])  # as meta_record
    targets.apply(meta, jobs)
    return meta, shown_once(meta, jobs)


def _runs_of(members: list[dict]) -> tuple | None:
    """What identifies a setting's runs: per seed, its recorded choices, parameter count, final loss, every metric
    but speeds, and its evaluation rows, bit for bit; None where a run has no finite loss (two settings that both
    diverged are not thereby the same)."""
    out = []
    for j in members:
        loss = j.get("final_val_loss")
        if not isinstance(loss, float) or not math.isfinite(loss):
            return None
        scores = {k: v for k, v in (j.get("metrics") or {}).items() if k not in SPEEDS}
        out.append(json.dumps([j.get("seed"), j.get("choices"), j.get("params"), loss, scores, j.get("eval")],
                              sort_keys=True, default=str))
    return tuple(sorted(out))


def _named(setting_key: str) -> str:
    return ", ".join(f"{k}={v}" for k, v in json.loads(setting_key).items())


def shown_once(meta: dict, jobs: list[dict]) -> list[dict]:
    """The jobs with each model shown once: a setting whose every run (seed, recorded choices, parameters, final
    loss, scores and evaluation rows, bit for bit) repeats an earlier setting's is the same model under another
    name (attn=local, from before patterns existed, is attn=window), so its rows go and meta["duplicates"] says
    which."""
    by_setting: dict[str, list[dict]] = {}
    for j in jobs:
        by_setting.setdefault(json.dumps(j.get("setting"), sort_keys=True), []).append(j)
    seen, dropped, said = {}, set(), []
    for key in sorted(by_setting):
        runs = _runs_of(by_setting[key])
        if runs is None:
            continue
        if runs in seen:
            dropped.add(key)
            said.append(f"{_named(key)} ran the same model as {_named(seen[runs])} (every seed's choices, parameter "
                        f"count, losses and scores identical, bit for bit): it is shown once, as "
                        f"{_named(seen[runs])}.")
        else:
            seen[runs] = key
    if said:
        meta["duplicates"] = said
    return [j for j in jobs if json.dumps(j.get("setting"), sort_keys=True) not in dropped]
