import math

from lightning.pytorch.callbacks import Callback, RichProgressBar


class DivergenceGuard(Callback):
    """Stops training at the first non-finite loss, or one above `max_loss`, and remembers the step."""

    def __init__(self, max_loss: float | None = None):
        self.max_loss = max_loss
        self.diverged_at_step: int | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = float(outputs["loss"])
        if not math.isfinite(loss) or (self.max_loss is not None and loss > self.max_loss):
            self.diverged_at_step = trainer.global_step
            trainer.should_stop = True


class StepProgressBar(RichProgressBar):
    """Rich progress over optimizer steps (the training stream is endless, so epochs mean nothing)."""

    def _get_train_description(self, current_epoch: int) -> str:
        return "train"

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
