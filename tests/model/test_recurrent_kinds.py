"""The recurrent attention kinds (gla, deltanet, based): each chunked parallel form equals a naive per-step loop
written directly from its paper's recurrence (the oracle) and the kind's own recurrent form, token by token, at
lengths that are not multiples of the chunk; the model is causal and its cached decoding equals recomputation;
gradients pass torch.autograd.gradcheck; the decoding state does not grow; bad options are one-line errors."""
import pytest
import torch
import torch.nn.functional as F

from blocklab.model.attention import ATTENTION_KINDS
from blocklab.model.based import sliding_window_attention, taylor_features
from blocklab.model.config import AttnConfig, ModelConfig, PosConfig
from blocklab.model.deltanet import delta_chunked, delta_step
from blocklab.model.generate import generate
from blocklab.model.mask import AttentionContext, self_attention_context
from blocklab.model.gla import gla_chunked, gla_step
from helpers import assert_cached_steps_equal_full, tokens
from variants import tiny_model

RECURRENT = ["gla", "deltanet", "based"]
V = 20
LENGTHS = [1, 7, 33]  # with chunk 16: shorter than, and not multiples of, the chunk
F64 = dict(dtype=torch.float64)


def draw(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), **F64)


# ---------------------------------------------------------------- the oracles: the papers' recurrences, per step

def gla_oracle(q, k, v, alpha):
    """Yang et al. 2024 (GLA), sec. 4.1: S_t = diag(alpha_t) S_{t-1} + k_t^T v_t, o_t = q_t S_t, one head, rows."""
    state = torch.zeros(k.shape[-1], v.shape[-1], **F64)
    outs = []
    for t in range(k.shape[0]):
        state = torch.diag(alpha[t]) @ state + torch.outer(k[t], v[t])
        outs.append(q[t] @ state)
    return torch.stack(outs)


def delta_oracle(q, k, v, beta):
    """Schlag et al. 2021 / Yang et al. 2024 (DeltaNet): S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,
    o_t = S_t q_t, one head, column vectors, S (d_v x d_k)."""
    state = torch.zeros(v.shape[-1], k.shape[-1], **F64)
    eye = torch.eye(k.shape[-1], **F64)
    outs = []
    for t in range(k.shape[0]):
        state = state @ (eye - beta[t] * torch.outer(k[t], k[t])) + beta[t] * torch.outer(v[t], k[t])
        outs.append(state @ q[t])
    return torch.stack(outs)


@pytest.mark.parametrize("length", LENGTHS)
def test_gla_chunked_equals_the_paper_recurrence_and_the_step_form(length):
    B, H, G, dk, dv = 2, 2, 2, 5, 3
    q, k, v = draw(B, H, G, length, dk, seed=1), draw(B, H, length, dk, seed=2), draw(B, H, length, dv, seed=3)
    alpha = torch.sigmoid(3 * draw(B, H, length, dk, seed=4)) ** (1 / 16) * torch.rand(B, H, length, dk, **F64)
    held = draw(B, H, dk, dv, seed=5)
    out, final = gla_chunked(q, k, v, alpha.log(), None, chunk=16)
    for b in range(B):
        for h in range(H):
            for g in range(G):
                torch.testing.assert_close(out[b, h, g], gla_oracle(q[b, h, g], k[b, h], v[b, h], alpha[b, h]),
                                           rtol=1e-5, atol=1e-5)
    # from a held state, token by token through the step form
    out, final = gla_chunked(q, k, v, alpha.log(), held, chunk=16)
    state = held
    for t in range(length):
        step, state = gla_step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :],
                               alpha[..., t:t + 1, :].log(), state)
        torch.testing.assert_close(step[..., 0, :], out[..., t, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", LENGTHS)
def test_deltanet_chunked_equals_the_paper_recurrence_and_the_step_form(length):
    B, H, G, dk, dv = 2, 2, 2, 5, 3
    q = F.normalize(draw(B, H, G, length, dk, seed=1), dim=-1)
    k = F.normalize(draw(B, H, length, dk, seed=2), dim=-1)
    v, beta = draw(B, H, length, dv, seed=3), torch.sigmoid(draw(B, H, length, seed=4))
    out, final = delta_chunked(q, k, v, beta, None, chunk=16)
    for b in range(B):
        for h in range(H):
            for g in range(G):
                torch.testing.assert_close(out[b, h, g], delta_oracle(q[b, h, g], k[b, h], v[b, h], beta[b, h]),
                                           rtol=1e-5, atol=1e-5)
    held = draw(B, H, dk, dv, seed=5)
    out, final = delta_chunked(q, k, v, beta, held, chunk=16)
    state = held
    for t in range(length):
        step, state = delta_step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :], beta[..., t:t + 1], state)
        torch.testing.assert_close(step[..., 0, :], out[..., t, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)


def test_deltanet_stores_a_value_under_a_key_and_overwrites_it():
    """beta = 1 and a unit key: reading with that key gives the newest value written under it (the delta rule's
    point: the old value is replaced, not summed as in linear attention)."""
    k = F.normalize(draw(1, 1, 1, 4, seed=0), dim=-1).expand(1, 1, 3, 4)
    v = draw(1, 1, 3, 2, seed=1)
    out, _ = delta_chunked(k[:, :, None], k, v, torch.ones(1, 1, 3, **F64), None, chunk=2)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0], rtol=1e-12, atol=1e-12)


