"""Linear attention kinds (linear, performer) and linformer: each equals its definition written out, the
causal parallel form equals the recurrent one whatever the chunking, decoding with the running state
equals recomputation and holds a fixed number of bytes, performer approaches softmax as its features
grow, padding contributes nothing, and what a kind cannot honour is a one-line config error."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from blocklab.model.attention import ATTENTION_KINDS, build_attention
from blocklab.model.config import AttnConfig, ModelConfig, PosConfig
from blocklab.model.generate import generate
from blocklab.model.mask import AttentionContext
from blocklab.model.position import build_position
from helpers import assert_cached_steps_equal_full, dense_attention, greedy_reference, tokens
from variants import KINDS, tiny_cfg, tiny_model

V, H, DH = 20, 4, 8
LINEAR = ["linear", "performer"]
GROUPS = {"mha": None, "gqa": 2, "mqa": 1}


def layer(kind, causal=True, pos="none", n_kv_heads=None, seed=0, **options):
    """One attention layer of the tiny model (float64), with its position scheme."""
    cfg = tiny_cfg(pos, causal, kind=kind, n_kv_heads=n_kv_heads, options=options)
    torch.manual_seed(seed)
    return build_attention(cfg).double().eval(), build_position(pos, 32, H, DH, causal)


def context(scheme, length, start=0, valid=None, need_weights=False):
    """A self-attention context for `length` new tokens at positions start.., no cache."""
    positions = torch.arange(start, start + length)[None]
    return AttentionContext(positions=positions, position_scheme=scheme, mask=None, is_causal=scheme.causal,
                            need_weights=need_weights, k_positions=positions, k_valid=valid)


def qkv(batch=2, length=11, kv=H, seed=3, size=1.0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, H, length, DH), (batch, kv, length, DH), (batch, kv, length, DH)]
    return [size * torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def performer_features(attn, x):
    """FAVOR+ (Choromanski et al. 2021, Lemma 1): exp(w^T x - |x|^2/2) / sqrt(m), x = sqrt(scale) x."""
    x = x * math.sqrt(attn.scale)
    w = attn.random_features
    return torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(w.shape[0])


FEATURES = {"linear": lambda attn, x: F.elu(x) + 1, "performer": performer_features}


def naive(phi_q, phi_k, v, causal):
    """sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j) over the visible keys, written out (O(n^2))."""
    group = phi_q.shape[1] // phi_k.shape[1]
    phi_k, v = phi_k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = phi_q @ phi_k.transpose(-2, -1)
    if causal:
        scores = scores * torch.ones(scores.shape[-2:]).tril()
    return scores / scores.sum(-1, keepdim=True) @ v


# ------------------------------------------------------------------------------ the definitions

@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kind", LINEAR)
def test_equals_the_naive_definition(kind, causal, group):
    attn, scheme = layer(kind, causal, n_kv_heads=GROUPS[group])
    q, k, v = qkv(kv=attn.n_kv_heads)
    expected = naive(FEATURES[kind](attn, q), FEATURES[kind](attn, k), v, causal)
    torch.testing.assert_close(attn.attend(q, k, v, context(scheme, 11), None), expected, rtol=1e-10, atol=1e-12)
    # the analysis path writes the weights out: the same output, rows that sum to one, causal zeros
    out = attn.attend(q, k, v, context(scheme, 11, need_weights=True), None)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    weights = attn.last_weights
    assert weights.shape == (2, H, 11, 11)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, H, 11, dtype=torch.float64))
    assert not causal or bool((weights.triu(1) == 0).all())


def test_linear_with_rope_rotates_the_features_in_the_numerator_only():
    """RoFormer sec. 3.4: sum_j (R_i phi(q_i)).(R_j phi(k_j)) v_j / sum_j phi(q_i).phi(k_j)."""
    attn, scheme = layer("linear", True, pos="rope")
    q, k, v = qkv()
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    rot_q, rot_k = scheme.rotate(phi_q, phi_k, torch.arange(11)[None])
    num = (rot_q @ rot_k.transpose(-2, -1)).tril() @ v
    den = (phi_q @ phi_k.transpose(-2, -1)).tril().sum(-1, keepdim=True)
    torch.testing.assert_close(attn.attend(q, k, v, context(scheme, 11), None), num / den, rtol=1e-10, atol=1e-12)
    # relative: shifting every position changes nothing (up to RoPE's float32 angles)
    torch.testing.assert_close(attn.attend(q, k, v, context(scheme, 11, start=7), None), num / den,
                               rtol=1e-5, atol=1e-6)


def test_performer_features_are_positive():
    attn, _ = layer("performer")
    for size in (0.1, 1.0, 4.0):  # float64 keeps exp(-|x|^2/2) of these
        q, k, _ = qkv(size=size)
        for x, is_query in ((q, True), (k, False)):
            phi, _ = attn.features(x, is_query)
            assert phi.shape == (2, H, 11, 64) and bool((phi > 0).all()) and bool(phi.isfinite().all())


def test_performer_random_features_are_orthogonal_blocks_with_gaussian_norms():
    attn, _ = layer("performer", n_features=24)
    w = attn.random_features
    for block in w.split(DH):
        gram = block @ block.T
        torch.testing.assert_close(gram - torch.diag(gram.diagonal()), torch.zeros_like(gram), atol=1e-5, rtol=0)
    assert w.shape == (24, DH) and len(set(w.norm(dim=1).tolist())) == 24  # norms drawn, not all sqrt(d)


@pytest.mark.parametrize("causal", [True, False])
def test_performer_approximates_softmax_better_with_more_features(causal):
    """Mean error over seeds (so not flaky): 256 random features approximate softmax better than 16."""
    errors = {}
    for m in (16, 256):
        total = 0.0
        for seed in range(8):
            attn, scheme = layer("performer", causal, n_features=m, seed=seed)
            q, k, v = qkv(length=32, seed=100 + seed, size=0.7)
            exact = dense_attention(q, k, v, attn.scale, causal=causal)
            total += (attn.attend(q, k, v, context(scheme, 32), None) - exact).abs().mean().item()
        errors[m] = total / 8
    assert errors[256] < 0.75 * errors[16], errors  # about 0.45-0.55 over seed sets (heavy-tailed estimates)


def test_performer_redraws_its_features_every_interval_of_training_calls_only():
    attn, scheme = layer("performer", redraw_interval=2)
    q, k, v = qkv()
    drawn = [attn.random_features.clone()]
    attn.train()
    for _ in range(5):
        attn.attend(q, k, v, context(scheme, 11), None)
        drawn.append(attn.random_features.clone())
    same = [torch.equal(a, b) for a, b in zip(drawn, drawn[1:])]
    assert same == [True, True, False, True, False]  # redrawn before the 3rd and 5th calls
    attn.eval()
    attn.attend(q, k, v, context(scheme, 11), None)
    assert torch.equal(attn.random_features, drawn[-1])
    fixed, _ = layer("performer")
    fixed.train()
    before = fixed.random_features.clone()
    for _ in range(3):
        fixed.attend(q, k, v, context(scheme, 11), None)
    assert torch.equal(fixed.random_features, before)


def test_performer_features_travel_with_the_checkpoint():
    a, b = tiny_model("rope", seed=0, kind="performer"), tiny_model("rope", seed=1, kind="performer")
    idx = tokens((2, 9))
    assert not torch.equal(a.blocks[0].attn.random_features, b.blocks[0].attn.random_features)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        assert torch.equal(a(idx), b(idx))


# -------------------------------------------------------------- parallel, chunked and recurrent forms

@pytest.mark.parametrize("pos", ["none", "rope"])
@pytest.mark.parametrize("kind", LINEAR)
def test_chunking_never_changes_the_result(kind, pos):
    attn, scheme = layer(kind, pos=pos, n_kv_heads=2)
    q, k, v = qkv(length=13, kv=2)
    outs = []
    for chunk in (1, 3, 5, 13, 64):  # 13 % 3, 13 % 5 != 0; 64: one chunk, the unchunked quadratic form
        attn.chunk = chunk
        outs.append(attn.attend(q, k, v, context(scheme, 13), None))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("pos", ["none", "rope"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("kind", LINEAR)
def test_parallel_form_equals_recurrent_form_token_by_token(kind, group, pos):
    attn, scheme = layer(kind, pos=pos, n_kv_heads=GROUPS[group], chunk=4)
    q, k, v = qkv(length=10, kv=attn.n_kv_heads, size=2.0)
    parallel = attn.attend(q, k, v, context(scheme, 10), None)
    state = attn.new_state()
    for t in range(10):
        step = attn.attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], context(scheme, 1, start=t), state)
        torch.testing.assert_close(step[:, :, 0], parallel[:, :, t], rtol=1e-10, atol=1e-12)


def test_performer_state_keeps_one_scale_when_a_larger_key_arrives():
    """The stabilizer takes out each pass's largest key exponent; a later, much larger key rescales the held sums."""
    attn, scheme = layer("performer")
    q, k, v = qkv(length=6)
    k[:, :, 4:] *= 6.0  # keys whose exponents dwarf the first ones'
    parallel = attn.attend(q, k, v, context(scheme, 6), None)
    state = attn.new_state()
    first = attn.attend(q[:, :, :3], k[:, :, :3], v[:, :, :3], context(scheme, 3), state)
    rest = attn.attend(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], context(scheme, 3, start=3), state)
    torch.testing.assert_close(torch.cat((first, rest), 2), parallel, rtol=1e-10, atol=1e-12)


