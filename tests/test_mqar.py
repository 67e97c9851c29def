"""task=mqar (Zoology's multi-query associative recall): every scored position is a key asked in the query region,
and its target is the value that key was paired with in the prefix; keys are distinct and from the key half of the
vocabulary, values from the other half; queries sit at even offsets, drawn by Zoology's power law; batches are a
pure function of the seed; evaluation scores the queried values only; bad config is one line per problem."""
import numpy as np
import pytest
import torch
from torch import nn

from blocklab.tasks import build_task, task_errors
from blocklab.tasks.base import IGNORE
from blocklab.tasks.mqar import MQARTask, mqar_batch, power_law_gaps

CFG = dict(name="mqar", vocab_size=96, seq_len=32, num_kv_pairs=4, power_a=0.01, random_non_queries=True,
           eval_buckets=[[32, 4], [64, 8]], eval_examples=16, eval_seed=1, batch_size=8)


def task(seed=0, **changes):
    return build_task({**CFG, **changes}, seed=seed)


@pytest.mark.parametrize("seq_len, pairs", [(32, 4), (64, 8), (64, 16), (256, 64)])
def test_each_query_asks_a_key_of_the_prefix_and_its_target_is_that_keys_value(seq_len, pairs):
    vocab = 2 * seq_len + 2
    inputs, targets = mqar_batch(np.random.default_rng(7), 50, vocab, seq_len, pairs, 0.01)
    assert inputs.shape == targets.shape == (50, seq_len)
    for row, target in zip(inputs.tolist(), targets.tolist()):
        keys, values = row[0:2 * pairs:2], row[1:2 * pairs:2]
        assert len(set(keys)) == pairs and all(1 <= k < vocab // 2 for k in keys)  # distinct, key half
        assert len(set(values)) == pairs and all(vocab // 2 <= v < vocab for v in values)  # distinct, value half
        pair_of = dict(zip(keys, values))
        scored = [t for t, y in enumerate(target) if y != IGNORE]
        # exactly one query per key, in the query region at an even offset from its start
        assert sorted(row[t] for t in scored) == sorted(keys)
        assert all(t >= 2 * pairs and (t - 2 * pairs) % 2 == 0 for t in scored)
        assert all(target[t] == pair_of[row[t]] for t in scored)  # the value paired with that key earlier


def test_only_the_queried_values_are_scored_and_the_filler_is_random():
    inputs, targets = mqar_batch(np.random.default_rng(1), 200, 200, 64, 8, 0.01)
    assert int((targets != IGNORE).sum()) == 200 * 8
    plain, _ = mqar_batch(np.random.default_rng(1), 200, 200, 64, 8, 0.01, random_non_queries=False)
    filler = (targets == IGNORE) & (torch.arange(64) >= 16)
    assert bool((plain[filler] == 0).all())  # without random fill: Zoology's zeros
    assert len(set(inputs[filler].tolist())) > 150  # with it: tokens of the whole vocabulary


def test_query_gaps_follow_the_power_law():
    """The first draw of each row has P(g) = (g+1)^(a-1) / sum; the mean of many draws matches it."""
    space, a = 8, 0.3
    gaps = power_law_gaps(np.random.default_rng(0), 40000, space, 3, a)
    assert all(len(set(row)) == 3 for row in gaps[:500].tolist())  # without replacement
    p = np.arange(1, space + 1) ** (a - 1.0)
    p /= p.sum()
    freq = np.bincount(gaps[:, 0], minlength=space) / len(gaps)
    np.testing.assert_allclose(freq, p, atol=0.01)
    # the second draw: without replacement among those left, as numpy's choice(replace=False, p=...)
    second = np.array([sum(p[i] * p[j] / (1 - p[i]) for i in range(space) if i != j) for j in range(space)])
    np.testing.assert_allclose(np.bincount(gaps[:, 1], minlength=space) / len(gaps), second, atol=0.01)


def test_batches_are_a_pure_function_of_the_seed_and_step():
    a, b, c = task(seed=3), task(seed=3), task(seed=4)
    first = [next(iter(t.train_batches(start_step=5)))["input"] for t in (a, b, c)]
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])
    stream = iter(a.train_batches())
    for _ in range(5):
        next(stream)
    assert torch.equal(next(stream)["input"], first[0])  # step 5 of a stream from 0 = the stream from step 5
    # the evaluation sets do not depend on the training seed
    assert torch.equal(a.eval_set(8)["input"], c.eval_set(8)["input"])


def test_buckets_and_lengths():
    t = task()
    assert t.eval_lengths == [4, 8] and t.in_distribution(4) and not t.in_distribution(8)
    assert t.max_seq_len == 64 and t.vocab_size == 96
    lengths = {b["length"]: b["input"].shape[1] for b in t.validation_batches()}
    assert lengths == {4: 32, 8: 64}
    assert t.tokenizer().get_vocab_size() == 96


