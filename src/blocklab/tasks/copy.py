"""Copy: the model reads `x SEP` and must write `x EOS`."""
import random

from blocklab.tasks.base import Example, SequenceTask
from blocklab.tasks.interface import TASKS

SEP = "<sep>"


@TASKS.register("copy")
class CopyTask(SequenceTask):
    def __init__(self, alphabet: str = "abcdefghijklmnop", **kwargs):
        self.alphabet = list(alphabet)
        super().__init__([SEP, *self.alphabet], **kwargs)

    @classmethod
    def errors(cls, cfg):
        errs = super().errors(cfg)
        alphabet = cfg.get("alphabet")
        if not isinstance(alphabet, str) or not alphabet or len(set(alphabet)) != len(alphabet):
            errs.append(f"task.alphabet={alphabet!r} must be a non-empty string of distinct characters")
        return errs

    def sample(self, rng: random.Random, length: int) -> Example:
        ids = [self.ids[ch] for ch in rng.choices(self.alphabet, k=length)]
        return Example(prompt=ids + [self.ids[SEP]], answer=ids + [self.eos_id])

    def max_prompt_len(self, length):
        return length + 1

    def max_answer_len(self, length):
        return length + 1
