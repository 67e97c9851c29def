"""One experiment: validate the config, train, evaluate length generalization, write results.json.
The pieces live beside it: checks.py, sweep.py (a run as a sweep job), loggers.py, outcome.py."""
import dataclasses
import logging
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from blocklab.experiment import RunConfig, Setup, run_config
from blocklab.model.size import model_size
from blocklab.errors import ConfigError, RunFolderError, print_error
from blocklab.hardware import accelerator_error, keep_freed_memory, precision_warning, use_threads
from blocklab.schema import ablation_choices
from blocklab.results import (CHECKPOINT, MODEL_FILE, SAVED_CONFIG, TOKENIZER_FILE, flatten, print_summary,
                              write_results)
from blocklab.train.callbacks import (DivergenceGuard, GracefulInterrupt, LastCheckpoint, RunRecord, StepProgressBar,
                                     StepRecord)
from blocklab.train.checkpoint_io import AtomicCheckpointIO
from blocklab.train.checks import check_run_dir, own_run_dir
from blocklab.train.continued import continued_setup, load_source_weights
from blocklab.train.wsd import branch_points, branch_start
from blocklab.train.diagnostics import Diagnostics
from blocklab.train.loggers import build_loggers, check_loggers, log_results
from blocklab.train.module import LitTransformer
from blocklab.train.outcome import choices, outcome
from blocklab.checkpoint import load_checkpoint
from blocklab.train.resume import (RESUME_FIX, check_restorable, guard_restore, resume_step, set_aside_checkpoints,
                                   with_keys)
from blocklab.train.job import (INTERRUPTED, beside_other_jobs, cores_per_job, in_sweep, job_overrides,
                                sweep_tags_and_group)
from blocklab.train.sweep import relaunch_only_this_job, run_as_sweep_job

# A run's console is its progress and its results: not Lightning's advertisements, its report of
# accelerators a CPU run does not use, its note that max_steps was reached, or its restore messages
# (the run says itself that it resumes). On a GPU: not the precision it was asked for, the device's index, or
# the advice to round float32 matmuls through TF32 (a 32-true run is asked to be exact; bf16-mixed is the fast one).
# Nor its echo of a limit the trainer preset set (trainer=debug's limit_val_batches: the preset's docs say it).
LIGHTNING_CHATTER = ("💡 Tip", "GPU available:", "TPU available:", "HPU available:", "`Trainer.fit` stopped:",
                     "`Trainer(limit_",
                     "Restoring states from the checkpoint", "Restored all states from the checkpoint",
                     "Using bfloat16 Automatic Mixed Precision", "You are using a CUDA device", "LOCAL_RANK:")
for _logger in ("lightning.pytorch.utilities.rank_zero", "lightning.pytorch.accelerators.cuda"):
    logging.getLogger(_logger).addFilter(lambda record: not str(record.msg).startswith(LIGHTNING_CHATTER))
# Trainer-group keys that BlockLab reads itself; the rest are lightning.Trainer's arguments.
BLOCKLAB_TRAINER_KEYS = ("compile", "threads", "data_workers", "resume_from", "limit_eval_examples")
# Lightning calls torch's deprecated pytree API on every fit; nothing a user can act on.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
# Loader workers are trainer.data_workers, chosen per trainer preset: on 2 cores they would take the training's cores.
warnings.filterwarnings("ignore", message=r".*does not have many workers which may be a bottleneck.*")


def step_callbacks(run_dir: Path, guard: DivergenceGuard, checkpoint_every: int,
                   bar: StepProgressBar | None = None, config: dict | None = None) -> list:
    """The callbacks every training run has (the overhead benchmark times its steps with the same)."""
    return [StepRecord(), guard, bar or StepProgressBar(), RunRecord(run_dir, config or {}, [SAVED_CONFIG, MODEL_FILE, TOKENIZER_FILE]),
            LastCheckpoint(run_dir / CHECKPOINT.parent, checkpoint_every), GracefulInterrupt(run_dir / CHECKPOINT)]


def prepare(cfg: RunConfig | DictConfig) -> Setup:
    """Everything that can fail on bad input, before any file is written. The Setup is the one the command line
    validated before Hydra ran, where the config is the same (Setup.from_config); a sweep job's is validated here."""
    config = run_config(cfg)
    setup = Setup.from_config(config)
    if error := accelerator_error(config["trainer"].get("accelerator")):
        raise ConfigError(error)
    check_loggers(config["logger"])
    check_run_dir(setup.run_dir)
    setup = continued_setup(setup)  # trainer.resume_from: its source checked, YaRN's original context its own
    step, adopted = resume_step(setup.run_dir, config, setup.model_cfg)
    if adopted:  # a run an older BlockLab started resumes as it started (pos.yarn_ramp=paper, ...)
        print(f"resuming as this run started: {', '.join(f'{k}={v}' for k, v in adopted.items())}", file=sys.stderr)
        setup = continued_setup(Setup.from_config(with_keys(config, adopted)))
        state = load_checkpoint(setup.run_dir, CHECKPOINT, model_size(setup.model_cfg).parameters, RESUME_FIX)
        check_restorable(setup.run_dir, state, setup.model_cfg)
    return dataclasses.replace(setup, start_step=step)


def run(cfg: DictConfig) -> float | None:
    """Train and evaluate one configuration. Inside a sweep, finished jobs are skipped and a failing
    job is recorded as failed without stopping the sweep; a single run fails loudly. Hydra's config is resolved
    once, here: the plain RunConfig is the one form that travels from here on."""
    keep_freed_memory()  # in this process: a sweep's workers run each job here too
    config = run_config(cfg)
    try:
        with own_run_dir(Path(config["run_dir"])):
            return run_as_sweep_job(config, train_and_evaluate)
    except RunFolderError as err:  # in use or damaged: a sweep goes on without it, and writes nothing there
        if not in_sweep():
            raise
        print_error(f"job skipped: {err}")
        return None


