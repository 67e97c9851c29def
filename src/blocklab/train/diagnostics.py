"""Diagnostics during training: measurements on a fixed probe batch at init (or at the resumed step when first
enabled at a resume), every K steps and at the end, logged to the experiment logger and written to the run
directory. They run in eval mode without touching the random state or leaving gradients behind, so the training
is unchanged."""
from pathlib import Path
from typing import Callable

import torch

from lightning.pytorch.callbacks import Callback

from blocklab import folder
from blocklab.results import json_safe
from blocklab.analysis.plots import attention_heatmaps
from blocklab.analysis.probe import forward_stats, logit_growth, probe_gradients, sublayer_gradient_norms, summarize


# Heads per layer whose weights a measurement keeps as numbers (the heatmap PNG shows every head): enough for a page
# to show the pattern (report: attention_maps), few enough that 32 heads do not swell results.json.
MAX_HEADS_KEPT = 4


def write_measurement(stats: dict, out_dir: Path, tag: str, maps: bool) -> dict:
    """Save heatmaps (if asked) and return the JSON-ready measurement; with the heatmaps, the first probe
    example's weights as numbers too (layers x heads x queries x keys, 3 decimals, the first MAX_HEADS_KEPT heads)."""
    weights = stats.pop("weights", None)
    if maps and weights is not None:
        folder.make_dirs(out_dir.parent, out_dir.name)  # checked: no link in the run folder's diagnostics/
        stats["attention_maps"] = [str(p.relative_to(out_dir.parent)) for p in attention_heatmaps(weights, out_dir, tag)]
        stats["attention_weights"] = [w[:MAX_HEADS_KEPT].double().round(decimals=3).tolist() for w in weights]
    return stats


class Diagnostics(Callback):
    def __init__(self, probe: dict, out_dir: Path, every_n_steps: int, sparsity_eps: float, attention_maps: str):
        self.probe, self.out_dir = probe, Path(out_dir)
        self.every_n_steps, self.sparsity_eps, self.attention_maps = every_n_steps, sparsity_eps, attention_maps
        self.history: list[dict] = []
        # results.json diagnostics.logit_curve: probe.logit_growth at init and at every validation, against step
        self.logit_curve: list[dict] = []
        self._grads_at_step: list[dict] | None = None

    def _measure(self, trainer, model, tag: str, step: int, gradients: Callable[[], list[dict]], maps: bool) -> None:
        """Measure, or record why not: a diverged model has nothing finite to measure, and no measurement
        may end the run (the divergence guard records the divergence itself)."""
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            self._skip(trainer, tag, step, "the weights are not finite (the run diverged)")
            return
        try:
            stats = forward_stats(model, self.probe, self.sparsity_eps, keep_weights=maps)
            stats["gradients"] = gradients()
        except (RuntimeError, ValueError) as err:  # e.g. an SVD of activations that overflowed
            self._skip(trainer, tag, step, f"{type(err).__name__}: {str(err).splitlines()[0]}")
            return
        maps = maps and trainer.is_global_zero  # one writer of files under DDP
        stats = write_measurement(stats, self.out_dir, tag, maps)
        self.history.append({"tag": tag, "step": step, **stats})
        for logger in trainer.loggers:
            logger.log_metrics(summarize(stats), step=step)
            if maps and hasattr(logger, "log_image"):
                logger.log_image(key=f"diag/attention_{tag}", images=[str(self.out_dir.parent / p)
                                                                      for p in stats["attention_maps"]], step=step)
        self._save(trainer)

    def _skip(self, trainer, tag: str, step: int, reason: str) -> None:
        self.history.append({"tag": tag, "step": step, "layers": None, "skipped": reason})
        self._save(trainer)

    def _save(self, trainer) -> None:
        if trainer.is_global_zero:
            # an overflowing model (48 layers, no norm) measures inf: null, not a crash that loses the run
            folder.write_json(self.out_dir.parent, Path(self.out_dir.name) / "history.json", json_safe(self.history),
                              indent=None)

    def _logit_point(self, model, step: int) -> None:
        """The logit-growth point at `step`, once; none for weights already non-finite (the run diverged) or a
        measurement that fails (it may not end the run)."""
        if any(p["step"] == step for p in self.logit_curve) or \
                not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            return
        try:
            self.logit_curve.append({"step": step, **logit_growth(model, self.probe)})
        except (RuntimeError, ValueError):
            return

    def state_dict(self) -> dict:
        return {"history": self.history, "logit_curve": self.logit_curve}  # a resumed run keeps its measurements

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = state_dict["history"]
        self.logit_curve = state_dict.get("logit_curve", [])  # a checkpoint from before the curve existed

    def on_train_start(self, trainer, pl_module):
        # Not on_fit_start: a resume restores global_step only after it.
        if self.history:  # resumed: the start was measured before the interruption
            return
        model, step = pl_module.model, trainer.global_step
        # Diagnostics first enabled at a resume measure the model where it is, not as if at init.
        self._measure(trainer, model, "init" if step == 0 else "resume", step,
                      lambda: probe_gradients(model, self.probe), self.attention_maps != "none")
        self._logit_point(model, step)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._logit_point(pl_module.model, trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0:
            self._grads_at_step = sublayer_gradient_norms(pl_module.model)  # the real training gradients

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._grads_at_step is not None:
            step = trainer.global_step - 1  # the step whose gradients were recorded
            grads = self._grads_at_step
            self._measure(trainer, pl_module.model, f"step{step}", step, lambda: grads, self.attention_maps == "all")
            self._grads_at_step = None

    def on_fit_end(self, trainer, pl_module):
        model = pl_module.model
        self._measure(trainer, model, "end", trainer.global_step, lambda: probe_gradients(model, self.probe),
                      self.attention_maps != "none")

    def summary(self) -> dict:
        """For results.json: the first and last measurement, and where the rest is."""
        if not self.history:
            return {}
        first = self.history[0]  # not the init when diagnostics were first enabled at a resume
        return {**({"init": first} if first["tag"] == "init" else {}), "end": self.history[-1],
                "every_n_steps": self.every_n_steps, "history": str(Path(self.out_dir.name) / "history.json"),
                **({"logit_curve": self.logit_curve} if self.logit_curve else {})}
