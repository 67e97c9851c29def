"""Launching a sweep, and a run as one of its jobs: every job's config is checked before the first starts; finished
and invalid jobs are skipped, a failed one is tried again with the record of its failure kept, a failing one is
recorded without stopping the sweep; plus the DDP re-launch of one job, what jobs side by side (joblib, the default
launcher) cannot do and how they stop on Ctrl-C (JobsInterrupt), and the sweep-end step (SweepEnd). What a running
job asks about its sweep (whether it is in one, beside others, on how many cores) is train/job.py."""
import copy
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from blocklab.errors import ConfigError, RunFolderError, print_error
from blocklab.folder import rename
from blocklab.ladder import ladder_error
from blocklab.results import RESULTS_FILE, previous_status, read_results, unfinished_run_error, write_results
from blocklab.train.job import INTERRUPTED, in_sweep, job_overrides, joblib_side_by_side

# A job in one of these states is never run again: its result is final (invalid: its config cannot exist).
FINAL_STATUSES = ("completed", "diverged", "invalid")


def side_by_side_error(job: dict, launcher: dict) -> str | None:
    """Why a job cannot run beside others on this machine (joblib's worker processes), with the fix."""
    if not joblib_side_by_side(launcher):
        return None
    fix = "add hydra.launcher.n_jobs=1 to run the jobs one after another"
    if job["trainer"].get("strategy") == "ddp":
        return f"trainer.strategy=ddp starts its own processes, which a job in joblib's workers cannot; {fix}"
    return None


def run_as_sweep_job(config: dict, train: Callable[[dict], float | None]) -> float | None:
    """`train(config)` (a resolved RunConfig), or inside a sweep what stands for it: the recorded result of a
    finished job, or None for a job that failed (recorded where its results would be). A single run fails loudly."""
    run_dir = Path(config["run_dir"])
    if INTERRUPTED["received"]:
        print(f"not started {run_dir}: the sweep was interrupted")
        return None
    status = previous_status(run_dir)
    if status in FINAL_STATUSES and in_sweep():
        print(f"skip {run_dir}: already {status}")
        return read_results(run_dir).get("final_val_loss")
    if status == "failed":  # keep the record of the failure, then try again
        rename(run_dir, RESULTS_FILE, f"results.failed-{int(time.time())}.json")
    if not in_sweep():
        return train(config)
    environ = dict(os.environ)
    try:
        return train(config)
    except RunFolderError:  # damaged or in use: the folder is not this job's to write
        raise
    except ConfigError as err:  # listed before launch (check_sweep_jobs); recorded so a relaunch skips it
        message = " | ".join(str(err).splitlines())
        print_error(f"job {run_dir} is invalid: {message}")
        run_dir.mkdir(parents=True, exist_ok=True)
        write_results(run_dir, {"status": "invalid", "error": message, "task": config["task"]["name"],
                                "overrides": job_overrides()})
        return None
    except Exception as err:  # a sweep goes on; the failure is recorded where the results would be
        print_error(f"job {run_dir} failed: {record_failure(run_dir, err, config['task']['name'], job_overrides())}")
        return None
    finally:
        # Lightning's DDP leaves LOCAL_RANK, MASTER_PORT... behind, which would make the next job
        # believe its processes were launched externally and wait for them forever.
        os.environ.clear()
        os.environ.update(environ)


def record_failure(run_dir: Path, err: Exception, task: str, overrides: list[str], where: str = "") -> str:
    """Write a failed job's record where its results would be; returns the one-line error."""
    message = f"{where}{type(err).__name__}: {err}".splitlines()[0][:500]
    run_dir.mkdir(parents=True, exist_ok=True)
    write_results(run_dir, {"status": "failed", "error": message, "task": task, "overrides": overrides})
    return message


def relaunch_only_this_job(run_dir: Path) -> None:
    """Lightning's DDP starts the other ranks by re-running sys.argv; inside a multirun that would
    re-run the whole sweep (Hydra #2070). Make the command this one job, as a single run."""
    hydra_cfg = HydraConfig.get()
    sys.argv = [sys.argv[0], *hydra_cfg.overrides.task, f"run_dir={run_dir}"]
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.run.dir = str(run_dir)  # Lightning passes it on as hydra.run.dir


class JobsInterrupt(Callback):
    """Ctrl-C or SIGTERM while jobs run side by side in joblib's workers (conf/config.yaml hydra.callbacks):
    the launching process passes SIGTERM on to the workers and waits; each running job finishes its step,
    saves its checkpoint and returns, the jobs not yet started are not, and the command ends with exit 143
    (blocklab.cli). Without this, joblib would stop its workers before any saved. A second Ctrl-C stops at once."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if not joblib_side_by_side(OmegaConf.to_container(config.hydra.launcher)):
            return

        def interrupt(signum, frame):
            if INTERRUPTED["received"]:
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                return
            INTERRUPTED["received"] = True
            print("interrupted: each running job finishes its step and saves its checkpoint (Ctrl-C again: stop "
                  "at once)", file=sys.stderr)
            for pid in _joblib_worker_pids():
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, interrupt)


def _joblib_worker_pids() -> list[int]:
    from joblib.externals.loky import reusable_executor  # the executor the joblib launcher's Parallel runs on

    executor = reusable_executor._executor
    return list(getattr(executor, "_processes", None) or {}) if executor is not None else []


class SweepEnd(Callback):
    """Hydra calls it once every job of a multirun is done (conf/config.yaml hydra.callbacks): each logger's
    sweep-wide step, such as W&B's comparison table of all jobs."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from blocklab.train.loggers import sweep_end  # torch, Lightning, W&B: not for every start-up

        sweep_end(config)


