"""Position schemes checked against their published definitions (RoPE, sinusoidal, ALiBi, T5, learned)."""
import math

import pytest
import torch

from blocklab.model import ModelConfig, Transformer
from blocklab.model.config import PosConfig
from blocklab.model.position import Learned, RoPE, Sinusoidal
from blocklab.model.position_bias import ALiBi, T5Bias, alibi_slopes, t5_buckets

from variants import SCHEMES, tiny_model  # noqa: E402  (every registered scheme)


make_model = tiny_model


# ----------------------------------------------------------------------------------------- RoPE

D_HEAD = 8


def rope_apply(rope: RoPE, x: torch.Tensor, positions) -> torch.Tensor:
    """Rotate vectors x (N, d) placed at positions (N,) -> (N, d)."""
    positions = torch.as_tensor(positions).reshape(1, -1)
    out, out_k = rope.rotate(x[None, None], x[None, None], positions)
    assert torch.equal(out, out_k)  # q and k get the same rotation
    return out[0, 0]


def rope_matrix(rope: RoPE, p: int) -> torch.Tensor:
    """The linear map x -> R_p x as a matrix (columns = images of the basis vectors)."""
    eye = torch.eye(D_HEAD, dtype=torch.float64)
    return rope_apply(rope, eye, [p] * D_HEAD).T


def test_rope_rotation_preserves_norms():
    torch.manual_seed(0)
    rope = RoPE(d_model=32, n_heads=4, d_head=D_HEAD)
    x = torch.randn(50, D_HEAD, dtype=torch.float64)
    positions = torch.randint(0, 200, (50,))
    rotated = rope_apply(rope, x, positions)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-6, atol=1e-6)
    assert (rotated - x).abs().max() > 0.1  # it does rotate (identity would trivially preserve norms)


def test_rope_dot_product_depends_only_on_offset():
    torch.manual_seed(0)
    rope = RoPE(d_model=32, n_heads=4, d_head=D_HEAD)
    q, k = torch.randn(2, 20, D_HEAD, dtype=torch.float64)
    by_offset = {}
    for offset in (0, 1, 3, 9):
        for p in (0, 2, 11):
            base = (rope_apply(rope, q, [p] * 20) * rope_apply(rope, k, [p + offset] * 20)).sum(-1)
            for s in (1, 5, 40):
                shifted = (rope_apply(rope, q, [p + s] * 20) * rope_apply(rope, k, [p + offset + s] * 20)).sum(-1)
                torch.testing.assert_close(shifted, base, rtol=1e-5, atol=1e-5)
            by_offset[offset] = base
    # ...and it does depend on the offset (an identity "rotation" would pass the check above).
    for offset in (1, 3, 9):
        assert (by_offset[offset] - by_offset[0]).abs().max() > 1e-2
    # At offset 0 the rotation cancels: q.k is the unrotated dot product.
    torch.testing.assert_close(by_offset[0], (q * k).sum(-1), rtol=1e-5, atol=1e-5)


