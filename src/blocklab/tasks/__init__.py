"""Tasks by name. `build_task` validates the task config first and raises ConfigError."""
from blocklab.errors import ConfigError
from blocklab.tasks.addition import AdditionTask
from blocklab.tasks.base import SequenceTask
from blocklab.tasks.copy import CopyTask

TASKS: dict[str, type[SequenceTask]] = {"copy": CopyTask, "addition": AdditionTask}

# Keys of a task config that describe the run, not the task's constructor.
_NOT_CONSTRUCTOR_ARGS = {"name"}


def task_errors(cfg: dict) -> list[str]:
    cls = TASKS.get(cfg.get("name"))
    if cls is None:
        return [f"task.name={cfg.get('name')!r} is unknown; use one of {list(TASKS)}"]
    return cls.errors(cfg)


def build_task(cfg: dict, seed: int) -> SequenceTask:
    errors = task_errors(cfg)
    if errors:
        raise ConfigError("\n".join(errors))
    options = {k: v for k, v in cfg.items() if k not in _NOT_CONSTRUCTOR_ARGS}
    return TASKS[cfg["name"]](seed=seed, **options)
