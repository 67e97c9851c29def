"""Language modelling: random windows of `block_size` tokens for training; loss, perplexity and
bits per character at 1x, 2x, 4x, 8x the training context for length extrapolation."""
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch.utils.data import IterableDataset

from blocklab.errors import ConfigError
from blocklab.tasks.base import ddp_rank, device_of, on_device
from blocklab.tasks.corpus import cache_key, load_corpus, source_key
from blocklab.tasks.interface import TASKS, Task, stream_steps
from blocklab.tasks.references import Level, References, bigram_loss, unigram_loss
from blocklab.tasks.tokenizer import tokenizer_errors, train_tokenizer

CACHE_FORMAT = 1


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@TASKS.register("lm")
class LMTask(Task):
    length_keys = "task.block_size times the largest of task.eval_multipliers (or the largest of task.eval_lengths)"

    def __init__(self, data: dict, tokenizer: dict, block_size: int, batch_size: int, eval_multipliers: list[int],
                 eval_max_tokens: int, cache_dir: str, seed: int, eval_lengths: list[int] | None = None):
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        self.eval_multipliers, self.eval_max_tokens = list(eval_multipliers), eval_max_tokens
        self.cache_dir = Path(cache_dir).expanduser()
        self.tok, self.train_ids, self.val_ids, self.meta = self._load(data, tokenizer)
        if len(self.train_ids) <= block_size or len(self.val_ids) <= block_size:
            raise ConfigError(
                f"the corpus is too short for task.block_size={block_size}: {len(self.train_ids)} training and "
                f"{len(self.val_ids)} validation tokens, each needs more than one block; lower block_size or add text")
        # Absolute lengths where given: runs at other contexts (a continuation at 4x) are scored at the same lengths.
        self.eval_lengths = list(eval_lengths) if eval_lengths else [m * block_size for m in self.eval_multipliers]
        self.eval_multipliers = [n / block_size if n % block_size else n // block_size for n in self.eval_lengths]

    @classmethod
    def errors(cls, cfg: dict) -> list[str]:
        errs = [f"task.{key}={cfg.get(key)!r} must be a positive integer"
                for key in ("block_size", "batch_size", "eval_max_tokens") if not _positive_int(cfg.get(key))]
        mults = cfg.get("eval_multipliers")
        if not isinstance(mults, (list, tuple)) or not mults or not all(_positive_int(m) for m in mults):
            errs.append(f"task.eval_multipliers={mults!r} must be a non-empty list of positive integers, e.g. [1,2,4,8]")
        lengths = cfg.get("eval_lengths")
        if lengths is not None and (not isinstance(lengths, (list, tuple)) or not all(_positive_int(n) for n in lengths)
                                    or cfg.get("block_size") not in lengths):
            errs.append(f"task.eval_lengths={lengths!r} must be null (task.eval_multipliers times task.block_size) or a "
                        f"list of positive token counts that holds task.block_size={cfg.get('block_size')!r} (the "
                        "in-distribution loss), e.g. [64,128,256,512]")
        data = cfg.get("data") or {}
        if data.get("path") and data.get("hub"):
            errs.append("task.data.path and task.data.hub are both set; keep one")
        fraction = data.get("val_fraction")
        if not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            errs.append(f"task.data.val_fraction={fraction!r} must be between 0 and 1")
        if data.get("encoding_errors") not in ("strict", "replace"):
            errs.append(f"task.data.encoding_errors={data.get('encoding_errors')!r} must be strict or replace")
        return errs + tokenizer_errors(cfg.get("tokenizer") or {})

    def _load(self, data: dict, tok_cfg: dict):
        """Tokenizer and token ids, cached by source + tokenizer settings + split."""
        key = cache_key(CACHE_FORMAT, source_key(data), tok_cfg, data["val_fraction"], data["encoding_errors"])
        folder = self.cache_dir / "lm" / key
        if (folder / "meta.json").exists():
            meta = json.loads((folder / "meta.json").read_text())
            return (Tokenizer.from_file(str(folder / "tokenizer.json")), np.load(folder / "train.npy"),
                    np.load(folder / "val.npy"), {**meta, "cache_hit": True})
        corpus = load_corpus(data, self.cache_dir)
        tok = train_tokenizer(tok_cfg, corpus.train)
        dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.int32
        train_ids = np.asarray(tok.encode(corpus.train).ids, dtype=dtype)
        val_ids = np.asarray(tok.encode(corpus.val).ids, dtype=dtype)
        meta = {"source": corpus.description, "val_chars": len(corpus.val),
                "val_bytes": len(corpus.val.encode("utf-8")), "train_chars": len(corpus.train)}
        folder.mkdir(parents=True, exist_ok=True)
        tok.save(str(folder / "tokenizer.json"))
        np.save(folder / "train.npy", train_ids)
        np.save(folder / "val.npy", val_ids)
        (folder / "meta.json").write_text(json.dumps(meta))  # written last: marks the cache complete
        return tok, train_ids, val_ids, {**meta, "cache_hit": False}

    # --- the task interface ----------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @property
    def max_seq_len(self) -> int:
        return max(self.eval_lengths)

    @property
    def train_lengths(self) -> tuple[int, int]:
        return self.block_size, self.block_size

    def in_distribution(self, length: int) -> bool:
        return length == self.block_size

    def tokenizer(self) -> Tokenizer:
        return self.tok

    def references(self) -> References:
        """The corpus' own baselines, fitted on its training split and scored on its validation split: the unigram
        and bigram losses. Learned: a validation loss below the bigram's (a model that has learned less than which
        token follows which has not learned the language)."""
        vocab = self.vocab_size
        unigram = unigram_loss(self.train_ids, self.val_ids, vocab)
        bigram = bigram_loss(self.train_ids, self.val_ids, vocab)
        return References((Level("bigram", "loss", bigram),),
                          (Level("unigram", "loss", unigram), Level("chance", "loss", math.log(vocab))))

    def train_batches(self, start_step: int = 0) -> "RandomWindows":
        return RandomWindows(torch.from_numpy(self.train_ids.astype(np.int64)), self.block_size, self.batch_size,
                             self.seed, start_step)

    def windows(self, length: int) -> torch.Tensor:
        """Non-overlapping (length + 1)-token windows over the validation text, at most eval_max_tokens."""
        ids = torch.from_numpy(self.val_ids.astype(np.int64))
        count = min((len(ids) - 1) // length, max(1, self.eval_max_tokens // length))
        return ids[: count * length + 1].unfold(0, length + 1, length)[:count] if count else ids.new_zeros(0, length + 1)

    def _batches(self, length: int, tokens_per_batch: int = 16384):
        windows = self.windows(length)
        rows = max(1, tokens_per_batch // length)
        for start in range(0, len(windows), rows):
            w = windows[start:start + rows]
            yield {"input": w[:, :-1], "target": w[:, 1:], "valid": torch.ones_like(w[:, :-1], dtype=torch.bool),
                   "length": length}

    def probe_batch(self, n: int) -> dict:
        """A fixed batch for diagnostics: the first n validation windows of the training context."""
        w = self.windows(self.block_size)[:n]
        return {"input": w[:, :-1], "target": w[:, 1:], "valid": torch.ones_like(w[:, :-1], dtype=torch.bool)}

    def validation_batches(self) -> list[dict]:
        return list(self._batches(self.block_size))

    @torch.no_grad()
    def evaluate(self, model) -> list[dict]:
        was_training = model.training
        model.eval()
        # Bits per character of the validation text: nats per token * tokens per character / ln 2.
        tokens_per_char = len(self.val_ids) / self.meta["val_chars"]
        rows = []
        for mult, length in zip(self.eval_multipliers, self.eval_lengths):
            loss_sum = correct = tokens = 0
            for batch in self._batches(length):
                batch = on_device(batch, device_of(model))
                logits = model(batch["input"])
                loss_sum += F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), reduction="sum").item()
                correct += (logits.argmax(-1) == batch["target"]).sum().item()
                tokens += batch["target"].numel()
            loss = loss_sum / tokens if tokens else None
            finite = loss is not None and math.isfinite(loss)
            rows.append({
                "length": length, "in_distribution": length == self.block_size, "exact_match": None,
                "token_acc": correct / tokens if tokens else None, "loss": loss if finite else None,
                "n": tokens // length if tokens else 0, "multiplier": mult,
                "perplexity": math.exp(min(loss, 700)) if finite else None,
                "bits_per_char": loss * tokens_per_char / math.log(2) if finite else None,
            })
        model.train(was_training)
        return rows


class RandomWindows(IterableDataset):
    """Endless batches of random (block_size + 1)-token windows; batch k is a pure function of (seed, k),
    so a resumed run sees the same batches as an uninterrupted one."""

    def __init__(self, ids: torch.Tensor, block_size: int, batch_size: int, seed: int, start_step: int = 0):
        self.ids, self.block_size, self.batch_size, self.seed = ids, block_size, batch_size, seed
        self.start_step = start_step

    def __iter__(self):
        offsets = torch.arange(self.block_size + 1)
        valid = torch.ones(self.batch_size, self.block_size, dtype=torch.bool)
        for step in stream_steps(self.start_step):
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 7919 * ddp_rank())
            starts = torch.randint(len(self.ids) - self.block_size, (self.batch_size,), generator=generator)
            windows = self.ids[starts[:, None] + offsets]
            yield {"input": windows[:, :-1], "target": windows[:, 1:], "valid": valid}