def test_rope_is_a_rotation_with_the_published_frequencies():
    rope = RoPE(d_model=32, n_heads=4, d_head=D_HEAD)
    torch.testing.assert_close(rope_matrix(rope, 0), torch.eye(D_HEAD, dtype=torch.float64))
    r1, r3, r4 = rope_matrix(rope, 1), rope_matrix(rope, 3), rope_matrix(rope, 4)
    torch.testing.assert_close(r1.T @ r1, torch.eye(D_HEAD, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r1 @ r3, r4, rtol=1e-6, atol=1e-6)  # R_a R_b = R_(a+b)
    # R_1 has eigenvalues exp(+-i theta_j), theta_j = 10000^(-2j/d): each frequency appears twice.
    angles = torch.linalg.eigvals(r1).angle().abs().sort().values
    theta = torch.tensor([10000 ** (-2 * j / D_HEAD) for j in range(D_HEAD // 2)], dtype=torch.float64)
    torch.testing.assert_close(angles, theta.repeat_interleave(2).sort().values, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------- Sinusoidal

def frequencies(d):
    return torch.tensor([10000 ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)


def test_sinusoidal_table_is_the_published_formula():
    d = 16
    sin = Sinusoidal(d_model=d, n_heads=4, d_head=4)
    positions = torch.arange(0, 60)
    table = sin.table(positions[None])[0].double()
    angles = positions.double()[:, None] * frequencies(d)
    torch.testing.assert_close(table[:, 0::2], angles.sin(), rtol=0, atol=2e-5)
    torch.testing.assert_close(table[:, 1::2], angles.cos(), rtol=0, atol=2e-5)


def test_sinusoidal_shift_is_a_fixed_block_rotation():
    """PE(p + k) = T_k PE(p), T_k block diagonal with 2x2 rotations by k w_i, the same for every p."""
    d = 16
    sin = Sinusoidal(d_model=d, n_heads=4, d_head=4)
    w = frequencies(d)
    for k in (1, 4, 13):
        t_k = torch.zeros(d, d, dtype=torch.float64)
        for i in range(d // 2):
            c, s = math.cos(k * w[i]), math.sin(k * w[i])
            # (sin, cos) pair: sin(a + b) = sin a cos b + cos a sin b; cos(a + b) = cos a cos b - sin a sin b
            t_k[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[c, s], [-s, c]], dtype=torch.float64)
        ps = torch.tensor([0, 1, 7, 25, 40])
        pe_p = sin.table(ps[None])[0].double()
        pe_pk = sin.table((ps + k)[None])[0].double()
        torch.testing.assert_close(pe_p @ t_k.T, pe_pk, rtol=0, atol=5e-5)
        assert (pe_pk - pe_p).abs().max() > 0.1


@pytest.mark.parametrize("scale_embeddings", [True, False])
def test_sinusoidal_model_adds_the_table_to_the_embeddings(scale_embeddings):
    """Vaswani et al. 3.4: embeddings times sqrt(d_model), plus PE (or plain x + PE when not scaled)."""
    sin = Sinusoidal(d_model=32, n_heads=4, d_head=8, scale_embeddings=scale_embeddings).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])
    angles = positions.double()[..., None] * frequencies(32)
    expected = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
    scale = 32 ** 0.5 if scale_embeddings else 1.0
    torch.testing.assert_close(sin.embed(x, positions) - scale * x, expected, rtol=0, atol=5e-5)


# ---------------------------------------------------------------------------------------- ALiBi

def test_alibi_slopes_power_of_two():
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    assert alibi_slopes(1).tolist() == [2.0 ** -8]


def published_slopes(n):
    """The rule from Press et al.'s reference code."""
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + published_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("n", [3, 5, 6, 12, 16])
def test_alibi_slopes_non_power_of_two(n):
    torch.testing.assert_close(alibi_slopes(n).double(), torch.tensor(published_slopes(n), dtype=torch.float64),
                               rtol=1e-6, atol=0)


def test_alibi_slopes_for_six_heads_by_hand():
    # slopes of 4 heads, then every other slope of 8 heads (2^-1, 2^-3)
    assert alibi_slopes(6).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]


def test_alibi_bias_is_minus_slope_times_distance():
    alibi = ALiBi(d_model=32, n_heads=4, d_head=8)
    q_pos = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    k_pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 7, 8]])
    bias = alibi.bias(q_pos, k_pos)
    assert bias.shape == (2, 4, 5, 7)
    slopes = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    for b in range(2):
        for h in range(4):
            for i in range(5):
                for j in range(7):
                    expected = -slopes[h] * abs(int(q_pos[b, i]) - int(k_pos[b, j]))
                    assert float(bias[b, h, i, j]) == pytest.approx(expected, abs=1e-6)


def zero_queries_and_keys(model):
    with torch.no_grad():
        for block in model.blocks:
            for part in "qk":
                for tensor in block.attn.projection(part):
                    tensor.zero_()


def test_alibi_attention_weights_follow_the_bias():
    """With q = k = 0 the scores are the bias alone: weight(i, j) proportional to exp(-m |i - j|), j <= i."""
    model = make_model("alibi", n_layers=1)
    zero_queries_and_keys(model)
    idx = torch.randint(0, 20, (1, 6))
    _, weights = model(idx, need_weights=True)
    slopes = torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8], dtype=torch.float64)
    i, j = torch.arange(6)[:, None], torch.arange(6)[None]
    scores = -slopes[:, None, None] * (i - j).abs()
    scores = scores.masked_fill(j > i, float("-inf"))
    torch.testing.assert_close(weights[0][0], scores.softmax(-1), rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------------------------------- T5 bias

@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (16, 64), (8, 20)])
def test_t5_causal_buckets(num_buckets, max_distance):
    distance = torch.arange(0, 4 * max_distance)
    buckets = t5_buckets(-distance, bidirectional=False, num_buckets=num_buckets, max_distance=max_distance)
    exact = num_buckets // 2
    assert torch.equal(buckets[:exact], distance[:exact])  # exact for small distances
    assert bool((buckets[1:] >= buckets[:-1]).all())  # monotone non-decreasing in distance
    assert bool((buckets[max_distance:] == num_buckets - 1).all())  # capped beyond max_distance
    assert bool((buckets[:max_distance] < num_buckets).all())
    assert set(buckets.tolist()) == set(range(num_buckets))  # every bucket is used


def test_t5_log_buckets_by_hand():
    # 32 buckets, max distance 128: 16 exact, then 16 log-spaced buckets over [16, 128)
    # bucket(d) = 16 + floor(log(d / 16) / log(128 / 16) * 16)
    distance = torch.tensor([15, 16, 32, 64, 127, 128, 1000])
    buckets = t5_buckets(-distance, bidirectional=False, num_buckets=32, max_distance=128)
    assert buckets.tolist() == [15, 16, 21, 26, 31, 31, 31]


