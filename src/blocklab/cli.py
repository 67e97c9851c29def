"""The Hydra application: `python -m blocklab.train norm=pre_ln pos=rope` (or `python train.py ...` in a
checkout). The config ships inside the package (blocklab/conf), so an installed BlockLab needs no checkout."""
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from blocklab.errors import ConfigError, exit_on, print_error
from blocklab.paths import CONF_DIR
from blocklab.startup import uncollected_imports

if TYPE_CHECKING:
    from blocklab.overrides import CommandLine


def main() -> "CommandLine":
    """The command line, read once (Hydra's parser) and composed once before Hydra runs. Its overrides and a single
    run's values (the schema) are checked first, before torch is imported: a misspelled key, an unknown option or
    a value out of range is one line and exit 2, before Hydra creates a run directory. Then a single run's setup
    is built and validated (it imports torch), and the run trains with that one. HYDRA_FULL_ERROR=1 shows Hydra's
    own message instead."""
    from blocklab.overrides import CommandLine

    command = CommandLine.read(sys.argv[1:])
    with uncollected_imports("torch"):  # the checks import torch
        if os.environ.get("HYDRA_FULL_ERROR") != "1":
            exit_on(command.check())
            _check_single_run(command.config)
        if command.multirun:
            _check_every_job(command.overrides)
    from blocklab.train.job import INTERRUPTED

    try:
        train()
    except BaseException:
        if not INTERRUPTED["received"]:
            raise
    if INTERRUPTED["received"]:  # jobs side by side, each running one saved its checkpoint (JobsInterrupt)
        print("sweep interrupted: run the same command again to resume it", file=sys.stderr)
        raise SystemExit(143)
    return command


def run_and_exit() -> None:
    """The entry point (`python train.py`, `python -m blocklab.train`): `main`, then, after a single run that
    finished, an exit that skips the interpreter's teardown of every module torch and Lightning imported (about
    1 s; `python -m blocklab.bench startup`). What a normal exit does first is done first: non-daemon threads are
    joined, the exit handlers run (logging's flush, W&B's teardown), stdout and stderr are flushed. A failure, a
    sweep (whose launcher ends its own workers), and a run under a tracer or profiler (coverage, cProfile, pdb,
    which write their output after the script) exit the usual way."""
    command = main()
    if command.multirun or "torch" not in sys.modules or sys.gettrace() or sys.getprofile():
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


def _check_single_run(config: dict | None) -> None:
    """The checks that need a component's own code (the registries, the task), once torch is imported but
    before Lightning is, or Hydra makes a run directory. The Setup built here (its task, its model config) is
    the one the run trains: Setup.from_config hands it back for the config Hydra composes (run_dir aside)."""
    if config is not None:
        from blocklab.experiment import Setup

        try:
            Setup.from_config(config)
        except ConfigError as err:
            exit_on(str(err))


def _check_every_job(overrides: list[str]) -> None:
    """A multirun validates every job before the first starts (it imports torch: sweeps only), and tells the
    jobs how many there are (train.job.cores_per_job)."""
    from blocklab.train.job import SWEEP_JOBS_ENV
    from blocklab.train.sweep import check_sweep_jobs

    from omegaconf.errors import InterpolationResolutionError

    try:
        os.environ[SWEEP_JOBS_ENV] = str(check_sweep_jobs(overrides))
    except ConfigError as err:
        exit_on(str(err))
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
        print_error(str(err))
        _remove_if_empty(Path(HydraConfig.get().runtime.output_dir))
        raise SystemExit(2) from None


def _remove_if_empty(run_dir: Path) -> None:
    """Hydra creates the run directory before the config is checked; leave no empty trace."""
    try:
        run_dir.rmdir()  # only ever succeeds on an empty directory
    except OSError:
        pass
