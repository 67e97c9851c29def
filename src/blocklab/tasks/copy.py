"""Copy: the model reads `x SEP` and must write `x EOS`.

Options: index hints (Zhou et al. 2024): each character of the input and of the output preceded by the
hint of its index. end_marker: the prompt is `x EOS SEP`, so the answer `x EOS` repeats the prompt up to SEP
and stopping is copying one more token; under coupling the prompt's EOS takes the id after the last
character's, the id the answer's EOS would take, so the last character's query finds it at the same offset
as every character it copies (without the marker no token sits there: the model must notice an absence,
which it learns only at the training lengths). BlockLab's own test of why coupled models miss the end of
longer answers, not a published method. Streams (tasks/placement.py), from the prompt alone, since the answer's length is the
input's:
  positions    position coupling (Cho et al. 2024, "Position Coupling: Improving Length Generalization of
               Arithmetic Transformers Using Task Structure", arXiv 2405.20671): the i-th character of the
               input and the i-th of the output share one id. As in their copy task, with starting id 1:
               characters 2, 3, ... n+1 in the input and again in the output, SEP 1 (the id before the
               first output character's, as their '=' takes `start`), EOS 0 (their BOS/EOS and padding id).
  digit_index  Abacus (McLeish et al. 2024, "Transformers Can Do Arithmetic with the Right Embeddings",
               arXiv 2405.17399), for strings: 1, 2, ... n for the characters of the input and again of the
               output, 0 for SEP and EOS.
A hint shares its character's coupled id (it marks that index, and the model writes the character when
it reads the hint) and has digit_index 0 (Abacus indexes the characters themselves; the hint's symbol
already names its index)."""
import random

from blocklab.tasks.base import Example, SequenceTask, hint_errors, hint_names, hinted
from blocklab.tasks.interface import TASKS
from blocklab.tasks.placement import DIGIT_INDEX, POSITIONS

SEP = "<sep>"


@TASKS.register("copy")
class CopyTask(SequenceTask):
    supplies = frozenset({POSITIONS, DIGIT_INDEX})

    def __init__(self, alphabet: str = "abcdefghijklmnop", index_hints: bool = False, hint_symbols: int = 102,
                 end_marker: bool = False, **kwargs):
        self.alphabet = list(alphabet)
        self.end_marker = end_marker
        hints = hint_names(hint_symbols) if index_hints else []
        super().__init__([SEP, *self.alphabet, *hints], **kwargs)
        self.hint_ids = tuple(self.ids[h] for h in hints)

    @classmethod
    def errors(cls, cfg):
        errs = super().errors(cfg)
        alphabet = cfg.get("alphabet")
        if not isinstance(alphabet, str) or not alphabet or len(set(alphabet)) != len(alphabet):
            errs.append(f"task.alphabet={alphabet!r} must be a non-empty string of distinct characters")
        if not isinstance(cfg.get("end_marker", False), bool):
            errs.append(f"task.end_marker={cfg['end_marker']!r} must be true or false")
        return errs or hint_errors(cfg, cls.hints_for)

    def sample(self, rng: random.Random, length: int) -> Example:
        ids = [self.ids[ch] for ch in rng.choices(self.alphabet, k=length)]
        return Example(prompt=ids + self._end() + [self.ids[SEP]], answer=ids + [self.eos_id])

    def _end(self) -> list[int]:
        return [self.eos_id] if self.end_marker else []

    def _copied(self, prompt: list[int]) -> list[int]:
        """The prompt's tokens the answer copies (hints included): all but the end marker and SEP."""
        return prompt[:len(prompt) - 1 - self.end_marker]

    def read_keys(self, example):
        # The answer repeats the prompt before SEP token for token (hints included): place p reads prompt[p],
        # and its EOS reads the end marker where there is one (else nothing in the prompt says where to stop).
        chars = len(self._copied(example.prompt))
        return [[place] for place in range(chars)] + [[chars] if self.end_marker else []]

    @staticmethod
    def hints_for(length: int) -> int:
        return length

    def hints_needed(self, length):
        return self.hints_for(length)

    def with_hints(self, example, hints):
        chars = self._copied(example.prompt)
        marked = hinted(chars, list(range(len(chars))), hints)
        return Example(prompt=marked + self._end() + example.prompt[-1:], answer=marked + [self.eos_id])

    def _per_token(self) -> int:
        return 2 if self.hint_ids else 1

    def max_prompt_len(self, length):
        return self._per_token() * length + 1 + self.end_marker

    def max_answer_len(self, length):
        return self._per_token() * length + 1

    def streams(self, prompt, length):
        hints = set(self.hint_ids)
        index, indices, is_char = 0, [], []  # each input token's character index (0-based), and whether a character
        for token in self._copied(prompt):
            indices.append(index)
            is_char.append(token not in hints)
            index += token not in hints  # a hint takes the index of the character after it
        end = [index + 2] if self.end_marker else []  # the marker: the id after the last character's
        room = self.max_answer_len(length) - len(indices)  # EOS and any slots past it
        positions = [i + 2 for i in indices] + end + [1] + [i + 2 for i in indices] + [0] * room
        digit_index = [(i + 1) * c for i, c in zip(indices, is_char)]
        digit_index = digit_index + [0] * len(end) + [0] + digit_index + [0] * room
        return {POSITIONS: positions, DIGIT_INDEX: digit_index}
