"""study.pack_seeds=true: a sweep's jobs that differ only in their seed train together as one pack
(train/pack.py). The first job of such a group to run trains every seed of the group that is not finished, into
the directories Hydra gives those jobs (the job's override_dirname with its seed changed, named by Hydra's own
function). With the jobs one after another (hydra.launcher.n_jobs=1) the group's later jobs find their results
and are skipped as any finished job is. Side by side (joblib's workers, the default) the jobs agree through
locks which one trains which seed (train/pack_claims.py): a job whose seed a pack beside it trains returns at
once, and its worker goes on to the next job, so the packs of different settings train side by side.

Not packed, each seed then running as its own job, as without the option (one note line says why): DDP or
several devices, a precision other than 32-true and bf16-mixed, trainer.compile, next-sentence prediction, a
launcher other than the basic one and joblib (submitit), a seed group's members resuming from different steps,
and models whose members would not compute alone what they compute packed (train/grouped.py checks every pack on
its first batches: e.g. BatchNorm's statistics over the batch, MoE's routing, performer's and linformer's
parameters used outside linear, embedding and norm layers)."""
import copy
import os
import sys
from pathlib import Path
from typing import Callable

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from blocklab.errors import ConfigError
from blocklab.overrides import command_line_overrides, job_dirname
from blocklab.results import previous_status, read_results, swept_overrides
from blocklab.train.pack_claims import Claims, Seed, group_lock, wait_for_turn
from blocklab.train.sweep import (FINAL_STATUSES, current_launcher, in_sweep, joblib_side_by_side, one_job_at_a_time,
                                  record_failure, sweep_tags_and_group)


def packed_or_alone(alone: Callable[[DictConfig], float | None]) -> Callable[[DictConfig], float | None]:
    """A sweep job's training: with study.pack_seeds, its seed group as one pack; otherwise `alone(cfg)`."""

    def train(cfg: DictConfig) -> float | None:
        if not (in_sweep() and (cfg.get("study") or {}).get("pack_seeds")):
            return alone(cfg)
        if not joblib_side_by_side(current_launcher()):
            return pack_group(cfg, alone, None)
        return pack_beside_other_jobs(cfg, alone)

    return train


def pack_beside_other_jobs(cfg: DictConfig, alone: Callable[[DictConfig], float | None]) -> float | None:
    """pack_group among jobs side by side: wait for the group's lock or for a pack beside to claim this seed."""
    run_dir = Path(cfg.run_dir)
    setting = " ".join(setting_of(HydraConfig.get().overrides.task))
    mine, group = Seed(run_dir), group_lock(run_dir, setting)
    if by := wait_for_turn(mine, group):
        print(f"packed: {run_dir.name} trains in the pack beside ({by})")
        return None
    claims = Claims(mine, group)
    try:
        if not mine.take():  # claimed by the pack whose group lock this job just missed
            print(f"packed: {run_dir.name} trains in the pack beside")
            return None
        if (status := previous_status(run_dir)) in FINAL_STATUSES:  # a pack beside finished it meanwhile
            print(f"skip {run_dir}: already {status}")
            return read_results(run_dir).get("final_val_loss")
        return pack_group(cfg, alone, claims)
    finally:
        claims.release()


def pack_group(cfg: DictConfig, alone: Callable[[DictConfig], float | None], claims: Claims | None) -> float | None:
    """Train this job's seed group as one pack (the seeds `claims` can take, when jobs run side by side); or,
    where it cannot pack, this job's seed alone."""
    members = seed_group(cfg, claims)
    if isinstance(members, str):
        print(f"note: study.pack_seeds: {members}; this seed runs as its own job", file=sys.stderr)
    pack = None
    if not isinstance(members, str) and len(members) > 1:
        from blocklab.train.pack import pack_of  # torch-heavy; only where a pack is asked for

        cfgs, overrides = zip(*members)
        group = sweep_tags_and_group(OmegaConf.to_container(cfg, resolve=True))
        groupings = [{**group, "tags": [t[:64] for t in swept_overrides(o)]} if group else {} for o in overrides]
        pack = pack_of(list(cfgs), list(overrides), groupings, settings_in_sweep() if claims else None)
        if isinstance(pack, str):
            print(f"note: study.pack_seeds: this model cannot be packed ({pack}); its seeds run as separate jobs",
                  file=sys.stderr)
            pack = None
    if pack is None:  # no pack: this seed alone (the group's other seeds finished, resume elsewhere, or cannot pack)
        if claims:
            claims.alone()
        return alone(cfg)
    if claims:
        claims.formed(f"seeds {','.join(str(c.seed) for c in cfgs)}, process {os.getpid()}")
    try:
        results = pack.run()
    except Exception as err:  # this job's failure is recorded by run_as_sweep_job; the others' jobs have returned
        for member, job in zip(cfgs, overrides):
            if claims and Path(member.run_dir) != Path(cfg.run_dir) and \
                    previous_status(Path(member.run_dir)) not in FINAL_STATUSES:
                record_failure(Path(member.run_dir), err, member.task.name, job, "in the pack of its seed group: ")
        raise
    if results is None:  # interrupted beside other jobs: every member's checkpoint is saved
        return None
    mine = next(r for c, r in zip(cfgs, results) if Path(c.run_dir) == Path(cfg.run_dir))
    return mine["final_val_loss"]


