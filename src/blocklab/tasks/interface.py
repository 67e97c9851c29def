"""What every task offers training, evaluation and diagnostics, and the registry of tasks by name."""
import itertools
from abc import ABC, abstractmethod
from typing import Iterable, Iterator

from tokenizers import Tokenizer
from torch import nn
from torch.utils.data import get_worker_info

from blocklab.registry import Registry
from blocklab.tasks.references import References

# The longest sequence (prompt and answer, or an LM window) a task builds. Past it one head's attention scores
# for one example exceed 4 GiB in float32 and building an evaluation set takes minutes on a CPU; no experiment
# here comes near it (the longest, attention_cost, trains 2048-token windows).
MAX_SEQ_LEN = 1 << 15


def stream_steps(start_step: int) -> Iterator[int]:
    """The training steps whose batches this process builds. In the training process, every step from start_step
    on; in DataLoader worker w of W (trainer.data_workers), steps start_step + w, + w + W, ..., which the loader
    hands back in turn. A batch is a pure function of (seed, step), so every worker count trains on the same batches."""
    worker = get_worker_info()
    if worker is None:
        return itertools.count(start_step)
    return itertools.count(start_step + worker.id, worker.num_workers)


class Task(ABC):
    """A source of training batches and a fixed evaluation of length generalization.

    `length` is the task's natural size (characters copied, digits per operand, context tokens);
    `eval_lengths` (set by the constructor) are the lengths evaluated, `train_lengths` the
    (shortest, longest) trained on."""

    # Examples split into a source and a target, so an encoder-decoder can learn the task.
    supports_seq2seq: bool = False
    # Predicts masked tokens from both sides (masked LM): it needs a bidirectional encoder-only model, which
    # in turn sees the very tokens any other task asks it to predict next.
    masked: bool = False
    # Whether the task builds batches under a Placement (tasks/placement.py: randomized, coupled positions...).
    places_tokens: bool = False
    bos_id: int | None = None  # the token a decoder starts from, where the task has one
    # Sentence pairs (BERT's next-sentence prediction): batches carry `segment` ids (0: first, 1: second) and
    # `is_next`, and the model gets segment embeddings and a pair classifier. 0: single sequences.
    segments: int = 0
    eval_lengths: list[int]
    length_keys: str = "the task's lengths"  # the keys that set max_seq_len, for the message past MAX_SEQ_LEN

    @property
    def name(self) -> str:
        """task.name in the config, as registered."""
        return self.registry_name

    @classmethod
    @abstractmethod
    def errors(cls, cfg: dict) -> list[str]:
        """Config problems as one line each naming the key and the fix (checked before building)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def max_seq_len(self) -> int:
        """Longest model input over training and evaluation."""

    @property
    @abstractmethod
    def train_lengths(self) -> tuple[int, int]: ...

    @abstractmethod
    def in_distribution(self, length: int) -> bool: ...

    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """Saved with every run, so generation needs nothing but the run directory."""

    @abstractmethod
    def train_batches(self, start_step: int = 0) -> Iterable[dict]:
        """Endless batches; batch k is a pure function of (seed, k), so a resumed run continues exactly."""

    @abstractmethod
    def validation_batches(self) -> list[dict]: ...

    @abstractmethod
    def evaluate(self, model: nn.Module) -> list[dict]:
        """One results.json `eval` row per length in eval_lengths."""

    @abstractmethod
    def probe_batch(self, n: int) -> dict:
        """A fixed batch of n examples for diagnostics."""

    @abstractmethod
    def references(self) -> References:
        """The task's reference levels (tasks/references.py): chance, and the bar at which a run has learned it.
        results.json records them, and a findings page judges every compared setting against them."""


TASKS: Registry[type[Task]] = Registry("task.name", framework_args=("seed", "seq2seq", "symbols", "placement"))
