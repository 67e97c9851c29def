"""A task's reference levels: what a model that learned nothing scores, and the bar at which it has learned.

Each task states its own (Task.references), computed from its configuration or its data, and results.json records
them (`references`), so a findings page judges whether a compared setting learned without knowing the task:
  copy, addition (every SequenceTask): chance loss, ln of the number of tokens an answer holds (a uniform guess
      over them), and the bar: in-distribution exact match >= 0.9 (results.LEARNED_THRESHOLD);
  lm: the held-out losses of the corpus' unigram and bigram models, fitted on the training split by the task itself;
      an LM has learned when its validation loss is below the bigram's;
  mqar: chance accuracy 2/V (one of the V/2 values);
  mlm: chance loss ln V and the unigram loss (learned below the unigram's: a context-free guess), and with
      next-sentence prediction its chance accuracy 0.5.
Where the bar is a chance accuracy c, a task counts as learned more than halfway from chance to perfect,
(1 + c) / 2: at chance the model learned nothing; half way it answers most queries the guess would miss.

Metrics are named as results.json's eval rows name them (loss, exact_match, token_acc, next_sentence_acc), read at
the training lengths; nothing here imports torch."""
import math
from dataclasses import dataclass, field

import numpy as np

LEARNED_EXACT_MATCH = 0.9  # the same mark as results.LEARNED_THRESHOLD (tests/tasks/test_references.py holds them equal)
LOWER_IS_BETTER = ("loss",)


@dataclass(frozen=True)
class Level:
    """One reference level: `value` of the eval-row `metric` at the training lengths, named for a page
    (chance, unigram, bigram, learned)."""

    name: str
    metric: str
    value: float

    @property
    def lower_is_better(self) -> bool:
        return self.metric in LOWER_IS_BETTER

    def reached(self, score: float) -> bool:
        """Whether `score` clears this level as a bar: strictly below a loss, at or above a score."""
        return score < self.value if self.lower_is_better else score >= self.value

    def as_dict(self) -> dict:
        return {"name": self.name, "metric": self.metric, "value": self.value}


@dataclass(frozen=True)
class References:
    """A task's levels: `learned`, the bars a run must clear (all of them) to have learned its task in
    distribution; `lines`, further levels worth drawing (chance, unigram)."""

    learned: tuple[Level, ...]
    lines: tuple[Level, ...] = field(default=())

    def as_dict(self) -> dict:
        """results.json's `references`."""
        return {"learned": [x.as_dict() for x in self.learned], "lines": [x.as_dict() for x in self.lines]}

    @classmethod
    def from_dict(cls, value) -> "References | None":
        """From results.json (untrusted): None where it is not one."""
        if not isinstance(value, dict):
            return None
        try:
            levels = [tuple(Level(str(x["name"]), str(x["metric"]), float(x["value"])) for x in value.get(part) or [])
                      for part in ("learned", "lines")]
        except (TypeError, KeyError, ValueError, AttributeError):
            return None
        if not all(math.isfinite(x.value) for part in levels for x in part):
            return None
        return cls(*levels)


def chance_bar(metric: str, chance: float) -> Level:
    """The bar of a task scored against a chance accuracy: halfway from chance to perfect."""
    return Level("learned", metric, (1 + chance) / 2)


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab: int) -> float:
    """Held-out cross-entropy (nats per token) of the training split's unigram model, add-one smoothed over the
    vocabulary (Jurafsky & Martin, Speech and Language Processing, 3rd ed., ch. 3.5)."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab).astype(np.float64) + 1.0
    p = counts / counts.sum()
    return float(-np.log(p[val.astype(np.int64)]).mean())


def bigram_loss(train: np.ndarray, val: np.ndarray, vocab: int) -> float:
    """Held-out cross-entropy (nats per token, over val[1:] given the token before) of the training split's bigram
    model, Witten-Bell interpolated with the add-one unigram: P(w|v) = (c(v,w) + T(v) P(w)) / (c(v) + T(v)), T(v)
    the number of distinct tokens seen after v (Witten & Bell 1991; Chen & Goodman 1998, sec. 2.5): no parameter to
    tune, and a context never seen falls back to the unigram."""
    train, val = train.astype(np.int64), val.astype(np.int64)
    unigram = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    unigram /= unigram.sum()
    pairs, counts = np.unique(train[:-1] * vocab + train[1:], return_counts=True)
    context = np.bincount(train[:-1], minlength=vocab).astype(np.float64)
    types = np.bincount(pairs // vocab, minlength=vocab).astype(np.float64)
    asked = val[:-1] * vocab + val[1:]
    at = np.clip(np.searchsorted(pairs, asked), 0, len(pairs) - 1)
    seen = np.where(pairs[at] == asked, counts[at], 0).astype(np.float64)
    v, w = val[:-1], val[1:]
    p = (seen + types[v] * unigram[w]) / np.maximum(context[v] + types[v], 1.0)
    p = np.where(context[v] + types[v] > 0, p, unigram[w])
    return float(-np.log(p).mean())