def make_model(kind, pos="rope", seed=0, **kw):
    return tiny_model(pos, seed, vocab_size=V, std=0.3, tie_embeddings=False, kind=kind, **kw)


@pytest.mark.parametrize("need_weights", [False, True], ids=["fast", "explicit"])
@pytest.mark.parametrize("pos", ["none", "rope", "learned"])
@pytest.mark.parametrize("kind", LINEAR)
def test_later_tokens_never_change_earlier_outputs(kind, pos, need_weights):
    model = make_model(kind, pos, n_kv_heads=2, options={"chunk": 4})
    idx = tokens((2, 10))
    with torch.no_grad():
        base = model(idx, need_weights=need_weights)
        base = base[0] if need_weights else base
        for t in (1, 4, 5, 9):
            changed = idx.clone()
            changed[:, t:] = (idx[:, t:] + 1) % V
            out = model(changed, need_weights=need_weights)
            out = out[0] if need_weights else out
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
            assert (out[:, t] - base[:, t]).abs().max() > 1e-4


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("pos", ["none", "rope", "sinusoidal"])
@pytest.mark.parametrize("kind", LINEAR)
def test_decoding_with_the_state_equals_full_recomputation(kind, pos, group):
    model = make_model(kind, pos, n_kv_heads=GROUPS[group], options={"chunk": 3})
    assert_cached_steps_equal_full(model, tokens((2, 12), seed=3), prefix=5, then=2)


