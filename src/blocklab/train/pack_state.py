"""A packed member's checkpoint, written in the layout Lightning writes for a run alone (checkpoints/last.ckpt):
the module's weights, AdamW's state, the schedule, the loop counters and BlockLab's totals and random state.
So generate and analyze read it as any run's, a plain run resumes from it (a sweep relaunched without
study.pack_seeds), and a pack resumes from the checkpoints of plain runs."""
import os
from pathlib import Path

import lightning
import torch

from blocklab.results import CHECKPOINT
from blocklab.train.module import lr_factor, rng_states


def _progress(n: int, *counters: str, behind: int = 0) -> dict:
    """Lightning's progress record: `ready`... all at n, `completed` at n - behind."""
    done = {name: n - behind if name == "completed" else n for name in counters}
    return {"total": dict(done), "current": dict(done)}


def loops_state(step: int) -> dict:
    """The fit loop's counters as a checkpoint Lightning saves after training step `step` holds them."""
    batches = _progress(step, "ready", "completed", "started", "processed", behind=1)
    idle = {**_progress(0, "ready", "completed", "started", "processed"), "is_last_batch": False}
    return {
        "fit_loop": {
            "state_dict": {},
            "epoch_loop.state_dict": {"_batches_that_stepped": step - 1},
            "epoch_loop.batch_progress": {**batches, "is_last_batch": False},
            "epoch_loop.scheduler_progress": _progress(step, "ready", "completed"),
            "epoch_loop.automatic_optimization.state_dict": {},
            "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {
                "step": _progress(step, "ready", "completed"),
                "zero_grad": _progress(step, "ready", "completed", "started")}},
            "epoch_loop.manual_optimization.state_dict": {},
            "epoch_loop.manual_optimization.optim_step_progress": _progress(0, "ready", "completed"),
            "epoch_loop.val_loop.state_dict": {},
            "epoch_loop.val_loop.batch_progress": idle,
            "epoch_progress": _progress(1, "ready", "completed", "started", "processed", behind=1),
        },
        "validate_loop": {"state_dict": {}, "batch_progress": idle},
        "test_loop": {"state_dict": {}, "batch_progress": idle},
        "predict_loop": {"state_dict": {}, "batch_progress": {k: v for k, v in idle.items() if k != "is_last_batch"}},
    }


def schedule_state(optimizer: torch.optim.Optimizer, optim: dict, step: int, total: int) -> dict:
    """The LambdaLR state (warmup + cosine, LitTransformer's) after `step` optimizer steps."""
    factor = lambda s: lr_factor(s, optim["warmup_steps"], total, optim["min_lr"] / optim["lr"])  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    state = schedule.state_dict()
    lrs = [base * factor(step) for base in schedule.base_lrs]
    state.update(last_epoch=step, _step_count=step + 1, _last_lr=lrs)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    return state


def member_optimizer_state(optimizer: torch.optim.Optimizer, names: list[str], stacked: dict, k: int) -> dict:
    """Member k's AdamW state_dict from the pack's: `optimizer` is an AdamW over the member's own parameters
    (build_optimizer's groups, the schedule applied), `names` its parameters' names in its order, `stacked`
    the pack's state by name."""
    state = optimizer.state_dict()
    state["state"] = {i: {key: value if key == "step" else value[k].clone() for key, value in stacked[name].items()}
                      for i, name in enumerate(names) if name in stacked}
    return state


def stacked_optimizer_state(states: list[dict], names: list[str]) -> dict:
    """The pack's AdamW state by parameter name, from its members' state_dicts (same steps: one step count)."""
    stacked = {}
    for i, name in enumerate(names):
        per_member = [s["state"].get(i) for s in states]
        if any(p is None for p in per_member):
            continue  # not stepped yet
        stacked[name] = {key: per_member[0][key].clone() if key == "step" else torch.stack([p[key] for p in per_member])
                         for key in per_member[0]}
    return stacked


def write_checkpoint(run_dir: Path, content: dict) -> None:
    """Atomically: an interruption while writing leaves the previous checkpoint."""
    path = Path(run_dir) / CHECKPOINT
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".ckpt.tmp")
    torch.save(content, tmp)
    os.replace(tmp, path)


def checkpoint(lit, step: int, optimizer_state: dict, schedule: dict, callbacks: dict) -> dict:
    """A member's checkpoint: `lit` (LitTransformer) holds its weights and totals."""
    return {"epoch": 0, "global_step": step, "pytorch-lightning_version": lightning.__version__,
            "state_dict": lit.state_dict(), "loops": loops_state(step), "callbacks": callbacks,
            "optimizer_states": [optimizer_state], "lr_schedulers": [schedule],
            "blocklab": {name: getattr(lit, name) for name in lit.TOTALS}, "rng_states": rng_states()}
