"""Copy and addition supply the placement streams, checked against the papers' definitions by reading each
example's text (not the implementation): position coupling (Cho et al. 2024) gives tokens of equal
significance one id; Abacus digit indices (McLeish et al. 2024) count each number's digits by significance;
index hints (Zhou et al. 2024) mark each digit with its index and are not scored. Then: offsets in training
only, cached decoding with the streams, one-line errors, and short end-to-end runs."""
import json
import re
from pathlib import Path

import pytest
import torch

from blocklab.errors import ConfigError
from blocklab.results import read_results
from blocklab.tasks import build_task
from blocklab.tasks.base import Example, IGNORE
from blocklab.tasks.placement import Placement
from conftest import FAST, compose_config, run_cli, run_in_process
from helpers import assert_refused_cli

COMMON = dict(min_len=2, max_len=5, eval_lengths=[3, 5, 9], batch_size=8, eval_examples=12, eval_seed=7)
FORMATS = [(True, False), (False, True), (True, True)]  # (reverse_answer, pad_operands) that coupling allows


def addition(reverse=True, pad=False, hints=False, seed=0, **placement):
    cfg = {"name": "addition", "reverse_answer": reverse, "pad_operands": pad, "index_hints": hints,
           "hint_symbols": 30, **COMMON}
    return build_task(cfg, seed, placement=Placement(**placement))


def copy(hints=False, seed=0, end_marker=False, **placement):
    cfg = {"name": "copy", "alphabet": "abcdef", "index_hints": hints, "hint_symbols": 30, "end_marker": end_marker,
           **COMMON}
    return build_task(cfg, seed, placement=Placement(**placement))


# --- reading an example's text -----------------------------------------------------------------------

def names(task, ids):
    return [task.tokens[i] for i in ids]


def is_hint(name):
    return name.startswith("<h")


def addition_roles(task, e: Example) -> list[tuple[str, int | None]]:
    """(role, significance) of every token of prompt + answer, from the text: 'digit' (significance 0 = ones),
    'hint' (the significance of the digit it precedes), 'sep' ('+' or '='), 'eos'."""
    text = names(task, e.prompt + e.answer)
    plus, eq = text.index("+"), text.index("=")
    roles = []
    for start, end, reverse in ((0, plus, False), (plus + 1, eq, False), (eq + 1, len(text) - 1, task.reverse_answer)):
        part = text[start:end]
        digits = [k for k, name in enumerate(part) if not is_hint(name)]
        significance = {k: (rank if reverse else len(digits) - 1 - rank) for rank, k in enumerate(digits)}
        for k, name in enumerate(part):
            roles.append(("hint", significance[k + 1]) if is_hint(name) else ("digit", significance[k]))
        roles.append(("sep", None) if end < len(text) - 1 else ("eos", None))
    return roles


def copy_roles(task, e: Example) -> list[tuple[str, int | None]]:
    """(role, index) of every token: 'char' (its 0-based index in its string), 'hint', 'sep', 'eos'."""
    roles = []
    for part, last in ((names(task, e.prompt[:-1]), "sep"), (names(task, e.answer[:-1]), "eos")):
        chars = [k for k, name in enumerate(part) if not is_hint(name)]
        index = {k: rank for rank, k in enumerate(chars)}
        roles += [("hint", index[k + 1]) if is_hint(name) else ("char", index[k]) for k, name in enumerate(part)]
        roles.append((last, None))
    return roles


def examples(task, lengths=(3, 5, 9)):
    return [(length, e) for length in lengths for e in task.eval_set(length)]


# --- position coupling (Cho et al. 2024) --------------------------------------------------------------

