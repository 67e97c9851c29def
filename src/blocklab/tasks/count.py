"""Count: a global, uniform probe for exercise 1.2 (attention patterns). The model reads `length` letters of the
alphabet and a query symbol <#x> naming one letter x, and writes how many times x occurs (decimal), then EOS.

Which attention it provokes and why: every letter of the string counts the same, wherever it is, so the query
must weigh all of them alike: a head attending uniformly over the prefix (or over the matching letters and a fixed
sink) turns the share of matches into the count. Its attention rows are flat and long (high entropy, mean
distance about half the length), the opposite of a local head. Each letter is drawn uniformly and independently,
so no part of the string predicts the count of another."""
import random

from blocklab.tasks.base import Example, SequenceTask
from blocklab.tasks.interface import TASKS

QUERY = "<#{}>"  # the query symbol naming the letter to count


@TASKS.register("count")
class CountTask(SequenceTask):
    supports_seq2seq = False  # the claim is about where one causal query looks

    def __init__(self, alphabet: str = "abcd", **kwargs):
        self.alphabet = list(alphabet)
        self.queries = [QUERY.format(ch) for ch in alphabet]
        super().__init__([*self.alphabet, *self.queries, *"0123456789"], **kwargs)

    @classmethod
    def errors(cls, cfg):
        errs = super().errors(cfg)
        alphabet = cfg.get("alphabet")
        if not isinstance(alphabet, str) or not alphabet or len(set(alphabet)) != len(alphabet) \
                or any(ch.isdigit() for ch in alphabet):
            errs.append(f"task.alphabet={alphabet!r} must be a non-empty string of distinct non-digit characters "
                        "(digits write the count)")
        return errs

    def sample(self, rng: random.Random, length: int) -> Example:
        letters = rng.choices(self.alphabet, k=length)
        query = rng.randrange(len(self.alphabet))
        count = letters.count(self.alphabet[query])
        return Example(prompt=[self.ids[ch] for ch in letters] + [self.ids[self.queries[query]]],
                       answer=[self.ids[d] for d in str(count)] + [self.eos_id])

    def max_prompt_len(self, length):
        return length + 1

    def max_answer_len(self, length):
        return len(str(length)) + 1
