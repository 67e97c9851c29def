"""Tasks by name. Every task offers: name, vocab_size, max_seq_len, eval_lengths, train_lengths,
in_distribution(length), tokenizer(), train_batches(), validation_batches(), evaluate(model).
`build_task` validates the task config first and raises ConfigError."""
from blocklab.errors import ConfigError
from blocklab.tasks.addition import AdditionTask
from blocklab.tasks.copy import CopyTask
from blocklab.tasks.lm import LMTask

TASKS = {"copy": CopyTask, "addition": AdditionTask, "lm": LMTask}


# Tasks whose examples split into a source and a target, so an encoder-decoder can learn them.
SEQ2SEQ_TASKS = ("copy", "addition")


def task_errors(cfg: dict, arch: str = "decoder") -> list[str]:
    cls = TASKS.get(cfg.get("name"))
    if cls is None:
        return [f"task.name={cfg.get('name')!r} is unknown; use one of {list(TASKS)}"]
    if arch == "encoder_decoder" and cfg["name"] not in SEQ2SEQ_TASKS:
        return [f"model.arch=encoder_decoder needs a source/target task ({', '.join(SEQ2SEQ_TASKS)}), "
                f"not task={cfg['name']}; use model.arch=decoder"]
    return cls.errors(cfg)


def build_task(cfg: dict, seed: int, arch: str = "decoder"):
    errors = task_errors(cfg, arch)
    if errors:
        raise ConfigError("\n".join(errors))
    options = {k: v for k, v in cfg.items() if k != "name"}
    if arch == "encoder_decoder":
        options["seq2seq"] = True
    return TASKS[cfg["name"]](seed=seed, **options)