@pytest.mark.parametrize("reverse, pad", FORMATS)
@pytest.mark.parametrize("hints", [False, True])
def test_coupled_ids_are_shared_by_digits_of_equal_significance(reverse, pad, hints):
    task = addition(reverse, pad, hints, coupled=True)
    for length, e in examples(task):
        ids = e.streams["positions"]
        assert len(ids) == len(e.prompt) + task.max_answer_len(length)  # the prompt and the answer's room
        roles = addition_roles(task, e)
        by_significance = {}
        for (role, sig), pid in zip(roles, ids):
            if role in ("digit", "hint"):  # a hint shares its digit's id
                by_significance.setdefault(sig, set()).add(pid)
        assert all(len(group) == 1 for group in by_significance.values()), by_significance
        ordered = [by_significance[s].pop() for s in sorted(by_significance)]
        assert ordered == sorted(set(ordered), reverse=True)  # one id per significance, distinct
        # '+' and '=' take the id after the ones digits' (Cho et al.'s `end`); EOS of a padded sum takes 0
        seps = {pid for (role, _), pid in zip(roles, ids) if role == "sep"}
        assert seps == {ordered[0] + 1}
        if pad:
            assert ids[len(roles) - 1] == 0
        assert min(ids[:len(roles) - 1]) >= 1  # every token read has a real id


def test_operands_of_different_lengths_are_aligned_by_significance():
    task = addition(coupled=True, abacus=True)
    e = Example(prompt=task.encode("98765+43="), answer=task.encode("80889") + [task.eos_id])  # 98808 reversed
    streams = task.streams(e.prompt, 5)
    ids, index = streams["positions"], streams["digit_index"]
    text = names(task, e.prompt + e.answer)
    # the ones digits: '5' of 98765, '3' of 43, and the sum's first digit '8'
    ones = [text.index("5"), text.index("+") + 2, text.index("=") + 1]
    tens = [text.index("6"), text.index("+") + 1, text.index("=") + 2]
    assert len({ids[k] for k in ones}) == 1 and len({ids[k] for k in tens}) == 1 and ids[ones[0]] != ids[tens[0]]
    assert [index[k] for k in ones] == [1, 1, 1] and [index[k] for k in tens] == [2, 2, 2]
    assert index[:5] == [5, 4, 3, 2, 1] and index[6:8] == [2, 1]  # restarting at each number, by significance


def test_some_evaluated_operands_differ_in_length():  # so the test above is not the only check of alignment
    task = addition(coupled=True)
    lengths = {tuple(len(part) for part in task.decode(e.prompt)[:-1].split("+")) for _, e in examples(task)}
    assert any(a != b for a, b in lengths)


@pytest.mark.parametrize("hints", [False, True])
def test_copy_couples_input_character_i_with_output_character_i(hints):
    task = copy(hints, coupled=True)
    for length, e in examples(task):
        ids, roles = e.streams["positions"], copy_roles(task, e)
        assert len(ids) == len(e.prompt) + task.max_answer_len(length)
        half = len(e.prompt)
        for k, (role, index) in enumerate(roles[:half - 1]):
            assert roles[half + k] == (role, index) and ids[half + k] == ids[k]  # input token k <-> output token k
        char_ids = [pid for (role, _), pid in zip(roles, ids) if role == "char"][:length]
        assert char_ids == list(range(char_ids[0], char_ids[0] + length))  # one id per index, in order
        assert ids[half - 1] == char_ids[0] - 1  # SEP: the id before the first output character's (their '=')
        assert ids[len(roles) - 1] == 0  # EOS


@pytest.mark.parametrize("hints", [False, True])
def test_with_an_end_marker_stopping_is_copying_the_token_after_the_last_character(hints):
    plain, marked = copy(hints, coupled=True), copy(hints, coupled=True, end_marker=True)
    for (length, p), (_, m) in zip(examples(plain), examples(marked)):
        assert m.prompt[:-1] == m.answer and names(marked, m.prompt[-2:]) == ["<eos>", "<sep>"]  # `x EOS SEP` -> `x EOS`
        assert m.prompt[:-2] == p.prompt[:-1] and m.answer == p.answer  # the same string, the marker added
        ids, half = m.streams["positions"], len(m.prompt)
        last_char = ids[half + len(m.answer) - 2]  # the answer's last character, whose query decides to stop
        assert ids[half - 2] == last_char + 1 == max(ids)  # the marker: one id past it, as each copied token is
        assert ids[half - 1] == p.streams["positions"][len(p.prompt) - 1]  # SEP keeps its id
        unmarked = ids[:half - 2] + ids[half - 1:]  # every other token keeps its id
        assert unmarked[:len(p.streams["positions"])] == p.streams["positions"][:len(unmarked)]


