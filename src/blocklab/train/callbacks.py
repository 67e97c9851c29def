import math
import signal
import sys
from pathlib import Path

from lightning.pytorch.callbacks import Callback, RichProgressBar

from blocklab.results import console_kwargs


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


SHORT_METRIC_NAMES = {"train/loss": "loss", "val/loss": "val"}


class StepProgressBar(RichProgressBar):
    """Rich progress over optimizer steps (the training stream is endless, so epochs mean nothing).
    Redrawn 4 times a second: Lightning's default of 100 renders after nearly every small step,
    in a thread that holds the GIL, a noticeable part of a baby-GPT step (`python -m blocklab.bench overhead`
    times what Lightning adds)."""

    def __init__(self, refresh_rate: int = 4, **kwargs):
        kwargs["console_kwargs"] = {**console_kwargs(), **kwargs.get("console_kwargs", {})}
        super().__init__(refresh_rate=refresh_rate, **kwargs)

    def _get_train_description(self, current_epoch: int) -> str:
        return "train"

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        # Short names keep the bar on one 80-column line (a log file wraps a longer one).
        return {SHORT_METRIC_NAMES.get(name, name): value for name, value in metrics.items()}


class GracefulInterrupt(Callback):
    """Ctrl-C or SIGTERM: finish the current step, save the checkpoint, and stop (Lightning raises
    SIGTERMException at the step boundary). A second Ctrl-C interrupts at once."""

    def __init__(self, checkpoint: Path):
        self.checkpoint = checkpoint

    def on_train_start(self, trainer, pl_module):
        def first_interrupt(signum, frame):
            trainer._signal_connector.received_sigterm = True  # the flag Lightning checks after each step
            signal.signal(signal.SIGINT, signal.default_int_handler)

        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, first_interrupt)

    def on_train_end(self, trainer, pl_module):
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def on_exception(self, trainer, pl_module, exception):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if trainer.global_step > 0:
            trainer.save_checkpoint(self.checkpoint)
            print(f"saved {self.checkpoint} at step {trainer.global_step}", file=sys.stderr)
