"""Exercise 1.2's probe tasks (brackets, count, max; repeats = periodic with period 2): every answer checked against
an independent computation over many random examples, batches fixed per (seed, step), one-line errors; the answer-row
attention entropy and distance the diagnostics record; the report's per-layer series and attention_maps plot."""
import json
import math
import random
from collections import Counter

import pytest
import torch

from blocklab.analysis import metrics
from blocklab.tasks import TASKS, build_task
from blocklab.tasks.base import IGNORE
from conftest import compose_config
from helpers import refused

COMMON = dict(min_len=1, max_len=8, eval_lengths=None, batch_size=8, eval_examples=10, eval_seed=7)
OPTIONS = {"max": {}, "count": {"alphabet": "abcd"}, "brackets": {"pairs": "()[]"}}


def make(name, seed=0, **kw):
    return build_task({"name": name, **COMMON, **OPTIONS[name], **kw}, seed=seed)


def examples(task, length, n=400, seed=0):
    rng = random.Random(seed)
    return [task.sample(rng, length) for _ in range(n)]


def text(task, ids):
    return [task.tokens[i] for i in ids]


# --------------------------------------------------------------------------------------------------- answers

@pytest.mark.parametrize("length", [1, 2, 5, 8, 16])
def test_max_answer_is_the_largest_digit(length):
    task = make("max")
    for e in examples(task, length):
        *digits, sep = text(task, e.prompt)
        assert sep == "<sep>" and len(digits) == length and all(d in "0123456789" for d in digits)
        assert text(task, e.answer) == [str(max(int(d) for d in digits)), "<eos>"]


def test_max_answers_are_uniform_so_nine_is_no_shortcut():
    task = make("max")
    counts = Counter(e.answer[0] for e in examples(task, 8, n=5000))
    assert len(counts) == 10 and all(0.08 < c / 5000 < 0.12 for c in counts.values())  # chance 1/10


@pytest.mark.parametrize("length", [1, 3, 8, 16])
def test_count_answer_is_the_number_of_the_queried_letter(length):
    task = make("count")
    queried = Counter()
    for e in examples(task, length):
        *letters, query = text(task, e.prompt)
        assert len(letters) == length and all(ch in "abcd" for ch in letters)
        letter = query.removeprefix("<#").removesuffix(">")
        assert query == f"<#{letter}>" and letter in "abcd"
        assert "".join(text(task, e.answer[:-1])) == str("".join(letters).count(letter)) and e.answer[-1] == task.eos_id
        queried[letter] += 1
    assert len(queried) == 4


def test_count_covers_every_count_and_letters_are_independent():
    task = make("count")
    answers = Counter(int("".join(text(task, e.answer[:-1]))) for e in examples(task, 8, n=3000))
    # each letter an independent uniform draw: the count is Binomial(8, 1/4)
    for k in range(9):
        assert answers[k] / 3000 == pytest.approx(math.comb(8, k) * 0.25 ** k * 0.75 ** (8 - k), abs=0.03)


def innermost_open(brackets: str, pairs: str) -> int:
    """Index of the innermost bracket left open, by a stack; asserts the string is a well-nested prefix."""
    opening, closing = pairs[0::2], pairs[1::2]
    stack = []
    for i, ch in enumerate(brackets):
        if ch in opening:
            stack.append(i)
        else:
            assert stack and closing.index(ch) == opening.index(brackets[stack[-1]]), brackets
            stack.pop()
    assert stack, f"{brackets!r} leaves nothing open"
    return stack[-1]


@pytest.mark.parametrize("pairs", ["()[]", "()[]{}"])
@pytest.mark.parametrize("length", [1, 2, 5, 8, 16])
def test_brackets_answer_closes_the_innermost_open_bracket(pairs, length):
    task = make("brackets", pairs=pairs)
    for e in examples(task, length):
        *chars, sep = text(task, e.prompt)
        assert sep == "<sep>" and len(chars) == length
        top = innermost_open("".join(chars), pairs)
        assert text(task, e.answer) == [pairs[pairs.index(chars[top]) + 1], "<eos>"]


def test_brackets_distance_depends_on_the_content():
    """The innermost open bracket lies 1, 3, 5 or 7 back from SEP, each as often (at length 8); it is mostly not the
    last token nor the last opening bracket (so copying neither solves it); each type is as likely."""
    task = make("brackets")
    distances, not_last, not_last_open, answers = Counter(), 0, 0, Counter()
    sample = examples(task, 8, n=3000)
    for e in sample:
        chars = "".join(text(task, e.prompt[:-1]))
        top = innermost_open(chars, "()[]")
        distances[len(chars) - top] += 1
        not_last += top != len(chars) - 1
        not_last_open += top != max(i for i, ch in enumerate(chars) if ch in "([")
        answers[e.answer[0]] += 1
    assert set(distances) == {1, 3, 5, 7} and all(0.2 < c / len(sample) < 0.3 for c in distances.values())
    assert not_last > 0.7 * len(sample) and not_last_open > 0.5 * len(sample)
    assert all(0.45 < c / len(sample) < 0.55 for c in answers.values())  # chance 1/2