@pytest.mark.parametrize("pos", ["rope", "learned"])
@pytest.mark.parametrize("kind", LINEAR)
def test_generation_with_left_padding_decodes_each_row_as_alone(kind, pos):
    """Padded keys contribute nothing: a left-padded batch, decoded through the state, gives each
    prompt the tokens it gets alone and recomputed from scratch every step."""
    model = make_model(kind, pos, n_kv_heads=2)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, V, (n,), generator=g) for n in (3, 7, 5)]
    cached = generate(model, prompts, max_new_tokens=8)
    for row, prompt in enumerate(prompts):
        assert torch.equal(cached[row], greedy_reference(model, prompt, 8)), f"row {row}"
    assert torch.equal(cached, generate(model, prompts, max_new_tokens=8, use_cache=False))


@pytest.mark.parametrize("kind", LINEAR)
def test_state_bytes_do_not_grow_with_decoded_tokens(kind):
    model = make_model(kind, n_kv_heads=2)
    assert model.cache_bytes_per_token() == 0
    cache = model.new_cache()
    sizes = []
    with torch.no_grad():
        model(tokens((2, 6)), cache=cache)
        for t in range(40):
            model(tokens((2, 1), seed=t), cache=cache)
            sizes.append(cache.bytes())
    assert sizes[0] > 0 and set(sizes) == {sizes[0]}