def test_taylor_features_give_the_second_order_expansion_of_exp():
    q, k = draw(6, 4, seed=1), draw(6, 4, seed=2)
    s = (q * k).sum(-1)
    torch.testing.assert_close((taylor_features(q) * taylor_features(k)).sum(-1), 1 + s + s * s / 2)
    assert taylor_features(q).shape[-1] == 1 + 4 + 4 * 5 // 2  # each product x_i x_j once: the state's rows


@pytest.mark.parametrize("length", LENGTHS)
def test_based_equals_the_paper_form(length):
    """The layer's two paths against the oracle, from the layer's own projected features."""
    model = tiny_model("none", seed=0, vocab_size=V, kind="based", options={"chunk": 16, "window_size": 5})
    attn = model.blocks[0].attn
    q, k, v = draw(2, 4, length, 8, seed=1), draw(2, 4, length, 8, seed=2), draw(2, 4, length, 8, seed=3)
    positions = torch.arange(length)[None]
    ctx = AttentionContext(positions=positions, position_scheme=model.pos, mask=None, is_causal=True,
                           k_positions=positions)
    with torch.no_grad():
        out = attn.attend(q, k, v, ctx, None)
        fq, fk = (attn.feature_proj(x) / attn.feature_dim ** 0.25 for x in (q, k))
    for b in range(2):
        for h in range(4):
            torch.testing.assert_close(out[b, h], based_oracle(fq[b, h], fk[b, h], q[b, h], k[b, h], v[b, h], 5,
                                                                attn.scale), rtol=1e-5, atol=1e-5)


def based_oracle(fq, fk, q, k, v, window, scale):
    """Arora et al. 2024 (Based), one head, written out per query: Taylor linear attention on the projected
    features, sum_j (1 + s + s^2/2) v_j / sum_j (1 + s + s^2/2) with s = fq_i.fk_j, plus softmax(scale q_i.k_j)
    over the last `window` keys (the two paths summed, as the layer does)."""
    outs = []
    for i in range(k.shape[0]):
        s = fk[:i + 1] @ fq[i]
        taylor = 1 + s + s * s / 2
        near = slice(max(0, i - window + 1), i + 1)
        soft = torch.softmax(scale * (k[near] @ q[i]), 0)
        outs.append(taylor @ v[:i + 1] / taylor.sum() + soft @ v[near])
    return torch.stack(outs)


@pytest.mark.parametrize("length", [1, 3, 7, 12])
def test_sliding_window_blocks_equal_the_windowed_softmax(length):
    q, k, v = draw(1, 2, 1, length, 4, seed=1), draw(1, 2, length, 4, seed=2), draw(1, 2, length, 4, seed=3)
    valid = torch.ones(1, length, dtype=torch.bool)
    out = sliding_window_attention(q, k, v, valid, window=3, scale=0.5)
    for h in range(2):
        expected = [torch.softmax(0.5 * k[0, h, max(0, i - 2):i + 1] @ q[0, h, 0, i], 0) @ v[0, h, max(0, i - 2):i + 1]
                    for i in range(length)]
        torch.testing.assert_close(out[0, h, 0], torch.stack(expected), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------ gradients

def test_gradients_of_the_chunked_forms_pass_gradcheck():
    B, H, G, T, d = 1, 1, 2, 5, 3
    q, k, v = draw(B, H, G, T, d, seed=1), draw(B, H, T, d, seed=2), draw(B, H, T, d, seed=3)
    log_alpha = F.logsigmoid(draw(B, H, T, d, seed=4))
    beta = torch.sigmoid(draw(B, H, T, seed=5))
    held = draw(B, H, d, d, seed=6)
    for x in (q, k, v, log_alpha, beta, held):
        x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: gla_chunked(*a, 2)[0], (q, k, v, log_alpha, held))
    assert torch.autograd.gradcheck(lambda q, k, v, b, s: delta_chunked(q, F.normalize(k, dim=-1), v, b, s, 2)[0],
                                    (q, k, v, beta, held))


