"""Masked language modelling (BERT: Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers
for Language Understanding", NAACL, section 3.1 "Task #1: Masked LM" and appendix A.1) on the LM corpora.

In each sequence a fraction `mask_prob` (15%) of the positions is selected for prediction; of those, 80% are
replaced by [MASK], 10% by a random token and 10% are left unchanged. The model predicts the original token at
the selected positions only: every other target is IGNORE, so the loss, accuracy and perplexity cover the
selected positions alone. As in BERT's reference code (create_pretraining_data.py), the number selected is
fixed per sequence, max(1, round(mask_prob * length)), at positions drawn uniformly: no sequence is left
without a target. Windows of text come from the LM task (tasks/lm.py); evaluation is at 1x, 2x, 4x, 8x the
training context as for LM, on masks fixed by eval_seed.

With `nsp=true`, BERT's second pretraining task (section 3.1, "Task #2: Next Sentence Prediction"): each
sequence is a pair [CLS] A [SEP] B [SEP]; half the time B is the text that followed A, half the time a span from
elsewhere in the corpus, and the model classifies which from [CLS]'s final state. Sentences here are spans of
tokens: a window of block_size - 3 tokens is split at a uniform point into A and B (the corpus has no sentence
boundaries BERT's documents had). [CLS] and [SEP] are never masked; the loss trained on is the masked-LM loss
plus the pair's cross-entropy, and each length row reports next_sentence_acc. With `nsp_loss=false` the sequences
are the same pairs but no classifier is trained on them: the masked LM alone on NSP's inputs, so that the masked-LM
losses with and without next-sentence prediction are measured on one input format (sweeps/mlm_nsp.yaml)."""
import math
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import IterableDataset

from blocklab.schema import SEED_MAX
from blocklab.tasks.base import IGNORE, ddp_rank, device_of, model_inputs, on_device
from blocklab.tasks.interface import TASKS, stream_steps
from blocklab.tasks.lm import LMTask, RandomWindows
from blocklab.tasks.references import Level, References, chance_bar, unigram_loss

MASK, CLS, SEP = "[MASK]", "[CLS]", "[SEP]"
MASK_STREAM = 0x6D6C6D << 32  # keeps the masks' random stream apart from the windows' (same seed and step)
PAIR_STREAM = 0x6E7370 << 32  # and the sentence pairs' from both


