"""Brackets: a data-dependent-distance probe for exercise 1.2 (attention patterns). The model reads `length`
brackets, a prefix of a well-nested string over the pairs (default `()[]`) with at least one bracket left open,
and SEP, and writes the closing bracket of the innermost open one (the top of the stack), then EOS.

Which attention it provokes and why: the answer is one earlier token, the innermost opening bracket not yet closed,
and how far back it lies depends on the content: right before SEP after `([`, far back after `([][][]`. Its type is
drawn independently of everything else, so nothing else tells it (a guess gets 1/|pairs|). A head must find the
position whose nesting depth matches the current one: sharp attention (low entropy) at a distance that varies
from example to example, between the local heads of repeats and the flat ones of counting.

Construction, so the distance is spread and not mostly 1: any prefix (a random walk: open a bracket of a random
type, always when none is open, else close the innermost, 1/2 each), then the answer's opening bracket, then a
random balanced string of 2k brackets, k uniform in 0..(length-1)//2; the answer's bracket is 2k + 1 back from SEP.
(A plain random walk leaves the innermost open bracket right before SEP in about 3 strings of 4 at length 8,
which copying the last token solves.)"""
import random

from blocklab.tasks.base import Example, SequenceTask
from blocklab.tasks.interface import TASKS

SEP = "<sep>"


@TASKS.register("brackets")
class BracketsTask(SequenceTask):
    supports_seq2seq = False  # the claim is about where one causal query looks

    def __init__(self, pairs: str = "()[]", **kwargs):
        self.pairs = pairs
        super().__init__([SEP, *pairs], **kwargs)

    @classmethod
    def errors(cls, cfg):
        errs = super().errors(cfg)
        pairs = cfg.get("pairs")
        if not isinstance(pairs, str) or len(pairs) < 2 or len(pairs) % 2 or len(set(pairs)) != len(pairs):
            errs.append(f"task.pairs={pairs!r} must list opening and closing brackets alternately, all distinct, "
                        "e.g. task.pairs='()[]'")
        return errs

    def sample(self, rng: random.Random, length: int) -> Example:
        opening, closing = self.pairs[0::2], self.pairs[1::2]
        inner = 2 * rng.randint(0, (length - 1) // 2)  # the balanced run after the answer's bracket
        stack, text = [], []  # stack: the types of the open brackets, innermost last
        for _ in range(length - 1 - inner):  # any prefix: open (always when none is open) or close the innermost
            if stack and rng.random() < 0.5:
                text.append(closing[stack.pop()])
            else:
                stack.append(rng.randrange(len(opening)))
                text.append(opening[stack[-1]])
        kind = rng.randrange(len(opening))
        text.append(opening[kind])
        depth = 0
        for left in range(inner, 0, -1):  # a random balanced string: open while room is left to close, else close
            if depth == 0 or (depth < left and rng.random() < 0.5):
                stack.append(rng.randrange(len(opening)))
                text.append(opening[stack[-1]])
                depth += 1
            else:
                text.append(closing[stack.pop()])
                depth -= 1
        return Example(prompt=[self.ids[ch] for ch in text] + [self.ids[SEP]],
                       answer=[self.ids[closing[kind]], self.eos_id])

    def max_prompt_len(self, length):
        return length + 1

    def max_answer_len(self, length):
        return 2
