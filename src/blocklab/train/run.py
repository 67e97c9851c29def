"""One experiment: validate the config, train, evaluate length generalization, write results.json."""
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from torch.utils.data import DataLoader

from blocklab.errors import ConfigError
from blocklab.net import reachable
from blocklab.model import ModelConfig
from blocklab.model.config import ARCHS
from blocklab.tasks import build_task, task_errors
from blocklab.train.callbacks import DivergenceGuard, GracefulInterrupt, StepProgressBar
from blocklab.train.diagnostics import Diagnostics
from blocklab.train.module import LitTransformer
from blocklab.train.resume import resume_step, set_aside_checkpoints
from blocklab.model.generate import generate
from blocklab.results import (CHECKPOINT, MODEL_FILE, RESULTS_FILE, TOKENIZER_FILE, print_summary, read_results,
                              swept_overrides, write_results)


# Lightning advertises its cloud products on every run; keep the console for the experiment.
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
    lambda record: not str(record.msg).startswith("💡 Tip"))


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


# trainer.precision values BlockLab trains correctly (Lightning's spellings) -> the name results.json records.
PRECISIONS = {"32-true": "32-true", "32": "32-true", 32: "32-true", "bf16-mixed": "bf16-mixed",
              "64-true": "64-true", "64": "64-true", 64: "64-true"}


def step_callbacks(run_dir: Path, guard: DivergenceGuard, checkpoint_every: int,
                   bar: StepProgressBar | None = None) -> list:
    """The callbacks every training run has (the overhead benchmark times its steps with the same)."""
    checkpoints = ModelCheckpoint(dirpath=run_dir / CHECKPOINT.parent, save_last=True, save_top_k=0,
                                  every_n_train_steps=checkpoint_every)
    return [guard, bar or StepProgressBar(), checkpoints, GracefulInterrupt(run_dir / CHECKPOINT)]


def training_errors(groups: dict) -> list[str]:
    errs = []
    steps = groups["trainer"].get("max_steps")
    if not isinstance(steps, int) or steps <= 0:
        errs.append(f"trainer.max_steps={steps!r} must be a positive integer")
    precision = groups["trainer"].get("precision", "32-true")
    if precision not in PRECISIONS:
        errs.append(f"trainer.precision={precision!r} is not supported; use 32-true (float32), bf16-mixed "
                    "(bfloat16 matmuls, float32 weights and attention) or 64-true")
    optim = groups["optim"]
    if not _positive(optim.get("lr")):
        errs.append(f"optim.lr={optim.get('lr')!r} must be a positive number")
    elif not (isinstance(optim.get("min_lr"), (int, float)) and 0 <= optim["min_lr"] <= optim["lr"]):
        errs.append(f"optim.min_lr={optim.get('min_lr')!r} must be between 0 and optim.lr={optim['lr']}")
    if not isinstance(optim.get("warmup_steps"), int) or optim["warmup_steps"] < 0:
        errs.append(f"optim.warmup_steps={optim.get('warmup_steps')!r} must be a non-negative integer")
    diag = groups["diagnostics"]
    if diag.get("enabled"):
        if not isinstance(diag.get("every_n_steps"), int) or diag["every_n_steps"] <= 0:
            errs.append(f"diagnostics.every_n_steps={diag.get('every_n_steps')!r} must be a positive integer")
        if not isinstance(diag.get("probe_examples"), int) or diag["probe_examples"] <= 0:
            errs.append(f"diagnostics.probe_examples={diag.get('probe_examples')!r} must be a positive integer")
        if diag.get("attention_maps") not in ("none", "end", "all"):
            errs.append(f"diagnostics.attention_maps={diag.get('attention_maps')!r} must be none, end or all")
    every = groups.get("checkpoint_every")
    if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
        errs.append(f"checkpoint_every={every!r} must be a positive number of steps")
    if not isinstance(groups.get("seed"), int):
        errs.append(f"seed={groups.get('seed')!r} must be an integer")
    return errs


