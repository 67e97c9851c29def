"""What copy and addition share: a vocabulary, (prompt, answer) examples generated from a seed,
padded batches with a loss mask, fixed validation sets per length, and index hints (Zhou et al. 2024)."""
import math
import random
from abc import abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from torch import Tensor
from torch.utils.data import IterableDataset

from blocklab.analysis.metrics import attention_on
from blocklab.model.generate import generate
from blocklab.tasks.interface import Task, stream_steps
from blocklab.tasks.placement import STREAMS, Placement
from blocklab.tasks.references import LEARNED_EXACT_MATCH, Level, References

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"  # BOS starts an encoder-decoder's target
IGNORE = -100  # cross-entropy ignore_index: no loss on prompt or padding
HINT = "<h{}>"  # the k-th index hint symbol (task.index_hints)


def hint_names(count: int) -> list[str]:
    """Index hints (Zhou et al. 2024, "Transformers Can Achieve Length Generalization But Not Robustly",
    arXiv 2402.09371, after Zhou et al. 2023): an ordered set of `count` marker symbols (102 in Zhou et
    al. 2024, the default of task.hint_symbols); each digit or character of an example is preceded by the
    marker of its index. Each example uses a run of consecutive markers starting at a random point of
    the set (as Zhou et al. sample consecutive hints from the ordered set, and Cho et al.'s index-hint
    baseline draws a random starting hint), so the markers longer test examples reach are trained on
    short examples too."""
    return [HINT.format(k) for k in range(count)]


def hinted(tokens: list[int], indices: list[int], hints: list[int]) -> list[int]:
    """`tokens` with each preceded by hints[its index]."""
    return [t for token, index in zip(tokens, indices) for t in (hints[index], token)]


def hint_errors(cfg: dict, hints_needed) -> list[str]:
    """task.hint_symbols must cover the run of hints the longest example uses (checked after the base checks)."""
    count = cfg.get("hint_symbols")
    if not cfg.get("index_hints"):
        return []
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return [f"task.hint_symbols={count!r} must be a positive integer (the number of index hint symbols)"]
    longest = max([*(cfg.get("eval_lengths") or default_eval_lengths(cfg["min_len"], cfg["max_len"])), cfg["max_len"]])
    if count < hints_needed(longest):
        return [f"task.hint_symbols={count} is fewer than the {hints_needed(longest)} consecutive index hints an "
                f"example of length {longest} needs; set task.hint_symbols >= {hints_needed(longest)}"]
    return []


def through_eos(tokens: list[int], eos_id: int) -> list[int]:
    """A generated row up to and including its first EOS (all of it without one)."""
    return tokens[:tokens.index(eos_id) + 1] if eos_id in tokens else tokens


@dataclass
class Example:
    prompt: list[int]
    answer: list[int]  # ends with EOS
    # Per-token integer streams (tasks/placement.py) over the prompt and max_answer_len tokens after it.
    streams: dict[str, list[int]] = field(default_factory=dict)


def collate(examples: list[Example], pad_id: int) -> dict[str, Tensor]:
    """Decoder-only: right-pad `prompt + answer`; the model reads it shifted by one and is scored
    on the answer only."""
    batch = _shifted([e.prompt + e.answer for e in examples], [len(e.prompt) - 1 for e in examples], pad_id)
    width = batch["input"].shape[1]
    for name in examples[0].streams:
        # padding's ids are never read (padding is masked), so 0 will do
        batch[name] = _padded([e.streams[name][:len(e.prompt) + len(e.answer) - 1] for e in examples], width, 0)
    return batch


def collate_seq2seq(examples: list[Example], pad_id: int, bos_id: int) -> dict[str, Tensor]:
    """Encoder-decoder: the prompt is the source; the decoder reads `BOS answer` shifted by one."""
    batch = _shifted([[bos_id] + e.answer for e in examples], [0] * len(examples), pad_id)
    width = max(len(e.prompt) for e in examples)
    batch["source"] = _padded([e.prompt for e in examples], width, pad_id)
    batch["source_valid"] = torch.arange(width) < torch.tensor([len(e.prompt) for e in examples])[:, None]
    return batch


def _shifted(sequences: list[list[int]], first_scored: list[int], pad_id: int) -> dict[str, Tensor]:
    """Inputs seq[:-1], targets seq[1:] from position `first_scored` on, right-padded and masked.
    Padded as lists and converted once: a tensor write per row made collation a visible share of a
    small model's training step."""
    width = max(len(seq) for seq in sequences) - 1
    targets = [[IGNORE] * start + seq[start + 1:] for seq, start in zip(sequences, first_scored)]
    lengths = torch.tensor([len(seq) - 1 for seq in sequences])
    return {"input": _padded([seq[:-1] for seq in sequences], width, pad_id),
            "target": _padded(targets, width, IGNORE), "valid": torch.arange(width) < lengths[:, None]}


