"""The RoPE context extensions (pos.scaling) against the library every RoPE checkpoint on the Hugging Face Hub loads
with: transformers 5.24.0, `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` (pinned in pyproject's `dev`
extra; its RoPE API changed between 4.x and 5.x, so another version may not run these). Each function there returns
the inverse frequencies and the attention factor that multiplies cos and sin (so q and k: every logit by its square);
the RoPE scheme's rotation at position 1 holds the same two things, as its angle (the effective frequency, PI's
position scaling included) and its magnitude. Compared over a grid of (d_head, base, trained context, factor)."""
import itertools
import math

import pytest
import torch

from blocklab.model.position import RoPE

transformers = pytest.importorskip("transformers", reason="transformers is the oracle here: pip install -e '.[dev]'")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

VERSION = "5.24.0"  # the version these tests were written against (pyproject's dev extra pins it)
D_HEADS = (4, 8, 16, 64, 128)
BASES = (10.0, 10000.0, 500000.0)
CONTEXTS = (4, 16, 64, 256, 4096)
FACTORS = (1.0, 2.0, 2.5, 4.0, 8.0, 32.0)
GRID = list(itertools.product(D_HEADS, BASES, CONTEXTS, FACTORS))


def test_the_oracle_is_the_pinned_version():
    assert transformers.__version__ == VERSION, f"these tests read transformers {VERSION}'s RoPE API"


def reference(rope_type: str, d_head: int, base: float, context: int, factor: float, seq_len: int | None = None,
              **parameters) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies (float32) and attention factor for one head of d_head dimensions."""
    config = LlamaConfig(hidden_size=4 * d_head, num_attention_heads=4, head_dim=d_head,
                         max_position_embeddings=int(context * factor),
                         rope_parameters={"rope_type": rope_type, "rope_theta": base, "factor": factor,
                                          "original_max_position_embeddings": context, **parameters})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len)
    return inv_freq.to(torch.float64), float(attention_factor)


def ours(method: str, d_head: int, base: float, context: int, factor: float, **options) -> tuple[torch.Tensor, float]:
    """The scheme's effective frequencies (the angle at position 1) and its q/k multiplier (the magnitude)."""
    scheme = RoPE(4 * d_head, 4, d_head, base=base, scaling=method, scaling_factor=factor, original_context=context,
                  **options)
    rotation = scheme.rotations(torch.tensor([[1]]), torch.float64)[0, 0, 0]
    magnitude = rotation.abs()
    assert torch.allclose(magnitude, magnitude[0].expand_as(magnitude), rtol=1e-6, atol=0)  # float32
    return rotation.angle(), float(magnitude[0])  # every frequency is at most 1 radian: the angle does not wrap


def mismatches(method: str, rope_type: str, grid=GRID, ours_options=None, reference_options=None) -> list[str]:
    bad = []
    for d_head, base, context, factor in grid:
        freq, multiplier = ours(method, d_head, base, context, factor, **(ours_options or {}))
        ref_freq, ref_factor = reference(rope_type, d_head, base, context, factor, **(reference_options or {}))
        if not (torch.allclose(freq, ref_freq, rtol=2e-6, atol=0) and math.isclose(multiplier, ref_factor,
                                                                                   rel_tol=1e-6)):
            bad.append(f"d_head {d_head} base {base} L {context} s {factor}: {freq.tolist()} x{multiplier} against "
                       f"{ref_freq.tolist()} x{ref_factor}")
    return bad


def test_pi_is_transformers_linear():
    """pos.scaling=pi divides positions by s; transformers' `linear` divides the inverse frequencies by s: the same
    angles (transformers 5.24.0, `_compute_linear_scaling_rope_parameters`)."""
    assert mismatches("pi", "linear") == []


def test_yarn_is_transformers_yarn():
    """pos.scaling=yarn with the default ramp (pos.yarn_ramp=reference) against transformers 5.24.0's
    `_compute_yarn_parameters` (beta_fast = pos.yarn_beta, beta_slow = pos.yarn_alpha, truncate true: the floor/ceil
    bounds of jquesnelle/yarn), frequencies and attention factor 0.1 ln(s) + 1, at the paper's bounds and others."""
    assert mismatches("yarn", "yarn") == []
    grid = list(itertools.product((8, 16, 64), (10000.0,), (64, 2048), (4.0, 16.0)))
    for alpha, beta in ((0.5, 8.0), (2.0, 64.0), (1.0, 4.0)):
        assert mismatches("yarn", "yarn", grid, {"yarn_alpha": alpha, "yarn_beta": beta},
                          {"beta_fast": beta, "beta_slow": alpha}) == [], (alpha, beta)


def test_the_paper_ramp_is_not_the_reference():
    """pos.yarn_ramp=paper is the project's former reading (§3.2, linear in r): it differs from transformers' yarn at
    context_extension's setting, where it interpolates the fastest pair (d_head 16, L 64, s 4)."""
    ref, _ = reference("yarn", 16, 10000.0, 64, 4.0)
    paper, _ = ours("yarn", 16, 10000.0, 64, 4.0, yarn_ramp="paper")
    assert ref[0] == 1.0 and abs(float(paper[0]) - 1 / 2.1176) < 1e-4


def test_ntk_is_transformers_dynamic_where_the_two_coincide():
    """transformers has no static NTK-aware scaling. Its `dynamic` type (transformers 5.24.0,
    `_compute_dynamic_ntk_parameters`) raises the base to b ((f T / L) - (f - 1))^(d/(d-2)) at sequence length T
    past L = max_position_embeddings; with f = 1 at T = s L that is b s^(d/(d-2)), pos.scaling=ntk's base at factor s
    (YaRN paper eq. 16). Compared there, for integer s L."""
    bad = []
    for d_head, base, context, factor in GRID:
        if factor * context != int(factor * context):
            continue
        config = LlamaConfig(hidden_size=4 * d_head, num_attention_heads=4, head_dim=d_head,
                             max_position_embeddings=context,
                             rope_parameters={"rope_type": "dynamic", "rope_theta": base, "factor": 1.0})
        ref, attention_factor = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", int(factor * context))
        freq, multiplier = ours("ntk", d_head, base, context, factor)
        if not (torch.allclose(freq, ref.to(torch.float64), rtol=2e-6, atol=0) and math.isclose(multiplier, attention_factor, rel_tol=1e-6)):
            bad.append(f"d_head {d_head} base {base} L {context} s {factor}")
    assert bad == []


def test_llama3_is_transformers_llama3():
    """pos.scaling=llama3 against transformers 5.24.0's `_compute_llama3_parameters` (low_freq_factor,
    high_freq_factor: Llama 3.1's 1 and 4, and others), no attention factor."""
    assert mismatches("llama3", "llama3", reference_options={"low_freq_factor": 1.0, "high_freq_factor": 4.0}) == []
    grid = list(itertools.product((8, 64), (10000.0, 500000.0), (64, 8192), (8.0,)))
    assert mismatches("llama3", "llama3", grid, {"llama3_low_freq_factor": 2.0, "llama3_high_freq_factor": 16.0},
                      {"low_freq_factor": 2.0, "high_freq_factor": 16.0}) == []