# --- what each answer token is read from (evaluation's read_attention) -------------------------------

@pytest.mark.parametrize("reverse, pad", [*FORMATS, (False, False)])
@pytest.mark.parametrize("hints", [False, True])
def test_a_sum_digit_is_read_from_the_operand_digits_of_its_significance(reverse, pad, hints):
    task = addition(reverse, pad, hints)
    for _, e in examples(task):
        roles, keys = addition_roles(task, e), task.read_keys(e)
        prompt_roles, answer_roles = roles[:len(e.prompt)], roles[len(e.prompt):]
        assert len(keys) == len(e.answer)  # one entry per place, the EOS last
        for place, (role, sig) in enumerate(answer_roles):
            expected = [k for k, r in enumerate(prompt_roles) if role != "eos" and r == (role, sig)]
            assert keys[place] == expected, (task.decode(e.prompt + e.answer), place)
            if role == "digit" and expected:  # the digit is the keys' digits plus a carry of 0 or 1, mod 10
                total = sum(int(task.tokens[e.prompt[k]]) for k in expected)
                assert (int(task.tokens[e.answer[place]]) - total) % 10 in (0, 1)
            if role == "hint" and expected:  # hints of one significance are one symbol
                assert {e.prompt[k] for k in expected} == {e.answer[place]}
        assert any(len(k) == 2 for k in keys) and keys[-1] == []


@pytest.mark.parametrize("hints", [False, True])
def test_a_copied_token_is_read_from_the_same_place_in_the_prompt(hints):
    task = copy(hints)
    for _, e in examples(task):
        keys = task.read_keys(e)
        assert keys[-1] == [] and len(keys) == len(e.answer)
        assert [e.prompt[k] for ks in keys[:-1] for k in ks] == e.answer[:-1]  # each place reads the token it writes
        assert copy_roles(task, e)[:len(e.prompt) - 1] == copy_roles(task, e)[len(e.prompt):-1]


@pytest.mark.parametrize("hints", [False, True])
def test_with_an_end_marker_the_answers_eos_is_read_from_the_marker(hints):
    task = copy(hints, end_marker=True)
    for _, e in examples(task):
        keys = task.read_keys(e)
        assert len(keys) == len(e.answer) and all(len(k) == 1 for k in keys)
        assert [e.prompt[k] for ks in keys for k in ks] == e.answer  # the EOS too: it reads the marker


# --- Abacus digit indices (McLeish et al. 2024) ------------------------------------------------------

@pytest.mark.parametrize("reverse, pad", FORMATS)
@pytest.mark.parametrize("hints", [False, True])
def test_abacus_indices_count_by_significance_and_restart_at_each_number(reverse, pad, hints):
    task = addition(reverse, pad, hints, abacus=True)
    for _, e in examples(task):
        roles, indices = addition_roles(task, e), e.streams["digit_index"]
        for (role, sig), index in zip(roles[:-1], indices):  # every token the model reads
            assert index == (sig + 1 if role == "digit" else 0)  # '+', '=' and hints: 0
        # EOS is never read. Without padding the sum may be a digit shorter than the longest, and the
        # streams, a function of the prompt alone, must not tell which: EOS and the slots after it keep the
        # indices of the longest sum's digits. Padded, the sum's length is known and EOS has 0.
        assert not pad or all(index == 0 for index in indices[len(roles) - 1:])


@pytest.mark.parametrize("hints", [False, True])
def test_copy_abacus_indices_are_each_characters_index_in_its_string(hints):
    task = copy(hints, abacus=True)
    for _, e in examples(task):
        for (role, index), value in zip(copy_roles(task, e), e.streams["digit_index"]):
            assert value == (index + 1 if role == "char" else 0)


# --- training offsets: training batches only ---------------------------------------------------------

