"""Keyed: a token every query must see (the `global` case, Beltagy et al. 2020). The model reads a key (its own
symbol <keyK>, K in 0..|alphabet|-1), `length` random tokens of the alphabet and SEP, and writes the key's letter,
alphabet[K], then EOS.

Why it needs the first token: the query that predicts the answer (SEP) has the key length + 1 positions back, and
the key is drawn independently of everything after it, so a query that sees fewer than length + 1 positions back
(a window of w keys through L layers reaches L*(w-1)) can only guess: 1/|alphabet|. attn=global makes the first
attn.n_global >= 1 tokens visible to every query. One answer token by design: a second one would let a window copy
the first. The answer is the key itself, not the last token shifted by it: a 2-layer, 64-wide model did not learn
that modular sum in 1000 steps even at length 1 (chance exact match), so it would not tell patterns apart."""
import random

from blocklab.tasks.base import Example, SequenceTask
from blocklab.tasks.interface import TASKS

SEP = "<sep>"


@TASKS.register("keyed")
class KeyedTask(SequenceTask):
    supports_seq2seq = False  # the claim is about distances in one causal stream

    def __init__(self, alphabet: str = "abcdefgh", **kwargs):
        self.alphabet = list(alphabet)
        self.keys = [f"<key{k}>" for k in range(len(alphabet))]
        super().__init__([SEP, *self.keys, *self.alphabet], **kwargs)

    @classmethod
    def errors(cls, cfg):
        errs = super().errors(cfg)
        alphabet = cfg.get("alphabet")
        if not isinstance(alphabet, str) or len(alphabet) < 2 or len(set(alphabet)) != len(alphabet):
            errs.append(f"task.alphabet={alphabet!r} must be a string of at least 2 distinct characters")
        return errs

    def sample(self, rng: random.Random, length: int) -> Example:
        key = rng.randrange(len(self.alphabet))
        body = [self.ids[ch] for ch in rng.choices(self.alphabet, k=length)]
        return Example(prompt=[self.ids[self.keys[key]], *body, self.ids[SEP]],
                       answer=[self.ids[self.alphabet[key]], self.eos_id])

    def max_prompt_len(self, length):
        return length + 2

    def max_answer_len(self, length):
        return 2
