"""Learning-rate schedules (`optim.schedule`): the factor of optim.lr at each step, as a registry.

- `cosine` (the default, and what a run saved before the key existed trained with): linear warmup, then cosine
  decay to optim.min_lr at trainer.max_steps (nanoGPT's schedule).
- `wsd`, warmup-stable-decay (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training
  Durations"; code: epfml/schedules-and-scaling; OLMo-core's `WSD` in src/olmo_core/optim/scheduler.py): the same
  warmup, the constant lr, then a cooldown to optim.min_lr over the last optim.cooldown of the steps, `linear` (as
  OLMo-core) or `1-sqrt` (Hägele et al.'s better-performing shape: 1 - sqrt of the cooldown's progress).
  - A trunk (optim.branch_points, fractions of its steps) never decays; it keeps a full checkpoint (weights,
    optimizer state, step, random states) at each of those steps (train/wsd.py).
  - A branch (optim.branch_from: the trunk's run folder, optim.branch_step: one of its kept steps) starts from
    that checkpoint and decays from branch_step to its own trainer.max_steps. One trunk then gives several
    budgets, each for its cooldown's extra steps (WSD-S: Wen et al. 2024; OLMo-core's ladders).

Pure arithmetic: no torch, so the config check imports it before anything heavy.
"""
import math

from blocklab.registry import Registry

SCHEDULES = Registry("optim.schedule")
SHAPES = ("linear", "1-sqrt")
# The optim group's keys the schedule reads, whichever the optimizer (optim.py's shared keys)
SCHEDULE_KEYS = ("schedule", "cooldown", "cooldown_shape", "branch_points", "branch_from", "branch_step")


def warmup_factor(step: int, warmup: int) -> float:
    """Linear warmup to 1 over `warmup` steps (step counted from 0)."""
    return (step + 1) / (warmup + 1)


@SCHEDULES.register("cosine")
class Cosine:
    """Linear warmup to 1, then cosine decay to min_ratio at `total` steps (nanoGPT's schedule)."""

    def __init__(self, optim: dict, total: int):
        self.warmup, self.total = optim["warmup_steps"], total
        self.min_ratio = optim["min_lr"] / optim["lr"]

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return warmup_factor(step, self.warmup)
        if step >= self.total:
            return self.min_ratio
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return self.min_ratio + 0.5 * (1 + math.cos(math.pi * progress)) * (1 - self.min_ratio)

    @staticmethod
    def errors(optim: dict, max_steps: int) -> list[str]:
        keys = [k for k in ("branch_points", "branch_from", "branch_step") if optim.get(k)]
        return [f"optim.{keys[0]} is for optim.schedule=wsd (a trunk and its cooldown branches); set "
                "optim.schedule=wsd or leave it unset"] if keys else []


@SCHEDULES.register("wsd")
class WSD:
    """Warmup, constant, cooldown over [decay_start, total]: the last `cooldown` of the steps; from branch_step in a
    branch; none in a trunk (it has branch_points)."""

    def __init__(self, optim: dict, total: int):
        self.warmup, self.total = optim["warmup_steps"], total
        self.min_ratio = optim["min_lr"] / optim["lr"]
        self.shape = optim.get("cooldown_shape", "linear")
        if optim.get("branch_from") is not None:
            self.decay_start = optim["branch_step"]
        elif optim.get("branch_points"):
            self.decay_start = total  # a trunk: constant to its end; its branches decay
        else:
            self.decay_start = total - round(optim.get("cooldown", 0.2) * total)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return warmup_factor(step, self.warmup)
        if step < self.decay_start:
            return 1.0
        decay = self.total - self.decay_start
        if decay <= 0 or step >= self.total:
            return self.min_ratio if decay > 0 else 1.0
        progress = (step - self.decay_start) / decay
        left = 1 - progress if self.shape == "linear" else 1 - math.sqrt(progress)
        return self.min_ratio + (1 - self.min_ratio) * left

    @staticmethod
    def errors(optim: dict, max_steps: int) -> list[str]:
        # the types and ranges of cooldown, cooldown_shape and branch_points are the schema's (blocklab/schema.py)
        errors, points = [], optim.get("branch_points") or []
        source, step = optim.get("branch_from"), optim.get("branch_step")
        if source is None and step is not None:
            errors.append(f"optim.branch_step={step} needs optim.branch_from, the trunk's run folder whose kept "
                          "checkpoint at that step this branch starts from")
        elif source is not None and step is None:
            errors.append(f"optim.branch_from={source} needs optim.branch_step, the step of the trunk's kept "
                          "checkpoint this branch starts from")
        elif source is not None:
            if points:
                errors.append("a branch (optim.branch_from) cannot be a trunk too (optim.branch_points): set one")
            if isinstance(step, bool) or not isinstance(step, int) or step < 1 or step >= max_steps:
                errors.append(f"optim.branch_step={step!r} must be a step of the trunk below trainer.max_steps="
                              f"{max_steps} (the branch decays from it to max_steps)")
        return errors


def branch_steps(fractions: list[float], total: int) -> list[int]:
    """A trunk's kept steps: each fraction of its `total` steps, rounded, at least 1."""
    return sorted({max(1, round(f * total)) for f in fractions})


def schedule_errors(optim: dict, max_steps: int) -> list[str]:
    """optim.schedule's errors: an unknown name, or its own constraints."""
    name = optim.get("schedule", "cosine")
    if name not in SCHEDULES:
        return [SCHEDULES.unknown(name)]
    return SCHEDULES[name].errors(optim, max_steps)


def schedule(optim: dict, total: int):
    """The step -> factor of optim.lr function of the run's schedule (cosine where the config has no key)."""
    return SCHEDULES[optim.get("schedule", "cosine")](optim, total)