def check_sweep_jobs(overrides: list[str]) -> int:
    """Validate every job of a multirun before the first starts. No valid job: ConfigError with the problems
    (once each, so a mistake common to all jobs is one line), and nothing is created. Some invalid: they
    are listed now, and each is recorded as 'invalid' when its turn comes. A sweep file's launch that would
    mix scales in one folder, or reuse a finished or interrupted job trained with another config, is refused."""
    from hydra import compose, initialize_config_dir

    from blocklab.paths import CONF_DIR
    from blocklab.experiment import config_errors
    from blocklab.naming import names_the_job
    from blocklab.overrides import OverrideError, compose_job, sweep_jobs

    jobs = sweep_jobs(overrides)
    problems: dict[str, list[str]] = {}
    job_settings = [[o for o in job if not o.lstrip("+~").startswith(("hydra.", "hydra/"))] for job in jobs]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        configs = job_configs(job_settings, lambda settings: compose_job([*settings, "run_dir=unused"]),
                              failures=OverrideError)
        uncomposed = uncomposed_jobs_error(jobs, configs, overrides)
        if uncomposed:
            raise ConfigError(uncomposed)
        first = compose("config", [*jobs[0], "run_dir=unused"], return_hydra_config=True)
        launcher = OmegaConf.to_container(first.hydra.launcher)
    for job, config in zip(jobs, configs):
        errors = config_errors(config) or list(filter(None, [side_by_side_error(config, launcher),
                                                             continued_source_error(config)]))
        if errors:
            problems[",".join(o for o in job if names_the_job(o))] = errors
    if len(problems) == len(jobs):
        raise ConfigError("\n".join(dict.fromkeys(line for lines in problems.values() for line in lines)))
    ladder = ladder_error(job_settings, configs)  # blocklab/ladder.py: rungs that differ only in their sizes
    if ladder:
        raise ConfigError(ladder)
    if first.get("study"):
        check_study_folder(job_settings, configs, Path(first.hydra.sweep.dir), first.hydra.job.config.override_dirname)
    for job, errors in problems.items():
        print_error(f"job {job} is invalid and will be recorded as such, not run: {' | '.join(errors)}", "warning: ")
    return len(jobs)


def uncomposed_jobs_error(jobs: list[list[str]], configs: list, overrides: list[str]) -> str | None:
    """The one line for jobs Hydra cannot compose at all: an override of a key that only some swept options have
    (-m attn=gla,mha attn.gate_rank=8: mha has no gate_rank). Hydra composes every job before the first starts
    and stops the whole sweep at the first it cannot, so such a job cannot be recorded invalid as others are;
    `++key=value` adds the key to every job, and a job whose options do not take it is then recorded invalid."""
    from blocklab.naming import names_the_job, override_key

    failed = [(job, config) for job, config in zip(jobs, configs) if isinstance(config, Exception)]
    if not failed:
        return None
    err = failed[0][1]
    key = getattr(err, "key", None)
    typed = next((o for o in overrides if key and override_key(o) == key and not o.startswith(("+", "~"))), None)
    names = sorted({",".join(o for o in job if names_the_job(o) and override_key(o) != key) for job, _ in failed})
    shown = "; ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    fix = (f"write ++{typed} to set it on every job (a job whose options do not take it is then recorded invalid), "
           "or sweep only the options that have it") if typed else "sweep only the options that have it"
    what = f"{typed or key} cannot be set in" if key else f"{err}: in"
    why = f", which have no key {key}" if key else ""
    return (f"{what} {len(failed)} of {len(jobs)} jobs ({shown}){why}, and Hydra stops a sweep at the first job it "
            f"cannot compose; {fix}")


def continued_source_error(config: dict) -> str | None:
    """trainer.resume_from's run not there (yet), as continued.py words it: listed at launch, since the job would be
    recorded invalid and a relaunch once the source is trained would skip it (a sweep whose every job continues a
    missing run, e.g. context_extension before pe_lm, is refused and nothing is written)."""
    source = config["trainer"].get("resume_from")
    if source is None:
        return None
    if not Path(source).parent.is_dir():  # no run there at all: one line for every job, not one per job
        return (f"trainer.resume_from continues runs in {Path(source).parent}, which does not exist; train them first "
                "(another sweep's runs: python train.py -m sweep=ITS_NAME, at the same study.scale)")
    error = unfinished_run_error(Path(source))
    return f"trainer.resume_from={source}: {error}" if error else None