def base_streams(task, batch, row):
    """The task's own streams for a batch row, recomputed from the prompt the row holds."""
    tokens = batch["input"][row][batch["valid"][row]].tolist()
    first_answer = int((batch["target"][row] != IGNORE).nonzero()[0])  # the prompt's last token predicts it
    return task.streams(tokens[:first_answer + 1], task.max_len), len(tokens)


@pytest.mark.parametrize("make", [addition, copy], ids=["addition", "copy"])
def test_offsets_shift_training_batches_only(make):
    task = make(coupled=True, abacus=True, coupled_offset=20, abacus_offset=20)
    shifts = {"positions": set(), "digit_index": set()}
    for batch, _ in zip(task.train_batches(), range(5)):
        for row in range(batch["input"].shape[0]):
            own, n = base_streams(task, batch, row)
            for name in shifts:
                carried, plain = batch[name][row][:n].tolist(), own[name][:n]
                assert [c == 0 for c in carried] == [p == 0 for p in plain]  # 0 (no id / not a digit) stays 0
                row_shift = {c - p for c, p in zip(carried, plain) if p}
                assert len(row_shift) == 1 and 0 <= min(row_shift) <= 20  # one shift per sequence, in [0, K]
                shifts[name] |= row_shift
    assert all(len(s) > 5 for s in shifts.values())  # drawn afresh per sequence
    for length in task.eval_lengths:  # evaluation: the task's own streams, unshifted
        for e in task.eval_set(length):
            assert e.streams == {k: v for k, v in task.streams(e.prompt, length).items()}
    for batch in task.validation_batches():
        for row in range(batch["input"].shape[0]):
            own, n = base_streams(task, batch, row)
            assert all(batch[name][row][:n].tolist() == own[name][:n] for name in shifts)


def test_the_model_is_sized_for_the_shifted_ids(tmp_path):
    from blocklab.experiment import Setup

    plain = Setup.from_config(compose_config(["task=addition", "pos=learned", "pos.coupled=true"], tmp_path / "a"))
    shifted = Setup.from_config(compose_config(["task=addition", "pos=learned", "pos.coupled=true",
                                                "pos.coupled_offset=50"], tmp_path / "b"))
    assert shifted.model_cfg.max_len == plain.model_cfg.max_len + 50
    most = max(max(b["positions"][b["valid"]].tolist()) for b, _ in zip(shifted.task.train_batches(), range(20)))
    assert plain.model_cfg.max_len < most < shifted.model_cfg.max_len


def test_digit_index_of_non_digits_is_zero_in_training_batches_too():
    task = addition(hints=True, abacus=True, abacus_offset=30)
    digits = torch.tensor([task.ids[d] for d in "0123456789"])
    for batch, _ in zip(task.train_batches(), range(3)):
        is_digit = torch.isin(batch["input"], digits) & batch["valid"]
        assert (batch["digit_index"][batch["valid"] & ~is_digit] == 0).all()
        assert (batch["digit_index"][is_digit] > 0).all()


# --- index hints (Zhou et al. 2024) ------------------------------------------------------------------

@pytest.mark.parametrize("make, kw", [(addition, dict(reverse=True, pad=False)), (addition, dict(reverse=False, pad=True)),
                                      (addition, dict(reverse=False, pad=False)), (copy, {})],
                         ids=["addition-reversed", "addition-padded", "addition-plain", "copy"])
def test_stripping_the_hints_gives_the_plain_example(make, kw):
    hinted, plain = make(hints=True, **kw), make(**kw)
    assert hinted.max_seq_len > plain.max_seq_len
    for length in (3, 5, 9):
        for h, p in zip(hinted.eval_set(length), plain.eval_set(length)):
            assert hinted.decode(hinted.scored(h.prompt)) == plain.decode(p.prompt)
            assert hinted.decode(hinted.scored(h.answer)) == plain.decode(p.answer)
            assert len(h.prompt) <= hinted.max_prompt_len(length) and len(h.answer) <= hinted.max_answer_len(length)
            text = names(hinted, h.prompt + h.answer)
            marks = [k for k, name in enumerate(text) if is_hint(name)]
            assert all(not is_hint(text[k + 1]) and text[k + 1] not in "+=" for k in marks)  # one hint per digit
            assert len(marks) == sum(name in "0123456789abcdef" for name in text)