def mask_tokens(tokens: Tensor, generator: torch.Generator, mask_id: int, n_random: int, mask_prob: float,
                mask_token_prob: float, random_token_prob: float,
                maskable: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """BERT's masking of (B, T) token ids -> (input, target). max(1, round(mask_prob * T)) positions per row are
    selected uniformly (T: the row's maskable positions, where `maskable` (B, T) is given: every row the same
    count); each selected one becomes `mask_id` with probability mask_token_prob, a token drawn
    uniformly from [0, n_random) with probability random_token_prob, else stays. target holds the original
    token at the selected positions and IGNORE elsewhere. The same generator state gives the same masks."""
    batch, length = tokens.shape
    scores = torch.rand(batch, length, generator=generator)
    candidates = length
    if maskable is not None:
        scores = scores.masked_fill(~maskable, 2.0)  # sorted after every maskable position: never chosen
        candidates = int(maskable.sum(dim=1).min())
    count = max(1, round(mask_prob * candidates))
    chosen = scores.argsort(dim=1)[:, :count]
    selected = torch.zeros(batch, length, dtype=torch.bool).scatter_(1, chosen, True)
    action = torch.rand(batch, length, generator=generator)
    random_ids = torch.randint(n_random, (batch, length), generator=generator)
    to_mask = selected & (action < mask_token_prob)
    to_random = selected & (action >= mask_token_prob) & (action < mask_token_prob + random_token_prob)
    inputs = torch.where(to_mask, mask_id, torch.where(to_random, random_ids, tokens))
    return inputs, torch.where(selected, tokens, IGNORE)


def random_spans(ids: Tensor, count: int, length: int, generator: torch.Generator) -> Tensor:
    """(count, length) spans of the text `ids`, each starting at a uniform position."""
    starts = torch.randint(len(ids) - length, (count,), generator=generator)
    return ids[starts[:, None] + torch.arange(length)]


def sentence_pairs(first: Tensor, other: Tensor, generator: torch.Generator, cls_id: int, sep_id: int) -> dict:
    """BERT's next-sentence pairs from (B, n) token windows, n >= 2. Row i splits at s drawn uniformly from
    [1, n-1]: sentence A is first[i, :s]; sentence B is first[i, s:], the text that followed A (is_next), with
    probability 1/2, else other[i, s:], a span of the same length from elsewhere. Returns `input`
    [CLS] A [SEP] B [SEP] (B, n + 3), `segment` (0 through the first [SEP], 1 after it), `is_next` (B,) and
    `special` (B, n + 3): True at [CLS] and [SEP]."""
    batch, n = first.shape
    split = torch.randint(1, n, (batch, 1), generator=generator)
    is_next = torch.rand(batch, generator=generator) < 0.5
    second = torch.where(is_next[:, None], first, other)
    at = torch.arange(n + 3).expand(batch, -1)  # position in the pair
    in_a, in_b = (at >= 1) & (at <= split), (at >= split + 2) & (at <= n + 1)
    ids = torch.where(in_a, first.gather(1, (at - 1).clamp(0, n - 1)),
                      torch.where(in_b, second.gather(1, (at - 2).clamp(0, n - 1)), sep_id))
    ids[:, 0] = cls_id
    return {"input": ids, "segment": (at > split + 1).long(), "is_next": is_next, "special": ~(in_a | in_b)}


@TASKS.register("mlm")
class MLMTask(LMTask):
    """Masked LM over the LM task's corpus, tokenizer and windows, for an encoder-only model (model.arch=encoder).
    The tokenizer gains one special token, [MASK], after the corpus' own (the corpus never contains it)."""

    masked = True

    def __init__(self, mask_prob: float = 0.15, mask_token_prob: float = 0.8, random_token_prob: float = 0.1,
                 eval_seed: int = 1234, nsp: bool = False, nsp_loss: bool = True, **lm):
        super().__init__(**lm)
        self.mask_prob, self.mask_token_prob, self.random_token_prob = mask_prob, mask_token_prob, random_token_prob
        self.eval_seed, self.nsp = eval_seed, nsp
        self.classify = nsp and nsp_loss  # pairs scored by the classifier; nsp_loss=false: the pairs alone
        self.n_corpus_tokens = self.tok.get_vocab_size()  # random replacements are corpus tokens, never specials
        self.tok.add_special_tokens([MASK])  # on this task's copy of the tokenizer; the cached file stays as it was
        self.mask_id = self.tok.token_to_id(MASK)
        if nsp:
            self.tok.add_special_tokens([CLS, SEP])
            self.cls_id, self.sep_id = self.tok.token_to_id(CLS), self.tok.token_to_id(SEP)
            self.segments = 2

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
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= SEED_MAX:
            errs.append(f"task.eval_seed={seed!r} must be an integer in [0, {SEED_MAX}] (torch seeds the masks "
                        "from it times 1000003)")
        block = cfg.get("block_size")  # task.nsp's type the registry checks against the signature's default
        if cfg.get("nsp") is True and isinstance(block, int) and block < 5:
            errs.append(f"task.nsp=true with task.block_size={block}: a pair [CLS] A [SEP] B [SEP] needs at least "
                        "5 tokens; raise block_size")
        if cfg.get("nsp_loss") is False and cfg.get("nsp") is not True:
            errs.append("task.nsp_loss=false drops the classifier of task.nsp's sentence pairs, and task.nsp is not "
                        "true; set task.nsp=true (the pairs without their classifier) or leave task.nsp_loss=true")
        return errs

    def references(self) -> References:
        """Chance loss ln V over the corpus' tokens, and the unigram loss: a masked token guessed without its
        context. Learned: a validation loss below the unigram's and, with next-sentence prediction, a pair
        classifier (where one is trained) halfway from chance (0.5) to perfect."""
        unigram = unigram_loss(self.train_ids, self.val_ids, self.n_corpus_tokens)
        nsp = self.classify
        learned = (Level("unigram", "loss", unigram), *((chance_bar("next_sentence_acc", 0.5),) if nsp else ()))
        return References(learned, (Level("chance", "loss", math.log(self.n_corpus_tokens)),
                                    *((Level("chance", "next_sentence_acc", 0.5),) if nsp else ())))

    def mask(self, tokens: Tensor, generator: torch.Generator,
             maskable: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return mask_tokens(tokens, generator, self.mask_id, self.n_corpus_tokens, self.mask_prob,
                           self.mask_token_prob, self.random_token_prob, maskable)

    def pairs(self, first: Tensor, ids: Tensor, generator: torch.Generator) -> dict:
        """A masked batch of sentence pairs from (B, n) windows `first` of the text `ids`: the other sentences
        are spans starting anywhere in it."""
        other = random_spans(ids, len(first), first.shape[1], generator)
        pair = sentence_pairs(first, other, generator, self.cls_id, self.sep_id)
        inputs, target = self.mask(pair["input"], generator, ~pair["special"])
        return {"input": inputs, "target": target, "valid": torch.ones_like(inputs, dtype=torch.bool),
                "segment": pair["segment"], "is_next": pair["is_next"]}

    def _eval_generator(self, length: int) -> torch.Generator:
        """The masks of the evaluation windows of one length: fixed by eval_seed, whatever the training seed."""
        return torch.Generator().manual_seed(MASK_STREAM + self.eval_seed * 1_000_003 + length)

    def train_batches(self, start_step: int = 0) -> "MaskedWindows | SentencePairs":
        if self.nsp:
            return SentencePairs(self, start_step)
        return MaskedWindows(super().train_batches(start_step), self)

    def _batches(self, length: int, tokens_per_batch: int = 16384):
        """The LM task's validation windows of `length` tokens (their inputs), masked; with nsp, as sentence
        pairs of `length` tokens in all."""
        generator = self._eval_generator(length)
        if self.nsp:
            ids = torch.from_numpy(self.val_ids.astype(np.int64))
            windows = self.windows(length - 3)[:, :-1]
            rows = max(1, tokens_per_batch // length)
            for start in range(0, len(windows), rows):
                yield {**self.pairs(windows[start:start + rows], ids, generator), "length": length}
            return
        for batch in super()._batches(length, tokens_per_batch):
            inputs, target = self.mask(batch["input"], generator)
            yield {**batch, "input": inputs, "target": target}

    def probe_batch(self, n: int) -> dict:
        if self.nsp:
            batch = next(self._batches(self.block_size))
            return {key: value[:n] for key, value in batch.items() if key != "length"}
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
            loss_sum = correct = scored = sequences = pairs_right = 0
            for batch in self._batches(length):
                batch = on_device(batch, device_of(model))
                out = model(batch["input"], **model_inputs(batch), **({"sentence": True} if self.classify else {}))
                logits, sentence = out if self.classify else (out, None)
                if sentence is not None:
                    pairs_right += (sentence.argmax(-1) == batch["is_next"].long()).sum().item()
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
                **({"next_sentence_acc": pairs_right / sequences if sequences else None} if self.classify else {}),
            })
        model.train(was_training)
        return rows


class MaskedWindows(IterableDataset):
    """The LM task's random windows, masked; batch k's masks are a pure function of (seed, k) like its windows,
    so a resumed run sees the same batches as an uninterrupted one."""

    def __init__(self, windows: RandomWindows, task: MLMTask):
        self.windows, self.task = windows, task

    def __iter__(self) -> Iterator[dict]:
        seed = self.windows.seed
        for step, batch in zip(stream_steps(self.windows.start_step), self.windows):
            generator = torch.Generator().manual_seed(MASK_STREAM + seed * 1_000_003 + step + 7919 * ddp_rank())
            inputs, target = self.task.mask(batch["input"], generator)
            yield {**batch, "input": inputs, "target": target}


class SentencePairs(IterableDataset):
    """Endless batches of masked sentence pairs of block_size tokens (task.nsp); batch k is a pure function of
    (seed, k), so a resumed run sees the same batches as an uninterrupted one."""

    def __init__(self, task: MLMTask, start_step: int = 0):
        self.task, self.start_step = task, start_step

    def __iter__(self) -> Iterator[dict]:
        task = self.task
        ids = torch.from_numpy(task.train_ids.astype(np.int64))
        span = task.block_size - 3  # A and B together, besides [CLS] and two [SEP]
        for step in stream_steps(self.start_step):
            generator = torch.Generator().manual_seed(PAIR_STREAM + task.seed * 1_000_003 + step + 7919 * ddp_rank())
            pairs = task.pairs(random_spans(ids, task.batch_size, span, generator), ids, generator)
            # Without is_next the batch is scored as a masked LM alone (train/module.py classifies batches holding it)
            yield pairs if task.classify else {k: v for k, v in pairs.items() if k != "is_next"}