def test_repeats_is_periodic_with_period_two(tmp_path):
    cfg = compose_config(["task=repeats"], tmp_path)
    task = build_task(dict(cfg.task), seed=0)
    assert task.name == "periodic" and task.period == 2 and task.train_lengths == (2, 8)
    for e in examples(task, 7):
        seq = e.prompt[:-1] + e.answer[:-1]
        assert all(seq[t] == seq[t - 2] for t in range(2, len(seq)))  # ABAB...


# --------------------------------------------------------------------------------------- determinism, config

@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_batches_are_fixed_per_seed_and_step(name):
    def first(task, start):
        return next(iter(task.train_batches(start)))

    a, b, other = make(name, seed=3), make(name, seed=3), make(name, seed=4)
    stream = iter(a.train_batches(0))
    batches = [next(stream) for _ in range(3)]
    assert torch.equal(first(b, 2)["input"], batches[2]["input"])  # a resume at step 2 sees step 2's batch
    assert not torch.equal(batches[0]["input"], batches[1]["input"])
    assert not torch.equal(first(other, 0)["input"], batches[0]["input"])
    assert a.eval_set(8) == other.eval_set(8)  # evaluation does not depend on the training seed


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_registered_with_a_config_file(name, tmp_path):
    cfg = compose_config([f"task={name}"], tmp_path)
    task = build_task(dict(cfg.task), seed=0)
    assert task.name == name and not TASKS[name].supports_seq2seq
    assert task.max_seq_len >= max(len(e.prompt) + len(e.answer) - 1 for e in examples(task, 16, n=50))


@pytest.mark.parametrize("name, options, message", [
    ("max", dict(min_len=0), "task.min_len=0 must be a positive integer"),
    ("count", dict(alphabet="ab1"), "task.alphabet='ab1' must be a non-empty string of distinct non-digit"),
    ("count", dict(alphabet="aa"), "task.alphabet='aa' must be a non-empty string of distinct non-digit"),
    ("brackets", dict(pairs="(()"), "task.pairs='(()' must list opening and closing brackets alternately"),
    ("brackets", dict(pairs="(("), "task.pairs='((' must list opening and closing brackets alternately"),
    ("brackets", dict(pairs=""), "task.pairs='' must list opening and closing brackets alternately"),
    ("max", dict(alphabet="ab"), "task.alphabet"),  # max has no alphabet: an unknown option
])
def test_bad_options_are_one_line(name, options, message):
    with refused(message):
        make(name, **options)


# ------------------------------------------------------------------------------------------ answer-row metrics

def test_entropy_and_distance_over_chosen_rows():
    """rows selects the query rows averaged: a one-hot row 3 back (entropy 0, distance 3) among uniform rows."""
    n = 6
    w = torch.full((2, 1, n, n), 1 / n)
    w[:, 0, 5] = 0
    w[:, 0, 5, 2] = 1
    rows = torch.zeros(2, n, dtype=torch.bool)
    rows[:, 5] = True
    assert metrics.attention_entropy(w, rows).item() == pytest.approx(0, abs=1e-9)
    assert metrics.attention_distance(w, rows).item() == pytest.approx(3)
    rows[0, 0] = True  # plus one uniform row at position 0: distances 0..5, mean 2.5; entropy log 6
    assert metrics.attention_entropy(w, rows).item() == pytest.approx(math.log(n) / 3)
    assert metrics.attention_distance(w, rows).item() == pytest.approx((3 + 3 + 2.5) / 3)
    assert torch.allclose(metrics.attention_entropy(w), metrics.attention_entropy(w, torch.ones(2, n, dtype=bool)))


def test_diagnostics_record_answer_rows(tmp_path):
    from blocklab.analysis.probe import forward_stats
    from blocklab.experiment import Setup
    from blocklab.model import build_model

    setup = Setup.from_config(compose_config(["task=max"], tmp_path))
    torch.manual_seed(0)
    model = build_model(setup.model_cfg)
    batch = setup.task.probe_batch(4)
    stats = forward_stats(model, batch)
    _, weights = model(batch["input"], need_weights=True)
    answer = batch["target"] != IGNORE
    assert answer.sum() == 4 * 2  # SEP predicts the digit, the digit predicts EOS
    for layer, w in zip(stats["layers"], weights):
        w = w.double()
        rows = w[answer[:, None, :].expand(-1, w.shape[1], -1)].view(4, w.shape[1], 2, -1)  # (B, H, 2, Tk)
        entropy = -(rows * rows.clamp_min(1e-12).log()).sum(-1).mean(dim=(0, 2))
        assert layer["attention_entropy_answer"] == pytest.approx(entropy.tolist())
        assert layer["attention_entropy_answer"] != pytest.approx(layer["attention_entropy"])


