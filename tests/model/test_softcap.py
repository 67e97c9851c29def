"""Soft-capping (Gemma 2: Gemma Team 2024, §2; google-deepmind/gemma, gemma/modules.py `Attention` and
gemma/transformer.py: `logits = tanh(logits / cap) * cap`, attention scores before the mask, final logits after the
head) and PaLM's z-loss (Chowdhery et al. 2022, §5: 1e-4 * log^2 Z), each against its formula on a case computed
here by hand from the same tensors."""
import math

import pytest
import torch

from blocklab.experiment import Setup
from blocklab.model import build_model
from blocklab.tasks.base import IGNORE
from blocklab.train.module import LitTransformer
from conftest import compose_config
from helpers import tokens
from variants import tiny_cfg


def gemma_attention(q, k, v, scale, cap):
    """gemma/modules.py Attention.__call__, its scores to the weighted values, written in torch for one causal
    sequence: logits = q k^T * scale (gemma scales q first); tanh(logits / cap) * cap; the causal mask; softmax."""
    logits = torch.einsum("bhtd,bhsd->bhts", q * scale, k)
    logits = torch.tanh(logits / cap) * cap
    t = logits.shape[-1]
    logits = torch.where(torch.ones(t, t, dtype=torch.bool).tril(), logits, torch.finfo(logits.dtype).min)
    return torch.einsum("bhts,bhsd->bhtd", logits.softmax(-1), v)


def test_capped_attention_matches_gemma_on_the_same_projections():
    model = build_model(tiny_cfg(pos="none", n_layers=1, softcap=2.0)).double().eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    q, k, v = (attn._heads(part) for part in attn.qkv_proj(x).split(attn.qkv_sizes, dim=-1))
    expected = attn.out_proj(gemma_attention(q, k, v, attn.scale, 2.0).transpose(1, 2).flatten(2))
    from blocklab.model.mask import self_attention_context

    ctx = self_attention_context(x[..., 0].long(), None, None, None, model.pos, True, model.pattern, False)
    torch.testing.assert_close(attn(x, ctx), expected, rtol=1e-10, atol=1e-12)


def test_a_large_cap_is_the_uncapped_model_and_a_small_one_is_not():
    idx = tokens((2, 9))
    torch.manual_seed(0)
    plain = build_model(tiny_cfg()).double().eval()
    for cap, close in ((1e6, True), (0.5, False)):
        torch.manual_seed(0)
        capped = build_model(tiny_cfg(softcap=cap)).double().eval()
        with torch.no_grad():
            same = torch.allclose(capped(idx), plain(idx), rtol=1e-9, atol=1e-9)
        assert same is close


def test_output_logits_are_capped_by_the_formula():
    idx = tokens((2, 7))
    torch.manual_seed(1)
    plain = build_model(tiny_cfg(std=2.0)).double().eval()
    torch.manual_seed(1)
    capped = build_model(tiny_cfg(std=2.0, logit_softcap=3.0)).double().eval()
    with torch.no_grad():
        raw, out = plain(idx), capped(idx)
    assert raw.abs().max() > 3  # the cap has something to do
    torch.testing.assert_close(out, 3.0 * torch.tanh(raw / 3.0), rtol=1e-12, atol=1e-12)
    assert out.abs().max() < 3


@pytest.mark.parametrize("weight", [0.0, 1e-4, 0.5])
def test_z_loss_is_the_weight_times_mean_squared_log_normalizer(weight):
    setup = Setup.from_config(compose_config(["logger=none", "diagnostics=none", "model.d_model=32",
                                              "task.batch_size=4", f"optim.z_loss={weight}"]))
    torch.manual_seed(0)
    lit = LitTransformer(setup.model_cfg, setup.config["optim"]).double()
    batch = next(iter(setup.task.train_batches(0)))
    loss, _, z_loss = lit.losses(batch)
    if weight == 0:
        assert z_loss is None
        return
    logits = lit.model(batch["input"]).flatten(0, 1)[batch["target"].flatten() != IGNORE]
    by_hand = [math.log(sum(math.exp(z) for z in row)) ** 2 for row in logits.tolist()]
    assert z_loss.item() == pytest.approx(weight * sum(by_hand) / len(by_hand), rel=1e-9)
    lit.model.zero_grad()
    z_loss.backward()
    assert lit.model.tok_emb.weight.grad.abs().sum() > 0  # it trains the model


def test_refusals_are_one_line_each():
    from blocklab.model.config import AttnConfig, ModelConfig

    gla = ModelConfig(attn=AttnConfig(kind="gla", softcap=50.0)).errors()
    assert len(gla) == 1 and "attn.softcap" in gla[0] and "attn.kind=gla" in gla[0]
    window = ModelConfig(attn=AttnConfig(window=4, softcap=50.0)).errors()
    assert len(window) == 1 and "attn.pattern=window" in window[0]
    negative = ModelConfig(attn=AttnConfig(softcap=-1.0)).errors()
    assert len(negative) == 1 and "attn.softcap" in negative[0]
    assert "model.logit_softcap" in ModelConfig(logit_softcap=0.0).errors()[0]
