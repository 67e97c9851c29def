"""Tasks by name (the Task interface in tasks/interface.py). `build_task` validates the task
config first and raises ConfigError."""
from blocklab.errors import ConfigError
from blocklab.tasks.interface import MAX_SEQ_LEN, TASKS, Task
from blocklab.tasks.placement import Placement
# Importing a task module registers it; this order is the order error messages list them in.
from blocklab.tasks.copy import CopyTask
from blocklab.tasks.addition import AdditionTask
from blocklab.tasks.lm import LMTask
from blocklab.tasks.periodic import PeriodicTask
from blocklab.tasks.keyed import KeyedTask
from blocklab.tasks.mlm import MLMTask
from blocklab.tasks.brackets import BracketsTask
from blocklab.tasks.count import CountTask
from blocklab.tasks.maximum import MaxTask
from blocklab.tasks.mqar import MQARTask

__all__ = ["TASKS", "Task", "CopyTask", "AdditionTask", "LMTask", "PeriodicTask", "KeyedTask", "MLMTask",
           "BracketsTask", "CountTask", "MaxTask", "MQARTask", "build_task", "task_errors"]


def task_errors(cfg: dict, seq2seq: bool = False, placement: Placement = Placement(),
                encoder_only: bool | None = None) -> list[str]:
    """seq2seq: the model is an encoder-decoder, so the task must split into a source and a target.
    placement: the pos group's shared settings, which only some tasks can honour.
    encoder_only: the model is a bidirectional encoder (model.arch=encoder), which only a masked task can train
    (None: the model is not known here, as when a finished run's task is rebuilt)."""
    name = cfg.get("name")
    if name not in TASKS:
        return [TASKS.unknown(name)]
    if encoder_only is not None and encoder_only != TASKS[name].masked:
        masked = [n for n in TASKS if TASKS[n].masked]
        return [f"task={name} predicts masked tokens from both sides, which needs a bidirectional encoder-only "
                f"model: use model.arch=encoder" if TASKS[name].masked else
                f"model.arch=encoder is bidirectional, so every position sees the token task={name} asks it to "
                f"predict next; use a masked task ({', '.join(masked)}) or model.arch=decoder"]
    if placement != Placement() and not TASKS[name].places_tokens:
        placing = [n for n in TASKS if TASKS[n].places_tokens]
        return [f"pos.randomize, pos.coupled and pos.abacus need a task that builds its own examples "
                f"({', '.join(placing)}), not task={name}; leave them at their defaults"]
    if seq2seq and not TASKS[name].supports_seq2seq:
        seq2seq_names = [n for n in TASKS if TASKS[n].supports_seq2seq]
        return [f"model.arch=encoder_decoder needs a source/target task ({', '.join(seq2seq_names)}), "
                f"not task={name}; use model.arch=decoder"]
    unknown = TASKS.option_errors(name, {k: v for k, v in cfg.items() if k != "name"}, "task")
    return unknown or TASKS[name].errors(cfg)


def build_task(cfg: dict, seed: int, seq2seq: bool = False, placement: Placement = Placement()) -> Task:
    errors = task_errors(cfg, seq2seq, placement)
    if errors:
        raise ConfigError("\n".join(errors))
    options = {k: v for k, v in cfg.items() if k != "name"}
    if seq2seq:
        options["seq2seq"] = True
    if placement != Placement():
        options["placement"] = placement
    task = TASKS[cfg["name"]](seed=seed, **options)
    if task.max_seq_len > MAX_SEQ_LEN:  # before any example is built: that alone would take minutes
        raise ConfigError(f"task={cfg['name']} would build sequences of {task.max_seq_len} tokens ({task.length_keys}), "
                          f"past the {MAX_SEQ_LEN} BlockLab builds (tasks.interface.MAX_SEQ_LEN: longer ones take "
                          f"minutes to build and gigabytes of attention scores); ask for shorter ones")
    errors = task.placement_errors() if task.places_tokens else []
    if errors:
        raise ConfigError("\n".join(errors))
    return task
