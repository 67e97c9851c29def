"""Periodic: the time-series case for strided attention (Child et al. 2019, sec. 4.1). The model reads `length`
tokens of a series of period P (`period`; its first P tokens random, length >= P) then SEP, and writes the
series' next P tokens then EOS.

Why it needs exactly P back: answer token k is predicted at the position just before it (SEP for k = 0), and
SEP shifts the answer one slot, so the series value it must write, and every copy of it, lie exactly P, 2P, ...
positions back from that query, never closer (EOS likewise needs SEP, P back). Any P consecutive values of the
series are independent uniform draws, so a query that sees fewer than P positions back knows nothing about its
answer token: a window of w keys through L layers reaches L*(w-1) back, and below P it guesses
(1/|alphabet| a token). attn=strided with attn.stride=P has the token P back in every query's support."""
import random

from blocklab.tasks.base import Example, SequenceTask
from blocklab.tasks.interface import TASKS

SEP = "<sep>"


@TASKS.register("periodic")
class PeriodicTask(SequenceTask):
    supports_seq2seq = False  # the claim is about distances in one causal stream

    def __init__(self, period: int = 8, alphabet: str = "abcdefghijklmnop", **kwargs):
        self.period, self.alphabet = period, list(alphabet)
        super().__init__([SEP, *self.alphabet], **kwargs)
        self.eval_lengths = [n for n in self.eval_lengths if n >= period]  # a shorter series holds no full period

    @classmethod
    def errors(cls, cfg):
        errs = super().errors(cfg)
        period, alphabet = cfg.get("period"), cfg.get("alphabet")
        if not isinstance(period, int) or isinstance(period, bool) or period <= 0:
            return errs + [f"task.period={period!r} must be a positive integer"]
        if not isinstance(alphabet, str) or len(alphabet) < 2 or len(set(alphabet)) != len(alphabet):
            errs.append(f"task.alphabet={alphabet!r} must be a string of at least 2 distinct characters")
        if isinstance(cfg.get("min_len"), int) and cfg["min_len"] < period:
            errs.append(f"task.min_len={cfg['min_len']} < task.period={period}: the series read must hold a whole "
                        "period; make min_len >= period")
        short = [n for n in cfg.get("eval_lengths") or [] if isinstance(n, int) and n < period]
        if short:
            errs.append(f"task.eval_lengths {short} are shorter than task.period={period}; use lengths >= period")
        return errs

    def sample(self, rng: random.Random, length: int) -> Example:
        cycle = [self.ids[ch] for ch in rng.choices(self.alphabet, k=self.period)]
        series = [cycle[t % self.period] for t in range(length + self.period)]
        return Example(prompt=series[:length] + [self.ids[SEP]], answer=series[length:] + [self.eos_id])

    def max_prompt_len(self, length):
        return length + 1

    def max_answer_len(self, length):
        return self.period + 1
