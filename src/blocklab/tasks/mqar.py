"""Multi-query associative recall (MQAR), Zoology's synthetic recall task (Arora, Eyuboglu et al. 2024, "Zoology:
Measuring and improving recall in efficient language models", ICLR 2024, sec. 3.1 and app. E.1).

An example of `seq_len` tokens starts with `num_kv_pairs` key-value pairs, k_1 v_1 k_2 v_2 ... (keys drawn without
replacement from the first half of the vocabulary, ids 1 .. V/2 - 1; values without replacement from the second,
V/2 .. V - 1), followed by the query region: every key is asked once, at an even offset 2 g of the region, and the
rest of the region is random tokens of the whole vocabulary (Zoology's `random_non_queries`). The gaps g are drawn
without replacement from 0 .. (seq_len - 2 N) / 2 - 1 with P(g) proportional to (g + 1)^(power_a - 1), Zoology's
power law: with power_a = 0.01 most queries sit near the start of the region. The model is trained as a language
model but scored only where a query key is the input: its next-token prediction there must be the value paired
with that key. Every other position, the key-value prefix included, carries no loss.

Length buckets: training uses one (seq_len, num_kv_pairs); evaluation runs each of `eval_buckets`, by default
Zoology's test set (64, 4), (128, 8), (256, 16), (256, 32), (256, 64). A row's `length` is its number of key-value
pairs (what must be recalled; `seq_len` is in the row too), so the buckets' pair counts must differ. Scores, all
teacher-forced in one forward pass (recall is the next token at each query, so nothing is generated):
  token_acc    the share of queried values predicted right: Zoology's MQAR accuracy
  exact_match  the share of examples with every one of their queries right
  loss         cross-entropy over the queried values only."""
import math

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import Tensor
from torch.utils.data import IterableDataset

from blocklab.tasks.base import IGNORE, ddp_rank, device_of
from blocklab.tasks.interface import TASKS, Task, stream_steps
from blocklab.tasks.references import Level, References, chance_bar

ZOOLOGY_TEST_BUCKETS = [[64, 4], [128, 8], [256, 16], [256, 32], [256, 64]]


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def bucket_errors(seq_len, pairs, where: str) -> list[str]:
    """What Zoology's generator asserts of one (seq_len, num_kv_pairs): an even length with room for the pairs and
    for every query at its own even offset (4 N <= seq_len)."""
    if not is_positive_int(seq_len) or not is_positive_int(pairs):
        return [f"{where}=({seq_len!r}, {pairs!r}) must be positive integers (sequence length, key-value pairs)"]
    errs = []
    if seq_len % 2 or 4 * pairs > seq_len:
        errs.append(f"{where}=({seq_len}, {pairs}): the sequence length must be even and at least 4 x the pairs "
                    f"(the pairs, then each query at its own even offset); use an even seq_len >= {4 * pairs}")
    return errs


def power_law_gaps(rng: np.random.Generator, rows: int, space: int, count: int, power_a: float) -> np.ndarray:
    """(rows, count) distinct gaps from 0..space-1 per row, drawn one after another with probability proportional
    to (g + 1)^(power_a - 1) among those left (numpy's choice(replace=False, p=...), as Zoology draws them), here
    for all rows at once by the Gumbel-top-k trick (Vieira 2014; Kool et al. 2019), which samples that sequential
    draw exactly."""
    log_p = (power_a - 1) * np.log(np.arange(1, space + 1))
    scores = log_p + rng.gumbel(size=(rows, space))
    return np.argsort(-scores, axis=1, kind="stable")[:, :count]


def distinct(rng: np.random.Generator, rows: int, low: int, high: int, count: int) -> np.ndarray:
    """(rows, count) ids drawn uniformly without replacement from low..high-1, per row."""
    return low + np.argsort(rng.random((rows, high - low)), axis=1)[:, :count]


