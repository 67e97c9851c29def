"""Addition: the model reads `a+b=` with operands of up to n digits and writes the sum then EOS.
Options: the answer's digits least-significant first (reverse_answer), and operands zero-padded
to n digits with the sum padded to n+1 (pad_operands), which fixes every digit's position."""
import random

from blocklab.tasks.base import Example, SequenceTask
from blocklab.tasks.interface import TASKS


@TASKS.register("addition")
class AdditionTask(SequenceTask):
    def __init__(self, reverse_answer: bool = True, pad_operands: bool = False, **kwargs):
        self.reverse_answer, self.pad_operands = reverse_answer, pad_operands
        super().__init__([*"0123456789", "+", "="], **kwargs)

    def format(self, a: int, b: int, digits: int) -> tuple[str, str]:
        width = digits if self.pad_operands else 0
        answer = str(a + b).zfill(width + 1 if width else 0)
        if self.reverse_answer:
            answer = answer[::-1]
        return f"{str(a).zfill(width)}+{str(b).zfill(width)}=", answer

    def sample(self, rng: random.Random, length: int) -> Example:
        a, b = rng.randrange(10**length), rng.randrange(10**length)
        prompt, answer = self.format(a, b, length)
        return Example(prompt=self.encode(prompt), answer=self.encode(answer) + [self.eos_id])

    def max_prompt_len(self, length):
        return 2 * length + 2

    def max_answer_len(self, length):
        return length + 2
