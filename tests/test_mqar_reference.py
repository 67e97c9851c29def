"""task=mqar's generator against Zoology's own (the oracle): `multiquery_ar` from zoology/data/multiquery_ar.py,
https://github.com/HazyResearch/zoology at commit dbcb60d2bd10a3cc7a89ee60c446c44900a4687f (the file's last change;
repository head d88d6f5), Apache License 2.0. Zoology is not on PyPI, so its generator is copied below: the body as
published (num_passes = 1, the default), returning (inputs, labels) in place of its DataSegment.

Ours draws with numpy's Generator (keys, values and the power-law gaps for all rows at once; the gaps by the
Gumbel-top-k trick) where Zoology draws row by row with the global np.random, so the two cannot agree token for
token from one seed. Checked instead: (1) from the same draws, the same sequences and labels (layout, alignment of
each label with its query, zeros where Zoology leaves them); (2) the same distributions: query gaps, key and value
vocabularies, the random filler."""
import numpy as np
import pytest
import torch

from blocklab.tasks import mqar as ours
from blocklab.tasks.base import IGNORE


def multiquery_ar(vocab_size, num_examples, input_seq_len, seed, power_a=0.01, num_kv_pairs=8, num_passes=1,
                  random_non_queries=True):
    """Zoology's generator, copied (dbcb60d); edits marked `# edit:`."""
    assert input_seq_len % 2 == 0, "input_seq_len must be even"
    assert vocab_size > input_seq_len
    assert num_kv_pairs * 2 * num_passes + num_kv_pairs * 2 <= input_seq_len

    np.random.seed(seed)

    # two tokens for key and value
    context_size = num_kv_pairs * 2 * num_passes

    # create keys so that each key is present exactly once in each example
    key_vocab_size = vocab_size // 2
    key_choices = np.arange(1, key_vocab_size)
    value_choices = np.arange(key_vocab_size, vocab_size)

    keys_unshuffled = np.tile(key_choices, (num_examples, 1))
    keys = np.apply_along_axis(np.random.choice, 1, keys_unshuffled, replace=False, size=num_kv_pairs)

    values_unshuffled = np.tile(value_choices, (num_examples, 1))
    values = np.apply_along_axis(np.random.choice, 1, values_unshuffled, replace=False, size=num_kv_pairs)

    # create sequences
    kvs = np.zeros((num_examples, context_size), dtype=np.int64)
    kvs[:, 0::2] = keys
    kvs[:, 1::2] = values
    kvs = np.tile(kvs, (1, num_passes))

    # compute power law
    space = (input_seq_len - context_size) // 2
    p = power_a * np.arange(1, space + 1) ** (power_a-1)
    p = p / p.sum()

    x = np.stack([np.arange(space, dtype=int)] * num_examples)
    gaps = np.apply_along_axis(np.random.choice, axis=1, arr=x, replace=False, p=p, size=num_kv_pairs)

    # queries and answers
    queries = np.zeros((num_examples, input_seq_len - context_size + 1), dtype=np.int64)
    np.put_along_axis(queries, (gaps * 2), values=keys, axis=1)
    examples = np.concatenate([
        kvs,
        queries
    ], axis=1)

    labels = np.full((num_examples, input_seq_len + 1), -100, dtype=np.int64)
    np.put_along_axis(labels, (gaps * 2) + context_size + 1, values=values, axis=1)

    inputs, labels = torch.tensor(examples[:, :-1]), torch.tensor(labels[:, 1:])

    # replace all the 0 with random values
    if random_non_queries:
        inputs[inputs == 0] = torch.randint(vocab_size, size=inputs.shape)[inputs == 0]
    return inputs, labels, gaps  # edit: was DataSegment(inputs, labels, slices=...); the gaps for the tests


def test_zoology_ignores_what_we_ignore():
    assert IGNORE == -100


@pytest.mark.parametrize("vocab, seq_len, pairs", [(96, 64, 4), (300, 128, 8), (600, 256, 64)])
def test_the_same_draws_give_zoologys_sequences_and_labels(monkeypatch, vocab, seq_len, pairs):
    rows = 64
    inputs, labels, gaps = multiquery_ar(vocab, rows, seq_len, seed=0, num_kv_pairs=pairs, random_non_queries=False)
    keys, values = inputs[:, 0:2 * pairs:2].numpy(), inputs[:, 1:2 * pairs:2].numpy()
    drawn = iter([keys, values])  # ours draws the keys, then the values
    monkeypatch.setattr(ours, "distinct", lambda rng, n, low, high, count: next(drawn))
    monkeypatch.setattr(ours, "power_law_gaps", lambda rng, n, space, count, a: gaps)
    got_inputs, got_targets = ours.mqar_batch(np.random.default_rng(0), rows, vocab, seq_len, pairs, 0.01,
                                              random_non_queries=False)
    assert torch.equal(got_inputs, inputs) and torch.equal(got_targets, labels)


def test_the_same_distributions_as_zoologys_generator():
    """Query gaps (each query's offset in the region, and the first key's alone), keys, values and filler, over
    20000 rows from each generator: frequencies within sampling error (4 standard errors of a binomial share)."""
    rows, vocab, seq_len, pairs, power_a = 20000, 40, 32, 4, 0.3
    theirs, their_labels, _ = multiquery_ar(vocab, rows, seq_len, seed=0, power_a=power_a, num_kv_pairs=pairs)
    mine, my_labels = ours.mqar_batch(np.random.default_rng(0), rows, vocab, seq_len, pairs, power_a)

    def close(a, b, count):
        a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        tolerance = 4 * np.sqrt(np.maximum(a * (1 - a), 1 / count) / count) * np.sqrt(2)
        assert np.all(np.abs(a - b) <= tolerance), (a, b)

    def shares(values, size):
        return np.bincount(np.asarray(values).ravel(), minlength=size)[:size] / np.asarray(values).size

    context = 2 * pairs
    for inputs, labels in ((theirs, their_labels), (mine, my_labels)):
        assert bool(((labels != IGNORE).sum(1) == pairs).all())
    position_shares = [shares((labels != IGNORE).nonzero()[:, 1].numpy(), seq_len) for labels in
                       (their_labels, my_labels)]
    close(*position_shares, rows * pairs)
    # where the first key is asked: its value's label (values are distinct in a row; filler may repeat the key)
    first = [(labels == inputs[:, 1:2]).int().argmax(1).numpy() for inputs, labels in
             ((theirs, their_labels), (mine, my_labels))]
    close(shares(first[0], seq_len), shares(first[1], seq_len), rows)
    keys = [inputs[:, 0:context:2].numpy() for inputs in (theirs, mine)]
    values = [inputs[:, 1:context:2].numpy() for inputs in (theirs, mine)]
    assert set(np.unique(keys[0])) == set(np.unique(keys[1])) == set(range(1, vocab // 2))
    assert set(np.unique(values[0])) == set(np.unique(values[1])) == set(range(vocab // 2, vocab))
    close(shares(keys[0], vocab), shares(keys[1], vocab), rows * pairs)
    filler = [inputs[:, context:][labels[:, context:] == IGNORE].numpy() for inputs, labels in
              ((theirs, their_labels), (mine, my_labels))]
    # the filler: Zoology's zeros replaced by uniform tokens of the whole vocabulary (the keys asked are not filler)
    close(shares(filler[0], vocab), shares(filler[1], vocab), min(len(filler[0]), len(filler[1])))
