"""The Hydra application: `python -m blocklab.train norm=pre_ln pos=rope` (or `python train.py ...` in a
checkout). The config ships inside the package (blocklab/conf), so an installed BlockLab needs no checkout."""
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from blocklab.errors import ConfigError, exit_on
from blocklab.paths import CONF_DIR
from blocklab.startup import uncollected_imports


def main() -> None:
    """The command line. Its overrides and a single run's values (the schema) are checked first, before torch
    is imported: a misspelled key, an unknown option or a value out of range is one line and exit 2, before
    Hydra creates a run directory. HYDRA_FULL_ERROR=1 shows Hydra's own message instead."""
    from blocklab.overrides import command_line_error, is_multirun

    with uncollected_imports("torch"):  # the checks import torch
        if os.environ.get("HYDRA_FULL_ERROR") != "1":
            exit_on(command_line_error(sys.argv[1:]))
            _check_single_run(sys.argv[1:])
        if is_multirun(sys.argv[1:]):
            _check_every_job(sys.argv[1:])
    from blocklab.train.job import INTERRUPTED

    try:
        train()
    except BaseException:
        if not INTERRUPTED["received"]:
            raise
    if INTERRUPTED["received"]:  # jobs side by side, each running one saved its checkpoint (JobsInterrupt)
        print("sweep interrupted: run the same command again to resume it", file=sys.stderr)
        raise SystemExit(143)


def run_and_exit() -> None:
    """The entry point (`python train.py`, `python -m blocklab.train`): `main`, then, after a single run that
    finished, an exit that skips the interpreter's teardown of every module torch and Lightning imported (about
    1 s; `python -m blocklab.bench startup`). What a normal exit does first is done first: non-daemon threads are
    joined, the exit handlers run (logging's flush, W&B's teardown), stdout and stderr are flushed. A failure, a
    sweep (whose launcher ends its own workers), and a run under a tracer or profiler (coverage, cProfile, pdb,
    which write their output after the script) exit the usual way."""
    from blocklab.overrides import is_multirun

    main()
    if is_multirun(sys.argv[1:]) or "torch" not in sys.modules or sys.gettrace() or sys.getprofile():
        return
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # logging's shutdown among them: it registers itself on import
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _check_single_run(argv: list[str]) -> None:
    """The checks that need a component's own code (the registries, the task), once torch is imported but
    before Lightning is, or Hydra makes a run directory. The task built here is the one the run uses."""
    from blocklab.overrides import single_run_config

    config = single_run_config(argv)
    if config is not None:
        from blocklab.experiment import config_errors

        exit_on("\n".join(config_errors(config)) or None)


def _check_every_job(argv: list[str]) -> None:
    """A multirun validates every job before the first starts (it imports torch: sweeps only), and tells the
    jobs how many there are (train.job.cores_per_job)."""
    from blocklab.overrides import command_line_overrides
    from blocklab.train.job import SWEEP_JOBS_ENV
    from blocklab.train.sweep import check_sweep_jobs

    from omegaconf.errors import InterpolationResolutionError

    try:
        os.environ[SWEEP_JOBS_ENV] = str(check_sweep_jobs(command_line_overrides(argv)))
    except ConfigError as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2) from None
    except InterpolationResolutionError as err:  # a swept value a ${...} cannot use (study.scale=abc)
        from blocklab.overrides import interpolation_error

        exit_on(interpolation_error(err))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def train(cfg: DictConfig) -> float | None:
    # Heavy imports (torch, Lightning) only after Hydra parsed the command line: `--help`, `--cfg` and
    # config errors stay fast, and start-up counts (`python -m blocklab.bench startup` measures it).
    # A sweep's worker process imports them here, in its first job.
    with uncollected_imports("lightning"):
        from blocklab.train.run import run

    try:
        return run(cfg)
    except ConfigError as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        _remove_if_empty(Path(HydraConfig.get().runtime.output_dir))
        raise SystemExit(2) from None


def _remove_if_empty(run_dir: Path) -> None:
    """Hydra creates the run directory before the config is checked; leave no empty trace."""
    try:
        run_dir.rmdir()  # only ever succeeds on an empty directory
    except OSError:
        pass
