"""A run as one job of a Hydra multirun: every job's config is checked before the first starts; finished
and invalid jobs are skipped, a failed one is tried again with the record of its failure kept, a failing
one is recorded without stopping the sweep; plus the DDP re-launch of one job, its W&B grouping, and the
sweep-end step (SweepEnd)."""
import os
import sys
import time
from pathlib import Path
from typing import Callable

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from blocklab.errors import ConfigError
from blocklab.results import RESULTS_FILE, previous_status, read_results, swept_overrides, write_results

# A job in one of these states is never run again: its result is final (invalid: its config cannot exist).
FINAL_STATUSES = ("completed", "diverged", "invalid")


def in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def job_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task)


def run_as_sweep_job(cfg: DictConfig, train: Callable[[DictConfig], float | None]) -> float | None:
    """`train(cfg)`, or inside a sweep what stands for it: the recorded result of a finished job, or
    None for a job that failed (recorded where its results would be). A single run fails loudly."""
    run_dir = Path(cfg.run_dir)
    status = previous_status(run_dir)
    if status in FINAL_STATUSES and in_sweep():
        print(f"skip {run_dir}: already {status}")
        return read_results(run_dir).get("final_val_loss")
    if status == "failed":  # keep the record of the failure, then try again
        os.replace(run_dir / RESULTS_FILE, run_dir / f"results.failed-{int(time.time())}.json")
    if not in_sweep():
        return train(cfg)
    environ = dict(os.environ)
    try:
        return train(cfg)
    except ConfigError as err:  # listed before launch (check_sweep_jobs); recorded so a relaunch skips it
        message = " | ".join(str(err).splitlines())
        print(f"error: job {run_dir} is invalid: {message}", file=sys.stderr)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_results(run_dir, {"status": "invalid", "error": message, "task": cfg.task.name,
                                "overrides": job_overrides()})
        return None
    except Exception as err:  # a sweep goes on; the failure is recorded where the results would be
        message = f"{type(err).__name__}: {err}".splitlines()[0][:500]
        print(f"error: job {run_dir} failed: {message}", file=sys.stderr)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_results(run_dir, {"status": "failed", "error": message, "task": cfg.task.name,
                                "overrides": job_overrides()})
        return None
    finally:
        # Lightning's DDP leaves LOCAL_RANK, MASTER_PORT... behind, which would make the next job
        # believe its processes were launched externally and wait for them forever.
        os.environ.clear()
        os.environ.update(environ)


def relaunch_only_this_job(run_dir: Path) -> None:
    """Lightning's DDP starts the other ranks by re-running sys.argv; inside a multirun that would
    re-run the whole sweep (Hydra #2070). Make the command this one job, as a single run."""
    hydra_cfg = HydraConfig.get()
    sys.argv = [sys.argv[0], *hydra_cfg.overrides.task, f"run_dir={run_dir}"]
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.run.dir = str(run_dir)  # Lightning passes it on as hydra.run.dir


def sweep_tags_and_group(groups: dict) -> dict:
    """W&B grouping for sweep jobs: group = study name + launch, tags = the swept overrides."""
    study = groups.get("study")
    if not study or not in_sweep():
        return {}
    hydra_cfg = HydraConfig.get()
    tags = swept_overrides(hydra_cfg.overrides.task)
    return {"group": wandb_group(study["name"], Path(hydra_cfg.sweep.dir)), "tags": [t[:64] for t in tags]}


def wandb_group(study_name: str, sweep_dir: Path) -> str:
    """One W&B group per launch of a sweep: its jobs and its comparison table."""
    marker = sweep_dir / "multirun.yaml"  # Hydra rewrites it at every launch
    launch = time.strftime("%Y%m%d-%H%M%S", time.localtime(marker.stat().st_mtime)) if marker.exists() else "run"
    return f"{study_name}-{launch}"


class SweepEnd(Callback):
    """Hydra calls it once every job of a multirun is done (conf/config.yaml hydra.callbacks): each logger's
    sweep-wide step, such as W&B's comparison table of all jobs."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from blocklab.train.loggers import sweep_end  # torch, Lightning, W&B: not for every start-up

        sweep_end(config)


def check_sweep_jobs(overrides: list[str]) -> None:
    """Validate every job of a multirun before the first starts. No valid job: ConfigError with the problems
    (once each, so a mistake common to all jobs is one line), and nothing is created. Some invalid: they
    are listed now, and each is recorded as 'invalid' when its turn comes."""
    from hydra import compose, initialize_config_dir

    from blocklab.cli import CONF_DIR
    from blocklab.experiment import config_errors
    from blocklab.overrides import names_the_job, sweep_jobs

    jobs = sweep_jobs(overrides)
    problems: dict[str, list[str]] = {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        for job in jobs:
            settings = [o for o in job if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
            errors = config_errors(OmegaConf.to_container(compose("config", [*settings, "run_dir=unused"]),
                                                        resolve=True))
            if errors:
                problems[",".join(o for o in job if names_the_job(o))] = errors
    if len(problems) == len(jobs):
        raise ConfigError("\n".join(dict.fromkeys(line for lines in problems.values() for line in lines)))
    for job, errors in problems.items():
        print(f"warning: job {job} is invalid and will be recorded as such, not run: {' | '.join(errors)}",
              file=sys.stderr)
