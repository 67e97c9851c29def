"""What a running job asks about the sweep it is in: whether it is in one, its overrides, whether other jobs run
beside it and on how many cores, whether the sweep was interrupted, and its W&B group. Queries only: launching a
sweep (the checks before it, a job's record, Ctrl-C, the sweep's end) is train/sweep.py."""
import os
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from blocklab.results import swept_overrides

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
JOBLIB_LAUNCHER = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"


def in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def one_job_at_a_time(launcher: dict) -> bool:
    """Whether Hydra's launcher (the hydra.launcher config) runs a multirun's jobs one after another in this
    process: the basic launcher, or joblib with n_jobs=1 (joblib then runs them in order, without workers)."""
    target = launcher.get("_target_")
    return target == BASIC_LAUNCHER or (target == JOBLIB_LAUNCHER and launcher.get("n_jobs") == 1)


def joblib_side_by_side(launcher: dict) -> bool:
    """Whether the launcher is joblib running jobs at once, in its worker processes on this machine."""
    return launcher.get("_target_") == JOBLIB_LAUNCHER and not one_job_at_a_time(launcher)


def current_launcher() -> dict:
    return OmegaConf.to_container(HydraConfig.get().launcher)


# How many jobs this multirun launches, set by the launching process before its joblib workers start (they
# inherit it): with fewer jobs than cores, each job side by side takes a larger share of the cores.
SWEEP_JOBS_ENV = "BLOCKLAB_SWEEP_JOBS"


def share_of_cores(cores: int, n_jobs: int, jobs: int | None) -> int:
    """Threads for each of `jobs` jobs (None: unknown) run side by side by joblib with `n_jobs` (joblib's meaning:
    a negative n is cores + 1 + n workers), on `cores` cores: the jobs that run at once split the cores evenly."""
    workers = n_jobs if n_jobs > 0 else max(1, cores + 1 + n_jobs)
    return max(1, cores // min(workers, jobs or workers))


def cores_per_job() -> int | None:
    """This job's share of the cores when it runs in a joblib worker beside others (None otherwise): joblib's own
    share assumes n_jobs jobs at once, which a launch of fewer jobs never reaches."""
    launcher = current_launcher() if in_sweep() else {}
    if not joblib_side_by_side(launcher):
        return None
    from joblib import cpu_count  # the cores this process may use (affinity, cgroup quota), as joblib counts

    jobs = os.environ.get(SWEEP_JOBS_ENV)
    return share_of_cores(cpu_count(), int(launcher.get("n_jobs", -1)), int(jobs) if jobs else None)


# Set once this process was interrupted while jobs ran side by side: in the launching process (JobsInterrupt),
# and in a joblib worker whose job saved its checkpoint and stopped (its later jobs are then not started).
INTERRUPTED = {"received": False}


def beside_other_jobs() -> bool:
    """Whether this run is a multirun job that runs while others do, on this machine or elsewhere."""
    return in_sweep() and not one_job_at_a_time(current_launcher())


def job_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task)


def sweep_tags_and_group(config: dict) -> dict:
    """W&B grouping for sweep jobs: group = study name + launch, tags = the swept overrides."""
    study = config.get("study")
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