def choices(model_cfg: ModelConfig, seed: int, precision: str | int = "32-true") -> dict:
    """What was run, named by what the model computes (field overrides included)."""
    return {
        "norm": model_cfg.norm.name, "pos": model_cfg.pos.name, "act": model_cfg.act.name,
        "attn": model_cfg.attn.name(model_cfg.n_heads), "init": model_cfg.init.name,
        "n_heads": model_cfg.n_heads, "n_layers": model_cfg.n_layers, "d_model": model_cfg.d_model, "seed": seed,
        "n_kv_heads": model_cfg.attn.n_kv_heads or model_cfg.n_heads, "d_ff": model_cfg.d_ff,
        "norm_type": model_cfg.norm.type, "norm_placement": model_cfg.norm.placement,
        "precision": PRECISIONS[precision],
    }


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        flat.update(flatten(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return flat


def prepare(cfg: DictConfig):
    """Everything that can fail on bad input, before any file is written."""
    groups = OmegaConf.to_container(cfg, resolve=True)
    arch = groups["model"]["arch"]
    if arch not in ARCHS:
        raise ConfigError(f"model.arch={arch!r} is unknown; use one of {list(ARCHS)}")
    errors = task_errors(groups["task"], arch) + training_errors(groups)
    if errors:
        raise ConfigError("\n".join(errors))
    task = build_task(groups["task"], groups["seed"], arch)
    model_cfg = ModelConfig.from_groups(groups, vocab_size=task.vocab_size, max_len=task.max_seq_len)
    errors = model_cfg.errors()
    if errors:
        raise ConfigError("\n".join(errors))
    run_dir = Path(groups["run_dir"])
    if previous_status(run_dir) in ("completed", "diverged"):
        raise ConfigError(f"{run_dir / RESULTS_FILE} already exists; choose a new hydra.run.dir (or run_dir) "
                          "so finished results are never overwritten")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write_test"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write to run directory {run_dir} ({err.strerror}); set hydra.run.dir to a "
                          "writable place") from None
    start_step = resume_step(run_dir, groups)
    return groups, task, model_cfg, run_dir, start_step


def save_config(cfg: DictConfig, run_dir: Path, model_cfg: ModelConfig, task) -> None:
    """The resolved config, plus what generation needs to rebuild the model without the data."""
    (run_dir / MODEL_FILE).write_text(json.dumps(dataclasses.asdict(model_cfg), indent=2) + "\n")
    task.tokenizer().save(str(run_dir / TOKENIZER_FILE))
    config_dir = run_dir / ".hydra"
    config_dir.mkdir(exist_ok=True)
    OmegaConf.save(cfg, config_dir / "config.yaml", resolve=True)
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)), config_dir / "overrides.yaml")
        OmegaConf.save(OmegaConf.create(dict(hydra_cfg.runtime.choices)), config_dir / "choices.yaml")


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
        return instantiate(cfg.logger, save_dir=str(run_dir), name=name, job_type=job_type, mode=mode,
                           offline=mode == "offline", **grouping)
    return instantiate(cfg.logger, save_dir=str(run_dir))


def in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def sweep_tags_and_group(groups: dict) -> dict:
    """W&B grouping for sweep jobs: group = study name + launch, tags = the swept overrides."""
    study = groups.get("study")
    if not study or not in_sweep():
        return {}
    hydra_cfg = HydraConfig.get()
    marker = Path(hydra_cfg.sweep.dir) / "multirun.yaml"  # Hydra rewrites it at every launch
    launch = time.strftime("%Y%m%d-%H%M%S", time.localtime(marker.stat().st_mtime)) if marker.exists() else "run"
    tags = swept_overrides(hydra_cfg.overrides.task)
    return {"group": f"{study['name']}-{launch}", "tags": [t[:64] for t in tags]}


def previous_status(run_dir: Path) -> str | None:
    path = run_dir / RESULTS_FILE
    if not path.exists():
        return None
    try:
        return read_results(run_dir).get("status")
    except (OSError, ValueError):
        return "failed"  # unreadable: treat as unfinished


def run(cfg: DictConfig) -> float | None:
    """Train and evaluate one configuration. Inside a sweep, finished jobs are skipped and a failing
    job is recorded as failed without stopping the sweep; a single run fails loudly."""
    run_dir = Path(cfg.run_dir)
    status = previous_status(run_dir)
    if status in ("completed", "diverged") and in_sweep():
        print(f"skip {run_dir}: already {status}")
        return read_results(run_dir).get("final_val_loss")
    if status == "failed":  # keep the record of the failure, then try again
        os.replace(run_dir / RESULTS_FILE, run_dir / f"results.failed-{int(time.time())}.json")
    if not in_sweep():
        return train_and_evaluate(cfg)
    environ = dict(os.environ)
    try:
        return train_and_evaluate(cfg)
    except Exception as err:  # a sweep goes on; the failure is recorded where the results would be
        message = f"{type(err).__name__}: {err}".splitlines()[0][:500]
        print(f"error: job {run_dir} failed: {message}", file=sys.stderr)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_results(run_dir, {"status": "failed", "error": message, "task": cfg.task.name,
                                "overrides": list(HydraConfig.get().overrides.task)})
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


def decode_stats(model, task, new_tokens: int = 64, batch: int = 8) -> dict:
    """KV-cache bytes per token (from the model's shape) and cached greedy decoding speed."""
    cfg = model.cfg
    kv_heads = cfg.attn.n_kv_heads or cfg.n_heads
    bytes_per_token = 2 * cfg.n_layers * kv_heads * cfg.d_head * next(model.parameters()).element_size()
    probe = task.probe_batch(batch)
    prompts = [row[:8] for row in probe.get("source", probe["input"])]
    new_tokens = min(new_tokens, cfg.max_len - 8)  # a learned position table ends at max_len
    start = time.perf_counter()
    generate(model, prompts, new_tokens, bos_id=getattr(task, "bos_id", None))
    elapsed = time.perf_counter() - start
    return {"kv_cache_bytes_per_token": bytes_per_token, "tokens_per_s": batch * new_tokens / elapsed}


