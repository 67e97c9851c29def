"""Sparse attention patterns (attn.pattern): each pattern's support against its definition written out
here from the papers, causality, blocked kernels against the dense masked computation (outputs and
gradients), decoding with the cache against full recomputation, and one-line config errors."""
import pytest
import torch

from blocklab.model import ModelConfig
from blocklab.model.attention import ATTENTION_KINDS, Attention
from blocklab.model.config import AttnConfig
from blocklab.model.mask import self_attention_context
from blocklab.model.patterns import ATTENTION_PATTERNS
from blocklab.train.run import prepare
from conftest import compose_config
from helpers import assert_cached_steps_equal_full, dense_attention, refused, tokens
from variants import tiny_model

V = 20

# Each pattern's options for the tests (windows shorter than the sequences, so blocks are exercised).
PATTERNS = {
    "full": {},
    "window": dict(window=4),
    "strided": dict(stride=3, window=2),
    "dilated": dict(window=3, dilation=2),
    "global": dict(window=3, n_global=2),
    "bigbird": dict(window=2, n_global=1, n_random=2, block=3, seed=7),
}
assert set(PATTERNS) == set(ATTENTION_PATTERNS)


def random_keys(pattern, i: int) -> set[int]:
    """The random keys BigBird gave query i's block (their properties are tested on their own)."""
    block = i // pattern.block
    return {int(j) for j in pattern.random_keys(block + 1)[block] if j >= 0}


def defined(name: str, opts: dict, pattern, i: int, j: int, causal: bool) -> bool:
    """May query i see key j: each pattern's definition, for absolute indices, as the papers state it."""
    back = i - j
    if causal and back < 0:
        return False
    near = abs(back) < opts.get("window", 0)  # a local window: the w most recent keys (|i - j| < w unmasked)
    glob = i < opts.get("n_global", 0) or j < opts.get("n_global", 0)  # global tokens see and are seen by all
    return {
        "full": lambda: True,
        "window": lambda: near,
        "strided": lambda: near or back % opts["stride"] == 0,  # Child et al.: local + every s-th key
        "dilated": lambda: abs(back) in {opts["dilation"] * m for m in range(opts["window"])},
        "global": lambda: near or glob,
        "bigbird": lambda: near or glob or j in random_keys(pattern, i),
    }[name]()


def build(name: str, **override):
    return ATTENTION_PATTERNS[name](**{**PATTERNS[name], **override})


def make_model(name: str, pos: str = "none", causal: bool = True, seed: int = 0, n_kv_heads=None, **override):
    opts = {**PATTERNS[name], **override}
    window = opts.pop("window", None)
    return tiny_model(pos, seed, vocab_size=V, causal=causal, pattern=name, window=window, pattern_options=opts,
                      n_kv_heads=n_kv_heads)


# ------------------------------------------------------------------------------------- support

@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", PATTERNS)
def test_support_is_the_pattern_definition(name, causal):
    pattern = build(name)
    n = 17
    index = torch.arange(n)
    support = pattern.support(index, index, causal)
    expected = torch.tensor([[defined(name, PATTERNS[name], pattern, i, j, causal) for j in range(n)]
                             for i in range(n)])
    assert torch.equal(support, expected)
    # Absolute indices: a slice of queries and keys (as a cache holds them) gives the same pairs.
    assert torch.equal(pattern.support(index[9:12], index[4:], causal), expected[9:12, 4:])
    assert bool(support.diagonal().all())  # every query sees itself: no empty softmax row


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", PATTERNS)
def test_attention_weights_fall_exactly_on_the_support(name, causal):
    """Analysis (need_weights) gets the explicit weights of the pattern: positive on every allowed key,
    zero elsewhere, each row summing to 1."""
    model = make_model(name, causal=causal)
    n = 14
    with torch.no_grad():
        _, weights = model(tokens((2, n)), need_weights=True)
    pattern = model.pattern
    expected = torch.tensor([[defined(name, PATTERNS[name], pattern, i, j, causal) for j in range(n)]
                             for i in range(n)])
    for w in weights:
        assert w.shape == (2, 4, n, n)
        assert torch.equal(w > 0, expected.expand_as(w))
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, n, dtype=w.dtype), rtol=0, atol=1e-12)


