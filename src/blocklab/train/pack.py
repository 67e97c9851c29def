"""Seeds trained together: K runs that differ only in their seed, trained in one process as one grouped model
(train/grouped.py), each writing its own run directory exactly as it would alone: config, model.json,
tokenizer, checkpoints (Lightning's layout, train/pack_state.py), logger, diagnostics and results.json, the
last from the same code (train/outcome.py).

Each member keeps its own init, data stream and evaluation. What is not elementwise is per member: the loss
(the sum of the members' means, so each member's gradient is its own), gradient clipping (each member's total
norm, computed as clip_grad_norm_ computes it), divergence (a diverged member's results are written at once; it
stays in the pack, its parameters frozen and its loss out of the sum, so the others compute exactly what they
would have). AdamW is elementwise, so one fused AdamW over the stacked parameters is the members' own.
Dropout draws one mask over the whole pack: each member gets its own masks, but not the ones it would draw
alone, so only a pack without dropout (or of one member) reproduces its runs bit for bit.

The pack trains where a run of its config would (trainer.accelerator: the CPU or one GPU) and in its precision:
32-true, or bf16-mixed, the forward under bfloat16 autocast with float32 weights, as Lightning's bf16-mixed runs it.

A plain loop, not Lightning's: Lightning trains one module with one optimizer and writes one checkpoint."""
import dataclasses
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import lightning as L
import torch
from lightning.fabric.utilities.seed import _set_rng_states
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from blocklab.experiment import Setup
from blocklab.errors import ConfigError
from blocklab.hardware import accelerator_error, finish_queued_work, training_device, use_threads
from blocklab.results import (CHECKPOINT, RESULTS_FILE, SAVED_CONFIG, console_kwargs, flatten, previous_status,
                              print_summary, write_results)
from blocklab.tasks.base import IGNORE, device_of, on_device
from blocklab.train.checks import check_run_dir
from blocklab.train.diagnostics import Diagnostics
from blocklab.train.grouped import GroupedModel, Unpackable, fold, pack_problem
from blocklab.train.loggers import build_loggers, check_loggers, log_results
from blocklab.train.module import LitTransformer, build_optimizer, lr_factor
from blocklab.train.outcome import choices, outcome
from blocklab.train.pack_state import (checkpoint, member_optimizer_state, schedule_state, stacked_optimizer_state,
                                       write_checkpoint)
from blocklab.train.resume import resume_step, set_aside_checkpoints
from blocklab.train.sweep import INTERRUPTED, beside_other_jobs, cores_per_job, in_sweep


@dataclass
class Member:
    """One run of the pack: its config, its setup and its LitTransformer (weights, when asked, and totals)."""

    cfg: DictConfig
    overrides: list[str]  # what names it in a sweep (results.json `overrides`)
    setup: Setup
    grouping: dict = field(default_factory=dict)  # its W&B group and tags in a sweep
    lit: LitTransformer | None = None
    picked: dict = field(default_factory=dict)
    loggers: list = field(default_factory=list)
    diagnostics: Diagnostics | None = None
    optimizer: torch.optim.Optimizer | None = None  # AdamW over the member's own parameters: its checkpoint's
    stream: object = None
    diverged_at_step: int | None = None
    results: dict | None = None

    @property
    def seed(self) -> int:
        return self.setup.groups["seed"]


def prepared(cfg: DictConfig) -> Setup:
    """run.prepare's checks, but nothing written yet: the member's validated setup and the step it resumes from."""
    setup = Setup.from_config(cfg)
    if error := accelerator_error(setup.groups["trainer"].get("accelerator")):
        raise ConfigError(error)
    check_loggers(cfg.logger)
    return dataclasses.replace(setup, start_step=resume_step(setup.run_dir, setup.groups))


def build(members: list[Member], packs: int | None = None) -> None:
    """Each member's module with its own init, exactly as its run alone builds it, on the device it trains on;
    `packs`: how many packs the launch trains (beside other jobs, they share the cores)."""
    use_threads(members[0].setup.groups["trainer"], cores_per_job(packs))  # the members differ only in seed
    device = training_device(members[0].setup.groups["trainer"])
    for m in members:
        groups, task = m.setup.groups, m.setup.task
        L.seed_everything(m.seed, workers=True, verbose=False)
        m.picked = choices(m.setup.model_cfg, m.seed, groups["trainer"].get("precision", "32-true"))
        m.lit = LitTransformer(m.setup.model_cfg, groups["optim"],
                               [n for n in task.eval_lengths if task.in_distribution(n)],
                               target_loss=groups["target_loss"]).to(device)
        m.stream = iter(task.train_batches(m.setup.start_step or 0))


