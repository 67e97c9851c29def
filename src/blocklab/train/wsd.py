"""Warmup-stable-decay trunks and their cooldown branches (optim.schedule=wsd; the schedule is blocklab/schedule.py).

A trunk (optim.branch_points: fractions of its steps) keeps, besides checkpoints/last.ckpt, a full checkpoint at each
branch point: checkpoints/step-S.ckpt, written as last.ckpt is (through the folder module, atomically), with the
weights, AdamW's moments, the loops' step, the random states and the run's totals. A branch (optim.branch_from=TRUNK,
optim.branch_step=S) is a new run in its own folder that starts from that file as a resume would, so its first step
is the step the trunk took after S with the trunk's exact state, and decays from S to its trainer.max_steps. An
interrupted branch then resumes from its own checkpoint like any run. The trunk's folder is only read."""
from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from blocklab import folder
from blocklab.checkpoint import load_checkpoint
from blocklab.errors import ConfigError
from blocklab.experiment import Setup
from blocklab.ladder import TRUNK_FROM, trunk_folder
from blocklab.model.size import model_size
from blocklab.results import CHECKPOINT, flatten
from blocklab.schedule import branch_steps
from blocklab.train.resume import config_differences, saved_config

# What a branch may set otherwise than its trunk: its budget, and the keys that make it a branch.
BRANCH_KEYS = ("trainer.max_steps", "trainer.val_check_interval", "optim.cooldown", "optim.cooldown_shape",
               "optim.branch_points", "optim.branch_from", "optim.branch_step")


def branch_file(step: int) -> Path:
    """A trunk's kept checkpoint at `step`, inside its run folder."""
    return CHECKPOINT.parent / f"step-{step}.ckpt"


class BranchPoints(Callback):
    """A wsd trunk's full checkpoint at each of its branch points (the fractions of trainer.max_steps)."""

    def __init__(self, run_dir: Path, fractions: list[float], total: int):
        self.run_dir, self.steps = run_dir, set(branch_steps(fractions, total))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step in self.steps and not folder.exists(self.run_dir, branch_file(step)):
            trainer.save_checkpoint(self.run_dir / branch_file(step))


def branch_points(run_dir: Path, config: dict) -> list[Callback]:
    """The trunk's BranchPoints callback, or none for any other run."""
    optim = config["optim"]
    if not optim.get("branch_points") or optim.get("branch_from") is not None:
        return []
    return [BranchPoints(run_dir, optim["branch_points"], config["trainer"]["max_steps"])]


@dataclass(frozen=True)
class Branch:
    path: Path  # the trunk's checkpoint the branch starts from
    step: int


def branch_start(setup: Setup) -> Branch | None:
    """Where a wsd branch starts (None for any other run): its trunk's kept checkpoint at optim.branch_step, checked
    before anything is written: there, at that step, from a trunk trained with this config but for BRANCH_KEYS,
    and restorable into this config's model."""
    from blocklab.train.module import restore_error  # Lightning's import

    optim = setup.config["optim"]
    source, step = optim.get("branch_from"), optim.get("branch_step")
    if source is None:
        return None
    trunk = trunk_of(setup.run_dir, setup.config)
    where = f"optim.branch_from={source}"
    if trunk.resolve() == setup.run_dir.resolve():
        raise ConfigError(f"{where} is this run's own folder; a branch writes a new run: choose another hydra.run.dir")
    if not trunk.is_dir() or not folder.exists(trunk, branch_file(step)):
        raise ConfigError(f"{where} has no kept checkpoint at step {step} ({trunk / branch_file(step)}); train the "
                          "trunk with optim.schedule=wsd and optim.branch_points that give this step, or branch from "
                          "one of its kept steps")
    state = load_checkpoint(trunk, branch_file(step), model_size(setup.model_cfg).parameters,
                            "train the trunk again, or branch from another of its steps")
    if state["global_step"] != step:
        raise ConfigError(f"{trunk / branch_file(step)} stands at step {state['global_step']}, not {step}; it is not "
                          "the trunk's checkpoint of that step")
    trunk_config = saved_config(trunk, state)
    mine = flatten(setup.config)
    theirs = flatten(trunk_config)
    aligned = {key: theirs.get(key) for key in BRANCH_KEYS}
    diffs = config_differences(trunk_config, _nested({**mine, **aligned}))
    if diffs:
        raise ConfigError(f"{where} was trained with another config than this branch ({'; '.join(diffs)}); a branch "
                          f"differs from its trunk only in {', '.join(BRANCH_KEYS)}")
    if error := restore_error(state, setup.model_cfg):
        raise ConfigError(f"{trunk / branch_file(step)} cannot start a branch: {error}")
    return Branch(trunk / branch_file(step), step)


def trunk_of(run_dir: Path, config: dict) -> Path:
    """A branch's trunk folder: optim.branch_from, or for a token ladder's branch (rung:trunk) the trunk beside it
    in its sweep folder (blocklab/ladder.py)."""
    source = config["optim"]["branch_from"]
    if source != TRUNK_FROM:
        return Path(source)
    try:
        return trunk_folder(run_dir, str((config.get("study") or {}).get("rung")))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def missing_trunks_error(sweep: Path, names: list[str], configs: list[dict]) -> str | None:
    """A launch's branches whose trunk (beside them in the sweep folder) has not kept their step yet, as one line:
    the trunks run first, in a launch of their own (blocklab/ladder.py)."""
    kept = [(trunk_of(sweep / name, config), branch_file(config["optim"]["branch_step"]))
            for name, config in zip(names, configs) if config["optim"].get("branch_from") == TRUNK_FROM]
    missing = [trunk / file for trunk, file in kept if not folder.exists(trunk, file)]
    if not missing:
        return None
    study = configs[0]["study"]
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return (f"{len(missing)} branches' trunks have not kept their checkpoints yet ({missing[0]}{more}): run the trunks "
            f"first, python train.py -m sweep={study['name']} study.rung=trunk (with this launch's other overrides), "
            "then this launch again")


def _nested(flat: dict) -> dict:
    """A nested config from dotted keys."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out
