"""Partial RoPE (pos.rotary_fraction) against its two references.

- rotary_form=dimensions: GPT-NeoX's rotary_pct, as transformers 5.24.0 runs it (`GPTNeoXRotaryEmbedding` with
  `partial_rotary_factor`, and `apply_rotary_pos_emb`): the first int(d p) dimensions rotated with frequencies
  base^(-2i/(d p)), the rest passed through. transformers pairs dimension i with i + r/2 ("rotate_half"), BlockLab
  pairs 2i with 2i+1: the test maps one layout onto the other by a fixed permutation of the rotated dimensions.
- rotary_form=frequencies: p-RoPE (Barbero et al. 2025), as google-deepmind/gemma's `apply_rope` computes it
  (gemma/positional_embeddings.py, rope_proportion): its few lines are written out below in torch as the oracle."""
import math

import pytest
import torch

from blocklab.model.config import ModelConfig
from blocklab.model.position import RoPE

transformers = pytest.importorskip("transformers", reason="transformers is the oracle here: pip install -e '.[dev]'")
from transformers import GPTNeoXConfig  # noqa: E402
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402


def qk(d_head: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 3, 7, d_head, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, torch.arange(7)[None] + 3


def half_layout(x: torch.Tensor, rotated: int) -> torch.Tensor:
    """BlockLab's interleaved pairs (2i, 2i+1) of the rotated part -> transformers' halves (i, i + r/2)."""
    return torch.cat([x[..., 0:rotated:2], x[..., 1:rotated:2], x[..., rotated:]], dim=-1)


@pytest.mark.parametrize("d_head,fraction", [(16, 0.25), (16, 0.5), (64, 0.25), (32, 0.75), (8, 1.0)])
def test_dimensions_form_matches_gpt_neox_in_transformers(d_head, fraction):
    base = 10000.0
    rope = RoPE(4 * d_head, 4, d_head, rotary_fraction=fraction, rotary_form="dimensions", base=base)
    q, k, positions = qk(d_head)
    ours_q, ours_k = rope.rotate(q, k, positions)
    config = GPTNeoXConfig(hidden_size=4 * d_head, num_attention_heads=4,
                           rope_parameters={"rope_type": "default", "rope_theta": base,
                                            "partial_rotary_factor": fraction})
    cos, sin = GPTNeoXRotaryEmbedding(config)(q, positions)
    rotated = int(d_head * fraction)
    ref_q, ref_k = apply_rotary_pos_emb(half_layout(q, rotated), half_layout(k, rotated), cos, sin)
    # transformers computes cos and sin in float32: compare at float32's precision
    torch.testing.assert_close(half_layout(ours_q, rotated), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(half_layout(ours_k, rotated), ref_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_q[..., rotated:], q[..., rotated:], rtol=0, atol=0)  # passed through untouched


def gemma_apply_rope(inputs: torch.Tensor, positions: torch.Tensor, base: float, rope_proportion: float):
    """google-deepmind/gemma, gemma/positional_embeddings.py `apply_rope` (JAX, Apache-2.0), in torch: inputs
    (B, L, N, H), positions (B, L). It splits each head into halves (first half, second half) as transformers does."""
    head_dim = inputs.shape[-1]
    rope_angles = int(rope_proportion * head_dim // 2)
    nope_angles = head_dim // 2 - rope_angles
    freq_exponents = 2 * torch.arange(rope_angles, dtype=torch.float64) / head_dim
    timescale = base ** freq_exponents
    timescale = torch.cat([timescale, torch.full((nope_angles,), math.inf, dtype=torch.float64)])
    sinusoid_inp = positions[..., None].double() / timescale[None, None, :]
    sinusoid_inp = sinusoid_inp[..., None, :]
    sin, cos = torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)
    first_half, second_half = inputs.chunk(2, dim=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return torch.cat([first_part, second_part], dim=-1)


@pytest.mark.parametrize("d_head,fraction", [(16, 0.25), (16, 0.5), (32, 0.75), (64, 0.1), (8, 1.0), (16, 0.0)])
def test_frequencies_form_matches_gemma_p_rope(d_head, fraction):
    base = 10000.0
    rope = RoPE(4 * d_head, 4, d_head, rotary_fraction=fraction, rotary_form="frequencies", base=base)
    q, k, positions = qk(d_head, seed=1)
    ours, _ = rope.rotate(q, k, positions)
    reference = gemma_apply_rope(half_layout(q, d_head).transpose(1, 2), positions, base, fraction).transpose(1, 2)
    torch.testing.assert_close(half_layout(ours, d_head), reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", ["frequencies", "dimensions"])
def test_fraction_one_is_bit_identical_to_rope(form):
    q, k, positions = qk(16, seed=2)
    plain = RoPE(64, 4, 16).rotate(q.float(), k.float(), positions)
    partial = RoPE(64, 4, 16, rotary_fraction=1.0, rotary_form=form).rotate(q.float(), k.float(), positions)
    for a, b in zip(plain, partial):
        assert torch.equal(a, b)


def test_p_rope_leaves_the_lowest_pairs_unrotated():
    """At fraction 0.5 of d_head 16, pairs 0-3 rotate and pairs 4-7 (the lowest frequencies) keep their values."""
    q, k, positions = qk(16, seed=3)
    out, _ = RoPE(64, 4, 16, rotary_fraction=0.5).rotate(q, k, positions)
    assert torch.equal(out[..., 8:], q[..., 8:])
    assert not torch.allclose(out[..., :8], q[..., :8])


def config_errors(**pos) -> list[str]:
    return ModelConfig.from_groups({"model": {"d_model": 64, "n_heads": 4}, "norm": {}, "act": {}, "init": {},
                                    "attn": {}, "pos": {"name": "rope", **pos}}, vocab_size=16, max_len=32).errors()


def test_odd_rotated_width_and_scaling_are_refused_in_one_line():
    assert config_errors(rotary_fraction=0.5, rotary_form="dimensions") == []
    odd = config_errors(rotary_fraction=0.3125, rotary_form="dimensions")  # int(16 * 0.3125) = 5
    assert len(odd) == 1 and "odd" in odd[0] and "pos.rotary_fraction" in odd[0]
    assert "pos.rotary_form" in config_errors(rotary_fraction=0.5, rotary_form="halves")[0]
    assert "[0, 1]" in config_errors(rotary_fraction=1.5)[0]
    scaled = config_errors(rotary_fraction=0.5, scaling="pi", scaling_factor=2.0, original_context=16)
    assert len(scaled) == 1 and "pos.scaling" in scaled[0]
