"""The reference levels of a findings page's runs (tasks/references.py): chance, and the bar at which a run learned.

results.json records them since they exist (`references`, Task.references at run time). A run folder written
before holds none: they are computed here from its saved task config by the task itself, once per distinct config.
Only the built-in corpus is read for an LM this way (a run folder is untrusted: a path or hub name in its config is
never followed), and the tokenized data goes to this machine's cache (BLOCKLAB_CACHE or ~/.cache/blocklab), never
to a directory the folder names. `backfill` adds them to findings files written before, composing each job's task
config from its sweep file and overrides as the sweep did."""
import json
import os
from functools import lru_cache
from pathlib import Path

from blocklab import folder
from blocklab.results import recorded_references
from blocklab.tasks.references import References

CACHE = os.environ.get("BLOCKLAB_CACHE", "~/.cache/blocklab")


@lru_cache(maxsize=64)
def _computed(task_json: str) -> str | None:
    from blocklab.errors import ConfigError
    from blocklab.tasks import build_task

    cfg = json.loads(task_json)
    data = cfg.get("data") if isinstance(cfg.get("data"), dict) else {}
    if data.get("path") or data.get("hub"):
        return None  # a corpus named by the folder: not read
    if "cache_dir" in cfg:
        cfg["cache_dir"] = CACHE
    try:
        return json.dumps(build_task(cfg, seed=0).references().as_dict(), sort_keys=True)
    except (ConfigError, TypeError, ValueError, KeyError, OSError):
        return None


def from_task_config(task_cfg) -> dict | None:
    """A task config's references (results.json's form), or None where it cannot build the task here."""
    if not isinstance(task_cfg, dict):
        return None
    try:
        key = json.dumps(task_cfg, sort_keys=True)
    except (TypeError, ValueError):
        return None
    text = _computed(key)
    return None if text is None else json.loads(text)


def of_run(results: dict, config) -> dict | None:
    """A run's references: recorded in its results.json, else computed from its saved config's task."""
    recorded = References.from_dict(recorded_references(results))
    if recorded is not None:
        return recorded.as_dict()
    return from_task_config(config.get("task")) if isinstance(config, dict) else None


def of_job(job: dict) -> References | None:
    """A findings file's job line's references (None: not recorded)."""
    return References.from_dict(job.get("references"))


@lru_cache(maxsize=256)
def _compose_task(sweep: str, scale, overrides: tuple[str, ...], task: str | None) -> str | None:
    """The job's task config as its sweep composes it (every override but the seed; where those do not compose
    today, the task's overrides alone; where the sweep file itself does not compose here, as a sweep whose groups a
    registry generates at launch, the task's defaults), as JSON."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from blocklab.paths import CONF_DIR

    tasks = tuple(o for o in overrides if o.lstrip("+").startswith("task"))
    sweep_file = [f"sweep={sweep}", f"study.scale={scale}"]
    plain = [[f"task={task}", *tasks]] if task else []
    for tried in [[*sweep_file, *overrides], [*sweep_file, *tasks], *plain]:
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
                cfg = compose(config_name="config", overrides=[*tried, "run_dir=unused"])
            return json.dumps(OmegaConf.to_container(cfg.task, resolve=True), sort_keys=True)
        except Exception:  # noqa: BLE001 - an override today's config no longer takes: try the task's alone
            continue
    return None


def backfill(out: Path) -> list[Path]:
    """Add `references` to every job line of the findings files in `out` that lacks them: the task config composed
    from the sweep file and the job's task overrides (the measured numbers are untouched). The files changed."""
    changed = []
    for data in sorted(out.glob("*.jsonl")):
        lines = [json.loads(line) for line in folder.read_text(out, data.name).splitlines() if line.strip()]
        meta, jobs = lines[0], lines[1:]
        sweep = (meta.get("study") or {}).get("name")
        touched = False
        for job in jobs:
            if job.get("references") is not None or not sweep:
                continue
            tasks = meta.get("task") or []
            task = _compose_task(sweep, meta.get("scale", 1),
                                 tuple(o for o in job.get("overrides") or [] if not o.startswith("seed=")),
                                 tasks[0] if len(tasks) == 1 else None)
            job["references"] = None if task is None else from_task_config(json.loads(task))
            touched = True
        if touched:
            changed.append(folder.write_text(out, data.name, "".join(
                json.dumps(x, sort_keys=True, allow_nan=False) + "\n" for x in [meta, *jobs])))
    return changed
