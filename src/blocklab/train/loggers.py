"""The experiment logger of a run (W&B, CSV, TensorBoard or none) and what it receives at the end."""
import sys
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig

from blocklab.net import reachable

WANDB_HOST = ("api.wandb.ai", 443)


def build_logger(cfg: DictConfig, run_dir: Path, name: str, job_type: str, grouping: dict):
    if cfg.logger.get("_target_") is None:
        return False
    if cfg.logger._target_.endswith("WandbLogger"):
        mode = cfg.logger.get("mode", "offline")
        if mode == "online" and not reachable(WANDB_HOST):
            print(f"warning: W&B server {WANDB_HOST[0]} unreachable; logging offline instead "
                  f"(upload later with `wandb sync {run_dir}/wandb/offline-run-*`)", file=sys.stderr)
            mode = "offline"
        import wandb

        # W&B's own console output (banners, history sparklines, sync hints) is replaced by one line.
        logger = instantiate(cfg.logger, save_dir=str(run_dir), name=name, job_type=job_type, mode=mode,
                             offline=mode == "offline", settings=wandb.Settings(silent=True), **grouping)
        # Lightning always passes `anonymous`, which W&B (0.19+) warns about before any setting applies.
        if logger._wandb_init.get("anonymous") is None:
            logger._wandb_init.pop("anonymous", None)
        if mode != "disabled":
            print(f"W&B {mode} run: {Path(logger.experiment.dir).parent}")
        return logger
    return instantiate(cfg.logger, save_dir=str(run_dir))


def log_results(logger, results: dict) -> None:
    """The evaluation table and the scalar results, for loggers that keep tables (W&B)."""
    if not hasattr(logger, "log_table"):
        return
    rows = results["eval"]
    columns = list(rows[0])
    logger.log_table("eval/by_length", columns=columns, data=[[r[c] for c in columns] for r in rows])
    logger.experiment.summary.update({k: v for k, v in results.items() if not isinstance(v, (dict, list))})
    logger.experiment.finish()
