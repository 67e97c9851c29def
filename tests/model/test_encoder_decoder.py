"""The original Transformer: bidirectional encoder, causal decoder, cross-attention over the whole source."""
import pytest
import torch

from blocklab.model.generate import generate
from variants import SCHEMES, tiny_model



def make(pos="rope", **attn):
    return tiny_model(pos, arch="encoder_decoder", vocab_size=17, max_len=40, std=None, **attn)


@pytest.mark.parametrize("pos", SCHEMES)
def test_encoder_is_not_causal(pos):
    model = make(pos)
    source = torch.randint(3, 17, (2, 9))
    changed = source.clone()
    changed[:, -1] = (changed[:, -1] + 1 - 3) % 14 + 3
    first = model.encode(source)[:, 0]
    assert not torch.allclose(first, model.encode(changed)[:, 0])


@pytest.mark.parametrize("pos", SCHEMES)
def test_decoder_is_causal_and_cross_attention_sees_the_whole_source(pos):
    model = make(pos)
    source, target = torch.randint(3, 17, (2, 9)), torch.randint(3, 17, (2, 6))
    logits = model(target, source=source)
    later = target.clone()
    later[:, 4:] = (later[:, 4:] + 5 - 3) % 14 + 3
    assert torch.allclose(model(later, source=source)[:, :4], logits[:, :4])  # earlier outputs unchanged
    last_source = source.clone()
    last_source[:, -1] = (last_source[:, -1] + 1 - 3) % 14 + 3
    assert not torch.allclose(model(target, source=last_source)[:, 0], logits[:, 0])  # first step sees the end


def test_source_padding_is_not_attended():
    model = make("rope")
    source, target = torch.randint(3, 17, (1, 6)), torch.randint(3, 17, (1, 4))
    alone = model(target, source=source)
    padded = torch.cat((source, torch.zeros(1, 3, dtype=torch.long)), dim=1)
    valid = torch.arange(9)[None] < 6
    assert torch.allclose(model(target, source=padded, source_valid=valid), alone, atol=1e-10)


@pytest.mark.parametrize("pos", SCHEMES)
@pytest.mark.parametrize("attn", [{}, {"n_kv_heads": 2}, {"n_kv_heads": 1}, {"window": 3}])
def test_cached_generation_equals_recomputation(pos, attn):
    model = make(pos, **attn)
    prompts = [torch.randint(3, 17, (n,)) for n in (4, 7, 5)]
    cached = generate(model, prompts, 10, bos_id=2, use_cache=True)
    full = generate(model, prompts, 10, bos_id=2, use_cache=False)
    assert torch.equal(cached, full)
    for row, prompt in enumerate(prompts):  # and each row as if alone
        assert torch.equal(generate(model, [prompt], 10, bos_id=2)[0], cached[row])


def test_cross_attention_keys_are_computed_once_per_source():
    model = make("rope", n_kv_heads=2)
    cache = model.new_cache()
    source = torch.randint(3, 17, (2, 7))
    model(torch.full((2, 1), 2), cache=cache, source=source)
    k, v = cache.cross[0]
    assert k.shape == (2, 2, 7, 8)  # (batch, kv heads, source length, head dim)
    model(torch.full((2, 1), 5), cache=cache)  # no source needed any more
    assert cache.cross[0][0] is k
