"""Length-generalization evaluation: per length, teacher-forced loss and token accuracy, and
exact match of the whole answer under greedy autoregressive generation."""
import math

import torch
import torch.nn.functional as F

from blocklab.model.generate import generate
from blocklab.tasks.base import IGNORE, SequenceTask, collate


def chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def validation_batches(task: SequenceTask, batch_size: int = 256) -> list[dict]:
    """The fixed eval sets as padded batches, each tagged with its length."""
    return [{**collate(part, task.pad_id), "length": length}
            for length in task.eval_lengths for part in chunks(task.eval_set(length), batch_size)]


@torch.no_grad()
def evaluate_length(model, task: SequenceTask, length: int, batch_size: int = 256) -> dict:
    was_training = model.training
    model.eval()
    loss_sum = correct = tokens = exact = 0
    examples = task.eval_set(length)
    for part in chunks(examples, batch_size):
        batch = collate(part, task.pad_id)
        logits = model(batch["input"], valid=batch["valid"])
        scored = batch["target"] != IGNORE
        loss_sum += F.cross_entropy(logits[scored], batch["target"][scored], reduction="sum").item()
        correct += (logits.argmax(-1)[scored] == batch["target"][scored]).sum().item()
        tokens += scored.sum().item()
        generated = generate(model, [torch.tensor(e.prompt) for e in part], task.max_answer_len(length),
                             eos_id=task.eos_id, pad_id=task.pad_id)
        for row, e in zip(generated.tolist(), part):
            exact += row[:len(e.answer)] == e.answer
    model.train(was_training)
    loss = loss_sum / tokens
    return {
        "length": length,
        "in_distribution": task.in_distribution(length),
        "exact_match": exact / len(examples),
        "token_acc": correct / tokens,
        "loss": loss if math.isfinite(loss) else None,
        "n": len(examples),
    }


def evaluate(model, task: SequenceTask) -> list[dict]:
    return [evaluate_length(model, task, length) for length in task.eval_lengths]