def mqar_batch(rng: np.random.Generator, rows: int, vocab_size: int, seq_len: int, pairs: int, power_a: float,
               random_non_queries: bool = True) -> tuple[Tensor, Tensor]:
    """(inputs, targets), each (rows, seq_len) long: targets IGNORE except at the query positions, where they hold
    the queried key's value (module docstring). Without random_non_queries the filler is token 0 (no key is 0)."""
    context = 2 * pairs
    keys = distinct(rng, rows, 1, vocab_size // 2, pairs)
    values = distinct(rng, rows, vocab_size // 2, vocab_size, pairs)
    inputs = np.zeros((rows, seq_len), dtype=np.int64)
    inputs[:, 0:context:2], inputs[:, 1:context:2] = keys, values
    filler = np.ones((rows, seq_len), dtype=bool)
    filler[:, :context] = False
    # the i-th key is asked at offset 2 g_i of the query region
    where = context + 2 * power_law_gaps(rng, rows, (seq_len - context) // 2, pairs, power_a)
    np.put_along_axis(inputs, where, keys, axis=1)
    np.put_along_axis(filler, where, False, axis=1)
    if random_non_queries:
        inputs[filler] = rng.integers(0, vocab_size, size=int(filler.sum()))
    targets = np.full((rows, seq_len), IGNORE, dtype=np.int64)
    np.put_along_axis(targets, where, values, axis=1)
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def query_logits(model, inputs: Tensor, scored: Tensor) -> Tensor:
    """The model's logits at the `scored` positions of `inputs` (B, T), in row-major order, on the CPU: only there
    computed where the model can (forward's `at`), picked from the full logits where it cannot."""
    device = device_of(model)
    if getattr(model, "selects_positions", False):
        return model(inputs.to(device), at=scored.flatten().nonzero().squeeze(1).to(device)).cpu()
    return model(inputs.to(device)).cpu()[scored]


@TASKS.register("mqar")
class MQARTask(Task):
    def __init__(self, vocab_size: int = 8192, seq_len: int = 64, num_kv_pairs: int = 4, power_a: float = 0.01,
                 random_non_queries: bool = True, eval_buckets: list | None = None, eval_examples: int = 256,
                 eval_seed: int = 1234, batch_size: int = 64, seed: int = 0):
        self._vocab_size, self.seq_len, self.num_kv_pairs = vocab_size, seq_len, num_kv_pairs
        self.power_a, self.random_non_queries = power_a, random_non_queries
        self.buckets = {pairs: length for length, pairs in (eval_buckets or ZOOLOGY_TEST_BUCKETS)}
        self.buckets.setdefault(num_kv_pairs, seq_len)  # the training bucket is always evaluated
        self.eval_lengths = sorted(self.buckets)
        self.eval_examples, self.eval_seed, self.batch_size, self.seed = eval_examples, eval_seed, batch_size, seed

    @classmethod
    def errors(cls, cfg: dict) -> list[str]:
        errs = [f"task.{key}={cfg.get(key)!r} must be a positive integer"
                for key in ("vocab_size", "seq_len", "num_kv_pairs", "eval_examples", "batch_size")
                if not is_positive_int(cfg.get(key))]
        power_a = cfg.get("power_a")
        if isinstance(power_a, bool) or not isinstance(power_a, (int, float)) or not 0 < power_a <= 1:
            errs.append(f"task.power_a={power_a!r} must be in (0, 1] (Zoology's query-gap power law; 1: uniform)")
        if not isinstance(cfg.get("random_non_queries"), bool):
            errs.append(f"task.random_non_queries={cfg.get('random_non_queries')!r} must be true or false")
        buckets = cfg.get("eval_buckets")
        if buckets is not None and (not isinstance(buckets, (list, tuple)) or not buckets or not all(
                isinstance(b, (list, tuple)) and len(b) == 2 for b in buckets)):
            return errs + [f"task.eval_buckets={buckets!r} must be a non-empty list of [seq_len, num_kv_pairs] "
                           "pairs, e.g. [[64,4],[128,8]], or null for Zoology's test set"]
        if errs:
            return errs
        vocab = cfg["vocab_size"]
        errs += bucket_errors(cfg["seq_len"], cfg["num_kv_pairs"], "task.(seq_len, num_kv_pairs)")
        buckets = [list(b) for b in (buckets or ZOOLOGY_TEST_BUCKETS)]
        for length, pairs in buckets:
            errs += bucket_errors(length, pairs, "task.eval_buckets entry")
        if errs:
            return errs
        # Keys come from ids 1..V/2-1, values from V/2..V-1, and Zoology asks V > seq_len.
        needed = max(max(2 * pairs + 2, length + 1) for length, pairs in [*buckets, [cfg["seq_len"], cfg["num_kv_pairs"]]])
        if vocab < needed:
            errs.append(f"task.vocab_size={vocab} is too small for the longest bucket: keys come from ids 1..V/2-1 and "
                        f"the vocabulary must exceed the sequence length (Zoology); use task.vocab_size >= {needed}")
        counts = [pairs for _, pairs in buckets]
        if len(set(counts)) != len(counts):
            errs.append(f"task.eval_buckets={buckets}: each bucket must ask a different number of pairs (a row's "
                        "length is its pair count); drop the duplicates")
        clash = [b for b in buckets if b[1] == cfg["num_kv_pairs"] and b[0] != cfg["seq_len"]]
        if clash:
            errs.append(f"task.eval_buckets has {clash[0]}, the training pair count at another length than "
                        f"task.seq_len={cfg['seq_len']}; use [{cfg['seq_len']}, {cfg['num_kv_pairs']}] or drop it")
        return errs

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_seq_len(self) -> int:
        return max(self.buckets.values())

    @property
    def train_lengths(self) -> tuple[int, int]:
        return self.num_kv_pairs, self.num_kv_pairs

    def in_distribution(self, length: int) -> bool:
        return length == self.num_kv_pairs

    def token_names(self) -> list[str]:
        """Id 0 is Zoology's filler, ids below V/2 keys, the rest values."""
        half = self._vocab_size // 2
        return ["<0>", *(f"k{i}" for i in range(1, half)), *(f"v{i - half}" for i in range(half, self._vocab_size))]

    def tokenizer(self) -> Tokenizer:
        tok = Tokenizer(models.WordLevel(vocab={name: i for i, name in enumerate(self.token_names())}, unk_token="<0>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return tok

    def batch(self, rng: np.random.Generator, rows: int, pairs: int) -> dict:
        inputs, targets = mqar_batch(rng, rows, self._vocab_size, self.buckets[pairs], pairs, self.power_a,
                                     self.random_non_queries)
        return {"input": inputs, "target": targets, "valid": torch.ones_like(inputs, dtype=torch.bool)}

    def eval_set(self, pairs: int) -> dict:
        """Fixed by eval_seed whatever the training seed, so runs compare on the same examples."""
        rng = np.random.default_rng([self.eval_seed % 2**64, pairs, self.buckets[pairs], 1])
        return self.batch(rng, self.eval_examples, pairs)

    def train_batches(self, start_step: int = 0) -> "MQARStream":
        return MQARStream(self, start_step)

    def probe_batch(self, n: int) -> dict:
        return {key: value[:n] for key, value in self.eval_set(self.num_kv_pairs).items()}

    def references(self) -> References:
        """Chance: a guess among the V - V//2 values (2/V, Zoology's vocabulary halves), and its loss; learned
        halfway from that chance accuracy to perfect recall."""
        values = self._vocab_size - self._vocab_size // 2
        return References((chance_bar("token_acc", 1 / values),),
                          (Level("chance", "token_acc", 1 / values), Level("chance", "loss", math.log(values))))

    def rows_per_batch(self, pairs: int) -> int:
        """Evaluation rows per forward pass: the logits at the queries (rows x pairs x vocab: the model computes them
        there alone, forward's `at`) kept to about 2^22 numbers."""
        return max(1, min(256, 2 ** 22 // (pairs * self._vocab_size)))

    def _parts(self, pairs: int):
        full = self.eval_set(pairs)
        rows = self.rows_per_batch(pairs)
        for start in range(0, self.eval_examples, rows):
            yield {key: value[start:start + rows] for key, value in full.items()}

    def validation_batches(self) -> list[dict]:
        return [{**part, "length": pairs} for pairs in self.eval_lengths for part in self._parts(pairs)]

    @torch.no_grad()
    def evaluate(self, model) -> list[dict]:
        was_training = model.training
        model.eval()
        rows = []
        for pairs in self.eval_lengths:
            loss_sum = right = queries = exact = 0
            for part in self._parts(pairs):
                target = part["target"]
                scored = target != IGNORE
                logits = query_logits(model, part["input"], scored)  # (queries of the part, vocab), row-major
                loss_sum += F.cross_entropy(logits.double(), target[scored], reduction="sum").item()
                hit = torch.zeros_like(scored)
                hit[scored] = logits.argmax(-1) == target[scored]
                right += int(hit.sum())
                queries += int(scored.sum())
                exact += int((hit.sum(1) == scored.sum(1)).sum())
            loss = loss_sum / queries
            rows.append({"length": pairs, "in_distribution": self.in_distribution(pairs), "seq_len": self.buckets[pairs],
                         "num_kv_pairs": pairs, "exact_match": exact / self.eval_examples, "token_acc": right / queries,
                         "loss": loss if math.isfinite(loss) else None, "n": self.eval_examples})
        model.train(was_training)
        return rows


class MQARStream(IterableDataset):
    """Endless training batches at the training bucket; batch k is a pure function of (seed, k, rank), so a resumed
    run continues with the batches an uninterrupted one would have seen."""

    def __init__(self, task: MQARTask, start_step: int = 0):
        self.task, self.start_step = task, start_step

    def __iter__(self):
        for step in stream_steps(self.start_step):
            rng = np.random.default_rng([self.task.seed % 2**64, step, ddp_rank(), 0])
            yield self.task.batch(rng, self.task.batch_size, self.task.num_kv_pairs)