# ------------------------------------------------------------------------------------- padding

@pytest.mark.parametrize("kind", [*LINEAR, "linformer"])
def test_right_padding_changes_no_real_output_of_a_non_causal_model(kind):
    model = make_model(kind, "rope", causal=False, n_kv_heads=2)
    idx = tokens((1, 7))
    padded = torch.cat((idx, torch.zeros(1, 4, dtype=torch.long)), 1)
    valid = torch.arange(11)[None] < 7
    with torch.no_grad():
        torch.testing.assert_close(model(padded, valid=valid)[:, :7], model(idx), rtol=1e-10, atol=1e-12)
        out, weights = model(padded, valid=valid, need_weights=True)
    torch.testing.assert_close(out[:, :7], model(idx), rtol=1e-10, atol=1e-12)
    assert all(bool((w[..., 7:] == 0).all()) for w in weights)  # padded keys get no weight


@pytest.mark.parametrize("kind", [*LINEAR, "linformer"])
def test_encoder_decoder_ignores_source_padding(kind):
    model = make_model(kind, "rope", causal=kind in LINEAR, arch="encoder_decoder")
    source, target = tokens((1, 6)), tokens((1, 5), seed=2)
    padded = torch.cat((source, torch.zeros(1, 3, dtype=torch.long)), 1)
    with torch.no_grad():
        alone = model(target, source=source)
        out = model(target, source=padded, source_valid=torch.arange(9)[None] < 6)
    torch.testing.assert_close(out, alone, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------ linformer

@pytest.mark.parametrize("group", GROUPS)
def test_linformer_equals_its_definition(group):
    """softmax(scale q (E K)^T) (F V), E and F sliced to the sequence length (Wang et al. 2020, eq. 7)."""
    attn, scheme = layer("linformer", causal=False, n_kv_heads=GROUPS[group], k=5)
    q, k, v = qkv(length=11, kv=attn.n_kv_heads)
    e, f = attn.e_proj[:, :11], attn.f_proj[:, :11]
    assert attn.e_proj.shape == (5, 64)  # (k, model max_len)
    group_size = H // attn.n_kv_heads
    keys, values = (e @ k).repeat_interleave(group_size, 1), (f @ v).repeat_interleave(group_size, 1)
    probs = (q @ keys.transpose(-2, -1) / math.sqrt(DH)).softmax(-1)
    with torch.no_grad():
        torch.testing.assert_close(attn.attend(q, k, v, context(scheme, 11), None), probs @ values,
                                   rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(attn.attend(q, k, v, context(scheme, 11, need_weights=True), None),
                                   probs @ values, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(attn.last_weights, probs @ f)  # what each original value gets


def test_linformer_sees_the_whole_sequence():
    model = make_model("linformer", causal=False)
    idx = tokens((2, 10))
    changed = idx.clone()
    changed[:, -1] = (idx[:, -1] + 1) % V
    with torch.no_grad():
        assert (model(changed)[:, 0] - model(idx)[:, 0]).abs().max() > 1e-4


# ----------------------------------------------------------------------------- config and label

def cfg_errors(kind, pos="rope", causal=True, **fields):
    options = {key: fields.pop(key) for key in list(fields) if key not in AttnConfig.__dataclass_fields__}
    cfg = ModelConfig(vocab_size=V, d_model=32, n_heads=H, max_len=64, pos=PosConfig(pos),
                      attn=AttnConfig(kind=kind, causal=causal, options=options, **fields))
    return cfg.errors()


@pytest.mark.parametrize("kind, fields, says", [
    ("performer", dict(n_features=0), "attn.n_features=0 must be a positive integer"),
    ("performer", dict(n_features=-3), "attn.n_features=-3 must be a positive integer"),
    ("performer", dict(redraw_interval=0), "attn.redraw_interval=0 must be a positive integer"),
    ("linear", dict(pos="alibi"), "pos=alibi adds a bias to every score"),
    ("performer", dict(pos="t5_bias"), "pos=t5_bias adds a bias to every score"),
    ("linear", dict(chunk=0), "attn.chunk=0 must be a positive integer"),
    ("linear", dict(scale=0.5), "attn.scale=0.5 does not apply to attn.kind=linear"),
    ("linformer", dict(causal=True), "attn.causal=true: linformer projects keys along the whole sequence"),
    ("linformer", dict(causal=False, k=0), "attn.k=0 must be a positive integer no larger than"),
    ("linformer", dict(causal=False, k=65), "attn.k=65 must be a positive integer no larger than"),
    ("linformer", dict(causal=False, max_len=32), "attn.max_len=32 is shorter than the longest sequence"),
    ("linformer", dict(causal=False, pos="alibi"), "pos=alibi adds a bias to every score"),
])
def test_bad_input_is_one_line_naming_the_key_and_fix(kind, fields, says):
    errs = cfg_errors(kind, **fields)
    assert len(errs) == 1 and errs[0].startswith(says) and "\n" not in errs[0], errs


@pytest.mark.parametrize("fields", [dict(window=4), dict(pattern="strided")], ids=["window", "strided"])
@pytest.mark.parametrize("kind", [*LINEAR, "linformer"])
def test_a_window_or_sparse_pattern_is_a_one_line_error(kind, fields):
    """A window or sparse pattern is a softmax mask, which these kinds never form (and a running state cannot
    drop keys)."""
    errs = cfg_errors(kind, causal=kind in LINEAR, **fields)
    key = next(iter(fields))
    assert len(errs) == 1 and "\n" not in errs[0] and f"attn.{key}" in errs[0], errs


@pytest.mark.parametrize("kind", [*LINEAR, "linformer"])
def test_the_kind_is_what_results_record(kind):
    cfg = tiny_cfg("rope", causal=kind in LINEAR, kind=kind, n_kv_heads=2)
    assert cfg.attn_label == kind == ATTENTION_KINDS[kind].registry_name


# ------------------------------------------------------- every registered kind, as far as it goes

def model_or_skip(kind, causal):
    """The tiny model of `kind`, or a skip where the kind says (its config error) that it cannot be so."""
    cfg = ModelConfig(vocab_size=V, d_model=32, n_heads=H, max_len=64, attn=AttnConfig(kind=kind, causal=causal))
    if cfg.errors():
        pytest.skip(cfg.errors()[0])
    # GQA where the kind has K/V heads; a kind that refuses them (mla: one shared latent) runs without
    grouped = dataclasses.replace(cfg, attn=dataclasses.replace(cfg.attn, n_kv_heads=2))
    return make_model(kind, "rope", causal=causal, n_kv_heads=None if grouped.errors() else 2)


@pytest.mark.parametrize("kind", KINDS)
def test_every_causal_kind_is_causal_and_decodes_as_it_recomputes(kind):
    model = model_or_skip(kind, causal=True)
    idx = tokens((2, 9))
    changed = idx.clone()
    changed[:, 6:] = (idx[:, 6:] + 1) % V
    with torch.no_grad():
        full = model(idx)
        torch.testing.assert_close(model(changed)[:, :6], full[:, :6], rtol=0, atol=1e-12)
        cache = model.new_cache()
        torch.testing.assert_close(model(idx[:, :4], cache=cache), full[:, :4], rtol=1e-10, atol=1e-10)
        for t in range(4, 9):
            torch.testing.assert_close(model(idx[:, t:t + 1], cache=cache)[:, 0], full[:, t], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_writes_out_the_weights_it_applies(kind, causal):
    model = model_or_skip(kind, causal)
    idx = tokens((2, 9))
    with torch.no_grad():
        out, weights = model(idx, need_weights=True)
        torch.testing.assert_close(out, model(idx), rtol=1e-10, atol=1e-10)
    assert [w.shape for w in weights] == [(2, H, 9, 9)] * 2