PACKABLE_PRECISIONS = ("32-true", "32", "bf16-mixed")


def refusal(groups: dict, launcher: dict) -> str | None:
    """Why a job's config (and Hydra's launcher) trains its seeds one after another even with study.pack_seeds
    (None: it can pack)."""
    trainer = groups["trainer"]
    if trainer.get("strategy") not in (None, "auto") or trainer.get("devices", 1) not in (1, "auto") \
            or trainer.get("num_nodes", 1) != 1:
        return "a pack trains in one process on one device (DDP and several devices are not packed)"
    if str(trainer.get("precision", "32-true")) not in PACKABLE_PRECISIONS:
        return (f"a pack trains in float32 or under bfloat16 autocast, not trainer.precision={trainer['precision']} "
                "(32-true or bf16-mixed)")
    if trainer.get("compile"):
        return "a pack is not compiled (trainer.compile=true)"
    if (groups.get("task") or {}).get("nsp"):
        return "a pack trains the token loss alone, not next-sentence prediction (task.nsp=true)"
    if not (one_job_at_a_time(launcher) or joblib_side_by_side(launcher)):
        return f"packs train under Hydra's basic or joblib launcher, not {launcher.get('_target_')}"
    return None


def sweep_jobs_now() -> list[list[str]]:
    """Every job's overrides, as Hydra's basic sweeper made them for this launch (blocklab.overrides.sweep_jobs,
    from inside a running job: the sweep file's hydra.sweeper.params, then the command line)."""
    params = HydraConfig.get().sweeper.get("params") or {}
    lines = [f"{key}={value}" for key, value in params.items()] + command_line_overrides(sys.argv[1:])
    parsed = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader()).parse_overrides(lines)
    parsed = [o for o in parsed if not o.is_hydra_override()]  # hydra.sweep.dir=...: Hydra's, not a job's
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, max_batch_size=None) for job in batch]


def settings_in_sweep() -> int:
    """How many settings (jobs but their seed) this launch has: with packs side by side, the jobs that train."""
    return len({setting_of(job) for job in sweep_jobs_now()})


def _key(line: str) -> str:
    return line.partition("=")[0]


def setting_of(job) -> tuple[str, ...]:
    """A job's overrides but its seed, in order: what the jobs of one seed group share."""
    return tuple(sorted(o for o in job if _key(o) != "seed"))


def seed_group(cfg: DictConfig, claims: Claims | None = None) -> list[tuple[DictConfig, list[str]]] | str:
    """The jobs of this sweep that differ from this one only in their seed, unfinished and resuming from this
    job's step, as (config, overrides), in the sweep's order; or why this job trains alone. With `claims` (jobs
    side by side), only the seeds it can take, and those taken but left out are given back."""
    from blocklab.train.pack import prepared

    groups = OmegaConf.to_container(cfg, resolve=True)
    reason = refusal(groups, current_launcher())
    if reason:
        return reason
    mine = list(HydraConfig.get().overrides.task)
    if not any(_key(o) == "seed" for o in mine):
        return "the sweep does not vary seed"
    jobs = [job for job in sweep_jobs_now() if setting_of(job) == setting_of(mine)]
    dirname, run_dir = HydraConfig.get().job.override_dirname, str(cfg.run_dir)
    naming = HydraConfig.get().job.config.override_dirname
    if sorted(mine) not in [sorted(job) for job in jobs] or job_dirname(mine, naming) != dirname \
            or not run_dir.endswith(dirname):
        return "its seeds' directories cannot be told from Hydra's naming here (hydra.sweep.subdir changed?)"
    start = prepared(cfg).start_step
    members = []
    for job in jobs:
        member = copy.deepcopy(cfg)
        seed = OverridesParser.create().parse_override(next(o for o in job if _key(o) == "seed")).value()
        member.seed, member.run_dir = seed, run_dir[:len(run_dir) - len(dirname)] + job_dirname(job, naming)
        if Path(member.run_dir) != Path(run_dir):
            if claims and not claims.take(member.run_dir):
                continue  # another job trains it
            if not joins(member, start):
                if claims:
                    claims.give_back(member.run_dir)
                continue
        members.append((member, job))
    return members


def joins(member: DictConfig, start: int | None) -> bool:
    """Whether another seed of the group trains in this job's pack: unfinished, and resuming from its step."""
    from blocklab.train.pack import prepared

    if previous_status(Path(member.run_dir)) in FINAL_STATUSES:
        return False
    try:
        return prepared(member).start_step == start  # else it resumes from another step, on its own turn
    except ConfigError:
        return False  # its own turn records why it cannot run