class Oracle(nn.Module):
    """Reads each key's value from the prefix: logits one-hot at the right value where a key is the input."""

    def __init__(self, vocab, wrong_every=0):
        super().__init__()
        self.vocab, self.wrong_every = vocab, wrong_every
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, idx, **_):
        logits = torch.zeros(*idx.shape, self.vocab)
        for b, row in enumerate(idx.tolist()):
            pairs = {}
            for t in range(0, len(row) - 1, 2):
                if row[t] in pairs:
                    break
                if not 1 <= row[t] < self.vocab // 2:
                    break
                pairs[row[t]] = row[t + 1]
            for t, token in enumerate(row):
                if t >= 2 * len(pairs) and token in pairs:
                    logits[b, t, pairs[token]] = 1.0
            if self.wrong_every and b % self.wrong_every == 0:
                logits[b, :, 0] = 2.0  # this row answers 0 everywhere
        return logits


def test_evaluation_scores_the_queried_values_only():
    t = task()
    rows = t.evaluate(Oracle(96))
    # the oracle's prefix parse can stop early only if a value repeats a key (impossible: halves differ)
    assert [(r["length"], r["seq_len"], r["in_distribution"]) for r in rows] == [(4, 32, True), (8, 64, False)]
    assert all(r["token_acc"] == 1.0 and r["exact_match"] == 1.0 and r["n"] == 16 for r in rows)
    half_wrong = t.evaluate(Oracle(96, wrong_every=2))
    assert all(r["token_acc"] == 0.5 and r["exact_match"] == 0.5 for r in half_wrong)


@pytest.mark.parametrize("change, says", [
    (dict(num_kv_pairs=9), "task.(seq_len, num_kv_pairs)=(32, 9): the sequence length must be even"),
    (dict(seq_len=33), "task.(seq_len, num_kv_pairs)=(33, 4): the sequence length must be even"),
    (dict(vocab_size=40), "task.vocab_size=40 is too small"),
    (dict(power_a=0), "task.power_a=0 must be in (0, 1]"),
    (dict(eval_buckets=[[30, 8], [64, 16]]), "task.eval_buckets entry=(30, 8): the sequence length must be even"),
    (dict(eval_buckets=[[40, 8], [64, 8]]), "task.eval_buckets=[[40, 8], [64, 8]]: each bucket"),
    (dict(eval_buckets=[[64, 4]]), "task.eval_buckets has [64, 4], the training pair count"),
    (dict(eval_buckets=[64, 4]), "task.eval_buckets=[64, 4] must be a non-empty list"),
    (dict(batch_size=0), "task.batch_size=0 must be a positive integer"),
])
def test_bad_config_is_one_line_naming_the_key(change, says):
    errs = task_errors({**CFG, **change})
    assert len(errs) == 1 and errs[0].startswith(says) and "\n" not in errs[0], errs


TINY = ["trainer=debug", "trainer.max_steps=10", "trainer.val_check_interval=5", "logger=none", "diagnostics=none",
        "task=mqar", "task.vocab_size=40", "task.seq_len=16", "task.num_kv_pairs=2", "task.eval_buckets=[[16,2],[32,4]]",
        "task.batch_size=8", "task.eval_examples=8", "model.d_model=32", "model.n_layers=1"]


@pytest.mark.parametrize("attn", ["gla", "deltanet", "based", "mha +attn.short_conv=3"])
def test_training_on_mqar_writes_results_for_the_recurrent_kinds(attn, run_dir):
    from blocklab.results import read_results
    from conftest import run_in_process

    kind, *extra = attn.split()
    run_in_process([*TINY, f"attn={kind}", *[e.lstrip("+") for e in extra]], run_dir)
    results = read_results(run_dir)
    rows = {row["length"]: row for row in results["eval"]}
    assert set(rows) == {2, 4} and rows[2]["in_distribution"] and not rows[4]["in_distribution"]
    assert rows[4]["seq_len"] == 32 and all(0 <= row["token_acc"] <= 1 for row in rows.values())
    assert results["choices"]["attn"] == ("mha" if kind == "mha" else kind)
    # trainer=debug validates on its first batch alone (limit_val_batches), twice; the end's evaluation is whole
    assert [step for step, _ in results["val_loss_curve"]] == [5, 10]
    assert all(row["n"] == 8 for row in rows.values())


@pytest.mark.slow
def test_the_mqar_learns_preset_learns_recall(run_dir):
    """The preset the docs lead with for MQAR (issue 54): the first run a user makes recalls, token accuracy (Zoology's
    MQAR accuracy) >= 0.9 at the training cell (64, 4). About a minute on one CPU thread."""
    from blocklab.results import read_results
    from conftest import run_in_process

    run_in_process(["experiment=mqar_learns", "logger=none", "diagnostics=none", "trainer.threads=1"], run_dir)
    rows = {row["length"]: row for row in read_results(run_dir)["eval"]}
    assert rows[4]["seq_len"] == 64 and rows[4]["in_distribution"]
    assert rows[4]["token_acc"] >= 0.9, rows[4]