def test_strided_sees_the_token_exactly_p_back_where_a_shorter_window_cannot():
    """The periodic task: the answer is the token P back. A window w < P never sees it; strided with
    stride P sees it from every query (and, causal, no later token)."""
    n = 40
    index = torch.arange(n)
    for period in (5, 8, 13):
        strided = ATTENTION_PATTERNS["strided"](stride=period, window=3).support(index, index, True)
        window = ATTENTION_PATTERNS["window"](window=period - 1).support(index, index, True)
        for i in range(period, n):
            assert strided[i, i - period] and not window[i, i - period]
        assert not bool(strided.triu(1).any())


def test_global_tokens_are_seen_by_every_query_where_a_window_misses_them():
    n, g = 30, 3
    index = torch.arange(n)
    glob = ATTENTION_PATTERNS["global"](window=4, n_global=g).support(index, index, True)
    window = ATTENTION_PATTERNS["window"](window=4).support(index, index, True)
    assert bool(glob[:, :g].tril().eq(torch.ones(n, g, dtype=torch.bool).tril()).all())
    assert not bool(window[g + 4:, :g].any())


def test_bigbird_random_keys_are_earlier_fixed_by_the_seed_and_independent_of_length():
    pattern = build("bigbird", n_random=3, block=4, seed=11)
    table = pattern.random_keys(20)
    for b, keys in enumerate(table.tolist()):
        drawn = [k for k in keys if k >= 0]
        assert len(drawn) == min(3, 4 * b) == len(set(drawn))  # r distinct keys where that many exist
        assert all(k < 4 * b for k in drawn)  # drawn among the keys before the block
    assert torch.equal(build("bigbird", n_random=3, block=4, seed=11).random_keys(20), table)
    assert not torch.equal(build("bigbird", n_random=3, block=4, seed=12).random_keys(20), table)
    assert torch.equal(build("bigbird", n_random=3, block=4, seed=11).random_keys(7), table[:7])
    # The support over a short sequence is the corner of that over a long one (decoding relies on it).
    short, long = torch.arange(12), torch.arange(40)
    assert torch.equal(pattern.support(short, short, True), pattern.support(long, long, True)[:12, :12])


# ------------------------------------------------------------------------------------ causality

@pytest.mark.parametrize("need_weights", [False, True], ids=["fast", "explicit"])
@pytest.mark.parametrize("pos", ["none", "rope", "alibi"])
@pytest.mark.parametrize("name", PATTERNS)
def test_later_tokens_never_change_earlier_outputs(name, pos, need_weights):
    model = make_model(name, pos)
    idx = tokens((2, 19))

    def run(x):
        with torch.no_grad():
            out = model(x, need_weights=need_weights)
        return out[0] if need_weights else out

    base = run(idx)
    for t in (1, 6, 13, 18):
        changed = idx.clone()
        changed[:, t:] = (idx[:, t:] + 1) % V
        out = run(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert (out[:, t] - base[:, t]).abs().max() > 1e-6


# ----------------------------------------------------------------------------- blocked kernels

BLOCKED = [("window", dict(window=4)), ("window", dict(window=1)), ("window", dict(window=7)),
           ("strided", dict(stride=3, window=2)), ("strided", dict(stride=4)), ("strided", dict(stride=2, window=5))]


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("length", [1, 3, 8, 13, 30])
@pytest.mark.parametrize("name, opts", BLOCKED, ids=[f"{n}-{'-'.join(map(str, o.values()))}" for n, o in BLOCKED])
def test_blocked_kernel_equals_the_dense_masked_computation(name, opts, length, causal, kv_heads):
    """Outputs and gradients, lengths a multiple of the block or not."""
    pattern = ATTENTION_PATTERNS[name](**opts)
    assert pattern.skips_masked_work
    g = torch.Generator().manual_seed(length)
    q = torch.randn(2, 4, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, length, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
    allowed = torch.tensor([[defined(name, {"window": opts.get("window", opts.get("stride")), **opts}, pattern,
                                     i, j, causal) for j in range(length)] for i in range(length)])
    weight = torch.randn(2, 4, length, 8, generator=g, dtype=torch.float64)
    outs, grads = [], []
    for fn in (lambda: pattern.attend(q, k, v, causal, 0.4, 0.0), lambda: dense_attention(q, k, v, 0.4, allowed)):
        out = fn()
        grads.append(torch.autograd.grad((out * weight).sum(), (q, k, v)))
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-12)
    for blocked, dense in zip(*grads):
        torch.testing.assert_close(blocked, dense, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["window", "strided"])
def test_blocked_path_is_taken_only_where_it_can_compute_everything(name):
    """The blocked kernel needs the queries to be the keys and no other mask: key padding, a position
    bias, held keys (decoding) and analysis fall back to the dense mask."""
    model = make_model(name)
    pattern, idx = model.pattern, tokens((2, 12))
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0, :3] = False
    alibi = make_model(name, "alibi").pos

    def ctx(**kw):
        args = dict(idx=idx, positions=None, valid=None, cache=None, scheme=model.pos, causal=True, pattern=pattern)
        return self_attention_context(**{**args, **kw})

    assert ctx().blocked is pattern and ctx().mask is None
    assert ctx(valid=torch.ones(2, 12, dtype=torch.bool)).blocked is pattern  # no padding after all
    for fallback in (ctx(valid=valid), ctx(scheme=alibi), ctx(need_weights=True)):
        assert fallback.blocked is None and fallback.mask is not None
    cache = model.new_cache()
    with torch.no_grad():
        model(idx, cache=cache)
    assert ctx(idx=idx[:, :1], cache=cache).blocked is None