@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (16, 64)])
def test_t5_bidirectional_buckets(num_buckets, max_distance):
    half = num_buckets // 2
    distance = torch.arange(0, 4 * max_distance)
    past = t5_buckets(-distance, bidirectional=True, num_buckets=num_buckets, max_distance=max_distance)
    future = t5_buckets(distance[1:], bidirectional=True, num_buckets=num_buckets, max_distance=max_distance)
    # past keys (and the query itself) use [0, half), future keys [half, num_buckets)
    assert bool(((past >= 0) & (past < half)).all())
    assert bool(((future >= half) & (future < num_buckets)).all())
    exact = half // 2
    assert torch.equal(past[:exact], distance[:exact])
    assert torch.equal(future[:exact - 1], half + distance[1:exact])
    assert bool((past[1:] >= past[:-1]).all()) and bool((future[1:] >= future[:-1]).all())
    assert bool((past[max_distance:] == half - 1).all())
    assert bool((future[max_distance - 1:] == num_buckets - 1).all())
    # symmetric: a key d ahead uses the mirror of the bucket of a key d behind
    torch.testing.assert_close(future - half, past[1:])


@pytest.mark.parametrize("causal", [True, False])
def test_t5_bias_reads_the_table_at_the_relative_bucket(causal):
    torch.manual_seed(0)
    t5 = T5Bias(d_model=32, n_heads=4, d_head=8, causal=causal, num_buckets=16, max_distance=40)
    q_pos = torch.arange(0, 50)[None]
    k_pos = torch.arange(0, 50)[None]
    bias = t5.bias(q_pos, k_pos)
    assert bias.shape == (1, 4, 50, 50)
    table = t5.table.weight
    for i in (0, 3, 20, 49):
        for j in (0, 2, 3, 10, 30, 49):
            bucket = t5_buckets(torch.tensor(j - i), not causal, 16, 40)
            torch.testing.assert_close(bias[0, :, i, j], table[int(bucket)])


def test_t5_attention_weights_follow_the_bias():
    model = make_model("t5_bias", n_layers=1)
    zero_queries_and_keys(model)
    idx = torch.randint(0, 20, (1, 6))
    _, weights = model(idx, need_weights=True)
    i, j = torch.arange(6)[:, None], torch.arange(6)[None]
    buckets = t5_buckets(j - i, False, model.pos.num_buckets, model.pos.max_distance)
    scores = model.pos.table.weight[buckets].permute(2, 0, 1).masked_fill(j > i, float("-inf"))
    torch.testing.assert_close(weights[0][0], scores.softmax(-1), rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------------------- relative vs absolute

@pytest.mark.parametrize("pos", SCHEMES)
def test_relative_schemes_are_translation_invariant(pos):
    """Shifting every position by a constant changes nothing for relative schemes, and changes
    the outputs of absolute ones. FIRE is relative while the query's position is below its threshold L
    (512 here); tests/test_fire.py checks what happens past it."""
    model = make_model(pos)
    torch.manual_seed(1)
    idx = torch.randint(0, 20, (2, 8))
    with torch.no_grad():
        plain = model(idx)
        shifted = model(idx, positions=torch.arange(8)[None] + 7)
    if pos in ("none", "rope", "alibi", "t5_bias", "fire"):
        torch.testing.assert_close(shifted, plain, rtol=1e-5, atol=1e-5)
    else:
        assert (shifted - plain).abs().max() > 1e-3


# -------------------------------------------------------------------------------------- Learned

def test_learned_positions_past_the_table_raise():
    learned = Learned(d_model=32, n_heads=4, d_head=8, max_len=10)
    x = torch.zeros(1, 10, 32)
    learned.embed(x, torch.arange(10)[None])  # positions 0..9 fit
    with pytest.raises(ValueError, match=r"pos\.max_len"):
        learned.embed(torch.zeros(1, 11, 32), torch.arange(11)[None])


def test_learned_embed_adds_the_row_of_each_position():
    torch.manual_seed(0)
    learned = Learned(d_model=32, n_heads=4, d_head=8, max_len=10)
    x = torch.randn(2, 3, 32)
    positions = torch.tensor([[0, 1, 2], [7, 8, 9]])
    torch.testing.assert_close(learned.embed(x, positions), x + learned.table.weight[positions])


def test_learned_max_len_shorter_than_model_is_reported_and_raises():
    cfg = ModelConfig(vocab_size=20, d_model=32, n_heads=4, pos=PosConfig("learned", {"max_len": 10}), max_len=20)
    errors = cfg.errors()
    assert any("pos.max_len" in e for e in errors), errors
    model = Transformer(cfg)
    model(torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(ValueError, match=r"pos\.max_len"):
        model(torch.zeros(1, 12, dtype=torch.long))


def test_learned_table_defaults_to_model_max_len():
    for options in ({}, {"max_len": None}):
        cfg = ModelConfig(vocab_size=20, d_model=32, n_heads=4, pos=PosConfig("learned", options), max_len=20)
        assert cfg.errors() == []
        model = Transformer(cfg)
        assert model(torch.zeros(1, 20, dtype=torch.long)).shape == (1, 20, 20)
        with pytest.raises(ValueError, match=r"pos\.max_len"):
            model(torch.zeros(1, 21, dtype=torch.long))