@pytest.mark.parametrize("reverse, pad", FORMATS + [(False, False)])
def test_a_hint_names_its_digits_significance(reverse, pad):
    task = addition(reverse, pad, hints=True)
    for _, e in examples(task):
        roles, text = addition_roles(task, e), names(task, e.prompt + e.answer)
        symbol = {}
        for (role, sig), name in zip(roles, text):
            if role == "hint":
                symbol.setdefault(sig, set()).add(int(name[2:-1]))
        assert all(len(s) == 1 for s in symbol.values())  # both operands and the sum: one hint per significance
        numbers = [symbol[s].pop() for s in sorted(symbol)]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # a consecutive run


def test_hints_longer_examples_use_are_trained_on_short_ones():
    task = copy(hints=True)
    trained = {i for b, _ in zip(task.train_batches(), range(40)) for i in b["input"][b["valid"]].tolist()}
    evaluated = {i for length in task.eval_lengths for e in task.eval_set(length) for i in e.prompt + e.answer}
    hints = set(task.hint_ids)
    assert evaluated & hints <= trained & hints == hints  # every hint symbol, and so every run, is trained
    assert max(task.eval_lengths) > task.max_len


def test_an_answer_with_right_digits_and_wrong_hints_is_exact(monkeypatch):
    """The rule: exact match scores the answer without its hints (and up to its first EOS). Right digits
    with wrong or missing hints: exact. A wrong digit, a missing EOS, a digit too many: not."""
    import blocklab.tasks.base as base

    task = addition(hints=True)
    examples_ = task.eval_set(3)
    hints = task.hint_ids

    def rewritten(e, how):
        row = list(e.answer)
        if how == "wrong hints":
            row = [hints[(hints.index(t) + 7) % len(hints)] if t in hints else t for t in row]
        elif how == "no hints":
            row = task.scored(row)
        elif how == "wrong digit":
            k = next(k for k, t in enumerate(row) if t not in hints)
            row[k] = task.ids["1"] if task.tokens[row[k]] != "1" else task.ids["2"]
        elif how == "no eos":
            row = row[:-1] + [task.ids["+"]]
        elif how == "a digit too many":
            row = row[:-1] + [task.ids["0"], task.eos_id]
        return row

    class Logits(torch.nn.Module):  # teacher-forced part: any logits
        def forward(self, idx, *args, **kwargs):
            return torch.zeros(*idx.shape, task.vocab_size)

    for how, expected in (("same", 1.0), ("wrong hints", 1.0), ("no hints", 1.0), ("wrong digit", 0.0),
                          ("no eos", 0.0), ("a digit too many", 0.0)):
        rows = [rewritten(e, how) for e in examples_]
        width = task.max_answer_len(3) + 2
        generated = torch.tensor([row + [task.pad_id] * (width - len(row)) for row in rows])
        monkeypatch.setattr(base, "generate", lambda *args, **kwargs: generated)
        assert task.evaluate_length(Logits(), 3)["exact_match"] == expected, how


def test_hint_symbols_must_cover_the_longest_example():
    with pytest.raises(ConfigError, match=r"task.hint_symbols=9 is fewer than the 10 consecutive index hints"):
        build_task({"name": "addition", "reverse_answer": True, "pad_operands": False, "index_hints": True,
                    "hint_symbols": 9, **COMMON}, 0)  # the sum of 9-digit operands: 10 digits
    build_task({"name": "copy", "alphabet": "ab", "index_hints": True, "hint_symbols": 9, **COMMON}, 0)
    build_task({"name": "copy", "alphabet": "ab", "index_hints": False, "hint_symbols": 1, **COMMON}, 0)


# --- decoding reads the streams ahead of the answer -------------------------------------------------

