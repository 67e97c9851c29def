"""Where tokens sit: the per-token integer streams a task can supply next to its tokens (position ids,
digit indices), and the length-generalization methods that act on them.

A stream covers an example's prompt and the `max_answer_len` tokens after it, and is a function of the
prompt alone, so decoding can read it ahead of the answer it writes. Streams:
  positions    position ids the position scheme reads (default: 0, 1, 2 ...)
  digit_index  1, 2, 3 ... for the digits or characters of each number or string, 0 elsewhere (Abacus)
"""
import random
from dataclasses import dataclass

POSITIONS, DIGIT_INDEX = "positions", "digit_index"
STREAMS = (POSITIONS, DIGIT_INDEX)


@dataclass(frozen=True)
class Placement:
    """The pos group's settings that every scheme shares (config.yaml's `pos:` block).

    coupled        position coupling (Cho et al. 2024): the task's position ids give tokens of equal
                   significance (the i-th digit of each operand and of the sum) one shared id.
    coupled_offset K: in training only, each sequence's coupled ids (all but 0, which marks tokens with no
                   coupled position) shift by a k drawn uniformly from [0, K], so the ids longer operands
                   need at test time were trained. Cho et al. draw each training sequence's starting
                   position id at random ("The starting position ID '6' is an arbitrarily chosen number",
                   their Figure 2; their code: start uniform in [1, max_pos - n) when training, 1 when
                   evaluating); K plays the part of max_pos. Not with random_max, which already trains
                   every id below L.
    abacus         Abacus embeddings (McLeish et al. 2024): each digit gets a learned embedding of its
                   index within its own number, from the task's digit_index stream.
    abacus_offset  K: in training only, each sequence's digit indices are shifted by a k drawn
                   uniformly from [0, K], so indices longer numbers need at test time were trained.
    random_max     L, or None: randomized positions (Ruoss et al. 2023). Each sequence's position ids
                   are replaced by a sorted random sample of distinct values from [0, L), in training
                   and at evaluation alike (as the paper's models do: they never see the plain ids
                   0..n-1), so positions up to L are all trained, whatever the training length.
    """

    coupled: bool = False
    abacus: bool = False
    abacus_offset: int = 0
    random_max: int | None = None
    coupled_offset: int = 0

    @classmethod
    def from_pos(cls, pos: dict) -> "Placement":
        """From the resolved pos group (its shared keys; the scheme's own options are ignored)."""
        return cls(coupled=bool(pos.get("coupled", False)), abacus=bool(pos.get("abacus", False)),
                   abacus_offset=int(pos.get("abacus_offset") or 0),
                   random_max=pos.get("random_max") if pos.get("randomize", False) else None,
                   coupled_offset=int(pos.get("coupled_offset") or 0))

    @property
    def streams(self) -> tuple[str, ...]:
        """The streams a task must supply for these settings."""
        return tuple(name for name, wanted in ((POSITIONS, self.coupled), (DIGIT_INDEX, self.abacus)) if wanted)

    @property
    def explicit_positions(self) -> bool:
        """Whether batches carry position ids (else the model counts 0, 1, 2 ...)."""
        return self.coupled or self.random_max is not None

    def max_position(self, longest_sequence: int) -> int:
        """One more than the largest position id a model under these settings can see (coupled ids are
        below the sequence's length, then shifted by up to coupled_offset in training)."""
        if self.random_max is not None:
            return self.random_max
        return longest_sequence + (self.coupled_offset if self.coupled else 0)

    def place(self, streams: dict[str, list[int]], length: int, rng: random.Random, training: bool) -> dict:
        """The streams a batch carries for one example of `length` tokens (prompt and answer room):
        the task's own, then randomized positions or the coupled training offset, and the Abacus
        training offset, drawn from `rng`."""
        out = {}
        if self.explicit_positions:
            positions = streams[POSITIONS] if self.coupled else list(range(length))
            if self.random_max:
                positions = randomized(positions, self.random_max, rng)
            elif self.coupled and training and self.coupled_offset:
                shift = rng.randint(0, self.coupled_offset)
                positions = [p + shift if p else 0 for p in positions]
            out[POSITIONS] = positions
        if self.abacus:
            shift = rng.randint(0, self.abacus_offset) if training and self.abacus_offset else 0
            out[DIGIT_INDEX] = [index + shift if index else 0 for index in streams[DIGIT_INDEX]]
        return out


def randomized(positions: list[int], random_max: int, rng: random.Random) -> list[int]:
    """Ruoss et al. 2023: map the ids 0..m-1 in order onto a sorted sample of m distinct values from
    [0, random_max). Equal ids (coupled positions) stay equal, and order is kept."""
    sample = sorted(rng.sample(range(random_max), max(positions) + 1))
    return [sample[p] for p in positions]