# ----------------------------------------------------------------------------------------------------- report

def fake_run(root, task, seed, entropy, png=True):
    """A run directory as the report reads it: results.json with diagnostics, and the saved heatmap."""
    from blocklab.analysis.plots import attention_heatmaps

    run = root / f"{task}_{seed}"
    maps = {}
    if png:
        for when in ("init", "end"):
            path = attention_heatmaps([torch.eye(4).expand(2, 4, 4)] * 2, run / "diagnostics", when)[0]
            maps[when] = [str(path.relative_to(run))]
    layer = lambda e: {"attention_entropy": [e, e + 0.2], "attention_distance": [1.0, 3.0],  # noqa: E731
                       "attention_entropy_answer": [e / 2, e / 2], "attention_distance_answer": [2.0, 2.0],
                       "activation_rms": 1.0, "relative_residual": {"fro": 1.0}, "spectral_norm_max": [1.0],
                       "head_similarity_mean": 0.5, "ffn_sparsity": 0.0}
    diagnostics = {when: {"layers": [layer(entropy), layer(entropy / 4)], "attention_maps": maps.get(when)}
                   for when in ("init", "end")}
    run.mkdir(parents=True, exist_ok=True)
    (run / "results.json").write_text(json.dumps({"diagnostics": diagnostics}))
    from blocklab.report.collect import _layers
    return {"run": str(run), "task": task, "seed": seed,
            "layers_init": _layers(diagnostics, "init"), "layers_end": _layers(diagnostics, "end")}


def test_layers_series_are_means_over_heads(tmp_path):
    row = fake_run(tmp_path, "max", 0, 1.0, png=False)
    assert row["layers_end"]["attention_entropy"] == pytest.approx([1.1, 0.35])
    assert row["layers_end"]["attention_distance"] == pytest.approx([2.0, 2.0])
    assert row["layers_end"]["attention_entropy_answer"] == pytest.approx([0.5, 0.125])


def test_attention_maps_plot_shows_the_saved_heatmaps(tmp_path):
    from blocklab.report.build import plot

    rows = [fake_run(tmp_path, "max", 1, 2.0), fake_run(tmp_path, "max", 0, 1.0), fake_run(tmp_path, "count", 0, 0.4)]
    spec = {"kind": "attention_maps", "metric": "attention_maps", "by": "task", "when": ["init", "end"]}
    note = plot(rows, spec, tmp_path / "maps.png")
    assert (tmp_path / "maps.png").stat().st_size > 10_000
    # answer rows preferred; mean over heads and seeds: max's layer 0 (1.0/2 + 2.0/2) / 2 = 0.75
    assert "task=max: entropy (answer queries) per layer 0.75 → 0.75, 0.19 → 0.19 nats" in note
    assert "task=count: entropy (answer queries) per layer 0.20 → 0.20, 0.05 → 0.05 nats" in note
    assert "(mean over heads and 2 runs)" in note and "distance (answer queries) per layer 2.00 → 2.00" in note


def test_attention_maps_plot_without_maps_says_how_to_get_them(tmp_path):
    from matplotlib.figure import Figure

    from blocklab.report.attention_maps import plot_attention_maps

    fig = Figure()
    ax = fig.subplots()
    rows = [fake_run(tmp_path, "max", 0, 1.0, png=False)]
    assert plot_attention_maps(ax, rows, {"when": "end"}, "attention_maps", ["task"]) is None
    assert "diagnostics.attention_maps=end" in fig.texts[0].get_text()


# ------------------------------------------------------------------------------------------------- learning

@pytest.mark.slow
@pytest.mark.parametrize("name", ["repeats", "brackets", "count", "max"])
def test_probe_tasks_learn_in_the_sweep_budget(name, run_dir):
    """The default tiny model learns each probe inside its training lengths in the sweep's 1000 steps
    (measured, seed 0: repeats 1.00, brackets 0.995, count 0.998, max 1.00)."""
    from blocklab.results import read_results
    from conftest import run_in_process

    run_in_process(["sweep=attention_patterns", f"task={name}", "logger=none", "diagnostics=none",
                    "task.eval_lengths=[8]"], run_dir)
    assert read_results(run_dir)["eval"][0]["exact_match"] >= 0.9
