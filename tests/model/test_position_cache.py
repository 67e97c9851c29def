"""Position tables and biases are remembered per positions tensor (once per length, not per layer and
step); remembered results must be exactly what a fresh computation gives."""
import pytest
import torch

from blocklab.model.position import default_positions

from variants import SCHEMES, tiny_model  # noqa: E402  (every registered scheme)
VARIANTS = {"mha": {}, "gqa": {"n_kv_heads": 2}, "mqa": {"n_kv_heads": 1}, "local": {"window": 3}}


def make_model(pos, **attn):
    return tiny_model(pos, max_len=256, **attn)


def fresh(model, idx, **kw):
    """The forward pass with nothing remembered: every table computed from scratch."""
    model.pos.memo.entries.clear()
    with torch.no_grad():
        out = model(idx, **kw)
    model.pos.memo.entries.clear()
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pos", SCHEMES)
def test_remembered_tables_equal_fresh_ones_at_every_length(pos, variant):
    model = make_model(pos, **VARIANTS[variant])
    g = torch.Generator().manual_seed(0)
    # growing past every length seen so far, then back to shorter ones
    for length in (5, 17, 64, 200, 17, 5, 201):
        idx = torch.randint(0, 20, (2, length), generator=g)
        with torch.no_grad():
            first, again = model(idx), model(idx)  # the second pass reads the remembered tables
        expected = fresh(model, idx)
        assert torch.equal(first, expected) and torch.equal(again, expected)
        with torch.no_grad():  # the explicit (analysis) path reads the same tables
            slow, _ = model(idx, need_weights=True)
        torch.testing.assert_close(slow, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("pos", ["sinusoidal", "rope", "alibi", "t5_bias"])
def test_explicit_positions_modified_in_place_are_recomputed(pos):
    model = make_model(pos)
    idx = torch.randint(0, 20, (1, 9))
    positions = torch.arange(9)[None].clone()
    with torch.no_grad():
        model(idx, positions=positions)
        positions += 3  # same tensor object, new values
        shifted = model(idx, positions=positions)
    assert torch.equal(shifted, fresh(model, idx, positions=torch.arange(3, 12)[None]))


@pytest.mark.parametrize("pos", ["sinusoidal", "rope", "alibi", "t5_bias"])
def test_tables_first_built_in_inference_mode_serve_training(pos):
    """Validation runs under inference_mode; the same length then trains (needs normal tensors)."""
    model = make_model(pos).train()
    idx = torch.randint(0, 20, (2, 11))
    with torch.inference_mode():
        model(idx)
    model(idx).sum().backward()
    assert all(p.grad is not None for p in model.blocks[0].parameters())


def test_default_positions_are_shared_per_length():
    assert default_positions(7, "cpu") is default_positions(7, "cpu")
    assert torch.equal(default_positions(7, "cpu"), torch.arange(7)[None])
    assert default_positions(8, "cpu").shape == (1, 8)