def train_and_evaluate(config: RunConfig) -> float | None:
    setup = prepare(config)
    task, run_dir, start_step = setup.task, setup.run_dir, setup.start_step
    branch = branch_start(setup) if start_step is None else None  # a wsd branch starts at its trunk's step
    is_rank_zero = rank_zero_only.rank == 0  # DDP re-launches this script once per extra device
    if is_rank_zero:
        if start_step is None:
            set_aside_checkpoints(run_dir)
        setup.save()
    if in_sweep() and config["trainer"].get("strategy") == "ddp":
        relaunch_only_this_job(run_dir)
    use_threads(config["trainer"], cores_per_job())
    warning = precision_warning(config["trainer"].get("accelerator"), str(config["trainer"].get("precision", "32-true")))
    if warning and is_rank_zero:
        print(warning, file=sys.stderr)
    L.seed_everything(config["seed"], workers=True, verbose=False)
    picked = {**choices(setup.model_cfg, config["seed"], config["trainer"].get("precision", "32-true"),
                        config["optim"].get("name", "adamw")), **ablation_choices(config)}
    run_name = "-".join(str(picked[k]) for k in ("norm", "pos", "act", "attn", "init")) + \
        f"-h{picked['n_heads']}-s{picked['seed']}"
    lit = LitTransformer(setup.model_cfg, config["optim"],
                         [n for n in task.eval_lengths if task.in_distribution(n)], target_loss=config["target_loss"],
                         compile=bool(config["trainer"].get("compile")))
    if start_step is None:  # trainer.resume_from: a fresh run from that run's final weights (else nothing)
        load_source_weights(lit.model, setup)

    loggers = build_loggers(config["logger"], run_dir, f"{task.name}-{run_name}", task.name,
                            sweep_tags_and_group(config))
    for logger in loggers:
        logger.log_hyperparams({**picked, **flatten(config)})
    guard = DivergenceGuard(config["max_loss"])
    callbacks = step_callbacks(run_dir, guard, config["checkpoint_every"], config=config)
    callbacks += branch_points(run_dir, config)  # a wsd trunk keeps its branch points' checkpoints
    if loggers:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    diag_cfg = config["diagnostics"]
    diagnostics = None
    if diag_cfg["enabled"]:
        diagnostics = Diagnostics(task.probe_batch(diag_cfg["probe_examples"]), run_dir / "diagnostics",
                                  diag_cfg["every_n_steps"], diag_cfg["sparsity_eps"], diag_cfg["attention_maps"])
        callbacks.append(diagnostics)
    # Resolved first: a trainer key may interpolate another group (a sweep's max_steps: ${mul:600,${study.scale}}).
    lightning_args = {k: v for k, v in config["trainer"].items() if k not in BLOCKLAB_TRAINER_KEYS}
    trainer = instantiate(lightning_args, logger=loggers or False, callbacks=callbacks, default_root_dir=str(run_dir),
                          plugins=[AtomicCheckpointIO(model_size(setup.model_cfg).parameters)])

    # Each iterator a DataLoader starts draws a seed from its generator: an own one keeps the global state,
    # which dropout draws from and the checkpoint carries, exactly where the training steps leave it.
    # Workers fork: in a joblib job the default start method would pickle the task, and forking needs no re-import.
    workers = config["trainer"].get("data_workers") or 0
    first_step = start_step if start_step is not None else (branch.step if branch else 0)
    train_loader = DataLoader(task.train_batches(first_step), batch_size=None, generator=torch.Generator(),
                              num_workers=workers, multiprocessing_context="fork" if workers else None)
    val_loader = DataLoader(task.validation_batches(), batch_size=None, generator=torch.Generator())
    ckpt_path = run_dir / CHECKPOINT if start_step is not None else (branch.path if branch else None)
    if start_step is not None:
        guard_restore(trainer, run_dir / CHECKPOINT, start_step)
        print(f"resuming {run_dir} from step {start_step}")
    elif branch:
        guard_restore(trainer, branch.path, branch.step)
        print(f"branching {run_dir} from {branch.path} (step {branch.step})")
    try:
        # max_steps 0 (schema: with trainer.resume_from only): the source's weights evaluated under this config
        if config["trainer"]["max_steps"] > 0:
            trainer.fit(lit, train_loader, val_loader,
                        ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException:
        print(f"interrupted at step {trainer.global_step}; checkpoint saved in {run_dir / CHECKPOINT.parent}. "
              "Run the same command again to resume.", file=sys.stderr)
        if beside_other_jobs():  # the launching process ends the command once every running job has saved
            INTERRUPTED["received"] = True
            return None
        raise SystemExit(143) from None
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # the next job of a sweep starts its own group
    if not trainer.is_global_zero:
        return None  # rank 0 evaluates and writes the results

    lit.to(trainer.strategy.root_device)  # Lightning's teardown moved it to the CPU: evaluate where it trained
    results = outcome(task, lit, guard.diverged_at_step, trainer.global_step, picked)
    if config.get("study"):
        results["study"] = config["study"]["name"]
    if in_sweep():  # what the job varied, as a failed job's record has it too
        results["overrides"] = job_overrides()
    if diagnostics is not None:
        results["diagnostics"] = diagnostics.summary()
    if results["status"] == "diverged":
        print(f"diverged at step {guard.diverged_at_step} (training loss {lit.last_train_loss}); results record "
              "status 'diverged'. Lower optim.lr, add warmup or gradient clipping.", file=sys.stderr)
    path = write_results(run_dir, results)
    log_results(loggers, results, results.get("overrides", []))
    print_summary(results, path)
    return results["final_val_loss"]