def problem(members: list[Member]) -> str | None:
    """Why these members cannot train as one pack (checked on their first batches; nothing is consumed)."""
    if any(m.setup.model_cfg != members[0].setup.model_cfg for m in members):
        return "the members' model configs differ (a model option derived from the seed?)"
    try:
        grouped = GroupedModel([m.lit.model for m in members])
    except Unpackable as err:
        return str(err)
    device = device_of(members[0].lit.model)
    batches = [on_device(next(iter(m.setup.task.train_batches(m.setup.start_step or 0))), device) for m in members]
    return pack_problem(grouped, [m.lit for m in members], batches, getattr(members[0].setup.task, "pad_id", 0))


class Pack:
    """The training loop of K members; `run()` trains them and returns their results."""

    def __init__(self, members: list[Member]):
        self.members, self.k = members, len(members)
        first = members[0].setup.groups
        self.trainer, self.optim = first["trainer"], first["optim"]
        self.total, self.start = self.trainer["max_steps"], members[0].setup.start_step or 0
        self.interrupted = False
        self.history: list[list[float]] = []  # every step's training losses, one per member
        self.pad_id = getattr(members[0].setup.task, "pad_id", 0)
        self.device = device_of(members[0].lit.model)  # where build() put them
        bf16 = str(self.trainer.get("precision", "32-true")) == "bf16-mixed"
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16)

    # ------------------------------------------------------------------------------ setting up

    def open(self) -> None:
        """Write each member's directory (as a run alone does before training), restore a resume, stack."""
        for m in self.members:
            setup, run_dir = m.setup, m.setup.run_dir
            check_run_dir(run_dir)
            if setup.start_step is None:
                set_aside_checkpoints(run_dir)
            setup.save(m.cfg)
            if m.overrides:  # setup.save wrote the running job's (Hydra's); this member's are its own
                OmegaConf.save(OmegaConf.create(m.overrides), run_dir / SAVED_CONFIG.parent / "overrides.yaml")
            m.optimizer = build_optimizer(m.lit.model, self.optim)
        resumed = [self._load(m) for m in self.members] if self.start else None
        self.grouped = GroupedModel([m.lit.model for m in self.members])
        names = {id(p): n for n, p in self.members[0].lit.model.named_parameters()}
        self.order = [names[id(p)] for group in self.members[0].optimizer.param_groups for p in group["params"]]
        self.optimizer = build_optimizer(self.members[0].lit.model, self.optim)
        for group in self.optimizer.param_groups:  # the same groups and settings, over the stacked parameters
            group["params"] = [self.grouped.params[names[id(p)]] for p in group["params"]]
        if resumed:
            state = stacked_optimizer_state([r["optimizer_states"][0] for r in resumed], self.order)
            for name, value in state.items():
                self.optimizer.state[self.grouped.params[name]] = on_device(value, self.device)
            _set_rng_states(resumed[0]["rng_states"])  # the pack's dropout goes on with the first member's draws
        for k, m in enumerate(self.members):
            self._open_logger(m)
            self._open_diagnostics(m, resumed[k] if resumed else None)
        self.alive = torch.ones(self.k, dtype=torch.bool, device=self.device)
        self.frozen: dict[int, dict] = {}

    def _load(self, m: Member) -> dict:
        state = torch.load(m.setup.run_dir / CHECKPOINT, map_location="cpu", weights_only=False)
        m.lit.load_state_dict(state["state_dict"])
        for name, value in state.get("blocklab", {}).items():
            setattr(m.lit, name, value)
        print(f"resuming {m.setup.run_dir} from step {self.start}")
        return state

    def _open_logger(self, m: Member) -> None:
        task, picked = m.setup.task, m.picked
        name = "-".join(str(picked[k]) for k in ("norm", "pos", "act", "attn", "init")) + \
            f"-h{picked['n_heads']}-s{picked['seed']}"
        # Only W&B reads the grouping: the members' W&B runs are open side by side.
        m.loggers = build_loggers(m.cfg, m.setup.run_dir, f"{task.name}-{name}", task.name,
                                  {**m.grouping, "reinit": "create_new"})
        for logger in m.loggers:
            logger.log_hyperparams({**picked, **flatten(m.setup.groups)})

    def _open_diagnostics(self, m: Member, resumed: dict | None) -> None:
        diag = m.setup.groups["diagnostics"]
        if not diag["enabled"]:
            return
        m.diagnostics = Diagnostics(m.setup.task.probe_batch(diag["probe_examples"]), m.setup.run_dir / "diagnostics",
                                    diag["every_n_steps"], diag["sparsity_eps"], diag["attention_maps"])
        saved = (resumed or {}).get("callbacks", {}).get(m.diagnostics.state_key)
        if saved:
            m.diagnostics.load_state_dict(saved)
        m.diagnostics.on_train_start(self._trainer_view(m, self.start), m.lit)

    def _trainer_view(self, m: Member, step: int) -> SimpleNamespace:
        """What Diagnostics reads of a trainer."""
        return SimpleNamespace(loggers=m.loggers, is_global_zero=True, global_step=step)

    # ------------------------------------------------------------------------------ training

    def run(self) -> list[dict] | None:
        """Train; the members' results, or None where jobs run side by side and this one was interrupted."""
        self.open()
        start_time = time.perf_counter()
        for m in self.members:
            m.lit._clock = start_time
        handlers = self._catch_interrupts()
        try:
            with self._progress() as progress:
                bar = progress.add_task("train", total=self.total, completed=self.start, losses="")
                for step in range(self.start, self.total):
                    losses = self.train_step(step)
                    progress.update(bar, completed=step + 1,
                                    losses=" ".join(f"{x:.3f}" for x in losses))
                    if self.interrupted:
                        self._save_all(step + 1)
                        print(f"interrupted at step {step + 1}; checkpoints saved in each member's "
                              f"{CHECKPOINT.parent}. Run the same command again to resume.", file=sys.stderr)
                        if beside_other_jobs():  # the launching process ends the command once every job has saved
                            INTERRUPTED["received"] = True
                            return None
                        raise SystemExit(143)
                    if not bool(self.alive.any()):
                        break
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        finished = [k for k, m in enumerate(self.members) if m.results is None]
        for k in finished:  # training ends now for all of them, whoever is evaluated first
            self.members[k].lit._count_train_time()
        for k in finished:
            self.members[k].lit._clock = time.perf_counter()
            self._finish(k, self.total)
        return [m.results for m in self.members]

    def train_step(self, step: int) -> list[float]:
        """One optimizer step of every member; returns their training losses."""
        begin = time.perf_counter()
        batches = [next(m.stream) for m in self.members]
        for group in self.optimizer.param_groups:  # LambdaLR's value, computed as it computes it
            group["lr"] = self.optim["lr"] * lr_factor(step, self.optim["warmup_steps"], self.total,
                                                          self.optim["min_lr"] / self.optim["lr"])
        with self.autocast:
            losses = self.grouped.losses(on_device(fold(batches, self.pad_id) if self.k > 1 else batches[0],
                                                   self.device))
        torch.where(self.alive, losses, torch.zeros_like(losses)).sum().backward()
        grads = [self.grouped.params[name].grad for name in self.order]
        self._before_step(step, grads)
        clip = self.trainer.get("gradient_clip_val")
        if clip:
            self._clip(grads, clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._keep_frozen()
        finish_queued_work(self.device)
        elapsed = time.perf_counter() - begin
        values = losses.tolist()
        self.history.append(values)
        for k, m in enumerate(self.members):
            if m.results is None:
                self._account(k, step + 1, values[k], batches[k], elapsed)
        return values

    def _clip(self, grads: list[torch.Tensor], max_norm: float) -> None:
        """torch.nn.utils.clip_grad_norm_ (what Lightning calls) for each member over its own gradients, in its
        arithmetic: the norm of the per-tensor norms, then one multiply by min(1, max_norm / (norm + 1e-6))."""
        present = [g for g in grads if g is not None]
        slices = [g[k] for k in range(self.k) for g in present]
        norms = torch._foreach_norm(slices, 2.0)  # each tensor's norm, as get_total_norm takes them
        n = len(present)
        coefs = []
        for k in range(self.k):
            total = torch.linalg.vector_norm(torch.stack(norms[k * n:(k + 1) * n]), 2.0)
            coefs += [torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)] * n
        torch._foreach_mul_(slices, coefs)

    def _account(self, k: int, step: int, loss: float, batch: dict, elapsed: float) -> None:
        """LitTransformer.on_train_batch_end's totals for member k, its logging and its divergence check."""
        m, lit = self.members[k], self.members[k].lit
        tokens = int(batch["valid"].sum())
        lit.tokens_seen += tokens
        lit.step_time_s += elapsed
        lit._window_tokens += tokens
        lit._window_time += elapsed
        lit.last_train_loss = loss
        if lit.target_loss is not None and lit.steps_to_target is None and loss < lit.target_loss:
            lit.steps_to_target = step
        lit._loss_window = [lit._loss_window[0] + loss, lit._loss_window[1] + 1]
        if step % max(1, self.total // lit.CURVE_POINTS) == 0 or step == self.total:
            lit.train_loss_curve.append([step, lit._loss_window[0] / lit._loss_window[1]])
            lit._loss_window = [0.0, 0]
        every = self.trainer["log_every_n_steps"]
        if m.loggers and (step % every == 0 or not math.isfinite(loss)):
            metrics = {"train/loss": loss, **{f"lr-AdamW/pg{i + 1}": g["lr"]  # LearningRateMonitor's names
                                              for i, g in enumerate(self.optimizer.param_groups)}}
            if lit._window_time > 0:
                metrics["train/tokens_per_s"] = lit._window_tokens / lit._window_time
                lit._window_tokens, lit._window_time = 0, 0.0
            for logger in m.loggers:
                logger.log_metrics(metrics, step=step)
        if m.diagnostics is not None and m.diagnostics._grads_at_step is not None:
            self.grouped.load_into(k, lit.model)
            m.diagnostics.on_train_batch_end(self._trainer_view(m, step), lit, None, batch, step - 1)
        if self._val_due(step) and m.loggers:
            self._validate(k, step)
        max_loss = m.setup.groups["max_loss"]
        if not math.isfinite(loss) or (max_loss is not None and loss > max_loss):
            m.diverged_at_step = step
            self._finish(k, step)
        elif step % m.setup.groups["checkpoint_every"] == 0 and step < self.total:
            self._save(k, step)

    def _before_step(self, step: int, grads: list) -> None:
        """At a diagnostics step, each member's unclipped gradients (Diagnostics.on_before_optimizer_step)."""
        for k, m in enumerate(self.members):
            if m.results is not None:
                for g in grads:
                    if g is not None:
                        g[k].zero_()
            elif m.diagnostics is not None and step > 0 and step % m.diagnostics.every_n_steps == 0:
                for name, p in m.lit.model.named_parameters():
                    grad = self.grouped.params[name].grad
                    p.grad = None if grad is None else grad[k].clone()
                m.diagnostics.on_before_optimizer_step(self._trainer_view(m, step), m.lit, None)
                m.lit.model.zero_grad(set_to_none=True)
            if m.loggers and step % self.trainer["log_every_n_steps"] == 0:
                norm = torch.linalg.vector_norm(torch.stack([g[k].norm() for g in grads if g is not None]))
                for logger in m.loggers:
                    logger.log_metrics({"train/grad_norm": float(norm)}, step=step)

    def _keep_frozen(self) -> None:
        """A diverged member's parameters stay where its run stopped."""
        with torch.no_grad():
            for k, saved in self.frozen.items():
                for name, value in saved.items():
                    self.grouped.params[name][k].copy_(value)

    def _val_due(self, step: int) -> bool:
        every = self.trainer.get("val_check_interval")
        return bool(every) and step % every == 0

    @torch.no_grad()
    def _validate(self, k: int, step: int) -> None:
        """LitTransformer's validation (in distribution and beyond), for the member's logger only."""
        m = self.members[k]
        model = self.grouped.load_into(k, m.lit.model)
        model.eval()
        sums = {True: [0.0, 0], False: [0.0, 0]}
        for batch in m.setup.task.validation_batches():
            batch = on_device(batch, self.device)
            with self.autocast:
                per_token = m.lit.batch_loss(batch, reduction="none")
            n = int((batch["target"] != IGNORE).sum())
            inside = batch["length"] in m.lit.in_distribution
            sums[inside] = [sums[inside][0] + float(per_token.sum()), sums[inside][1] + n]
        model.train()
        metrics = {name: total / n for name, (total, n) in (("val/loss", sums[True]),
                                                            ("val/loss_beyond_train", sums[False])) if n}
        for logger in m.loggers:
            logger.log_metrics(metrics, step=step)

    # ------------------------------------------------------------------------------ checkpoints, results

    def _save_all(self, step: int) -> None:
        for k, m in enumerate(self.members):
            if m.results is None:
                self._save(k, step)

    def _save(self, k: int, step: int) -> None:
        m = self.members[k]
        self.grouped.load_into(k, m.lit.model)
        m.lit._count_train_time()
        stacked = {name: self.optimizer.state[p] for name, p in self.grouped.params.items()
                   if p in self.optimizer.state}
        schedule = schedule_state(m.optimizer, self.optim, step, self.total)
        callbacks = {} if m.diagnostics is None else {m.diagnostics.state_key: m.diagnostics.state_dict()}
        write_checkpoint(m.setup.run_dir, checkpoint(m.lit, step, member_optimizer_state(m.optimizer, self.order,
                                                                                         stacked, k),
                                                     schedule, callbacks))

    def _finish(self, k: int, step: int) -> None:
        """Member k's run ends at `step` (the last, or where it diverged): checkpoint, diagnostics, results."""
        m = self.members[k]
        self._save(k, step)
        if m.diverged_at_step is not None:
            self.alive[k] = False
            self.frozen[k] = {name: p[k].detach().clone() for name, p in self.grouped.params.items()}
        if m.diagnostics is not None:
            m.diagnostics.on_fit_end(self._trainer_view(m, step), m.lit)
        m.results = member_results(m, step, self.k, [x.seed for x in self.members])
        if m.diverged_at_step is not None:
            print(f"{m.setup.run_dir}: diverged at step {m.diverged_at_step} (training loss {m.lit.last_train_loss}); "
                  "its results record status 'diverged', the other members train on. Lower optim.lr, add warmup "
                  "or gradient clipping.", file=sys.stderr)
        path = write_results(m.setup.run_dir, m.results)
        for logger in m.loggers:
            logger.finalize("success")  # as Lightning does at the end of fit
        log_results(m.loggers, m.results, m.results.get("overrides", []))
        print_summary(m.results, path)

    # ------------------------------------------------------------------------------ console, signals

    def _progress(self) -> Progress:
        seeds = ",".join(str(m.seed) for m in self.members)
        return Progress(TextColumn(f"train seeds {seeds}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("loss {task.fields[losses]}"), refresh_per_second=4,
                        console=Console(**console_kwargs()))

    def _catch_interrupts(self) -> dict:
        """SIGTERM or a first Ctrl-C: finish the step, save every member's checkpoint, stop (exit 143)."""
        def first(signum, frame):
            self.interrupted = True
            signal.signal(signal.SIGINT, signal.default_int_handler)

        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        signal.signal(signal.SIGTERM, first)
        if handlers[signal.SIGINT] is signal.default_int_handler:
            signal.signal(signal.SIGINT, first)
        return handlers


def member_results(m: Member, step: int, k: int, seeds: list[int]) -> dict:
    """results.json of one member, from train/outcome.py as a run alone writes it, plus how it was packed."""
    results = outcome(m.setup.task, m.lit, m.diverged_at_step, step, m.picked)
    groups = m.setup.groups
    if groups.get("study"):
        results["study"] = groups["study"]["name"]
    if in_sweep():
        results["overrides"] = m.overrides
    if m.diagnostics is not None:
        results["diagnostics"] = m.diagnostics.summary()
    # Times and throughput are the pack's (every member trained for all of it): compare them among runs packed alike.
    results["pack"] = {"members": k, "seeds": seeds}
    return results


def train_pack(cfgs: list[DictConfig], overrides: list[list[str]] | None = None,
               groupings: list[dict] | None = None) -> list[dict] | str:
    """Train the runs `cfgs` (configs that differ only in seed and run_dir, resuming from the same step) as one
    pack and write each one's run directory; in a sweep, `overrides` and `groupings` name each member's job and
    W&B group and tags. Returns their results, or, where they cannot be packed, why (a string; nothing has
    been written)."""
    pack = pack_of(cfgs, overrides, groupings)
    return pack if isinstance(pack, str) else pack.run()


def pack_of(cfgs: list[DictConfig], overrides: list[list[str]] | None = None,
            groupings: list[dict] | None = None, packs: int | None = None) -> "Pack | str":
    """The pack of `cfgs`, ready to run, or why they cannot be packed (nothing written either way); `packs`: how
    many packs the launch trains, where jobs run side by side."""
    members = [Member(cfg, overrides[i] if overrides else [], prepared(cfg), groupings[i] if groupings else {})
               for i, cfg in enumerate(cfgs)]
    starts = {m.setup.start_step for m in members}
    if len(starts) > 1:
        return f"the members resume from different steps ({sorted(map(str, starts))})"
    build(members, packs)
    if len(members) > 1:
        reason = problem(members)
        if reason:
            return reason
    for m in members:  # as run_as_sweep_job does: keep the record of a failure, then try again
        if previous_status(m.setup.run_dir) == "failed":
            (m.setup.run_dir / RESULTS_FILE).rename(m.setup.run_dir / f"results.failed-{int(time.time())}.json")
    return Pack(members)