@pytest.mark.parametrize("padded", [False, True], ids=["full", "left_padded"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("pos", ["rope", "alibi", "t5_bias"])
@pytest.mark.parametrize("name", PATTERNS)
def test_fast_and_explicit_paths_give_the_same_outputs_and_gradients(name, pos, causal, padded):
    """Training's path (blocked kernel, or SDPA with the dense mask where padding or a bias needs it)
    against the explicit softmax of analysis, with GQA."""
    model = make_model(name, pos, causal=causal, n_kv_heads=2)
    idx, kw = tokens((2, 15)), {}
    if padded:
        valid = torch.ones(2, 15, dtype=torch.bool)
        valid[0, :4] = False
        kw = dict(valid=valid, positions=(valid.long().cumsum(1) - 1).clamp(min=0))
    results = []
    for need_weights in (False, True):
        model.zero_grad()
        out = model(idx, need_weights=need_weights, **kw)
        logits = out[0] if need_weights else out
        (logits * torch.linspace(-1, 1, V, dtype=logits.dtype)).sum().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (fast, fast_grads), (slow, slow_grads) = results
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)
    assert fast_grads.keys() == slow_grads.keys()
    for n in fast_grads:
        torch.testing.assert_close(fast_grads[n], slow_grads[n], rtol=1e-9, atol=1e-11, msg=n)


@pytest.mark.parametrize("name", PATTERNS)
def test_padding_does_not_change_the_outputs_of_real_tokens(name):
    """Right padding never changes a real token's output. Left padding (with positions) shifts the
    row's indices, which leaves it unchanged exactly for the patterns that depend only on i - j
    (global tokens and BigBird's random keys sit at absolute indices, so padding takes their place)."""
    model = make_model(name, "rope")
    short, long, garbage = tokens((1, 9), seed=2), tokens((1, 13), seed=3), tokens((1, 4), seed=4)
    with torch.no_grad():
        alone, alone_long = model(short)[0], model(long)[0]
        valid = torch.ones(2, 13, dtype=torch.bool)
        valid[0, 9:] = False
        right = model(torch.cat((torch.cat((short, garbage), 1), long)), valid=valid)
        valid = valid.flip(1)
        left = model(torch.cat((torch.cat((garbage, short), 1), long)), valid=valid,
                     positions=(valid.long().cumsum(1) - 1).clamp(min=0))
    torch.testing.assert_close(right[0, :9], alone, rtol=1e-10, atol=1e-10)
    for batch in (right, left):
        torch.testing.assert_close(batch[1], alone_long, rtol=1e-10, atol=1e-10)
    index = torch.arange(13)
    if torch.equal(model.pattern.support(index + 4, index + 4, True), model.pattern.support(index, index, True)):
        torch.testing.assert_close(left[0, 4:], alone, rtol=1e-10, atol=1e-10)
    else:
        assert left[0, 4:].isfinite().all()


# ------------------------------------------------------------------------------------- decoding

@pytest.mark.parametrize("pos", ["rope", "alibi"])
@pytest.mark.parametrize("name", PATTERNS)
def test_decoding_with_the_cache_equals_full_recomputation(name, pos):
    model = make_model(name, pos)
    idx = tokens((2, 24), seed=3)
    reach = {"window": 4, "dilated": 2 * (3 - 1) + 1}.get(name)  # keys a query can see back

    def holds_what_the_pattern_reaches(cache, t):
        assert {k.shape[2] for k in cache.keys} == {t + 1 if reach is None else min(t + 1, reach)}

    assert_cached_steps_equal_full(model, idx, prefix=6, after_step=holds_what_the_pattern_reaches)


# ------------------------------------------------------------------------------------ bad input

def config(max_len=32, kind="softmax", **attn) -> ModelConfig:
    return ModelConfig(vocab_size=V, d_model=32, n_heads=4, max_len=max_len, attn=AttnConfig(kind=kind, **attn))


@pytest.mark.parametrize("attn, message", [
    (dict(window=0), "attn.window=0 must be null (full attention) or a positive integer"),
    (dict(pattern="window", window=-3), "attn.window=-3 must be null (full attention) or a positive integer"),
    (dict(pattern="window", window=33), "attn.window=33 must be a positive integer no longer than the context"),
    (dict(pattern="window"), "attn.window=None must be a positive integer"),
    (dict(pattern="strided", pattern_options=dict(stride=0)), "attn.stride=0 must be a positive integer"),
    (dict(pattern="strided", pattern_options=dict(stride=40)), "attn.stride=40 must be a positive integer no longer"),
    (dict(pattern="strided", window=0, pattern_options=dict(stride=4)), "attn.window=0 must be null (full attention) or"),
    (dict(pattern="dilated", window=4, pattern_options=dict(dilation=0)), "attn.dilation=0 must be a positive"),
    (dict(pattern="dilated", window=4, pattern_options=dict(dilation=33)), "attn.dilation=33 must be a positive"),
    (dict(pattern="dilated", window=8, pattern_options=dict(dilation=5)),
     "attn.dilation=5 with attn.window=8 reaches 36 keys back, beyond the context (model.max_len=32)"),
    (dict(pattern="global", window=4, pattern_options=dict(n_global=0)), "attn.n_global=0 must be a positive"),
    (dict(pattern="global", window=4, pattern_options=dict(n_global=40)), "attn.n_global=40 must be a positive"),
    (dict(pattern="global", pattern_options=dict(n_global=2)), "attn.window=None must be a positive integer"),
    (dict(pattern="bigbird", window=4, pattern_options=dict(n_random=-1)), "attn.n_random=-1 must be a non-negative"),
    (dict(pattern="bigbird", window=4, pattern_options=dict(block=0)), "attn.block=0 must be a positive integer"),
    (dict(pattern="bigbird", window=4, pattern_options=dict(seed=0.5)), "attn.seed=0.5 must be an integer"),
    (dict(pattern="strided", pattern_options=dict(stride="wide")), "attn.stride='wide' must be a positive integer"),
    (dict(pattern="stride"), "attn.pattern='stride' is unknown; did you mean 'strided'?"),
    (dict(pattern="window", window=4, pattern_options=dict(stride=2)),
     "attn.stride is not an option of attn.pattern=window; its options are ['window']"),
    (dict(pattern="full", window=4), "attn.window is not an option of attn.pattern=full"),
])
def test_bad_pattern_options_are_one_line_naming_the_key(attn, message):
    errors = config(**attn).errors()
    assert len(errors) == 1 and message in errors[0], errors


class UniformAttention(Attention):
    """A throwaway kind that ignores patterns: each query averages the values it may see."""

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 mix: float = 1.0):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias)
        self.mix = mix