@pytest.mark.parametrize("overrides", [
    ["task=addition", "pos=learned", "pos.coupled=true"],
    ["task=addition", "pos=rope", "pos.abacus=true", "pos.abacus_offset=10", "task.pad_operands=true",
     "task.reverse_answer=false"],
    ["task=addition", "pos=learned", "pos.coupled=true", "pos.randomize=true", "pos.random_max=256",
     "task.index_hints=true"],
    ["task=copy", "pos=learned", "pos.coupled=true", "pos.abacus=true", "task.index_hints=true",
     "pos.coupled_offset=8"],
    ["task=copy", "pos=rope", "pos.randomize=true", "pos.random_max=200", "pos.abacus=true"],
    ["task=copy", "pos=rope", "pos.coupled=true", "task.end_marker=true", "task.index_hints=true"],
], ids=["coupled", "abacus-padded", "randomized-coupled-hints", "copy-coupled-abacus-hints", "copy-randomized-abacus",
        "copy-coupled-end-marker-hints"])
def test_cached_decoding_with_streams_equals_recomputation(overrides, tmp_path):
    streams, cached, model, prompts, new = decoded_both_ways(overrides, tmp_path)
    from blocklab.model.generate import generate
    other = [{k: torch.roll(v, 1) if k == "positions" else v + (v > 0) for k, v in s.items()} for s in streams]
    assert not torch.equal(cached, generate(model, prompts, new, streams=other))  # the streams were read


METHODS = sorted(p.stem for p in (Path(__file__).parents[1] / "src/blocklab/conf/method").glob("*.yaml"))


@pytest.mark.parametrize("task", ["copy", "addition"])
@pytest.mark.parametrize("method", METHODS)
def test_every_method_decodes_the_same_with_and_without_the_cache(method, task, tmp_path):
    decoded_both_ways([f"method={method}", f"task={task}"], tmp_path)


def decoded_both_ways(overrides, tmp_path):
    """Greedy answers to 8 evaluation prompts of length 8 (twice the training length), with the KV cache and
    recomputing everything, from a model with large random weights (its choices depend on every input); asserts
    they are equal."""
    from blocklab.experiment import Setup
    from blocklab.model import build_model
    from blocklab.model.generate import generate

    setup = Setup.from_config(compose_config([*overrides, "init.std=1.0", "task.max_len=4",
                                              "task.eval_lengths=[2,8]"], tmp_path / "run"))
    task = setup.task
    torch.manual_seed(0)
    model = build_model(setup.model_cfg).eval()
    batch = task.eval_set(8)[:8]  # addition: prompts of different lengths, left-padded
    prompts = [torch.tensor(e.prompt) for e in batch]
    streams = [{k: torch.tensor(v) for k, v in e.streams.items()} for e in batch]
    new = task.max_answer_len(8)
    cached = generate(model, prompts, new, streams=streams, use_cache=True)
    recomputed = generate(model, prompts, new, streams=streams, use_cache=False)
    assert cached.shape[1] > 1 and torch.equal(cached, recomputed)
    return streams, cached, model, prompts, new


# --- bad input: one line, before any work -------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["task=lm", "pos.coupled=true"], "pos.randomize, pos.coupled and pos.abacus need a task that builds its own"),
    (["task=lm", "pos.abacus=true"], "pos.randomize, pos.coupled and pos.abacus need a task that builds its own"),
    (["task=addition", "pos.coupled=true", "task.reverse_answer=false", "task.pad_operands=false"],
     "pos.coupled=true needs each digit's significance before the sum is written"),
    (["task=addition", "pos.abacus=true", "task.reverse_answer=false"], "pos.abacus=true needs each digit's"),
    (["pos.abacus_offset=-1"], "pos.abacus_offset=-1 must be an integer >= 0"),
    (["pos.coupled_offset=-1"], "pos.coupled_offset=-1 must be an integer >= 0"),
    (["pos.coupled_offset=5"], "pos.coupled_offset=5 shifts coupled position ids, but pos.coupled=false"),
    (["pos.coupled=true", "pos.coupled_offset=5", "pos.randomize=true", "pos.random_max=500"],
     "pos.coupled_offset=5 has no use with pos.randomize=true"),
    (["pos.randomize=true", "pos.random_max=20"], "pos.random_max=20 is smaller than the longest evaluated sequence"),
    (["task.index_hints=true", "task.hint_symbols=20"], "task.hint_symbols=20 is fewer than the 32 consecutive"),
    (["task.index_hints=1"], "task.index_hints=1 must be true or false"),
    (["task.end_marker=1"], "task.end_marker=1 must be true or false"),
])
def test_bad_settings_are_one_line_errors_before_any_work(args, message, tmp_path):
    proc = run_cli([*args, f"run_dir={tmp_path / 'run'}", "logger=none"], timeout=120)
    assert_refused_cli(proc, message, tmp_path / "run")


