"""Masked language modelling (BERT: Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers
for Language Understanding", NAACL, section 3.1 "Task #1: Masked LM" and appendix A.1) on the LM corpora.

In each sequence a fraction `mask_prob` (15%) of the positions is selected for prediction; of those, 80% are
replaced by [MASK], 10% by a random token and 10% are left unchanged. The model predicts the original token at
the selected positions only: every other target is IGNORE, so the loss, accuracy and perplexity cover the
selected positions alone. As in BERT's reference code (create_pretraining_data.py), the number selected is
fixed per sequence, max(1, round(mask_prob * length)), at positions drawn uniformly: no sequence is left
without a target. Windows of text come from the LM task (tasks/lm.py); evaluation is at 1x, 2x, 4x, 8x the
training context as for LM, on masks fixed by eval_seed."""
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import IterableDataset

from blocklab.tasks.base import IGNORE, ddp_rank
from blocklab.tasks.interface import TASKS
from blocklab.tasks.lm import LMTask, RandomWindows

MASK = "[MASK]"
MASK_STREAM = 0x6D6C6D << 32  # keeps the masks' random stream apart from the windows' (same seed and step)


def mask_tokens(tokens: Tensor, generator: torch.Generator, mask_id: int, n_random: int, mask_prob: float,
                mask_token_prob: float, random_token_prob: float) -> tuple[Tensor, Tensor]:
    """BERT's masking of (B, T) token ids -> (input, target). max(1, round(mask_prob * T)) positions per row are
    selected uniformly; each selected one becomes `mask_id` with probability mask_token_prob, a token drawn
    uniformly from [0, n_random) with probability random_token_prob, else stays. target holds the original
    token at the selected positions and IGNORE elsewhere. The same generator state gives the same masks."""
    batch, length = tokens.shape
    count = max(1, round(mask_prob * length))
    chosen = torch.rand(batch, length, generator=generator).argsort(dim=1)[:, :count]
    selected = torch.zeros(batch, length, dtype=torch.bool).scatter_(1, chosen, True)
    action = torch.rand(batch, length, generator=generator)
    random_ids = torch.randint(n_random, (batch, length), generator=generator)
    to_mask = selected & (action < mask_token_prob)
    to_random = selected & (action >= mask_token_prob) & (action < mask_token_prob + random_token_prob)
    inputs = torch.where(to_mask, mask_id, torch.where(to_random, random_ids, tokens))
    return inputs, torch.where(selected, tokens, IGNORE)


@TASKS.register("mlm")
class MLMTask(LMTask):
    """Masked LM over the LM task's corpus, tokenizer and windows, for an encoder-only model (model.arch=encoder).
    The tokenizer gains one special token, [MASK], after the corpus' own (the corpus never contains it)."""

    masked = True

    def __init__(self, mask_prob: float = 0.15, mask_token_prob: float = 0.8, random_token_prob: float = 0.1,
                 eval_seed: int = 1234, **lm):
        super().__init__(**lm)
        self.mask_prob, self.mask_token_prob, self.random_token_prob = mask_prob, mask_token_prob, random_token_prob
        self.eval_seed = eval_seed
        self.n_corpus_tokens = self.tok.get_vocab_size()  # random replacements are corpus tokens, never [MASK]
        self.tok.add_special_tokens([MASK])  # on this task's copy of the tokenizer; the cached file stays as it was
        self.mask_id = self.tok.token_to_id(MASK)

    @classmethod
    def errors(cls, cfg: dict) -> list[str]:
        errs = super().errors(cfg)
        probs = {key: cfg.get(key) for key in ("mask_prob", "mask_token_prob", "random_token_prob")}
        bad = [key for key, value in probs.items()
               if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1]
        errs += [f"task.{key}={probs[key]!r} must be a number in [0, 1]" for key in bad]
        if not bad and probs["mask_prob"] == 0:
            errs.append("task.mask_prob=0 selects no token to predict; use a fraction in (0, 1], e.g. 0.15 (BERT)")
        if not bad and probs["mask_token_prob"] + probs["random_token_prob"] > 1:
            errs.append(f"task.mask_token_prob + task.random_token_prob = "
                        f"{probs['mask_token_prob'] + probs['random_token_prob']:g} > 1: they split the selected "
                        "tokens with those left unchanged; make the sum at most 1 (BERT: 0.8 + 0.1)")
        seed = cfg.get("eval_seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            errs.append(f"task.eval_seed={seed!r} must be an integer")
        return errs

    def mask(self, tokens: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return mask_tokens(tokens, generator, self.mask_id, self.n_corpus_tokens, self.mask_prob,
                           self.mask_token_prob, self.random_token_prob)

    def _eval_generator(self, length: int) -> torch.Generator:
        """The masks of the evaluation windows of one length: fixed by eval_seed, whatever the training seed."""
        return torch.Generator().manual_seed(MASK_STREAM + self.eval_seed * 1_000_003 + length)

    def train_batches(self, start_step: int = 0) -> "MaskedWindows":
        return MaskedWindows(super().train_batches(start_step), self)

    def _batches(self, length: int, tokens_per_batch: int = 16384):
        """The LM task's validation windows of `length` tokens (their inputs), masked."""
        generator = self._eval_generator(length)
        for batch in super()._batches(length, tokens_per_batch):
            inputs, target = self.mask(batch["input"], generator)
            yield {**batch, "input": inputs, "target": target}

    def probe_batch(self, n: int) -> dict:
        batch = super().probe_batch(n)
        inputs, target = self.mask(batch["input"], self._eval_generator(self.block_size))
        return {**batch, "input": inputs, "target": target}

    @torch.no_grad()
    def evaluate(self, model) -> list[dict]:
        """Per length: loss, accuracy and perplexity on the selected (masked) positions only."""
        was_training = model.training
        model.eval()
        rows = []
        for mult, length in zip(self.eval_multipliers, self.eval_lengths):
            loss_sum = correct = scored = sequences = 0
            for batch in self._batches(length):
                logits = model(batch["input"])
                target = batch["target"]
                loss_sum += F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE,
                                            reduction="sum").item()
                selected = target != IGNORE
                correct += (logits.argmax(-1)[selected] == target[selected]).sum().item()
                scored += int(selected.sum())
                sequences += len(target)
            loss = loss_sum / scored if scored else None
            finite = loss is not None and math.isfinite(loss)
            rows.append({
                "length": length, "in_distribution": mult == 1, "exact_match": None,
                "token_acc": correct / scored if scored else None, "loss": loss if finite else None,
                "n": sequences, "multiplier": mult, "masked_tokens": scored,
                "perplexity": math.exp(min(loss, 700)) if finite else None,
            })
        model.train(was_training)
        return rows


class MaskedWindows(IterableDataset):
    """The LM task's random windows, masked; batch k's masks are a pure function of (seed, k) like its windows,
    so a resumed run sees the same batches as an uninterrupted one."""

    def __init__(self, windows: RandomWindows, task: MLMTask):
        self.windows, self.task = windows, task

    def __iter__(self) -> Iterator[dict]:
        step, seed = self.windows.start_step, self.windows.seed
        for batch in self.windows:
            generator = torch.Generator().manual_seed(MASK_STREAM + seed * 1_000_003 + step + 7919 * ddp_rank())
            inputs, target = self.task.mask(batch["input"], generator)
            yield {**batch, "input": inputs, "target": target}
            step += 1
