"""Max: a global probe for exercise 1.2 (attention patterns). The model reads `length` digits and SEP, and writes
the largest digit, then EOS.

Which attention it provokes and why: the answer is a function of the whole string that no position nearer the
query summarises, and the largest digit may sit anywhere in it, so the query (SEP) must look at every digit; a
head can do it in one step by scoring keys by their digit's value, which puts its weight on the maximum wherever
it is (content-selected, position-free: long mean distance). The maximum m is drawn first, uniform over the
digits, then the other digits uniform in [0, m] with m at one random place, so every answer is as likely (chance
1/10) and `9` is not a shortcut (plain uniform digits would make it the answer of 57% of 8-digit strings)."""
import random

from blocklab.tasks.base import Example, SequenceTask
from blocklab.tasks.interface import TASKS

SEP = "<sep>"
DIGITS = "0123456789"


@TASKS.register("max")
class MaxTask(SequenceTask):
    supports_seq2seq = False  # the claim is about where one causal query looks

    def __init__(self, **kwargs):
        super().__init__([SEP, *DIGITS], **kwargs)

    def sample(self, rng: random.Random, length: int) -> Example:
        top = rng.randrange(len(DIGITS))
        digits = [rng.randint(0, top) for _ in range(length)]
        digits[rng.randrange(length)] = top
        return Example(prompt=[self.ids[DIGITS[d]] for d in digits] + [self.ids[SEP]],
                       answer=[self.ids[DIGITS[top]], self.eos_id])

    def max_prompt_len(self, length):
        return length + 1

    def max_answer_len(self, length):
        return 2
