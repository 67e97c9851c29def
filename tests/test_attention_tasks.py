"""The tasks that need a sparse pattern (periodic: the token exactly P back; keyed: the first token) are what they
claim, checked from their definitions and against the patterns' real support; and the cost measurements that the
attention_kinds sweep reports (train/costs.py)."""
import random
from types import SimpleNamespace

import pytest
import torch

from blocklab.model import build_model
from blocklab.model.patterns import ATTENTION_PATTERNS
from blocklab.tasks import TASKS, build_task
from conftest import compose_config
from helpers import refused

COMMON = dict(eval_lengths=None, batch_size=8, eval_examples=10, eval_seed=7)


def periodic(period=8, min_len=8, max_len=16, **kw):
    return build_task({"name": "periodic", "period": period, "alphabet": "abcdefghijklmnop", "min_len": min_len,
                       "max_len": max_len, **COMMON, **kw}, seed=0)


def keyed(min_len=1, max_len=16, **kw):
    return build_task({"name": "keyed", "alphabet": "abcdefgh", "min_len": min_len, "max_len": max_len,
                       **COMMON, **kw}, seed=0)


def reach(pattern: str, length: int, layers: int, **options) -> torch.Tensor:
    """(T, T) bool: which inputs can reach which position's output through `layers` causal layers of the pattern
    (the support composed with itself): the only routes information has."""
    index = torch.arange(length)
    step = ATTENTION_PATTERNS[pattern](**options).support(index, index, causal=True).long()
    seen = step
    for _ in range(layers - 1):
        seen = (seen @ step).clamp(max=1)
    return seen.bool()


def sequences(task, length: int, n: int = 50):
    rng = random.Random(length)
    return [task.sample(rng, length) for _ in range(n)]


@pytest.mark.parametrize("period", [3, 8])
@pytest.mark.parametrize("length", [8, 13, 24])
def test_periodic_answer_is_the_token_exactly_period_back_from_its_query(period, length):
    """Answer token k is predicted at the position before it (SEP for k = 0); it equals the token P back from
    there, the series is periodic, and the answer ends with EOS, which needs SEP, P back."""
    task = periodic(period=period, min_len=period)
    sep = task.ids["<sep>"]
    for e in sequences(task, length):
        seq = e.prompt + e.answer
        assert len(e.prompt) == length + 1 and e.prompt[-1] == sep and len(e.answer) == period + 1
        series = e.prompt[:-1] + e.answer[:-1]
        assert all(series[t] == series[t - period] for t in range(period, len(series)))
        for k, token in enumerate(e.answer):
            query = len(e.prompt) + k - 1
            assert token == (task.eos_id if k == period else seq[query - period])
        assert seq[len(seq) - 2 - period] == sep  # the EOS query sees SEP exactly P back


def test_periodic_answer_has_no_copy_closer_than_period():
    """Any P consecutive series values are independent draws: the only positions holding the answer's series
    index (mod P) are P, 2P, ... back from its query, so nothing nearer says anything about it."""
    period, length = 8, 13
    task = periodic(period=period)
    prompt_len = length + 1
    series_index = list(range(length)) + [None] + list(range(length, length + period))  # SEP has none
    for k in range(period):
        query, target = prompt_len + k - 1, length + k
        copies = [p for p in range(query + 1)
                  if series_index[p] is not None and series_index[p] % period == target % period]
        assert copies and all((query - c) % period == 0 and query - c >= period for c in copies)
    # and the first period really is random: all residues take many values
    e = sequences(task, length, 200)
    assert all(len({s.prompt[r] for s in e}) > 8 for r in range(period))


def test_window_cannot_reach_the_token_period_back_and_strided_can():
    """With L layers and window w the reach is L*(w-1): below P no answer query reaches any copy of its answer;
    strided with stride P (same window) reaches the one P back in one layer; a reach >= P (deeper) would."""
    period, length, layers, w = 8, 16, 2, 4
    assert layers * (w - 1) < period
    task = periodic(period=period)
    total = length + 1 + period + 1
    window = reach("window", total, layers, window=w)
    strided = reach("strided", total, 1, stride=period, window=w)
    deeper = reach("window", total, 3, window=w)  # 3 * 3 = 9 >= 8: depth would carry it
    for k in range(period + 1):
        query = length + k  # SEP, then the answer tokens before the last
        assert not window[query, :query - layers * (w - 1)].any()
        assert not window[query, query - period] and strided[query, query - period] and deeper[query, query - period]
    assert task.eval_lengths == [8, 12, 16, 20, 24, 28, 32]  # none below one period


def test_keyed_answer_is_the_first_token_which_nothing_after_it_tells():
    task = keyed()
    keys, sep = task.keys, task.ids["<sep>"]
    for length in (1, 7, 30):
        answers = set()
        for e in sequences(task, length, 200):
            key = task.tokens[e.prompt[0]]
            assert key in keys and e.prompt[-1] == sep and len(e.prompt) == length + 2
            assert all(task.tokens[t] in task.alphabet for t in e.prompt[1:-1])
            assert e.answer == [task.ids[task.alphabet[keys.index(key)]], task.eos_id]
            answers.add(e.answer[0])
        assert len(answers) == len(task.alphabet)  # every key occurs: a guess gets 1/8
    # The key is drawn before and apart from the body: the same body follows every key.
    rng = random.Random(0)
    pairs = [(e.prompt[0], tuple(e.prompt[1:-1])) for e in (task.sample(rng, 2) for _ in range(2000))]
    bodies_per_key = {k: {b for kk, b in pairs if kk == k} for k, _ in pairs}
    assert min(len(b) for b in bodies_per_key.values()) > 40  # 64 possible bodies of length 2