def job_configs(jobs: list[list[str]], compose: Callable[[list[str]], DictConfig],
                failures: type[Exception] | tuple[type[Exception], ...] = ()) -> list[dict | Exception]:
    """Each job's resolved config, `compose`d from its overrides. Jobs that differ only in a plain `seed=N`
    share one composition (Hydra's compose is most of a sweep's check), with the seed set before resolving.
    A job whose composition raises one of `failures` has that exception in place of its config."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def composed_or_failure(settings: list[str]):
        try:
            return compose(settings)
        except failures as err:
            return err

    composed, configs = {}, []
    for job in jobs:
        seeds = [o for o in job if o.startswith("seed=")]
        rest = tuple(o for o in job if o not in seeds)
        if len(seeds) != 1:
            config = composed_or_failure(job)
            configs.append(config if isinstance(config, Exception) else OmegaConf.to_container(config, resolve=True))
            continue
        if rest not in composed:
            composed[rest] = composed_or_failure(list(rest))
        if isinstance(composed[rest], Exception):
            configs.append(composed[rest])
            continue
        config = copy.deepcopy(composed[rest])  # the shared composition stays as composed
        config.seed = OverridesParser.create().parse_override(seeds[0]).value()
        configs.append(OmegaConf.to_container(config, resolve=True))
    return configs


def longest_name(folder: Path) -> int:
    """The longest file name, in bytes, the file system that will hold `folder` allows (255 where it does not say)."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_study_folder(jobs: list[list[str]], configs: list[dict], folder: Path, naming: DictConfig) -> None:
    """`jobs`: each job's overrides but Hydra's own, `configs` its config. A sweep file's jobs share one folder, where a finished job is skipped and an interrupted one resumed: so
    one launch takes one study.scale (each scale has its folder), and a job found there must have been trained
    with the config this launch asks of it, or its results would be reported as this config's."""
    from blocklab import study_folder
    from blocklab.folder import FolderError, check, exists, read_yaml
    from blocklab.naming import override_key
    from blocklab.overrides import job_dirname
    from blocklab.results import CHECKPOINT, SAVED_CONFIG
    from blocklab.train.resume import config_differences

    scales = sorted({(config.get("study") or {}).get("scale", 1) for config in configs})
    if len(scales) > 1:
        name = configs[0]["study"]["name"]
        raise ConfigError(f"study.scale takes one value per launch of a sweep file ({', '.join(map(str, scales))} "
                          f"asked): each scale writes its own folder (outputs/sweeps/{study_folder(name, scales[-1])}); "
                          "launch the sweep once per scale")
    names, limit = [job_dirname(job, naming) for job in jobs], longest_name(folder)
    too_long = [name for name in names if len(name.encode()) > limit]
    if too_long:
        raise ConfigError(f"a job's folder would be named with {len(too_long[0].encode())} bytes "
                          f"({too_long[0][:48]}...), over this file system's {limit}-byte limit; put the settings every "
                          "job shares in an experiment file (DIR/experiment/NAME.yaml, then hydra.searchpath=[file://DIR] "
                          "experiment=NAME), so fewer overrides name each job")
    from blocklab.train.wsd import missing_trunks_error  # Lightning's import: only for a sweep file's launch

    if missing := missing_trunks_error(folder, names, configs):  # a token ladder's branches need their trunks
        raise ConfigError(missing)
    stale = []
    for job, config, name in zip(jobs, configs, names):
        run_dir = check(folder, name, "dir")  # a job folder planted as a link would take the job's files elsewhere
        saved = Path(name) / SAVED_CONFIG
        reused = previous_status(run_dir) in FINAL_STATUSES or exists(folder, Path(name) / CHECKPOINT)
        if reused and exists(folder, saved):
            try:  # as data: no alias expanded, no interpolation resolved
                saved_config = read_yaml(folder, saved)
                if not isinstance(saved_config, dict):
                    raise ValueError("not a mapping of keys")
            except FolderError:
                raise
            except ValueError as err:  # a list, a scalar, not YAML: not a config BlockLab saved
                raise RunFolderError(f"{folder / saved} is damaged ({err}), so it cannot be told whether the job was "
                                     f"trained with this config; move {run_dir} away (or delete it) to train the job "
                                     "again") from None
            diffs = config_differences(saved_config, config,
                                       frozenset(override_key(o) for o in job))
            if diffs:
                stale.append((run_dir, diffs))
    if stale:
        run_dir, diffs = stale[0]
        more = f" (and {len(stale) - 1} more jobs)" if len(stale) > 1 else ""
        raise ConfigError(f"{run_dir} was trained with another config than this launch asks of it ({'; '.join(diffs)})"
                          f"{more}, and would be reused as if it were not; give the study another folder "
                          f"(study.name=NEW_NAME) or move {folder} away")
