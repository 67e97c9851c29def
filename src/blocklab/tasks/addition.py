"""Addition: the model reads `a+b=` with operands of up to n digits and writes the sum then EOS.
Options: the answer's digits least-significant first (reverse_answer), operands zero-padded to n digits
with the sum padded to n+1 (pad_operands), which fixes every digit's position, and index hints
(index_hints; Zhou et al. 2024, "Transformers Can Achieve Length Generalization But Not Robustly", arXiv
2402.09371): each digit of the operands and of the sum preceded by the hint of its significance, so
digits to be added carry the same hint whatever their operand's length or the order it is written in.

Streams (tasks/placement.py), from the prompt alone; they need the sum's digit order known before it is
written, which reverse_answer (the i-th digit written has significance i) or pad_operands (the sum has n+1
digits) give; without either the sum's length, hence its first digit's significance, is unknown:
  positions    position coupling (Cho et al. 2024, "Position Coupling: Improving Length Generalization of
               Arithmetic Transformers Using Task Structure", arXiv 2405.20671): "we assign the same
               position IDs to two or more 'relevant' tokens; for integer addition tasks, we regard digits
               of the same significance as in the same position". As their Figure 2 and code, with m the
               longer operand's digit count and starting id 1: the digit of significance i of either
               operand and of the sum has id 1 + m - i (the sum's possible leading digit, significance m,
               has 1); '+' and '=' have m + 2, the id after the ones digits' (their `end`); EOS and the
               slots past the longest possible sum have 0 (their BOS/EOS id). Operands of different
               lengths are aligned by significance. A shorter sum's EOS falls in a slot with a digit's id,
               which nothing reads (EOS is predicted, never fed).
  digit_index  Abacus (McLeish et al. 2024, "Transformers Can Do Arithmetic with the Right Embeddings",
               arXiv 2405.17399): each digit's index within its own number, 1 for the ones digit, 2 for
               the tens... (McLeish et al. write every number least-significant first, so the index from a
               number's start is its significance; ours are written most-significant first, so the index
               is counted by significance), restarting at each number; 0 for '+', '=', EOS and hints.
A hint shares its digit's coupled id (it marks that significance, and the model writes the digit when it
reads the hint) and has digit_index 0 (Abacus indexes the digits themselves; the hint's symbol already
names the significance)."""
import itertools
import random
from collections import defaultdict

from blocklab.tasks.base import Example, SequenceTask, hint_errors, hint_names, hinted
from blocklab.tasks.interface import TASKS
from blocklab.tasks.placement import DIGIT_INDEX, POSITIONS


@TASKS.register("addition")
class AdditionTask(SequenceTask):
    supplies = frozenset({POSITIONS, DIGIT_INDEX})

    def __init__(self, reverse_answer: bool = True, pad_operands: bool = False, index_hints: bool = False,
                 hint_symbols: int = 102, **kwargs):
        self.reverse_answer, self.pad_operands = reverse_answer, pad_operands
        hints = hint_names(hint_symbols) if index_hints else []
        super().__init__([*"0123456789", "+", "=", *hints], **kwargs)
        self.hint_ids = tuple(self.ids[h] for h in hints)
        self.digit_ids = frozenset(self.ids[d] for d in "0123456789")

    @classmethod
    def errors(cls, cfg):
        return super().errors(cfg) or hint_errors(cfg, cls.hints_for)

    def placement_errors(self):
        errs = super().placement_errors()
        wanted = [s for s, on in (("pos.coupled=true", self.placement.coupled),
                                  ("pos.abacus=true", self.placement.abacus)) if on]
        if wanted and not self.reverse_answer and not self.pad_operands:
            errs.append(f"{' and '.join(wanted)} need{'s' if len(wanted) == 1 else ''} each digit's significance "
                        "before the sum is written, which task.reverse_answer=false with task.pad_operands=false "
                        "leaves unknown (the sum's length is not); set task.reverse_answer=true or "
                        "task.pad_operands=true")
        return errs

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

    @staticmethod
    def hints_for(length: int) -> int:
        return length + 1  # significances 0..length: the sum's digits

    def hints_needed(self, length):
        return self.hints_for(length)

    def with_hints(self, example, hints):
        plus = example.prompt.index(self.ids["+"])
        a, b, total = example.prompt[:plus], example.prompt[plus + 1:-1], example.answer[:-1]
        down = lambda n: list(range(n - 1, -1, -1))  # significances of a number written most-significant first
        sum_order = list(range(len(total))) if self.reverse_answer else down(len(total))
        return Example(prompt=hinted(a, down(len(a)), hints) + [self.ids["+"]] + hinted(b, down(len(b)), hints)
                       + [self.ids["="]],
                       answer=hinted(total, sum_order, hints) + [self.eos_id])

    def _per_digit(self) -> int:
        return 2 if self.hint_ids else 1

    def max_prompt_len(self, length):
        return 2 * self._per_digit() * length + 2

    def max_answer_len(self, length):
        return self._per_digit() * (length + 1) + 1

    def _significances(self, tokens: list[int], ones_first: bool) -> list[int]:
        """Each token's significance in a number written ones digit first or last: a digit's (0 for the ones),
        a hint that of the digit after it."""
        is_digit = [token in self.digit_ids for token in tokens]
        if ones_first:
            return list(itertools.accumulate(is_digit, initial=0))[:-1]  # digits before each token
        return [n - 1 for n in list(itertools.accumulate(reversed(is_digit)))[::-1]]  # digits from it to the end

    def read_keys(self, example):
        # A digit of the sum is read from the operands' digits of its significance (a hint from their hints);
        # the carry comes from lower places. The sum's leading carry digit reads no operand digit.
        plus = example.prompt.index(self.ids["+"])
        keys = defaultdict(list)
        for start, operand in ((0, example.prompt[:plus]), (plus + 1, example.prompt[plus + 1:-1])):
            for k, (sig, token) in enumerate(zip(self._significances(operand, ones_first=False), operand)):
                keys[sig, token in self.digit_ids].append(start + k)
        total = example.answer[:-1]
        return [keys.get((sig, token in self.digit_ids), [])
                for sig, token in zip(self._significances(total, ones_first=self.reverse_answer), total)] + [[]]

    def streams(self, prompt, length):
        """Each token's significance (None for '+', '=', EOS) and kind, then the ids and indices above."""
        plus = prompt.index(self.ids["+"])
        operands = prompt[:plus], prompt[plus + 1:-1]
        m = max(sum(t in self.digit_ids for t in operand) for operand in operands)
        significance, digit = [], []
        for operand in operands:
            significance += [*self._significances(operand, ones_first=False), None]  # then '+' or '='
            digit += [*(token in self.digit_ids for token in operand), False]
        order = range(m + 1) if self.reverse_answer else range(m, -1, -1)  # the longest sum's digits, as written
        for sig in order:
            if self.hint_ids:
                significance.append(sig)
                digit.append(False)
            significance.append(sig)
            digit.append(True)
        room = len(prompt) + self.max_answer_len(length) - len(significance)  # EOS and any slots past it
        significance += [None] * room
        digit += [False] * room
        separators = {plus, len(prompt) - 1}
        positions = [m + 2 if k in separators else 0 if sig is None else 1 + m - sig
                     for k, sig in enumerate(significance)]
        digit_index = [sig + 1 if is_digit else 0 for sig, is_digit in zip(significance, digit)]
        return {POSITIONS: positions, DIGIT_INDEX: digit_index}
