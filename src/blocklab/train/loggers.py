"""The experiment loggers of a run (W&B, CSV, TensorBoard; none, one or several) and what they receive at the end
of a run and of a sweep. `logger` is one logger's config (with `_target_`; null: none) or several: a mapping of
name -> one logger's config (conf/logger/wandb_tensorboard.yaml). Each logger class is one LOGGER_KINDS entry."""
import inspect
import sys
from pathlib import Path

from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from blocklab import folder
from blocklab.errors import ConfigError
from blocklab.net import reachable
from blocklab.registry import Registry
from blocklab.train.hparams import (RESULTS_PREFIX, experiment_summary, job_hparams, result_metrics,
                                    session_summaries, sweep_results)

WANDB_HOST = ("api.wandb.ai", 443)


def logger_configs(logger_cfg: dict) -> dict[str, dict]:
    """Each configured logger by the key that sets it (`logger`, or `logger.wandb` among several), from the
    resolved `logger` group."""
    if "_target_" in logger_cfg:
        return {"logger": logger_cfg} if logger_cfg["_target_"] is not None else {}
    return {f"logger.{name}": cfg for name, cfg in logger_cfg.items()
            if not isinstance(cfg, dict) or cfg.get("_target_") is not None}


def check_loggers(logger_cfg: dict) -> None:
    """ConfigError, before any work, for a key its logger class does not take: `logger=[wandb,tensorboard]`
    merges two options into one logger, where several loggers are one option that lists them."""
    for key, cfg in logger_configs(logger_cfg).items():
        if not isinstance(cfg, dict) or "_target_" not in cfg:
            raise ConfigError(f"{key} must be one logger's config, with _target_ (as in conf/logger/wandb.yaml)")
        target = cfg["_target_"]
        if target not in LOGGER_KINDS:
            raise ConfigError(LOGGER_KINDS.unknown(target))
        unknown = sorted(set(cfg) - {"_target_"} - LOGGER_KINDS[target].options(target))
        if unknown:
            raise ConfigError(f"{', '.join(f'{key}.{k}' for k in unknown)} not taken by {target}; for several "
                              "loggers pick an option that lists them (logger=wandb_tensorboard), not logger=[...]")


def build_loggers(logger_cfg: dict, run_dir: Path, name: str, job_type: str, grouping: dict) -> list:
    """Each logger, writing its own files into a folder of the run that the folder module created and checked."""
    for cfg in logger_configs(logger_cfg).values():
        folder.make_dirs(run_dir, LOGGER_KINDS[cfg["_target_"]].subfolder(cfg))
    return [LOGGER_KINDS[c["_target_"]].build(c, run_dir, name, job_type, grouping)
            for c in logger_configs(logger_cfg).values()]


def log_results(loggers: list, results: dict, overrides: list[str]) -> None:
    """Hand each logger the run's results (W&B: evaluation table and summary; TensorBoard: HParams session)."""
    hparams = job_hparams(results, overrides)
    for logger in loggers:
        kind = next(LOGGER_KINDS[t] for t in LOGGER_KINDS if isinstance(logger, get_class(t)))
        kind.log_results(logger, results, hparams)


def sweep_end(config: DictConfig) -> None:
    """Once every job of a multirun is done: each logger's sweep-wide step. Nothing it does can lose a job's
    results, so a failure is one warning line."""
    sweep_dir = Path(config.hydra.sweep.dir)
    study = OmegaConf.to_container(config.study, resolve=True) if config.get("study") else None
    for key, cfg in logger_configs(OmegaConf.to_container(config.logger, resolve=True)).items():
        try:
            LOGGER_KINDS[cfg["_target_"]].sweep_end(cfg, sweep_dir, study)
        except Exception as err:  # the jobs' results are written; say what went wrong and go on
            print(f"warning: {key}'s sweep-end step failed: {type(err).__name__}: {str(err).splitlines()[0]}",
                  file=sys.stderr)