def _padded(rows: list[list[int]], width: int, fill: int) -> Tensor:
    """Rows right-padded with `fill` to `width`, as one long tensor."""
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows], dtype=torch.long)


def model_inputs(batch: dict) -> dict:
    """The keyword arguments a model takes from a batch (encoder-decoder batches carry a source, sentence pairs
    their segments)."""
    return {key: batch[key] for key in ("valid", "source", "source_valid", "segment", *STREAMS) if key in batch}


def on_device(batch: dict, device: torch.device) -> dict:
    """The batch with its tensors on `device` (a model's, where it runs on a GPU); other values as they are."""
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}


def device_of(model) -> torch.device:
    """Where the model's parameters are (the CPU for a module without any, such as a rule written as one)."""
    first = next(model.parameters(), None)
    return torch.device("cpu") if first is None else first.device


def hits_by_position(predicted: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Per place in the answer (the k-th scored target token of a row, the end-of-answer token included): how
    many predictions are right there and how many rows have a k-th token. Answers of one length may differ in
    size (a carry adds a digit), so the counts differ by place."""
    scored = target != IGNORE
    place = (scored.cumsum(1) - 1)[scored]
    right = (predicted == target)[scored].to(torch.float64)
    size = int(place.max()) + 1 if place.numel() else 0
    return torch.bincount(place, weights=right, minlength=size), torch.bincount(place, minlength=size)


def default_eval_lengths(min_len: int, max_len: int) -> list[int]:
    """The training range and beyond it, up to twice the training maximum, in about eight steps."""
    step = max(1, max_len // 4)
    return sorted({min_len, max_len, *range(step, 2 * max_len + 1, step)})


class SequenceTask(Task):
    """A task generating (prompt, answer) examples of a natural `length` (characters, digits...)."""

    supports_seq2seq = True
    places_tokens = True
    supplies: frozenset[str] = frozenset()  # the streams (tasks/placement.py) `streams` computes
    hint_ids: tuple[int, ...] = ()  # the index hint symbols' ids in order (task.index_hints); () without hints
    length_keys = "task.max_len and task.eval_lengths"

    def __init__(self, symbols: list[str], min_len: int, max_len: int, eval_lengths: list[int] | None,
                 batch_size: int, eval_examples: int, eval_seed: int, seed: int, seq2seq: bool = False,
                 placement: Placement = Placement(), eval_given_length: bool = False):
        self.tokens = [PAD, EOS, BOS, *symbols]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id, self.eos_id, self.bos_id = self.ids[PAD], self.ids[EOS], self.ids[BOS]
        self.seq2seq = seq2seq  # batches for an encoder-decoder model
        self.min_len, self.max_len = min_len, max_len
        self.eval_lengths = list(eval_lengths) if eval_lengths else default_eval_lengths(min_len, max_len)
        self.batch_size, self.eval_examples = batch_size, eval_examples
        self.eval_seed, self.seed = eval_seed, seed
        self.placement = placement
        self.eval_given_length = eval_given_length

    @classmethod
    def errors(cls, cfg: dict) -> list[str]:
        errs = []
        for key in ("min_len", "max_len", "batch_size", "eval_examples"):
            value = cfg.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                errs.append(f"task.{key}={value!r} must be a positive integer")
        if not errs and cfg["min_len"] > cfg["max_len"]:
            errs.append(f"task.min_len={cfg['min_len']} > task.max_len={cfg['max_len']}: the training length "
                        "range is empty; make min_len <= max_len")
        if not isinstance(cfg.get("eval_given_length", False), bool):
            errs.append(f"task.eval_given_length={cfg['eval_given_length']!r} must be true or false")
        lengths = cfg.get("eval_lengths")
        if lengths is not None and (not isinstance(lengths, (list, tuple)) or not lengths
                                    or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in lengths)):
            errs.append(f"task.eval_lengths={lengths!r} must be a non-empty list of positive integers, "
                        "e.g. task.eval_lengths=[4,8,16], or null for the default")
        return errs

    # --- what a concrete task defines -------------------------------------------------
    @abstractmethod
    def sample(self, rng: random.Random, length: int) -> Example: ...

    @abstractmethod
    def max_answer_len(self, length: int) -> int: ...

    @abstractmethod
    def max_prompt_len(self, length: int) -> int: ...

    def streams(self, prompt: list[int], length: int) -> dict[str, list[int]]:
        """The streams named in `supplies`, over the prompt and max_answer_len(length) tokens after it,
        from the prompt alone (decoding reads them before the answer exists)."""
        return {}

    def references(self) -> References:
        """Learned: in-distribution exact match >= 0.9. Chance loss: ln of the number of distinct tokens the
        answers hold (a uniform guess over them), counted on 256 examples drawn over the training lengths."""
        rng = random.Random(0)
        seen = set()
        for _ in range(256):
            seen.update(self.sample(rng, rng.randint(self.min_len, self.max_len)).answer)
        return References((Level("learned", "exact_match", LEARNED_EXACT_MATCH),),
                          (Level("chance", "loss", math.log(max(len(seen), 1))),))

    def hints_needed(self, length: int) -> int:
        """How many consecutive index hints an example of `length` uses (a task with index hints says)."""
        raise NotImplementedError(f"task={self.name} has no index hints")

    def with_hints(self, example: Example, hints: list[int]) -> Example:
        """The example with each digit or character preceded by hints[its index] (a task with index hints says)."""
        raise NotImplementedError(f"task={self.name} has no index hints")

    def read_keys(self, example: Example) -> list[list[int]] | None:
        """Per place in the answer (its end-of-answer token last), the prompt positions that answer token is
        read from: the tokens a head has to find to write it ([] where no prompt token says, as for the end).
        None: the task does not say. Evaluation reports how much attention the model gives them
        (`read_attention`), which shows whether a model that fails beyond its training lengths still finds
        what it must copy or add."""
        return None

    def scored(self, tokens: list[int]) -> list[int]:
        """What exact match compares of an answer, applied alike to the generated row and the true answer:
        the tokens themselves, less any index hints. Hints are scaffolding the task adds to the format;
        what is scored is the answer they mark, so an answer with every digit (and the EOS) right counts
        as exact whatever hints were written between them. (Teacher-forced loss and token accuracy still
        count the hint tokens: they are targets the model is trained to write.)"""
        if not self.hint_ids:
            return list(tokens)
        hints = set(self.hint_ids)
        return [t for t in tokens if t not in hints]

    def placement_errors(self) -> list[str]:
        """What this task cannot do of the pos group's shared settings, one line each."""
        errs = []
        placement, setting = self.placement, {"positions": "pos.coupled=true", "digit_index": "pos.abacus=true"}
        if placement.coupled_offset and not placement.coupled:
            errs.append(f"pos.coupled_offset={placement.coupled_offset} shifts coupled position ids, but "
                        "pos.coupled=false; set pos.coupled=true or pos.coupled_offset=0")
        elif placement.coupled_offset and placement.random_max is not None:
            errs.append(f"pos.coupled_offset={placement.coupled_offset} has no use with pos.randomize=true, whose "
                        "ids already cover [0, pos.random_max) in training; set pos.coupled_offset=0")
        for stream in placement.streams:
            if stream not in self.supplies:
                errs.append(f"{setting[stream]} needs a task that supplies {stream.replace('_', ' ')}; "
                            f"task={self.name} supplies none: use task=copy or task=addition")
        if (placement.streams or placement.explicit_positions) and self.seq2seq:
            errs.append("pos.coupled, pos.abacus and pos.randomize work with model.arch=decoder only; "
                        "use model.arch=decoder")
        longest = self.max_seq_len + 1  # positions of every token, the answer's last included
        if placement.random_max is not None and placement.random_max < longest:
            errs.append(f"pos.random_max={placement.random_max} is smaller than the longest evaluated sequence "
                        f"({longest} tokens); set pos.random_max >= {longest} (Ruoss et al. use several times "
                        "the longest test length)")
        return errs

    # --- shared machinery -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def max_seq_len(self) -> int:
        """Longest model input over training and evaluation (the answer's last token is never input)."""
        longest = max(self.eval_lengths + [self.max_len])
        return self.max_prompt_len(longest) + self.max_answer_len(longest) - 1

    def collate(self, examples: list[Example]) -> dict[str, Tensor]:
        return collate_seq2seq(examples, self.pad_id, self.bos_id) if self.seq2seq else collate(examples, self.pad_id)

    def in_distribution(self, length: int) -> bool:
        return self.min_len <= length <= self.max_len

    def encode(self, text: str) -> list[int]:
        return [self.ids[ch] for ch in text]

    def decode(self, ids) -> str:
        return "".join(self.tokens[i] for i in ids if i != self.pad_id)

    def eval_set(self, length: int) -> list[Example]:
        """Fixed for a given eval_seed, whatever the training seed, so runs compare on the same data
        (placement draws from its own generator, so the examples are the same under every method)."""
        rng = random.Random(f"{self.eval_seed}/{self.name}/{length}")
        place_rng = random.Random(f"{self.eval_seed}/{self.name}/{length}/placement")
        return [self.placed(self.sample(rng, length), length, place_rng, training=False)
                for _ in range(self.eval_examples)]

    def placed(self, example: Example, length: int, rng: random.Random, training: bool) -> Example:
        """The example as its batches carry it: with index hints (a run of consecutive hint symbols from a
        random start, in training and evaluation alike), and the streams of the configured placement."""
        if self.hint_ids:
            needed = self.hints_needed(length)
            start = rng.randint(0, len(self.hint_ids) - needed)
            example = self.with_hints(example, list(self.hint_ids[start:start + needed]))
        if not self.placement.streams and not self.placement.explicit_positions:
            return example
        room = len(example.prompt) + self.max_answer_len(length)
        own = self.streams(example.prompt, length) if self.placement.streams else {}
        example.streams = self.placement.place(own, room, rng, training)
        return example

    @property
    def train_lengths(self) -> tuple[int, int]:
        return self.min_len, self.max_len

    def tokenizer(self) -> Tokenizer:
        """The vocabulary as a `tokenizers` tokenizer (one token per character, specials whole),
        saved with every run so generation needs nothing but the run directory."""
        specials = [t for t in self.tokens if t.startswith("<")]
        tok = Tokenizer(models.WordLevel(vocab=dict(self.ids), unk_token=PAD))
        tok.add_special_tokens(specials)
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        return tok

    def train_batches(self, start_step: int = 0) -> "TrainStream":
        return TrainStream(self, start_step)

    def probe_batch(self, n: int) -> dict:
        """A fixed batch for diagnostics: the longest training length (same length, so no padding)."""
        return self.collate(self.eval_set(self.max_len)[:n])

    def validation_batches(self, batch_size: int = 256) -> list[dict]:
        """The fixed eval sets as padded batches, each tagged with its length."""
        return [{**self.collate(part), "length": length}
                for length in self.eval_lengths for part in _chunks(self.eval_set(length), batch_size)]

    def evaluate(self, model) -> list[dict]:
        rows = [self.evaluate_length(model, length) for length in self.eval_lengths]
        reading = self.read_attention(model)
        if reading:
            # The reading head is the one that reads best at the longest trained length; every length reports
            # that head, so a drop beyond training is the same head losing its keys, not another head's score.
            trained = reading[max((r["length"] for r in rows if r["in_distribution"]), default=min(reading))]
            layer, head = divmod(int(trained.argmax()), trained.shape[1])
            for row in rows:
                row["read_attention"], row["read_head"] = float(reading[row["length"]][layer, head]), [layer, head]
        return rows

    def _generate(self, model, examples: list[Example], max_new_tokens: int, min_new_tokens: Tensor | None = None):
        return generate(model, [torch.tensor(e.prompt) for e in examples], max_new_tokens, eos_id=self.eos_id,
                        pad_id=self.pad_id, bos_id=self.bos_id, min_new_tokens=min_new_tokens,
                        streams=[{k: torch.tensor(v) for k, v in e.streams.items()} for e in examples])

    def _exact_given_length(self, model, examples: list[Example], exact_rows: list[bool]) -> int:
        """How many answers greedy decoding gets right when told where they end: the end-of-answer token is
        ruled out until the answer's length, and the tokens before it are compared (the oracle length of
        Newman et al. 2020, "The EOS Decision and Length Extrapolation"). It separates writing the answer
        from deciding where it stops. A row decoded right is right so too (no EOS was its choice before the
        end), so only the others are decoded again."""
        wrong = [e for e, right in zip(examples, exact_rows) if not right]
        if not wrong:
            return len(examples)
        sizes = [len(e.answer) - 1 for e in wrong]
        generated = self._generate(model, wrong, max(sizes), min_new_tokens=torch.tensor(sizes))
        return sum(exact_rows) + sum(self.scored(row[:size]) == self.scored(e.answer[:-1])
                                     for row, size, e in zip(generated.tolist(), sizes, wrong))

    @torch.no_grad()
    def read_attention(self, model, examples: int = 64) -> dict[int, Tensor]:
        """Per evaluated length, (layers, heads): each head's attention on the keys the answer is read from
        (`read_keys`), summed over them and averaged over the answer's places that have any, on the first
        `examples` of the length's eval set (teacher-forced). {} where the task does not say, or for an
        encoder-decoder (its reading is cross-attention)."""
        if self.seq2seq or self.read_keys(self.eval_set(self.max_len)[0]) is None:
            return {}
        was_training = model.training
        model.eval()
        reading = {}
        for length in self.eval_lengths:
            part = self.eval_set(length)[:examples]
            batch = on_device(self.collate(part), device_of(model))
            _, weights = model(batch["input"], need_weights=True, **model_inputs(batch))
            reads = self.read_map(part, batch["input"].shape[1])
            reading[length] = torch.stack([attention_on(w.double().cpu(), reads) for w in weights])
        model.train(was_training)
        return reading

    def read_map(self, examples: list[Example], width: int) -> Tensor:
        """(B, width, width) bool for decoder-only batches: input position q must read position k. The query
        that predicts answer place p is the token before it, at len(prompt) - 1 + p."""
        reads = torch.zeros(len(examples), width, width, dtype=torch.bool)
        for row, example in enumerate(examples):
            first = len(example.prompt) - 1
            for place, keys in enumerate(self.read_keys(example)):
                reads[row, first + place, keys] = True
        return reads

    @torch.no_grad()
    def evaluate_length(self, model, length: int, batch_size: int = 256) -> dict:
        """Teacher-forced loss and token accuracy (overall and per place in the answer), and exact match of
        the whole answer under greedy autoregressive generation (with the KV cache): the generated row up to
        its first EOS and the true answer agree once both pass through `scored` (index hints dropped)."""
        was_training = model.training
        model.eval()
        loss_sum = exact = exact_given_length = 0
        right_at, rows_at = torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
        examples = self.eval_set(length)
        for part in _chunks(examples, batch_size):
            batch = self.collate(part)  # scored on the CPU (float64 counts); the model reads it where it runs
            on_model = on_device(batch, device_of(model))
            logits = model(on_model["input"], **model_inputs(on_model)).cpu()
            scored = batch["target"] != IGNORE
            loss_sum += F.cross_entropy(logits[scored], batch["target"][scored], reduction="sum").item()
            right, rows = hits_by_position(logits.argmax(-1), batch["target"])
            right_at, rows_at = _add_padded(right_at, right), _add_padded(rows_at, rows)
            generated = self._generate(model, part, self.max_answer_len(length))
            exact_rows = [self.scored(through_eos(row, self.eos_id)) == self.scored(e.answer)
                          for row, e in zip(generated.tolist(), part)]
            exact += sum(exact_rows)
            if self.eval_given_length:
                exact_given_length += self._exact_given_length(model, part, exact_rows)
        model.train(was_training)
        tokens = int(rows_at.sum())
        loss = loss_sum / tokens
        return {
            "length": length,
            "in_distribution": self.in_distribution(length),
            "exact_match": exact / len(examples),
            **({"exact_match_given_length": exact_given_length / len(examples)} if self.eval_given_length else {}),
            "token_acc": int(right_at.sum()) / tokens,
            "token_acc_by_position": (right_at / rows_at).tolist(),  # where in the answer the errors sit
            "loss": loss if math.isfinite(loss) else None,
            "n": len(examples),
        }


def _add_padded(a: Tensor, b: Tensor) -> Tensor:
    """a + b, the shorter one extended with zeros."""
    size = max(len(a), len(b))
    return F.pad(a, (0, size - len(a))) + F.pad(b, (0, size - len(b)))


def ddp_rank() -> int:
    """This process's rank under distributed training (0 otherwise): each rank draws its own batches."""
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def rank_suffix() -> str:
    rank = ddp_rank()
    return f"/rank{rank}" if rank else ""


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


class TrainStream(IterableDataset):
    """An endless stream of padded training batches. Batch k is a pure function of (seed, k), so a
    resumed run continues with exactly the batches an uninterrupted run would have seen."""

    def __init__(self, task: SequenceTask, start_step: int = 0):
        self.task, self.start_step = task, start_step

    def __iter__(self):
        task = self.task
        for step in stream_steps(self.start_step):
            rng = random.Random(f"{task.seed}/{task.name}/train/{step}{rank_suffix()}")
            place_rng = random.Random(f"{task.seed}/{task.name}/train/{step}{rank_suffix()}/placement")
            examples = []
            for _ in range(task.batch_size):
                length = rng.randint(task.min_len, task.max_len)
                examples.append(task.placed(task.sample(rng, length), length, place_rng, training=True))
            yield task.collate(examples)
