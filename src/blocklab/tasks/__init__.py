"""Tasks by name. Every task offers: name, vocab_size, max_seq_len, eval_lengths, train_lengths,
in_distribution(length), tokenizer(), train_batches(), validation_batches(), evaluate(model).
`build_task` validates the task config first and raises ConfigError."""
from blocklab.errors import ConfigError
from blocklab.tasks.addition import AdditionTask
from blocklab.tasks.copy import CopyTask
from blocklab.tasks.lm import LMTask

TASKS = {"copy": CopyTask, "addition": AdditionTask, "lm": LMTask}


def task_errors(cfg: dict) -> list[str]:
    cls = TASKS.get(cfg.get("name"))
    if cls is None:
        return [f"task.name={cfg.get('name')!r} is unknown; use one of {list(TASKS)}"]
    return cls.errors(cfg)


def build_task(cfg: dict, seed: int):
    errors = task_errors(cfg)
    if errors:
        raise ConfigError("\n".join(errors))
    return TASKS[cfg["name"]](seed=seed, **{k: v for k, v in cfg.items() if k != "name"})
