import random

import pytest
import torch

from blocklab.errors import ConfigError
from blocklab.tasks import TASKS, Task, build_task, task_errors
from blocklab.tasks.base import IGNORE, SequenceTask, collate, default_eval_lengths

COMMON = dict(min_len=2, max_len=6, eval_lengths=None, batch_size=8, eval_examples=10, eval_seed=7)


def copy_task(seed=0, **kw):
    return build_task({"name": "copy", "alphabet": "abcdef", **COMMON, **kw}, seed)


def addition_task(seed=0, **kw):
    return build_task({"name": "addition", "reverse_answer": False, "pad_operands": False, **COMMON, **kw}, seed)


def test_copy_example_is_input_sep_then_input_eos():
    task = copy_task()
    for length in (1, 5, 9):
        e = task.sample(random.Random(length), length)
        text = task.decode(e.prompt)
        assert text.endswith("<sep>") and len(e.prompt) == length + 1
        assert e.answer[:-1] == e.prompt[:-1] and e.answer[-1] == task.eos_id


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("pad", [False, True])
def test_addition_answer_is_the_sum(reverse, pad):
    task = addition_task(reverse_answer=reverse, pad_operands=pad)
    rng = random.Random(0)
    for length in (1, 3, 8):
        for _ in range(50):
            e = task.sample(rng, length)
            prompt, answer = task.decode(e.prompt), task.decode(e.answer[:-1])
            a, b = prompt.rstrip("=").split("+")
            if pad:
                assert len(a) == len(b) == length and len(answer) == length + 1
            else:
                assert a == str(int(a)) and b == str(int(b))  # no leading zeros
            assert int(a) < 10**length and int(b) < 10**length
            assert int(answer[::-1] if reverse else answer) == int(a) + int(b)


def test_collate_scores_answer_only_and_masks_padding():
    task = copy_task()
    examples = [task.sample(random.Random(i), n) for i, n in enumerate((1, 4))]
    batch = collate(examples, task.pad_id)
    for row, e in enumerate(examples):
        seq = e.prompt + e.answer
        n = len(seq) - 1
        assert batch["input"][row, :n].tolist() == seq[:-1]
        assert batch["valid"][row].sum() == n and not batch["valid"][row, n:].any()
        scored = batch["target"][row] != IGNORE
        assert batch["target"][row][scored].tolist() == e.answer
        assert (batch["input"][row, n:] == task.pad_id).all()


def test_training_stream_is_a_function_of_the_seed():
    first = [next(iter(copy_task(seed=3).train_batches())) for _ in range(2)]
    other = next(iter(copy_task(seed=4).train_batches()))
    assert torch.equal(first[0]["input"], first[1]["input"])
    assert not torch.equal(first[0]["input"], other["input"])
    lengths = set()
    for _, batch in zip(range(20), copy_task().train_batches()):
        lengths |= set(((batch["target"] != IGNORE).sum(1) - 1).tolist())
    assert lengths == set(range(2, 7))  # exactly the training range


def test_eval_sets_are_fixed_by_eval_seed_not_training_seed():
    a, b = copy_task(seed=0), copy_task(seed=1)
    assert [e.prompt for e in a.eval_set(5)] == [e.prompt for e in b.eval_set(5)]
    c = copy_task(eval_seed=8)
    assert [e.prompt for e in a.eval_set(5)] != [e.prompt for e in c.eval_set(5)]
    assert all(len(e.prompt) == 6 for e in a.eval_set(5))


def test_default_eval_lengths_cover_training_range_and_twice_beyond():
    lengths = default_eval_lengths(1, 16)
    assert min(lengths) == 1 and max(lengths) == 32 and 16 in lengths
    assert any(n > 16 for n in lengths) and lengths == sorted(set(lengths))
    task = copy_task()
    assert [task.in_distribution(n) for n in (1, 2, 6, 7)] == [False, True, True, False]


def test_max_seq_len_covers_longest_eval_sequence():
    task = addition_task(eval_lengths=[3, 20])
    longest = max(len(e.prompt) + len(e.answer) - 1 for e in task.eval_set(20))
    assert task.max_seq_len >= longest