def test_window_cannot_reach_the_key_and_global_can():
    layers, w = 2, 4
    for length in (6, 8, 16, 32):  # the key is length + 1 back from SEP, beyond 2 * 3 = 6
        sep = length + 1
        window = reach("window", sep + 2, layers, window=w)
        glob = reach("global", sep + 2, 1, window=w, n_global=1)
        assert not window[sep, 0] and not window[sep + 1, 0] and glob[sep, 0] and glob[sep + 1, 0]
    assert reach("window", 6, layers, window=w)[5, 0]  # length 4: within reach


def test_evaluation_goes_beyond_the_training_lengths():
    for task in (periodic(), keyed()):
        beyond = [n for n in task.eval_lengths if not task.in_distribution(n)]
        assert beyond and max(beyond) == 2 * task.max_len
        batch = task.validation_batches()[-1]
        assert batch["length"] == 2 * task.max_len and batch["input"].shape[1] <= task.max_seq_len


def test_tasks_are_registered_with_their_config_files(tmp_path):
    for name in ("periodic", "keyed"):
        assert name in TASKS and not TASKS[name].supports_seq2seq
        cfg = compose_config([f"task={name}"], tmp_path)
        assert build_task(dict(cfg.task), seed=0).name == name


@pytest.mark.parametrize("options, message", [
    (dict(min_len=4), "task.min_len=4 < task.period=8: the series read must hold a whole period"),
    (dict(eval_lengths=[4, 16]), "task.eval_lengths [4] are shorter than task.period=8"),
    (dict(period=0), "task.period=0 must be a positive integer"),
    (dict(alphabet="aa"), "task.alphabet='aa' must be a string of at least 2 distinct characters"),
])
def test_periodic_bad_options_are_one_line(options, message):
    with refused(message) as err:
        periodic(**options)
    assert str(err.value).startswith(message)


# ------------------------------------------------------------------------------------------------ costs

def model_for(tmp_path, *overrides):
    from blocklab.experiment import Setup

    setup = Setup.from_config(compose_config([*overrides], tmp_path))
    torch.manual_seed(0)
    return build_model(setup.model_cfg), setup.task


def test_peak_memory_counts_what_is_made_and_alive_at_once():
    from blocklab.train.costs import PeakMemory

    x = torch.randn(256, 256)  # made before: not counted
    with PeakMemory() as memory:
        a = x @ x            # 1 matrix alive
        b = a.relu()         # 2
        del a                # 1
        c = b.t()            # a view: nothing new
        b.add_(1)            # in place: nothing new
        d = torch.cat([c, c])  # 1 + 2
    assert memory.peak == 3 * 256 * 256 * 4 and memory.now == memory.peak
    del b, c, d
    assert memory.now == 0


def test_decoding_state_at_a_long_context(tmp_path):
    """A window's cache keeps w keys, linear attention a fixed state, full attention every key."""
    from blocklab.train.costs import decode_at

    sizes = {}
    for attn in ("mha", "window", "linear"):
        model, _ = model_for(tmp_path, f"attn={attn}")
        sizes[attn] = [decode_at(model, context, 4, 2)["decode_state_bytes"] for context in (40, 60)]
    per_key = 2 * 2 * 64 * 4  # layers x (K, V) x d_model x float32
    assert sizes["mha"] == [40 * per_key, 60 * per_key]
    assert sizes["window"] == [16 * per_key] * 2  # attn=window: 16 keys
    assert sizes["linear"][0] == sizes["linear"][1] < sizes["window"][0]


def test_costs_are_recorded_for_decoders_and_left_null_where_they_do_not_apply(tmp_path):
    from blocklab.train.costs import costs

    model, task = model_for(tmp_path, "attn=window")
    out = costs(model, task)
    assert out["context"] == model.cfg.max_len and out["decode_state_bytes"] == 16 * 2 * 2 * 64 * 4
    assert out["step_peak_bytes"] > out["context_step_peak_bytes"] > 0 and out["decode_tokens_per_s"] > 0
    assert all(p.grad is None for p in model.parameters())  # the measurement leaves no gradients behind
    model, task = model_for(tmp_path, "attn=linformer")
    out = costs(model, task)
    assert out["step_peak_bytes"] > 0 and out["decode_tokens_per_s"] is None and out["decode_state_bytes"] is None


def test_decode_speed_is_set_by_neither_the_first_call_nor_one_slow_decode(tmp_path, monkeypatch):
    """decode_stats times with a clock that only the decodes move, each by a set time: the first call and one later
    one stall, as a machine's hiccup would; the speed must be the median timed decode's, whatever the machine."""
    from blocklab.train import outcome

    model, task = model_for(tmp_path)
    model.eval()
    seconds = [5.0, 0.2, 5.0, 0.1]  # untimed first call, then three timed ones; their median is 0.2
    clock, calls, real_generate = [0.0], [], outcome.generate

    def generate(*args, **kwargs):
        calls.append(len(calls))
        clock[0] += seconds[len(calls) - 1]
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(outcome, "generate", generate)
    monkeypatch.setattr(outcome, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    out = outcome.decode_stats(model, task, new_tokens=16, batch=2, rounds=3)
    assert len(calls) == 4  # one untimed, three timed
    assert out["tokens_per_s"] == pytest.approx(2 * 16 / 0.2)  # batch x new tokens over the median decode