# --- end to end -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [
    ["task=addition", "pos.coupled=true", "pos.coupled_offset=8"],
    ["task=copy", "task.index_hints=true", "pos.coupled=true", "pos=learned"],
    ["task=copy", "task.index_hints=true", "pos.abacus=true", "pos=none"],
    ["task=copy", "task.end_marker=true", "pos.coupled=true", "pos=rope"],
], ids=["addition-coupled", "copy-hints-coupled", "copy-hints-abacus-nope", "copy-end-marker-coupled"])
def test_short_runs_train_and_evaluate(overrides, run_dir, capsys):
    run_in_process([*FAST, *overrides], run_dir)
    results = read_results(run_dir)
    assert results["status"] == "completed" and results["steps"] == 20
    assert results["eval"] and all(0 <= row["exact_match"] <= 1 for row in results["eval"])
    saved = json.loads((run_dir / "model.json").read_text())
    assert saved["pos"]["coupled"] == ("pos.coupled=true" in overrides)
    assert saved["pos"]["abacus"] == ("pos.abacus=true" in overrides)
    # Generation from a free prompt has no digit indices or coupled ids to give: one line, naming the setting.
    from blocklab.generate import main as generate_main
    setting = "pos.coupled" if "pos.coupled=true" in overrides else "pos.abacus"
    with pytest.raises(SystemExit) as refused:
        generate_main([str(run_dir), "--prompt", "12+34="])
    assert refused.value.code == 2
    assert re.search(f"trained with {setting}.*position streams come from the task", capsys.readouterr().err)


def test_generation_refuses_exactly_the_settings_whose_positions_come_from_the_task():
    from blocklab.generate import derived_positions_error
    assert derived_positions_error(Placement()) is None
    assert derived_positions_error(Placement(coupled_offset=0)) is None
    assert "pos.randomize" in derived_positions_error(Placement(random_max=64))
    assert "pos.coupled, pos.abacus" in derived_positions_error(Placement(coupled=True, abacus=True))


def test_the_published_coupling_recipe_builds_the_papers_model_and_trains_every_id_it_tests(tmp_path):
    """experiment=coupling_published (Cho et al. 2024's small addition setting): one block of d_model 512 with a gated
    FFN of 2048 hidden units, 1-5 digits in training, 10 (2x) among the tested, and coupled ids whose training shifts cover the ids
    the longest tested sums use."""
    import random

    from blocklab.experiment import Setup
    from blocklab.model import build_model

    setup = Setup.from_config(compose_config(["experiment=coupling_published"], tmp_path / "run"))
    cfg, task = setup.model_cfg, setup.task
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads) == (1, 512, 4)
    ffn = {m.weight.shape for name, m in build_model(cfg).named_modules() if isinstance(m, torch.nn.Linear) and "ffn" in name}
    assert ffn == {(2 * 2048, 512), (512, 2048)}  # gate and value (fused), then down: 2048 hidden units
    assert (task.min_len, task.max_len) == (1, 5) and 10 in task.eval_lengths and task.pad_operands
    tested = max(max(e.streams["positions"]) for e in task.eval_set(max(task.eval_lengths)))
    rng = random.Random(0)
    trained = max(max(task.placed(task.sample(rng, 5), 5, rng, training=True).streams["positions"]) for _ in range(400))
    assert trained >= tested  # the random start reaches every id a 10-digit sum is read at