@pytest.mark.parametrize("bad, key", [
    ({"min_len": 5, "max_len": 2}, "task.min_len=5 > task.max_len=2"),
    ({"min_len": 0}, "task.min_len=0"),
    ({"batch_size": -1}, "task.batch_size=-1"),
    ({"eval_lengths": []}, "task.eval_lengths"),
    ({"eval_lengths": [4, -2]}, "task.eval_lengths"),
    ({"alphabet": "aab"}, "task.alphabet"),
])
def test_bad_task_config_names_the_key(bad, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
        copy_task(**bad)


def test_a_task_missing_part_of_the_interface_cannot_be_built():
    class OnlySampling(SequenceTask):  # no max_prompt_len, max_answer_len
        def sample(self, rng, length):
            return None

    with pytest.raises(TypeError, match="max_answer_len"):
        OnlySampling(["a"], min_len=1, max_len=2, eval_lengths=None, batch_size=1, eval_examples=1, eval_seed=0, seed=0)

    class Incomplete(Task):
        errors = classmethod(lambda cls, cfg: [])

    with pytest.raises(TypeError, match="evaluate"):
        Incomplete()


def test_every_registered_task_implements_the_interface():
    assert list(TASKS) == ["copy", "addition", "lm", "periodic", "keyed", "mlm", "brackets", "count", "max", "mqar"]
    for name in TASKS:
        assert issubclass(TASKS[name], Task) and not TASKS[name].__abstractmethods__
    assert copy_task().name == "copy" and addition_task().name == "addition"


def test_unknown_task_names_the_choices():
    assert task_errors({"name": "cpy"}) == ["task.name='cpy' is unknown; did you mean 'copy'? "
                                            "use one of ['copy', 'addition', 'lm', 'periodic', 'keyed', 'mlm', "
                                            "'brackets', 'count', 'max', 'mqar']"]


def test_seq2seq_support_is_read_from_the_task_class(tmp_path):
    from conftest import compose_config

    from blocklab.experiment import Setup

    with pytest.raises(ConfigError) as err:
        Setup.from_config(compose_config(["model.arch=encoder_decoder", "task=lm"], tmp_path))
    assert str(err.value) == ("model.arch=encoder_decoder needs a source/target task (copy, addition), "
                              "not task=lm; use model.arch=decoder")

    @TASKS.register("copy_as_seq2seq")
    class Seq2SeqCopy(TASKS["copy"]):
        pass

    @TASKS.register("copy_decoder_only")
    class DecoderOnlyCopy(TASKS["copy"]):
        supports_seq2seq = False

    try:
        cfg = {"alphabet": "abc", **COMMON}
        assert build_task({"name": "copy_as_seq2seq", **cfg}, 0, seq2seq=True).seq2seq
        assert task_errors({"name": "copy_decoder_only", **cfg}, seq2seq=True) == [
            "model.arch=encoder_decoder needs a source/target task (copy, addition, copy_as_seq2seq), "
            "not task=copy_decoder_only; use model.arch=decoder"]
        assert task_errors({"name": "copy_decoder_only", **cfg}, seq2seq=False) == []
    finally:
        TASKS.unregister("copy_as_seq2seq")
        TASKS.unregister("copy_decoder_only")


def test_hits_by_position_counts_the_kth_scored_token_of_each_row():
    from blocklab.tasks.base import hits_by_position

    x = IGNORE
    target = torch.tensor([[x, x, 5, 6, 7], [x, 5, 6, x, x], [x, x, x, 9, x]])  # answers of 3, 2 and 1 tokens
    predicted = torch.tensor([[0, 0, 5, 0, 7], [0, 5, 6, 0, 0], [0, 0, 0, 1, 0]])
    right, rows = hits_by_position(predicted, target)
    assert rows.tolist() == [3, 2, 1]
    assert right.tolist() == [2.0, 1.0, 1.0]  # first places: 5, 5 right, 9 wrong; second: 6 wrong, 6 right


def test_token_accuracy_by_place_shows_where_the_errors_sit_and_averages_to_token_acc(monkeypatch):
    """Addition without padding: answers of one operand length differ in size (a carry adds a digit), so the
    last places have fewer rows. Wrong logits at the second answer place of half the rows give 0.5 there and
    1.0 elsewhere, and the places' row-weighted mean is the overall token accuracy."""
    import blocklab.tasks.base as base

    task = addition_task(eval_examples=40)
    examples = task.eval_set(3)
    batch = task.collate(examples)
    target = batch["target"]
    logits = torch.nn.functional.one_hot(target.clamp(min=0), task.vocab_size).float()
    second = [(row, (target[row] != IGNORE).nonzero()[1].item()) for row in range(0, len(examples), 2)]
    for row, t in second:
        logits[row, t] = torch.roll(logits[row, t], 1)

    class Teacher(torch.nn.Module):
        def forward(self, idx, *args, **kwargs):
            return logits

    monkeypatch.setattr(base, "generate", lambda *args, **kwargs: torch.full((len(examples), 8), task.pad_id))
    result = task.evaluate_length(Teacher(), 3)
    sizes = [len(e.answer) for e in examples]
    assert len(set(sizes)) == 2, "the eval set should mix answers with and without a carry"
    by_place = result["token_acc_by_position"]
    assert len(by_place) == max(sizes)
    assert by_place[1] == pytest.approx(0.5) and all(a == 1.0 for k, a in enumerate(by_place) if k != 1)
    rows_at = [sum(size > k for size in sizes) for k in range(max(sizes))]
    weighted = sum(a * n for a, n in zip(by_place, rows_at)) / sum(rows_at)
    assert weighted == pytest.approx(result["token_acc"])