@pytest.fixture
def uniform_kind():
    ATTENTION_KINDS.register("uniform")(UniformAttention)
    yield
    ATTENTION_KINDS.unregister("uniform")


def test_a_pattern_with_a_kind_that_cannot_honour_it_is_refused(uniform_kind):
    assert not UniformAttention.honours_patterns and ATTENTION_KINDS["softmax"].honours_patterns
    honouring = ", ".join(kind for kind in ATTENTION_KINDS if ATTENTION_KINDS[kind].honours_patterns)
    assert "softmax" in honouring and "linear" not in honouring
    for name, opts in PATTERNS.items():
        window = opts.get("window")
        cfg = config(kind="uniform", pattern=name, window=window,
                     pattern_options={k: v for k, v in opts.items() if k != "window"})
        errors = cfg.errors()
        if not ATTENTION_PATTERNS[name].sparse:
            assert errors == []
            continue
        assert errors == [f"attn.pattern={name} needs a kind that honours sparse patterns ({honouring}); "
                          f"attn.kind=uniform cannot: use attn.pattern=full or attn.kind=softmax"]
    # A window alone (the local preset's way) names the window and its fix.
    assert config(kind="uniform", window=4).errors() == [
        f"attn.window=4 (attn.pattern=window) needs a kind that honours sparse patterns ({honouring}); "
        "attn.kind=uniform cannot: use attn.window=null or attn.kind=softmax"]


