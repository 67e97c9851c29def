"""Randomized positions (Ruoss et al. 2023) and the pos settings every scheme shares: the streams a
task's batches carry, their determinism, and the one-line errors before any work."""
import random

import pytest
import torch

from blocklab.errors import ConfigError
from blocklab.tasks import build_task
from blocklab.tasks.placement import Placement, randomized
from conftest import run_cli
from helpers import assert_refused_cli

COPY = dict(name="copy", alphabet="abcdef", min_len=2, max_len=6, eval_lengths=[4, 12], batch_size=8,
            eval_examples=10, eval_seed=7)


def copy_task(seed=0, **placement):
    return build_task(COPY, seed, placement=Placement(**placement))


def test_randomized_ids_are_a_sorted_sample_of_distinct_values_below_random_max():
    rng = random.Random(0)
    for n in (1, 5, 40):
        ids = randomized(list(range(n)), 64, rng)
        assert ids == sorted(ids) and len(set(ids)) == n and all(0 <= p < 64 for p in ids)


def test_randomized_keeps_equal_ids_equal_and_order():
    ids = randomized([0, 1, 2, 0, 1, 2, 3], 100, random.Random(1))
    assert ids[:3] == ids[3:6] and ids[0] < ids[1] < ids[2] < ids[6]


def test_training_batches_carry_randomized_positions_over_the_whole_range():
    task = copy_task(random_max=64)
    seen = set()
    for batch in (b for b, _ in zip(task.train_batches(), range(20))):
        positions, valid = batch["positions"], batch["valid"]
        for row in range(positions.shape[0]):
            ids = positions[row][valid[row]].tolist()
            assert ids == sorted(ids) and len(set(ids)) == len(ids) and 0 <= min(ids) and max(ids) < 64
            seen.update(ids)
    assert len(seen) > 60  # the whole of [0, 64) is trained, though sequences are at most 13 tokens


def test_randomized_positions_change_with_the_seed_not_between_passes_over_a_seeds_stream():
    first = [b["positions"] for b, _ in zip(copy_task(seed=0, random_max=64).train_batches(), range(3))]
    again = [b["positions"] for b, _ in zip(copy_task(seed=0, random_max=64).train_batches(), range(3))]
    other = [b["positions"] for b, _ in zip(copy_task(seed=1, random_max=64).train_batches(), range(3))]
    resumed = next(iter(copy_task(seed=0, random_max=64).train_batches(start_step=2)))["positions"]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert torch.equal(resumed, first[2])  # a resumed run sees the positions an uninterrupted one would
    assert not any(torch.equal(a, b) for a, b in zip(first, other) if a.shape == b.shape)


def test_evaluation_is_randomized_too_and_the_examples_are_those_of_the_plain_task():
    plain, randomized_task = copy_task(), copy_task(random_max=64)
    for length in (4, 12):
        a, b = plain.eval_set(length), randomized_task.eval_set(length)
        assert [e.prompt for e in a] == [e.prompt for e in b]  # same data under every method
        ids = b[0].streams["positions"]
        assert len(ids) == len(b[0].prompt) + randomized_task.max_answer_len(length)
        assert ids == sorted(ids) and ids != list(range(len(ids)))
    assert copy_task(random_max=64).eval_set(12)[3].streams == randomized_task.eval_set(12)[3].streams


def test_randomized_coupled_ids_stay_coupled_and_reach_beyond_the_training_ids():
    """method=coupled_rope_randomized: the i-th output character keeps the i-th input character's id, in training
    and evaluation, while the ids themselves spread over [0, random_max), past any plain coupled id."""
    task = copy_task(coupled=True, random_max=64)
    sep = task.ids["<sep>"]
    seen = set()
    for batch in (b for b, _ in zip(task.train_batches(), range(10))):
        for tokens, ids in zip(batch["input"].tolist(), batch["positions"].tolist()):
            n = tokens.index(sep)
            assert tokens[n + 1:2 * n + 1] == tokens[:n]  # the answer's characters, as fed back
            assert ids[n + 1:2 * n + 1] == ids[:n] and ids[:n] == sorted(ids[:n]) and len(set(ids[:n])) == n
            seen.update(ids[:n])
    assert max(seen) > 40  # plain coupled ids of 2-6 characters stop at 7
    example = task.eval_set(12)[0]
    ids = example.streams["positions"]
    assert ids[:12] == ids[13:25] and len(set(ids[:12])) == 12


def test_plain_batches_carry_no_position_streams():
    batch = next(iter(copy_task().train_batches()))
    assert "positions" not in batch and "digit_index" not in batch


def test_random_max_below_the_longest_sequence_is_refused():
    longest = copy_task().max_seq_len + 1
    with pytest.raises(ConfigError, match=f"pos.random_max={longest - 1} is smaller"):
        copy_task(random_max=longest - 1)
    copy_task(random_max=longest)


@pytest.mark.parametrize("args, message", [
    (["pos.randomize=true"], "pos.randomize=true needs pos.random_max"),
    (["pos.randomize=true", "pos.random_max=8"], "pos.random_max=8 is smaller than the longest evaluated sequence"),
    (["pos.abacus_offset=-1"], "pos.abacus_offset=-1"),
    (["task=lm", "pos.randomize=true", "pos.random_max=4096"], "need a task that builds its own examples"),
    (["model.arch=encoder_decoder", "pos.randomize=true", "pos.random_max=256"], "model.arch=decoder only"),
])
def test_bad_settings_are_one_line_errors_before_any_work(args, message, tmp_path):
    proc = run_cli([*args, f"run_dir={tmp_path / 'run'}", "logger=none"])
    assert_refused_cli(proc, message, tmp_path / "run")


def test_a_randomized_model_decodes_with_its_cache_as_by_recomputation():
    from blocklab.model import ModelConfig, build_model
    from blocklab.model.generate import generate

    task = copy_task(random_max=64)
    cfg = ModelConfig(vocab_size=task.vocab_size, max_len=64, d_model=32, n_heads=4)
    cfg.pos.name = "learned"  # absolute: every id matters
    cfg.init.std = 1.0  # large random weights: greedy choices that depend on every input
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    examples = task.eval_set(12)[:4]
    prompts = [torch.tensor(e.prompt) for e in examples]
    streams = [{k: torch.tensor(v) for k, v in e.streams.items()} for e in examples]
    new = task.max_answer_len(12)
    cached = generate(model, prompts, new, streams=streams, use_cache=True)
    recomputed = generate(model, prompts, new, streams=streams, use_cache=False)
    plain = generate(model, prompts, new, use_cache=True)
    assert torch.equal(cached, recomputed)
    assert not torch.equal(cached, plain)  # the streams were read