class LoggerKind:
    """One Lightning logger class: the options it takes, how a run builds it, what it receives at the end of a
    run and of a sweep. `passes_on_to()`: where the class hands its **kwargs (their keywords are options too)."""

    def passes_on_to(self) -> tuple:
        return ()

    def options(self, target: str) -> set[str]:
        return {name for function in (get_class(target).__init__, *self.passes_on_to())
                for name, p in inspect.signature(function).parameters.items()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self"}

    def subfolder(self, cfg: dict) -> str:
        """The folder of the run the logger writes into (Lightning's loggers: save_dir/name)."""
        return cfg.get("name") or "lightning_logs"

    def build(self, cfg: dict, run_dir: Path, name: str, job_type: str, grouping: dict):
        return instantiate(cfg, save_dir=str(run_dir))

    def log_results(self, logger, results: dict, hparams: dict) -> None:
        pass

    def sweep_end(self, cfg: dict, sweep_dir: Path, study: dict | None) -> None:
        pass


class WandbKind(LoggerKind):
    """Offline by default; online falls back to offline when W&B's server cannot be reached. A sweep ends with
    one more run in the sweep's group: a table of every job's choices and results (sweep/comparison)."""

    def passes_on_to(self):
        import wandb

        return (wandb.init,)

    def subfolder(self, cfg: dict) -> str:
        return "wandb"

    @staticmethod
    def mode(cfg: dict, where: Path) -> str:
        mode = cfg.get("mode", "offline")
        if mode == "online" and not reachable(WANDB_HOST):
            print(f"warning: W&B server {WANDB_HOST[0]} unreachable; logging offline instead "
                  f"(upload later with `wandb sync {where}/wandb/offline-run-*`)", file=sys.stderr)
            mode = "offline"
        return mode

    def build(self, cfg, run_dir, name, job_type, grouping):
        import wandb

        mode = self.mode(cfg, run_dir)
        # W&B's own console output (banners, history sparklines, sync hints) is replaced by one line.
        logger = instantiate(cfg, save_dir=str(run_dir), name=name, job_type=job_type, mode=mode,
                             offline=mode == "offline", settings=wandb.Settings(silent=True), **grouping)
        # Lightning always passes `anonymous`, which W&B (0.19+) warns about before any setting applies.
        if logger._wandb_init.get("anonymous") is None:
            logger._wandb_init.pop("anonymous", None)
        if mode != "disabled":
            print(f"W&B {mode} run: {Path(logger.experiment.dir).parent}")
        return logger

    def log_results(self, logger, results, hparams):
        rows = results["eval"]
        columns = [c for c in rows[0] if not isinstance(rows[0][c], list)]  # per-position lists stay in results.json
        logger.log_table("eval/by_length", columns=columns, data=[[r[c] for c in columns] for r in rows])
        logger.experiment.summary.update({k: v for k, v in results.items() if not isinstance(v, (dict, list))})
        logger.experiment.finish()

    def sweep_end(self, cfg, sweep_dir, study):
        """The comparison table, one row per job; skipped where the same rows were logged last time (a
        relaunch that ran no job)."""
        import wandb

        from blocklab.train.job import wandb_group

        rows = [{"job": job, "status": results["status"], **job_hparams(results, results.get("overrides", [])),
                 **result_metrics(results)} for job, results in sweep_results(sweep_dir).items()]
        logged = Path("wandb") / "comparison.json"
        if not rows or (folder.exists(sweep_dir, logged) and folder.read_json(sweep_dir, logged) == rows):
            return
        mode = self.mode(cfg, sweep_dir)
        if mode == "disabled":
            return
        columns = list(dict.fromkeys(key for row in rows for key in row))
        table = wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows],
                            allow_mixed_types=True)
        settings = {k: v for k, v in cfg.items()  # project, entity...
                    if k in inspect.signature(wandb.init).parameters and k not in ("mode", "dir", "name")}
        name = study["name"] if study else sweep_dir.name
        run = wandb.init(**settings, dir=str(sweep_dir), mode=mode, name=f"{name}-comparison", job_type="sweep",
                         group=wandb_group(study["name"], sweep_dir) if study else None,
                         settings=wandb.Settings(silent=True))
        run.log({"sweep/comparison": table})
        run.finish()
        folder.write_json(sweep_dir, logged, rows, indent=None)
        print(f"W&B {mode} run with the comparison table of {len(rows)} jobs: {Path(run.dir).parent}")


class TensorBoardKind(LoggerKind):
    """Training curves as they come; at the end of a run its HParams session (job_hparams) and results.json's
    scalars (tagged results/...); at the end of a sweep its HParams experiment, in SWEEP_DIR/<logger.name>.
    Until then TensorBoard builds the experiment from the sessions, with every scalar tag as a metric."""

    def passes_on_to(self):
        from torch.utils.tensorboard import SummaryWriter

        return (SummaryWriter.__init__,)

    def log_results(self, logger, results, hparams):
        logger.log_metrics({RESULTS_PREFIX + k: v for k, v in result_metrics(results).items()}, step=results["steps"])
        # Lightning closed the writer at the end of fit: writing reopens it (a new event file), finalize closes it.
        writer = logger.experiment._get_file_writer()  # torch's SummaryWriter has no public add_summary
        for summary in session_summaries(hparams, results["status"]):
            writer.add_summary(summary, results["steps"])
        logger.finalize("success")

    def sweep_end(self, cfg, sweep_dir, study):
        from torch.utils.tensorboard.writer import FileWriter

        experiment = experiment_summary(sweep_results(sweep_dir))
        if experiment is None:
            return
        events = folder.make_dirs(sweep_dir, cfg.get("name", "tensorboard"))  # checked: no link on the way
        for old in events.glob("events.out.tfevents.*"):  # TensorBoard would keep the first experiment it reads
            folder.remove(sweep_dir, old.relative_to(sweep_dir))
        writer = FileWriter(str(events))
        writer.add_summary(experiment)
        writer.close()


LOGGER_KINDS: Registry[LoggerKind] = Registry("logger._target_")
LOGGER_KINDS.register("lightning.pytorch.loggers.CSVLogger")(LoggerKind())
LOGGER_KINDS.register("lightning.pytorch.loggers.WandbLogger")(WandbKind())
LOGGER_KINDS.register("lightning.pytorch.loggers.TensorBoardLogger")(TensorBoardKind())
