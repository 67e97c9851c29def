"""read_attention: how much of a head's attention falls on the prompt tokens each answer token is read from,
checked against attention patterns whose value is known (one-hot on the right key, uniform under the mask)."""
import pytest
import torch
from torch import nn

from blocklab.analysis.metrics import attention_on
from blocklab.tasks import build_task


def copy_task(seq2seq=False):
    return build_task(dict(name="copy", alphabet="abcdef", min_len=2, max_len=6, eval_lengths=[2, 4, 6, 12],
                           batch_size=8, eval_examples=16, eval_seed=1), 0, seq2seq=seq2seq)


def causal_uniform(t: int) -> torch.Tensor:
    return torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1)[:, None]


def test_one_hot_on_the_key_scores_one_elsewhere_zero_and_uniform_one_over_the_keys_seen():
    t = 6
    reads = torch.zeros(1, t, t, dtype=torch.bool)
    reads[0, 3, 1] = reads[0, 5, [0, 2]] = True  # query 5 reads two keys; the rest read nothing
    on_key, off_key = torch.zeros(1, 1, t, t), torch.zeros(1, 1, t, t)
    on_key[0, 0, 3, 1] = on_key[0, 0, 5, 0] = on_key[0, 0, 5, 2] = 0.5
    on_key[0, 0, 3, 0] = 0.5
    off_key[0, 0, :, 0] = 1
    off_key[0, 0, 5, 0], off_key[0, 0, 5, 4] = 0, 1
    weights = torch.cat([on_key, off_key, causal_uniform(t)[None, None]], dim=1)  # three heads
    # query 3 gives its key 0.5, query 5 gives its two keys 0.5 each; queries reading nothing do not count
    assert attention_on(weights, reads).tolist() == pytest.approx([(0.5 + 1.0) / 2, 0.0, (1 / 4 + 2 / 6) / 2])


class CopyOracle(nn.Module):
    """Head 0 puts all its attention on the character each copy step must read (the query at L + i reads
    character i), head 1 spreads it evenly over the keys the causal mask allows."""

    def forward(self, idx, need_weights=False, valid=None, **streams):
        b, t = idx.shape
        length = (t - 1) // 2  # one eval length per batch: L characters, SEP, then L answer tokens fed
        reader = torch.zeros(t, t)
        reader[torch.arange(length, 2 * length), torch.arange(length)] = 1
        weights = torch.stack([reader, causal_uniform(t)])[None].expand(b, -1, -1, -1)
        return torch.zeros(b, t, 8), [weights * 0.5 + torch.stack([causal_uniform(t)] * 2) * 0.5, weights]


def test_the_read_head_of_a_copying_model_scores_one_at_every_length_and_uniform_heads_one_over_the_keys():
    task = copy_task()
    reading = task.read_attention(CopyOracle())
    assert sorted(reading) == task.eval_lengths
    for length, per_head in reading.items():
        assert per_head.shape == (2, 2)
        queries = torch.arange(length, 2 * length, dtype=torch.float64)
        uniform = float((1 / (queries + 1)).mean())  # query q sees q + 1 keys, one of them its own
        assert per_head[1].tolist() == pytest.approx([1.0, uniform])
        assert per_head[0].tolist() == pytest.approx([0.5 + uniform / 2, uniform])


class FadingReader(nn.Module):
    """Two layers of two heads, with attention known by hand at every length L (queries L..2L-1 read their
    character): layer 0 head 0 puts half on the character and half evenly under the mask (reading 1/2 + u_L / 2,
    u_L = the mean of 1 / (q + 1)), head 1 evenly (u_L); layer 1 head 0 evenly, head 1 exactly on the character up
    to length 6, evenly beyond (1, then u_L)."""

    def forward(self, idx, need_weights=False, valid=None, **streams):
        b, t = idx.shape
        length = (t - 1) // 2
        reader = torch.zeros(t, t)
        reader[torch.arange(length, 2 * length), torch.arange(length)] = 1
        uniform = causal_uniform(t)
        layer0 = torch.stack([(reader + uniform) / 2, uniform])
        layer1 = torch.stack([uniform, reader if length <= 6 else uniform])
        return torch.zeros(b, t, 8), [w[None].expand(b, -1, -1, -1) for w in (layer0, layer1)]


def test_evaluation_reports_the_head_that_reads_best_at_the_longest_trained_length_at_every_length(monkeypatch):
    """At length 6 (the longest trained) layer 1 head 1 reads best (1 against 1/2 + u_6 / 2); at 12 layer 0 head 0
    does. Every row reports layer 1 head 1, with its own reading at that length: 1, 1, 1, then u_12."""
    task = copy_task()
    # The rows' other metrics decode with a cache this stand-in has not; only the reading is under test here.
    monkeypatch.setattr(task, "evaluate_length", lambda model, length: {"length": length,
                                                                         "in_distribution": length <= 6})
    model = FadingReader().train()
    rows = task.evaluate(model)
    assert model.training  # evaluation leaves the mode as it found it
    u_12 = float((1 / (torch.arange(12, 24, dtype=torch.float64) + 1)).mean())
    assert [row["length"] for row in rows] == [2, 4, 6, 12]
    assert all(row["read_head"] == [1, 1] for row in rows)
    assert [row["read_attention"] for row in rows] == pytest.approx([1.0, 1.0, 1.0, u_12])


def test_no_read_attention_where_the_task_does_not_say_or_the_model_reads_by_cross_attention():
    count = build_task(dict(name="count", alphabet="abcd", min_len=2, max_len=4, eval_lengths=None, batch_size=8, eval_examples=8,
                            eval_seed=1), 0)
    assert count.read_keys(count.eval_set(2)[0]) is None and count.read_attention(CopyOracle()) == {}
    assert copy_task(seq2seq=True).read_attention(CopyOracle()) == {}
