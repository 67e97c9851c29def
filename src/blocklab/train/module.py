"""The LightningModule: one configured Transformer trained with AdamW and its learning-rate schedule (optim.schedule)."""
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, grad_norm
from torchmetrics import MeanMetric

from blocklab.model import ModelConfig, build_model
from blocklab.model.moe import load_and_drops, routed_layers, routing_summary
from blocklab.optim import build_optimizer, saved_state_parts
from blocklab.schedule import SCHEDULES, schedule
from blocklab.tasks.base import IGNORE, model_inputs


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at `total` steps (optim.schedule=cosine, nanoGPT's)."""
    return SCHEDULES["cosine"]({"warmup_steps": warmup, "lr": 1.0, "min_lr": min_ratio}, total)(step)


def scored_positions(target: torch.Tensor) -> torch.Tensor | None:
    """The flat indices of the positions a masked loss reads (target not IGNORE: MQAR's queries, copy's and
    addition's answers, MLM's masked tokens), for the model to compute its output layer there alone (about 85%
    of a default MQAR step went to logits and log-softmax over 8192 tokens at all 4096 positions, of which the
    loss reads 256). None where every position is scored (a language model): the plain forward then."""
    read = (target.flatten() != IGNORE).nonzero().squeeze(1)
    return None if read.numel() == target.numel() else read


def rng_states() -> dict:
    """The global random states (torch, CUDA, numpy, Python; Lightning's own collection), numpy's key as a list:
    torch's weights-only loader, which generate and analyze read the checkpoint with, refuses numpy arrays."""
    states = _collect_rng_states()
    kind, key, *rest = states["numpy"]
    states["numpy"] = (kind, key.tolist(), *rest)
    return states


# The running totals a checkpoint carries (LitTransformer.TOTALS), with their types: a resume restores each as it is
# and adds to it at the next step.
TOTAL_TYPES = {"tokens_seen": int, "step_time_s": (int, float), "train_time_s": (int, float),
               "last_train_loss": (int, float), "steps_to_target": (int, type(None)), "train_loss_curve": list,
               "_loss_window": list, "val_loss_curve": list}


class LitTransformer(L.LightningModule):
    def __init__(self, model_cfg: ModelConfig, optim: dict, in_distribution: list[int] | None = None,
                 target_loss: float | None = None, compile: bool = False):
        super().__init__()
        self.model = build_model(model_cfg)
        # trainer.compile: only the training step's forward (a function, so the state dict keeps its keys).
        # Evaluation decodes token by token at every length, where each new shape would compile again.
        self._train_forward = torch.compile(self.model.forward, dynamic=True) if compile else None
        self.optim = optim
        self.in_distribution = set(in_distribution or [])
        self.val_loss = MeanMetric()
        self.val_loss_beyond = MeanMetric()
        self.tokens_seen = 0
        self.step_time_s = 0.0
        self.train_time_s = 0.0  # wall time in fit, counted up to the last checkpoint or the end of fit
        self._clock = 0.0  # when train_time_s was last brought up to date
        self._stepped = False  # whether this process trained a step (a finished run's re-evaluation does not)
        self._window_tokens, self._window_time, self._step_start = 0, 0.0, 0.0
        self.last_train_loss = float("nan")
        self.target_loss, self.steps_to_target = target_loss, None
        # MoE layers: their load-balancing loss joins the loss trained on (none for a dense model: no overhead).
        self.routed = routed_layers(self.model)
        self.routing: dict | None = None  # results.json `moe`, taken when training ends
        # results.json train_loss_curve: [step, mean training loss over the steps since the last point], about
        # CURVE_POINTS per run whatever its length (the report reads its early loss off it); the window carries on.
        self.train_loss_curve: list[list] = []
        self._loss_window = [0.0, 0]
        # results.json val_loss_curve: [step, validation loss] at each of the trainer's validations (a ladder's
        # intermediate evaluation points, trainer.val_check_interval apart), so a fit can read the whole curve.
        self.val_loss_curve: list[list] = []

    CURVE_POINTS = 20
    # Running totals survive a resume, so results (train time and throughput too) are the whole run's.
    TOTALS = tuple(TOTAL_TYPES)

    def _count_train_time(self) -> None:
        now = time.perf_counter()
        self.train_time_s += now - self._clock
        self._clock = now

    def setup(self, stage):
        self._clock = time.perf_counter()  # fit's first hook: its setup and the first diagnostics count too

    def on_fit_end(self):
        if self._stepped:  # a fit that only re-evaluates a finished run keeps the train time of its checkpoint
            self._count_train_time()
        self.routing = routing_summary(self.routed)  # before anything after training runs the model in train mode

    def on_save_checkpoint(self, checkpoint):
        self._count_train_time()  # a resume goes on from this checkpoint, and from the time spent up to it
        checkpoint["blocklab"] = {name: getattr(self, name) for name in self.TOTALS}
        # Dropout draws from the global generators: a resume goes on with the next draws, not new ones.
        checkpoint["rng_states"] = rng_states()

    def on_load_checkpoint(self, checkpoint):
        for name, value in checkpoint.get("blocklab", {}).items():
            if name in self.TOTALS:  # restore_error refused any other name before Lightning restored anything
                setattr(self, name, value)
        if "rng_states" in checkpoint:
            _set_rng_states(checkpoint["rng_states"])

    def forward(self, idx, **kwargs):
        return self.model(idx, **kwargs)

    def batch_loss(self, batch, reduction: str = "mean", model=None):
        """The token loss (the task's), however the batch is scored besides."""
        return self.losses(batch, reduction, model)[0]

    def losses(self, batch, reduction: str = "mean", model=None) -> tuple:
        """(token loss, next-sentence loss or None, z-loss or None): a batch of sentence pairs (`is_next`) is also
        classified; under optim.z_loss = c > 0 the third is c * mean(log^2 Z) over the scored positions, Z the
        softmax's normalizer (PaLM, Chowdhery et al. 2022, §5: c = 1e-4, to keep log Z near 0 for stability)."""
        pairs = "is_next" in batch
        target = batch["target"].flatten()
        read = scored_positions(target)  # None: the loss reads every position
        at = {"at": read} if read is not None and getattr(self.model, "selects_positions", False) else {}
        out = (model or self.model)(batch["input"], **model_inputs(batch), **({"sentence": True} if pairs else {}), **at)
        logits, sentence = out if pairs else (out, None)
        if not at:
            logits = logits.flatten(0, 1)
            if read is not None:
                logits = logits.index_select(0, read)
        if read is not None:
            target = target.index_select(0, read)
        # The loss over the scored positions only: the same value as cross-entropy over all of them with
        # ignore_index (its mean divides by the scored count; reduction="none" gives the scored ones' losses).
        loss = F.cross_entropy(logits, target, reduction=reduction)
        z_weight = self.optim.get("z_loss", 0.0)
        z_loss = z_weight * torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).square().mean() if z_weight else None
        return loss, (F.cross_entropy(sentence, batch["is_next"].long()) if pairs else None), z_loss

    def on_train_batch_start(self, batch, batch_idx):
        self._step_start = time.perf_counter()
        self._stepped = True

    def training_step(self, batch, batch_idx):
        loss, sentence_loss, z_loss = self.losses(batch, model=self._train_forward)
        # Lightning hands metrics to the logger only every log_every_n_steps, and self.log costs a
        # noticeable part of a small step (`python -m blocklab.bench overhead` times what Lightning
        # adds); so log exactly when it would be written (and always a blown-up loss).
        log = self.trainer._logger_connector.should_update_logs or not torch.isfinite(loss)
        if log:
            self.log("train/loss", loss, prog_bar=True)
        # Terms trained on besides the task loss. train/loss and results' final_train_loss stay the task loss, so
        # runs with and without them compare.
        extra = []
        if sentence_loss is not None:  # BERT: masked-LM loss + next-sentence loss
            if log:
                self.log("train/nsp_loss", sentence_loss)
            extra.append(sentence_loss)
        if self.routed:
            extra.append(self._aux_loss(log))
        if z_loss is not None:
            if log:
                self.log("train/z_loss", z_loss)
            extra.append(z_loss)
        if not extra:
            return loss
        return {"loss": loss + sum(extra), "task_loss": loss.detach()}

    def _aux_loss(self, log: bool):
        """Every MoE layer's weighted balancing loss (Switch eq. 4), logged as train/aux_loss."""
        aux = sum(layer.weighted_aux_loss() for layer in self.routed)
        if log:
            self.log("train/aux_loss", aux)
            for i, layer in enumerate(self.routed):
                load, dropped = load_and_drops(layer.last_routed, layer.last_dropped)
                self.log_dict({f"moe/layer{i}/dropped": dropped,
                               **{f"moe/layer{i}/load_expert{e}": share for e, share in enumerate(load)}})
        return aux

    def record_step(self, outputs, batch) -> None:
        """A finished step's totals and loss curve point. Called by the StepRecord callback, which Lightning runs
        before the checkpoint callback saves: this module's own on_train_batch_end would run after the save, and a
        resume from that checkpoint would lose the step's point and loss."""
        elapsed = time.perf_counter() - self._step_start
        tokens = int(batch["valid"].sum())
        self.tokens_seen += tokens
        self.step_time_s += elapsed
        self._window_tokens += tokens
        self._window_time += elapsed
        self.last_train_loss = float(outputs.get("task_loss", outputs["loss"]))
        if self.target_loss is not None and self.steps_to_target is None and self.last_train_loss < self.target_loss:
            self.steps_to_target = self.global_step
        self._loss_window = [self._loss_window[0] + self.last_train_loss, self._loss_window[1] + 1]
        total = self.trainer.max_steps
        if self.global_step % max(1, total // self.CURVE_POINTS) == 0 or self.global_step == total:
            self.train_loss_curve.append([self.global_step, self._loss_window[0] / self._loss_window[1]])
            self._loss_window = [0.0, 0]
        if (self.global_step % self.trainer.log_every_n_steps) == 0 and self._window_time > 0:
            self.log("train/tokens_per_s", self._window_tokens / self._window_time)
            self._window_tokens, self._window_time = 0, 0.0

    def on_before_optimizer_step(self, optimizer):
        if self.global_step % self.trainer.log_every_n_steps == 0:
            norms = grad_norm(self.model, norm_type=2)
            self.log("train/grad_norm", norms["grad_2.0_norm_total"])

    def validation_step(self, batch, batch_idx):
        per_token = self.batch_loss(batch, reduction="none")
        n_tokens = (batch["target"] != IGNORE).sum()
        metric = self.val_loss if batch["length"] in self.in_distribution else self.val_loss_beyond
        metric.update(per_token.sum() / n_tokens, weight=n_tokens)

    def on_validation_epoch_end(self):
        if self.val_loss.update_called:
            loss = self.val_loss.compute()
            self.log("val/loss", loss, prog_bar=True, sync_dist=True)
            if not self.trainer.sanity_checking and self.global_step not in {s for s, _ in self.val_loss_curve}:
                self.val_loss_curve.append([self.global_step, float(loss)])
        if self.val_loss_beyond.update_called:
            self.log("val/loss_beyond_train", self.val_loss_beyond.compute(), sync_dist=True)
        self.val_loss.reset()
        self.val_loss_beyond.reset()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            # Lightning refuses to clip for a fused optimizer under any autocast, because with float16's
            # loss scaler the gradients would still be scaled. bfloat16 has no scaler: they clip as in float32.
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        optimizer = build_optimizer(self.model, self.optim)
        # optim.schedule (blocklab/schedule.py): cosine, or wsd; a config saved before the key existed is cosine
        # wrapped in a function: LambdaLR saves (and a resume restores) a callable object's attributes, which would
        # give a wsd branch its trunk's schedule
        factor = schedule(self.optim, self.trainer.max_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor(step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# What Lightning reads from a checkpoint to resume a fit, each with its type: a full save (GracefulInterrupt,
# LastCheckpoint) always has them all. Without `loops` Lightning would restart the step count at 0, silently.
RESUME_KEYS = {"epoch": int, "global_step": int, "pytorch-lightning_version": str, "state_dict": dict, "loops": dict,
               "callbacks": dict, "optimizer_states": list, "lr_schedulers": list}


def restore_error(checkpoint: dict, model_cfg: ModelConfig) -> str | None:
    """Why Lightning could not resume a LitTransformer of `model_cfg` from `checkpoint`, as a phrase, or None. Checked
    before anything is restored: what Lightning reads (RESUME_KEYS), the weights' names and shapes against this
    config's model (built on the meta device: nothing is allocated), AdamW's state against its parameter groups, and
    the module's own running totals. A crafted file could still fail inside Lightning in other ways; resume.py's
    guard makes that one line too."""
    for key, kind in RESUME_KEYS.items():
        if key not in checkpoint:
            return f"it has no {key}"
        if not isinstance(checkpoint[key], kind):
            return f"its {key} is a {type(checkpoint[key]).__name__}, not a {kind.__name__}"
    if not isinstance(checkpoint["loops"].get("fit_loop"), dict):
        return "its loops hold no fit_loop"
    with torch.device("meta"):
        model = build_model(model_cfg)
    return (_weights_error(checkpoint["state_dict"], model) or _optimizer_error(checkpoint["optimizer_states"], model)
            or _schedule_error(checkpoint["lr_schedulers"]) or _totals_error(checkpoint.get("blocklab", {})))


def _weights_error(state_dict: dict, model: torch.nn.Module) -> str | None:
    expected = {f"model.{name}": tuple(value.shape) for name, value in model.state_dict().items()}
    for name, shape in expected.items():
        value = state_dict.get(name)
        if value is None:
            return f"it has no weight {name}"
        if not isinstance(value, torch.Tensor):
            return f"its weight {name} is a {type(value).__name__}, not a tensor"
        if tuple(value.shape) != shape:
            return f"its weight {name} has shape {tuple(value.shape)}, this config's model {shape}"
    extra = sorted(str(name) for name in state_dict if name not in expected)
    if extra:
        shown = ", ".join(extra[:3]) + (", ..." if len(extra) > 3 else "")
        return f"it holds weights this config's model does not have ({shown})"
    return None


def _optimizer_error(states: list, model: torch.nn.Module) -> str | None:
    """The optimizer's saved state (torch's Optimizer.state_dict: parameters numbered in group order; Muon's a part
    per inner optimizer) against this model's groups: torch checks the group sizes when it loads, but moment tensors
    of another shape only fail at a step."""
    if len(states) != 1 or not isinstance(states[0], dict):
        return "its optimizer_states is not the state of one optimizer"
    for name, saved, params, moments in saved_state_parts(model, states[0]):
        groups, state = saved.get("param_groups") if isinstance(saved, dict) else None, \
            saved.get("state") if isinstance(saved, dict) else None
        if not isinstance(groups, list) or not isinstance(state, dict) or len(groups) != len(params) \
                or any(not isinstance(group, dict) or not isinstance(group.get("params"), list) for group in groups):
            return f"its optimizer state is not {name} (param_groups and state)"
        ids = [i for group in groups for i in group["params"]]
        if [len(group["params"]) for group in groups] != [len(group) for group in params] \
                or not all(isinstance(i, int) for i in ids) or len(set(ids)) != len(ids):
            return f"its optimizer state ({name}) is for other parameters than this config's model has"
        shapes = dict(zip(ids, (tuple(p.shape) for group in params for p in group)))
        for i, saved_moments in state.items():
            if i not in shapes or not isinstance(saved_moments, dict) \
                    or any(not isinstance(saved_moments.get(key), torch.Tensor) for key in moments) \
                    or any(tuple(saved_moments[key].shape) != shapes[i] for key in moments if key != "step"):
                return f"its optimizer state ({name}) for parameter {i} does not fit this config's model"
    return None


def _schedule_error(schedules: list) -> str | None:
    if len(schedules) != 1 or not isinstance(schedules[0], dict) \
            or not isinstance(schedules[0].get("last_epoch"), int) or "lr_lambdas" not in schedules[0]:
        return "its lr_schedulers is not the state of one learning-rate schedule"
    return None


def _totals_error(totals) -> str | None:
    if not isinstance(totals, dict):
        return f"its blocklab totals are a {type(totals).__name__}, not a dict"
    for name, value in totals.items():
        if name not in TOTAL_TYPES or not isinstance(value, TOTAL_TYPES[name]):
            return f"its blocklab totals hold {str(name)[:40]!r} as a {type(value).__name__}"
    return None
