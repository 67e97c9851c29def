import math
import signal
import sys
from pathlib import Path

from lightning.pytorch.callbacks import Callback, ModelCheckpoint, RichProgressBar

from blocklab.checkpoint import CHECKPOINT_CONFIG_KEY, CHECKPOINT_FILES_KEY, file_digests
from blocklab.results import console_kwargs
from blocklab.train.checkpoint_io import DiskFull
from blocklab.train.job import beside_other_jobs


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


class StepRecord(Callback):
    """Records each step's totals and loss curve point (LitTransformer.record_step). Lightning runs checkpoint
    callbacks after every other callback and before the module's own hook, so the point is in the checkpoint
    saved at its step: a resume, or a re-evaluation from the final checkpoint, loses none."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.record_step(outputs, batch)


class RunRecord(Callback):
    """Puts the run's resolved config in each checkpoint, as plain containers the weights-only loader reads, so a
    resume can be checked where .hydra/config.yaml is lost; and the SHA-256 of the files that rebuild the model,
    so generate and analyze refuse one that a flipped bit left readable."""

    def __init__(self, run_dir: Path, config: dict, files: list):
        self.run_dir, self.config, self.files = run_dir, config, files

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint[CHECKPOINT_CONFIG_KEY] = self.config
        checkpoint[CHECKPOINT_FILES_KEY] = file_digests(self.run_dir, self.files)


SHORT_METRIC_NAMES = {"train/loss": "loss", "val/loss": "val"}


class StepProgressBar(RichProgressBar):
    """Rich progress over optimizer steps (the training stream is endless, so epochs mean nothing).
    Redrawn 4 times a second: Lightning's default of 100 renders after nearly every small step,
    in a thread that holds the GIL, a noticeable part of a baby-GPT step (`python -m blocklab.bench overhead`
    times what Lightning adds)."""

    def __init__(self, refresh_rate: int = 4, **kwargs):
        # Jobs side by side share the terminal: a live bar each would overwrite the others' lines, so each
        # prints its bar once, when done.
        side_by_side = {"force_terminal": False, "width": 120} if beside_other_jobs() else {}
        kwargs["console_kwargs"] = {**console_kwargs(), **side_by_side, **kwargs.get("console_kwargs", {})}
        super().__init__(refresh_rate=refresh_rate, **kwargs)

    def _get_train_description(self, current_epoch: int) -> str:
        return "train"

    @property
    def total_train_batches(self) -> int | float:
        # The whole run's steps: a resumed run's bar counts on from its step (Lightning's total is what is left).
        return self.trainer.max_steps if self.trainer.max_steps > 0 else super().total_train_batches

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        # Short names keep the bar on one 80-column line (a log file wraps a longer one).
        return {SHORT_METRIC_NAMES.get(name, name): value for name, value in metrics.items()}


class LastCheckpoint(ModelCheckpoint):
    """checkpoints/last.ckpt every `every` steps and at the end, always that file (no version counter: a resume
    whose callback did not know the file would write last-v1.ckpt beside it). One fixed file and no top-k leave
    it no state worth restoring, so it saves none: Lightning keys a callback's saved state by its settings
    (checkpoint_every among them) and checks the folder named in it, so a resume with another checkpoint_every,
    or from a moved run directory, would warn."""

    def __init__(self, dirpath: Path, every: int):
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0, every_n_train_steps=every,
                         enable_version_counter=False)

    def state_dict(self) -> dict:
        return {}  # Lightning saves no empty state, so there is none to load either

    def on_train_end(self, trainer, pl_module):
        # Lightning saves at the end only when the fit saved nothing before; here the end is always kept
        # (generate and analyze read the trained model from this file).
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class GracefulInterrupt(Callback):
    """Ctrl-C or SIGTERM: finish the current step, save the checkpoint, and stop (Lightning raises
    SIGTERMException at the step boundary). A second Ctrl-C interrupts at once.

    Any other failure saves too, but only once this process has trained a step: before that the checkpoint on disk
    is all there is. A resume whose restore fails (a checkpoint Lightning cannot load) has weights, optimizer or
    step counts half restored, and saving them would overwrite the file that could not be read with a fresh
    optimizer at its step, which the same command would then resume from without a word."""

    def __init__(self, checkpoint: Path):
        self.checkpoint = checkpoint
        self.trained = False  # whether this process finished a training step (after any restore)

    def setup(self, trainer, pl_module, stage):
        self.trained = False  # before Lightning restores a checkpoint

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.trained = True

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
        if self.trained and not isinstance(exception, DiskFull):  # a full disk takes no second try
            trainer.save_checkpoint(self.checkpoint, weights_only=False)  # explicit: Lightning logs its default
            print(f"saved {self.checkpoint} at step {trainer.global_step}", file=sys.stderr)