def train_and_evaluate(cfg: DictConfig) -> float | None:
    groups, task, model_cfg, run_dir, start_step = prepare(cfg)
    is_rank_zero = rank_zero_only.rank == 0  # DDP re-launches this script once per extra device
    if is_rank_zero:
        if start_step is None:
            set_aside_checkpoints(run_dir)
        save_config(cfg, run_dir, model_cfg, task)
    if in_sweep() and groups["trainer"].get("strategy") == "ddp":
        relaunch_only_this_job(run_dir)
    L.seed_everything(groups["seed"], workers=True, verbose=False)
    picked = choices(model_cfg, groups["seed"], groups["trainer"].get("precision", "32-true"))
    run_name = "-".join(str(picked[k]) for k in ("norm", "pos", "act", "attn", "init")) + \
        f"-h{picked['n_heads']}-s{picked['seed']}"
    lit = LitTransformer(model_cfg, groups["optim"], [n for n in task.eval_lengths if task.in_distribution(n)],
                         target_loss=groups["target_loss"])

    logger = build_logger(cfg, run_dir, f"{task.name}-{run_name}", task.name, sweep_tags_and_group(groups))
    if logger:
        logger.log_hyperparams({**picked, **flatten(groups)})
    guard = DivergenceGuard(groups["max_loss"])
    callbacks = step_callbacks(run_dir, guard, groups["checkpoint_every"])
    if logger:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    diag_cfg = groups["diagnostics"]
    diagnostics = None
    if diag_cfg["enabled"]:
        diagnostics = Diagnostics(task.probe_batch(diag_cfg["probe_examples"]), run_dir / "diagnostics",
                                  diag_cfg["every_n_steps"], diag_cfg["sparsity_eps"], diag_cfg["attention_maps"])
        callbacks.append(diagnostics)
    trainer = instantiate(cfg.trainer, logger=logger, callbacks=callbacks, default_root_dir=str(run_dir))

    train_loader = DataLoader(task.train_batches(start_step or 0), batch_size=None)
    val_loader = DataLoader(task.validation_batches(), batch_size=None)
    if start_step is not None:
        print(f"resuming {run_dir} from step {start_step}")
    start = time.perf_counter()
    try:
        trainer.fit(lit, train_loader, val_loader, ckpt_path=run_dir / CHECKPOINT if start_step is not None else None)
    except SIGTERMException:
        print(f"interrupted at step {trainer.global_step}; checkpoint saved in {run_dir / CHECKPOINT.parent}. "
              "Run the same command again to resume.", file=sys.stderr)
        raise SystemExit(143) from None
    train_time = time.perf_counter() - start
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # the next job of a sweep starts its own group
    if not trainer.is_global_zero:
        return None  # rank 0 evaluates and writes the results

    rows = task.evaluate(lit.model)
    in_dist = [r["loss"] for r in rows if r["in_distribution"] and r["loss"] is not None]
    status = "diverged" if guard.diverged_at_step is not None else "completed"
    results = {
        "status": status,
        "task": task.name,
        "choices": picked,
        "params": lit.model.num_params(),
        "steps": trainer.global_step,
        "train_time_s": round(train_time, 3),
        "tokens_per_s": lit.tokens_seen / lit.step_time_s if lit.step_time_s else 0.0,
        "ms_per_step": 1000 * lit.step_time_s / max(1, trainer.global_step),
        "final_train_loss": lit.last_train_loss,
        "final_val_loss": sum(in_dist) / len(in_dist) if in_dist else None,
        "diverged_at_step": guard.diverged_at_step,
        "steps_to_target_loss": lit.steps_to_target,
        "train_lengths": list(task.train_lengths),
        "eval": rows,
        "decode": decode_stats(lit.model, task),
    }
    if groups.get("study"):
        results["study"] = groups["study"]["name"]
        if in_sweep():
            results["overrides"] = list(HydraConfig.get().overrides.task)
    if diagnostics is not None:
        results["diagnostics"] = diagnostics.summary()
    if status == "diverged":
        print(f"diverged at step {guard.diverged_at_step} (training loss {lit.last_train_loss}); results record "
              "status 'diverged'. Lower optim.lr, add warmup or gradient clipping.", file=sys.stderr)
    path = write_results(run_dir, results)
    if logger and hasattr(logger, "log_table"):
        columns = list(rows[0])
        logger.log_table("eval/by_length", columns=columns, data=[[r[c] for c in columns] for r in rows])
        logger.experiment.summary.update({k: v for k, v in results.items() if not isinstance(v, (dict, list))})
        logger.experiment.finish()
    print_summary(results, path)
    return results["final_val_loss"]