@pytest.mark.parametrize("kind", RECURRENT)
def test_gradients_of_the_layer_pass_gradcheck(kind):
    options = {"chunk": 2, **({"window_size": 2, "feature_dim": 2} if kind == "based" else {})}
    model = tiny_model("rope", seed=0, vocab_size=V, kind=kind, n_layers=1, options=options)
    attn = model.blocks[0].attn
    idx = torch.zeros(1, 5, dtype=torch.long)
    ctx = self_attention_context(idx, None, None, None, model.pos, True, model.pattern)
    x = draw(1, 5, 32, seed=7).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: attn(x, ctx), (x,))


# ------------------------------------------------------------------------------- the model: causal, cached

def make_model(kind, pos="rope", n_kv_heads=None, short_conv=0, **options):
    """The tiny float64 model of `kind`; the recurrent kinds with chunk 16 and (Based) a window of 4."""
    if kind in RECURRENT:
        options = {"chunk": 16, **({"window_size": 4} if kind == "based" else {}), **options}
    return tiny_model(pos, seed=0, vocab_size=V, std=0.3, tie_embeddings=False, kind=kind, n_kv_heads=n_kv_heads,
                      short_conv=short_conv, options=options)


@pytest.mark.parametrize("group", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("kind", RECURRENT)
def test_later_tokens_never_change_earlier_outputs(kind, group):
    model = make_model(kind, n_kv_heads=group)
    idx = tokens((2, 35))
    with torch.no_grad():
        base = model(idx)
        for t in (1, 16, 20, 34):
            changed = idx.clone()
            changed[:, t:] = (idx[:, t:] + 1) % V
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
            assert (out[:, t] - base[:, t]).abs().max() > 1e-6


@pytest.mark.parametrize("pos", ["rope", "none", "learned"])
@pytest.mark.parametrize("group", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("kind", RECURRENT)
def test_cached_decoding_equals_recomputation(kind, group, pos):
    model = make_model(kind, pos, n_kv_heads=group)
    assert_cached_steps_equal_full(model, tokens((2, 33), seed=3), prefix=7, then=18)


def assert_padded_batch_decodes_each_row_as_alone(model, lengths, new_tokens, seed):
    """Prompts of different lengths, left-padded into one cached batch, decode as each does alone, uncached."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, V, (n,), generator=g) for n in lengths]
    cached = generate(model, prompts, max_new_tokens=new_tokens)
    for row, prompt in enumerate(prompts):
        alone = generate(model, [prompt], max_new_tokens=new_tokens, use_cache=False)
        assert torch.equal(cached[row], alone[0]), f"row {row}"


@pytest.mark.parametrize("kind", RECURRENT)
def test_generation_with_left_padding_decodes_each_row_as_alone(kind):
    assert_padded_batch_decodes_each_row_as_alone(make_model(kind, n_kv_heads=2), (3, 7, 5), 6, seed=1)


@pytest.mark.parametrize("kind", RECURRENT)
def test_the_state_has_a_fixed_size(kind):
    model = make_model(kind, n_kv_heads=2)
    assert model.cache_bytes_per_token() == 0 and not model.new_cache().keeps_keys
    cache = model.new_cache()
    sizes = []
    with torch.no_grad():
        model(tokens((2, 6)), cache=cache)
        for t in range(20):
            model(tokens((2, 1), seed=t), cache=cache)
            sizes.append(cache.bytes())
    assert sizes[0] > 0 and set(sizes) == {sizes[0]}
    # what it is: per layer, S (d_head x d_head) per K/V head; Based: its sums and window
    per_layer = {"gla": 2 * 8 * 8, "deltanet": 2 * 8 * 8,
                 "based": 2 * (1 + 16 + 16 * 17 // 2) * (8 + 1) + 2 * 2 * 3 * 8}[kind] * 2 * 8  # batch 2, float64
    extra = 2 * 3 if kind == "based" else 0  # the window's padding flags (bool, batch 2)
    assert sizes[0] == 2 * (per_layer + extra)


# --------------------------------------------------------------------------------------- config errors

def cfg_errors(kind, causal=True, arch="decoder", pos="rope", **fields):
    options = {key: fields.pop(key) for key in list(fields) if key not in AttnConfig.__dataclass_fields__}
    cfg = ModelConfig(arch=arch, vocab_size=V, d_model=32, n_heads=4, max_len=64, pos=PosConfig(pos),
                      attn=AttnConfig(kind=kind, causal=causal, options=options, **fields))
    return cfg.errors()


@pytest.mark.parametrize("kind, fields, says", [
    ("gla", dict(causal=False), "attn.causal=false: attn.kind=gla is a causal recurrence"),
    ("deltanet", dict(arch="encoder_decoder"), "model.arch=encoder_decoder needs bidirectional attention"),
    ("based", dict(arch="encoder"), "model.arch=encoder needs bidirectional attention"),
    ("gla", dict(pos="alibi"), "pos=alibi adds a bias to every score"),
    ("gla", dict(chunk=0), "attn.chunk=0 must be a positive integer"),
    ("gla", dict(gate_rank=0), "attn.gate_rank=0 must be a positive integer"),
    ("gla", dict(gate_temperature=-1.0), "attn.gate_temperature=-1.0 must be a number > 0"),
    ("deltanet", dict(scale=0.5), "attn.scale and attn.scale_factor do not apply to attn.kind=deltanet"),
    ("deltanet", dict(qk_activation="relu"), "attn.qk_activation='relu' must be one of ['none', 'silu']"),
    ("deltanet", dict(v_activation="gelu"), "attn.v_activation='gelu' must be one of ['none', 'silu']"),
    ("based", dict(window_size=0), "attn.window_size=0 must be a positive integer"),
    ("based", dict(feature_dim=0), "attn.feature_dim=0 must be a positive integer"),
])
def test_bad_input_is_one_line_naming_the_key_and_fix(kind, fields, says):
    errs = cfg_errors(kind, **fields)
    assert len(errs) == 1 and errs[0].startswith(says) and "\n" not in errs[0], errs


@pytest.mark.parametrize("kind", RECURRENT)
def test_a_window_is_a_one_line_error(kind):
    errs = cfg_errors(kind, window=4)
    assert len(errs) == 1 and "attn.window" in errs[0], errs


@pytest.mark.parametrize("kind", RECURRENT)
def test_the_kind_is_what_results_record(kind):
    assert ATTENTION_KINDS[kind].registry_name == kind


# ------------------------------------------------------------------------------ attn.short_conv

def test_short_conv_is_the_causal_depthwise_convolution_plus_its_input():
    from blocklab.model.short_conv import ShortConv
    conv = ShortConv(3, 4).double()
    x = draw(2, 6, 3, seed=1)
    expected = x.clone()
    for t in range(6):
        for j in range(4):
            if t - j >= 0:
                expected[:, t] += conv.weight[:, 0, 3 - j] * x[:, t - j]  # weight[..., K-1] meets x_t
    torch.testing.assert_close(conv(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["softmax", "gla", "based", "linear"])
def test_short_conv_keeps_the_model_causal_and_its_cache_equal_to_recomputation(kind):
    model = make_model(kind, short_conv=4)
    assert model.blocks[0].attn.short_conv is not None
    idx = tokens((2, 21), seed=5)
    with torch.no_grad():
        full = model(idx)
        for t in (1, 9, 20):
            changed = idx.clone()
            changed[:, t:] = (idx[:, t:] + 1) % V
            torch.testing.assert_close(model(changed)[:, :t], full[:, :t], rtol=0, atol=1e-12)
    assert_cached_steps_equal_full(model, idx, prefix=2, then=8)
    with torch.no_grad():
        assert (make_model(kind)(idx) - full).abs().max() > 1e-6  # the convolution changes what the model computes


@pytest.mark.parametrize("kind", ["softmax", "deltanet"])
def test_short_conv_generation_with_left_padding_decodes_each_row_as_alone(kind):
    assert_padded_batch_decodes_each_row_as_alone(make_model(kind, short_conv=3), (2, 6, 4), 5, seed=2)


def test_short_conv_must_be_a_non_negative_integer():
    errs = cfg_errors("softmax", short_conv=-1)
    assert len(errs) == 1 and errs[0].startswith("attn.short_conv=-1") and "\n" not in errs[0], errs


@pytest.mark.parametrize("kind", RECURRENT)
def test_training_memory_grows_linearly_with_the_length(kind):
    """No (T, T) tensor: what autograd saves from one layer's forward doubles (not quadruples) with the length."""
    model = tiny_model("none", seed=0, vocab_size=V, kind=kind, n_layers=1, max_len=1024)
    attn = model.blocks[0].attn

    def saved_bytes(length):
        storages = {}

        def keep(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        idx = torch.zeros(1, length, dtype=torch.long)
        ctx = self_attention_context(idx, None, None, None, model.pos, True, model.pattern)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            attn(draw(1, length, 32, seed=1).requires_grad_(True), ctx)
        return sum(storages.values())

    small, large = saved_bytes(512), saved_bytes(1024)
    assert 1.8 < large / small < 2.2, (small, large)  # above 1.8: the activations, not the weights, dominate


# ------------------------------------------------------------------------------ positions and DeltaNet's SiLU

@pytest.mark.parametrize("kind", ["gla", "deltanet"])
def test_gla_and_deltanet_take_no_positions_unless_asked(kind):
    """Under pos=rope the kind skips the rotation (its paper and flash-linear-attention's layer use no positions):
    the same weights compute what they compute under pos=none; attn.rotary=true rotates, and computes otherwise."""
    idx = tokens((2, 19), seed=5)
    plain, rope, rotary = (make_model(kind, pos, **options)(idx) for pos, options in
                           (("none", {}), ("rope", {}), ("rope", {"rotary": True})))
    torch.testing.assert_close(rope, plain, rtol=0, atol=0)
    assert (rotary - plain).abs().max() > 1e-3


@pytest.mark.parametrize("activation", ["silu", "none"])
def test_the_configured_v_activation_reaches_the_layer(activation):
    """attn.v_activation from the config to the model (the layer test above checks what each computes); the default
    is SiLU, as flash-linear-attention's DeltaNet layer."""
    layer = make_model("deltanet", "none", v_activation=activation).blocks[0].attn
    assert layer.v_activation == activation
    assert make_model("deltanet", "none").blocks[0].attn.v_activation == "silu"


@pytest.mark.parametrize("kind, pos, options, applied", [
    ("gla", "rope", {}, "none"), ("gla", "rope", {"rotary": True}, "rope"), ("deltanet", "rope", {}, "none"),
    ("gla", "learned", {}, "learned"), ("gla", "none", {}, "none"), ("based", "rope", {}, "rope"),
    ("softmax", "rope", {}, "rope"), ("softmax", "alibi", {}, "alibi")])
def test_results_record_the_positions_the_model_sees(kind, pos, options, applied):
    from blocklab.train.outcome import choices
    from variants import tiny_cfg

    cfg = tiny_cfg(pos, vocab_size=V, kind=kind, options=options)
    assert choices(cfg, seed=0)["positions"] == applied


@pytest.mark.parametrize("group", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("kind", ["gla", "deltanet"])
def test_cached_decoding_with_rotary_equals_recomputation(kind, group):
    model = make_model(kind, "rope", n_kv_heads=group, rotary=True)
    assert_cached_steps_equal_full(model, tokens((2, 33), seed=3), prefix=7, then=18)


@pytest.mark.parametrize("activation", ["silu", "none"])
def test_deltanet_layer_equals_the_delta_rule_on_activated_unit_keys(activation):
    """The whole layer against the oracle: q, k, v from its projection; SiLU on q and k (flash-linear-attention
    0.3's DeltaNet layer default, `qk_activation="silu"`, fla/layers/delta_net.py) or none, then the L2 norm; SiLU
    on v (attn.v_activation, as that layer) or none; beta =
    sigmoid(x W_beta); the paper's delta rule per head (delta_oracle); each head RMS-normalized; out_proj."""
    layer = ATTENTION_KINDS["deltanet"](16, 2, chunk=4, qk_activation=activation, v_activation=activation).double()
    torch.manual_seed(0)
    for p in layer.parameters():
        p.data = torch.randn_like(p) * 0.3
    x = draw(1, 9, 16, seed=2)
    act = F.silu if activation == "silu" else (lambda t: t)
    q, k, v = layer.qkv_proj(x).split(layer.qkv_sizes, dim=-1)
    beta = torch.sigmoid(layer.beta_proj(x))[0]
    heads = []
    for h in range(2):
        cut = slice(8 * h, 8 * h + 8)
        qh, kh = F.normalize(act(q[0, :, cut]), dim=-1), F.normalize(act(k[0, :, cut]), dim=-1)
        heads.append(layer.out_norm(delta_oracle(qh, kh, act(v[0, :, cut]), beta[:, h])))
    expected = layer.out_proj(torch.cat(heads, dim=-1))[None]
    from blocklab.model.position import NoPE

    got = layer(x, AttentionContext(torch.arange(9)[None], NoPE(16, 2, 8), None, True))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind, saved, old", [
    ("gla", {}, {"rotary": True}),
    ("gla", {"rotary": False}, {"rotary": False}),
    ("deltanet", {}, {"rotary": True, "qk_activation": "none", "v_activation": "none"}),
    # saved after attn.rotary and attn.qk_activation, before attn.v_activation: no SiLU on v
    ("deltanet", {"rotary": False, "qk_activation": "silu"},
     {"rotary": False, "qk_activation": "silu", "v_activation": "none"}),
    ("deltanet", {"rotary": False, "qk_activation": "silu", "v_activation": "silu"},
     {"rotary": False, "qk_activation": "silu", "v_activation": "silu"})])
def test_a_run_saved_before_the_options_reads_as_it_trained(kind, saved, old):
    assert ATTENTION_KINDS[kind].old_run_options(saved) == old


def test_based_mixes_its_paths_by_a_learned_weight_per_head():
    """attn.path_mix: at init (both weights 1) the layer is the plain sum, the paper form above; weights (a, b) on a
    head give a * Taylor + b * window there, so a head can turn its Taylor path off; path_mix=false has none."""
    length, window = 9, 3
    mixed = tiny_model("none", seed=0, vocab_size=V, kind="based", options={"chunk": 4, "window_size": window})
    summed = tiny_model("none", seed=0, vocab_size=V, kind="based",
                        options={"chunk": 4, "window_size": window, "path_mix": False})
    attn, plain = mixed.blocks[0].attn, summed.blocks[0].attn
    assert plain.path_weights is None and tuple(attn.path_weights.shape) == (2, 4, 1, 1)
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if k != "path_weights"})
    q, k, v = draw(1, 4, length, 8, seed=1), draw(1, 4, length, 8, seed=2), draw(1, 4, length, 8, seed=3)
    positions = torch.arange(length)[None]
    ctx = AttentionContext(positions=positions, position_scheme=mixed.pos, mask=None, is_causal=True,
                           k_positions=positions)
    with torch.no_grad():
        torch.testing.assert_close(attn.attend(q, k, v, ctx, None), plain.attend(q, k, v, ctx, None))
        attn.path_weights[:, 1] = torch.tensor([0.0, 2.0], **F64)[:, None, None]  # head 1: the window alone, doubled
        attn.path_weights[:, 2] = torch.tensor([0.5, 0.0], **F64)[:, None, None]  # head 2: half the Taylor path
        out = attn.attend(q, k, v, ctx, None)
        fq, fk = (attn.feature_proj(x) / attn.feature_dim ** 0.25 for x in (q, k))
    for h, (a, b) in ((0, (1.0, 1.0)), (1, (0.0, 2.0)), (2, (0.5, 0.0))):
        both = based_oracle(fq[0, h], fk[0, h], q[0, h], k[0, h], v[0, h], window, attn.scale)
        near = window_part(q[0, h], k[0, h], v[0, h], window, attn.scale)
        torch.testing.assert_close(out[0, h], a * (both - near) + b * near, rtol=1e-9, atol=1e-9)
    assert ATTENTION_KINDS["based"].old_run_options({}) == {"path_mix": False}


def window_part(q, k, v, window, scale):
    """The oracle's window path alone: softmax(scale q_i.k_j) over the last `window` keys."""
    return torch.stack([torch.softmax(scale * (k[max(0, i - window + 1):i + 1] @ q[i]), 0)
                        @ v[max(0, i - window + 1):i + 1] for i in range(k.shape[0])])
