"""BatchNorm over the batch and the sequence (norm.type=batchnorm): statistics of the real tokens only, running
statistics in evaluation, cached decoding, and the one-line error for a training batch of one sequence."""
import json

import pytest
import torch

from blocklab.errors import ConfigError
from blocklab.model import ModelConfig, build_model
from blocklab.model.config import InitConfig, NormConfig, PosConfig
from blocklab.model.generate import generate
from blocklab.model.norm import build_norm
from conftest import FAST, run_in_process
from helpers import assert_learned_and_changed

D, EPS = 8, 1e-5


def ragged(seed=0):
    """(B, T, D) activations with a ragged right padding whose values would swamp any statistic they entered."""
    g = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(3, 6, D, generator=g, dtype=torch.float64) + 0.7
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    return x.masked_fill(~valid[..., None], 1e6), valid


def bn(affine=True):
    return build_norm("batchnorm", D, EPS, affine=affine).double()


# ------------------------------------------------------------------------------------- the module

def test_training_normalizes_each_feature_over_the_real_tokens_only():
    x, valid = ragged()
    norm = bn().train()
    y = norm(x, valid)
    real = x[valid]  # (N, D): the 13 real tokens
    mean, var = real.mean(0), real.var(0, unbiased=False)
    torch.testing.assert_close(y[valid], (real - mean) / (var + EPS).sqrt(), rtol=1e-10, atol=1e-10)
    assert torch.all(y[~valid].abs() < 1)  # padding comes out finite and small, not as the values it came in with
    # Running estimates (momentum 0.1 from mean 0, variance 1): the unbiased variance of the real tokens.
    n = len(real)
    torch.testing.assert_close(norm.running_mean, 0.1 * mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(norm.running_var, 0.9 + 0.1 * var * n / (n - 1), rtol=1e-10, atol=1e-10)


def test_training_without_padding_uses_every_token():
    x, _ = ragged()
    y = bn().train()(x)
    flat = x.reshape(-1, D)
    expected = (flat - flat.mean(0)) / (flat.var(0, unbiased=False) + EPS).sqrt()
    torch.testing.assert_close(y.reshape(-1, D), expected, rtol=1e-10, atol=1e-10)


def test_evaluation_uses_the_running_statistics_token_by_token():
    x, valid = ragged()
    norm = bn()
    with torch.no_grad():
        norm.running_mean.copy_(torch.linspace(-1, 1, D, dtype=torch.float64))
        norm.running_var.copy_(torch.linspace(0.5, 3, D, dtype=torch.float64))
        norm.weight.normal_(1, 0.3)
        norm.bias.normal_(0, 0.3)
    norm.eval()
    y = norm(x, valid)
    expected = (x - norm.running_mean) / (norm.running_var + EPS).sqrt() * norm.weight + norm.bias
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)
    # One token alone comes out as it does inside the batch, and nothing is updated.
    torch.testing.assert_close(norm(x[1:2, 0:1]), y[1:2, 0:1], rtol=1e-12, atol=1e-12)
    assert norm.num_batches_tracked.item() == 0


def test_affine_free_batchnorm_has_no_parameters_and_keeps_its_running_statistics():
    norm = bn(affine=False)
    assert list(norm.parameters()) == []
    assert {name for name, _ in norm.named_buffers()} >= {"running_mean", "running_var"}


# ---------------------------------------------------------------------------------- in a model

def bn_cfg(placement="pre", **kw):
    return ModelConfig(vocab_size=20, max_len=32, d_model=16, n_layers=2, n_heads=2,
                       norm=NormConfig("batchnorm", placement), pos=PosConfig("rope"), init=InitConfig("normal", 0.2),
                       **kw)