def test_flat_attn_keys_split_between_the_kind_and_the_pattern(uniform_kind):
    groups = dict(model=dict(d_model=32, n_heads=4), norm={}, pos=dict(name="none"), act={}, init={})
    cfg = ModelConfig.from_groups({**groups, "attn": dict(kind="uniform", mix=0.5)}, V, 32)
    assert cfg.attn.options == {"mix": 0.5} and cfg.attn.pattern_options == {} and cfg.errors() == []
    cfg = ModelConfig.from_groups({**groups, "attn": dict(pattern="strided", stride=4, window=2)}, V, 32)
    assert cfg.attn.pattern_options == {"stride": 4} and cfg.attn.options == {} and cfg.errors() == []
    assert cfg.attn.pattern_args == {"stride": 4, "window": 2}
    # A key only another pattern takes goes to the pattern, so its error names the pattern.
    cfg = ModelConfig.from_groups({**groups, "attn": dict(window=4, dilation=2)}, V, 32)
    assert cfg.attn.pattern_options == {"dilation": 2}
    assert cfg.errors() == ["attn.dilation is not an option of attn.pattern=window; its options are ['window']"]


def test_an_option_both_the_pattern_and_the_kind_take_is_refused():
    class Clashing(UniformAttention):
        honours_patterns = True

        def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                     stride: int = 2):
            super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias)

    ATTENTION_KINDS.register("clashing")(Clashing)
    try:
        groups = dict(model=dict(d_model=32, n_heads=4), norm={}, pos=dict(name="none"), act={}, init={})
        cfg = ModelConfig.from_groups({**groups, "attn": dict(kind="clashing", pattern="strided", stride=4)}, V, 32)
        assert cfg.errors() == ["attn.stride is an option of both attn.pattern=strided and attn.kind=clashing, so "
                                "the config cannot say which it sets; rename one of them"]
    finally:
        ATTENTION_KINDS.unregister("clashing")


@pytest.mark.parametrize("overrides, message", [
    ("attn=window attn.window=100000", "attn.window=100000 must be a positive integer no longer than the context"),
    ("attn=strided attn.stride=-2", "attn.stride=-2 must be a positive integer"),
    ("attn=strided attn.stride=100000", "attn.stride=100000 must be a positive integer no longer than the context"),
    ("attn=dilated attn.dilation=0", "attn.dilation=0 must be a positive integer"),
    ("attn=global attn.n_global=0", "attn.n_global=0 must be a positive integer"),
    ("attn=mha attn.pattern=windw", "attn.pattern='windw' is unknown; did you mean 'window'?"),
])
def test_bad_pattern_on_the_command_line_fails_before_any_work(overrides, message, tmp_path):
    run_dir = tmp_path / "run"
    with refused(message, run_dir):
        prepare(compose_config(overrides.split(), run_dir))


# ------------------------------------------------------------------------------------ presets

@pytest.mark.parametrize("preset, label, pattern", [
    ("mha", "mha", "full"), ("gqa", "gqa", "full"), ("local", "local", "window"), ("window", "local", "window"),
    ("strided", "strided", "strided"), ("dilated", "dilated", "dilated"), ("global", "global", "global"),
    ("bigbird", "bigbird", "bigbird"),
])
def test_presets_build_their_pattern_and_record_a_label(preset, label, pattern, tmp_path):
    """choices.attn: 'local' for a window, as earlier results recorded it; the pattern's name otherwise."""
    cfg = prepare(compose_config([f"attn={preset}"], tmp_path / "run")).model_cfg
    assert cfg.errors() == [] and cfg.attn.pattern_name == pattern and cfg.attn_label == label


def test_which_patterns_skip_the_work_they_mask_out():
    """What the bench prints: blocked kernels (and full's causal kernel) against dense masks."""
    skips = {name for name in ATTENTION_PATTERNS if ATTENTION_PATTERNS[name].skips_masked_work}
    assert skips == {"full", "window", "strided"}