def padded(idx, extra=3, seed=1):
    """idx with `extra` columns of random padding tokens on the right, and its mask."""
    g = torch.Generator().manual_seed(seed)
    pad = torch.randint(0, 20, (idx.shape[0], extra), generator=g)
    valid = torch.cat((torch.ones_like(idx, dtype=torch.bool), torch.zeros_like(pad, dtype=torch.bool)), dim=1)
    return torch.cat((idx, pad), dim=1), valid


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich"])
def test_a_padded_batch_gives_the_real_tokens_the_unpadded_outputs_in_training_and_evaluation(placement):
    """Causal attention never looks right, so only BatchNorm's statistics could carry padding into real tokens."""
    torch.manual_seed(0)
    plain = build_model(bn_cfg(placement)).double()
    with_pad = build_model(bn_cfg(placement)).double()
    with_pad.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 20, (4, 7))
    idx_pad, valid = padded(idx)
    plain.train()
    with_pad.train()
    torch.testing.assert_close(with_pad(idx_pad, valid=valid)[:, :7], plain(idx), rtol=1e-9, atol=1e-9)
    # The running statistics took the same step, so evaluation agrees too.
    for a, b in zip(plain.buffers(), with_pad.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    plain.eval()
    with_pad.eval()
    torch.testing.assert_close(with_pad(idx_pad, valid=valid)[:, :7], plain(idx), rtol=1e-9, atol=1e-9)


def test_padded_sources_and_bidirectional_stacks_leave_the_real_tokens_alone():
    """An encoder-decoder's source padding (encoder blocks and the encoder's final norm) and an encoder-only stack,
    whose real tokens also attend rightwards (padding keys are masked), in training mode."""
    torch.manual_seed(0)
    idx, target = torch.randint(0, 20, (4, 7)), torch.randint(0, 20, (4, 5))
    idx_pad, valid = padded(idx)
    seq2seq = build_model(bn_cfg(arch="encoder_decoder")).double().train()
    torch.testing.assert_close(seq2seq(target, source=idx_pad, source_valid=valid), seq2seq(target, source=idx),
                               rtol=1e-9, atol=1e-9)
    encoder = build_model(bn_cfg(arch="encoder")).double().train()
    torch.testing.assert_close(encoder(idx_pad, valid=valid)[:, :7], encoder(idx), rtol=1e-9, atol=1e-9)


def test_without_the_mask_the_padding_would_change_the_real_tokens():
    """The check above has teeth: the same padding counted as tokens moves the real tokens' outputs."""
    torch.manual_seed(0)
    model = build_model(bn_cfg()).double().train()
    idx = torch.randint(0, 20, (4, 7))
    idx_pad, _ = padded(idx)
    assert not torch.allclose(model(idx_pad)[:, :7], model(idx), atol=1e-6)


def test_evaluation_uses_running_statistics_so_a_row_does_not_depend_on_its_batch():
    torch.manual_seed(0)
    model = build_model(bn_cfg()).double()
    idx = torch.randint(0, 20, (6, 7))
    model.train()
    for _ in range(3):
        model(idx)  # running statistics move away from 0 / 1
    model.eval()
    alone = model(idx[:1])
    torch.testing.assert_close(model(idx)[:1], alone, rtol=1e-10, atol=1e-10)
    model.train()  # in training the batch's own statistics: the same row comes out differently
    assert not torch.allclose(model(idx)[:1], model(idx[:2])[:1], atol=1e-6)


def test_generate_with_a_batchnorm_model_matches_recomputation():
    torch.manual_seed(0)
    model = build_model(bn_cfg()).train()
    idx = torch.randint(0, 20, (8, 10))
    for _ in range(3):
        model(idx)
    model.eval()
    prompts = [torch.tensor([3, 4, 5]), torch.tensor([7, 1, 2, 9, 8]), torch.tensor([6])]  # left-padded together
    cached = generate(model, prompts, 6)
    recomputed = generate(model, prompts, 6, use_cache=False)
    assert torch.equal(cached, recomputed)
    # Each row as it would be decoded alone (batch of one sequence, one token per step).
    for row, prompt in enumerate(prompts):
        assert torch.equal(generate(model, [prompt], 6)[0], cached[row])


# ----------------------------------------------------------------------------------- end to end

def test_a_training_batch_of_one_sequence_is_one_line_before_any_work(run_dir):
    with pytest.raises(ConfigError) as err:
        run_in_process([*FAST, "norm.type=batchnorm", "task.batch_size=1"], run_dir)
    assert str(err.value) == ("norm.type=batchnorm needs task.batch_size >= 2 (got 1): its statistics would come from "
                              "one sequence and its running estimates would not match them; raise task.batch_size or "
                              "use norm.type=layernorm")
    assert not run_dir.exists()


@pytest.mark.parametrize("overrides, name", [(["norm.type=batchnorm"], "pre_bn"),
                                             (["norm=pre_bn", "norm.affine=false"], "pre_bn_noaffine")])
def test_batchnorm_trains_end_to_end(overrides, name, run_dir, default_run):
    run_in_process([*FAST, *overrides], run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    assert_learned_and_changed(results, default_run)
    assert results["choices"]["norm"] == name
    assert results["choices"]["norm_type"] == "batchnorm"
    assert all(0 <= row["exact_match"] <= 1 for row in results["eval"])
    # The checkpoint holds the running statistics that evaluation used.
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert any(key.endswith("running_var") for key in state)


def test_the_pre_norm_score_bound_is_not_claimed_for_batchnorm():
    """The probe's bound needs every normalized token at most sqrt(d) |gain| long, which BatchNorm does not give."""
    from blocklab.analysis.probe import prenorm_score_bounds

    model = build_model(bn_cfg())
    layernorm_model = build_model(ModelConfig(vocab_size=20, max_len=32, d_model=16, n_layers=2, n_heads=2))
    with torch.no_grad():  # as the probe runs
        assert prenorm_score_bounds(model, model.blocks[0]) is None
        assert prenorm_score_bounds(layernorm_model, layernorm_model.blocks[0]) is not None


def test_measuring_a_step_leaves_the_running_statistics_as_evaluation_left_them():
    """costs.step_peak_bytes runs a training-mode step after evaluation: the model it leaves must be the one evaluated."""
    from blocklab.train.costs import step_peak_bytes

    model = build_model(ModelConfig(vocab_size=12, d_model=D, n_layers=1, n_heads=2, max_len=16,
                                    norm=NormConfig(type="batchnorm"))).eval()
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    ids = torch.randint(12, (2, 9), generator=torch.Generator().manual_seed(0))
    step_peak_bytes(model, {"input": ids[:, :-1], "target": ids[:, 1:]})
    assert before and all(torch.equal(buffer, before[name]) for name, buffer in model.named_buffers())
    assert not model.training
