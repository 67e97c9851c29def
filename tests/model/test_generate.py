"""Decoding: the KV cache changes nothing but speed, left-padded batches decode each row as alone,
and local attention's cache never holds more than the window."""
import pytest
import torch

from blocklab.model.generate import generate
from helpers import assert_cached_steps_equal_full, greedy_reference
from variants import SCHEMES, VARIANTS, tiny_model

V = 20


def make_model(pos="rope", seed=0, **attn):
    return tiny_model(pos, seed, vocab_size=V, std=0.3, tie_embeddings=False, **attn)


def make_prompts(lengths=(3, 7, 5), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pos", SCHEMES)
def test_cache_gives_the_same_tokens(pos, variant):
    model = make_model(pos, **VARIANTS[variant])
    prompts = make_prompts()
    cached = generate(model, prompts, max_new_tokens=8, use_cache=True)
    uncached = generate(model, prompts, max_new_tokens=8, use_cache=False)
    assert cached.shape == (3, 8)
    assert torch.equal(cached, uncached)
    for row, prompt in enumerate(prompts):
        assert torch.equal(cached[row], greedy_reference(model, prompt, 8)), f"row {row}"
    assert len(set(cached.flatten().tolist())) > 1  # not a degenerate constant output


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pos", ["rope", "alibi", "t5_bias"])
def test_cached_logits_match_full_forward(pos, variant):
    """Step-by-step logits with the cache equal the logits of one full forward pass, and the cache
    of local attention never holds more than `window` keys."""
    model = make_model(pos, **VARIANTS[variant])
    window = VARIANTS[variant].get("window")
    def within_the_window(cache, t):
        held = [t + 1 if window is None else min(t + 1, window)] * len(cache.keys)
        assert [k.shape[2] for k in cache.keys] == [v.shape[2] for v in cache.values] == held

    idx = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(3))
    assert_cached_steps_equal_full(model, idx, prefix=5, after_step=within_the_window)


@pytest.mark.parametrize("pos", SCHEMES)
def test_local_cache_never_exceeds_the_window(pos):
    model = make_model(pos, window=3)
    cache = model.new_cache()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        model(torch.randint(0, V, (2, 6), generator=g), positions=torch.arange(6).expand(2, 6), cache=cache)
        for _ in range(10):
            assert len(cache.keys) == 2
            for k, v in zip(cache.keys, cache.values):
                assert k.shape == v.shape == (2, 4, 3, 8)
            model(torch.randint(0, V, (2, 1), generator=g), cache=cache)


def test_eos_stops_a_row_and_pads_after_it():
    model = make_model("rope")
    prompts = make_prompts()
    free = generate(model, prompts, max_new_tokens=8)
    eos = int(free[0, 2])
    first = (free[0] == eos).nonzero()[0, 0]  # where row 0 first emits it
    out = generate(model, prompts, max_new_tokens=8, eos_id=eos, pad_id=0)
    assert torch.equal(out[0, :first + 1], free[0, :first + 1])
    assert bool((out[0, first + 1:] == 0).all())
    for row in range(3):
        hits = (free[row] == eos).nonzero()
        stop = int(hits[0, 0]) + 1 if len(hits) else out.shape[1]
        assert torch.equal(out[row, :stop], free[row, :stop])
        assert bool((out[row, stop:] == 0).all())


def test_a_row_cannot_end_before_its_min_new_tokens():
    model = make_model("rope")
    prompts = make_prompts()
    eos = int(generate(model, prompts, max_new_tokens=1)[0, 0])  # row 0 would end at once
    minimum = torch.tensor([5, 0, 3])
    out = generate(model, prompts, max_new_tokens=8, eos_id=eos, pad_id=0, min_new_tokens=minimum)
    for row, prompt in enumerate(prompts):
        expected = greedy_reference(model, prompt, 8, eos=eos, min_new=int(minimum[row]))
        hits = (expected == eos).nonzero()
        stop = int(hits[0, 0]) + 1 if len(hits) else len(expected)
        assert torch.equal(out[row, :stop], expected[:stop]) and bool((out[row, stop:] == 0).all())
        assert eos not in out[row, :int(minimum[row])].tolist()
    assert out[1].tolist() == generate(model, prompts, max_new_tokens=8, eos_id=eos, pad_id=0)[1].tolist()


def test_generation_ends_when_every_row_has_emitted_eos():
    model = make_model("rope")
    prompts = make_prompts()
    free = generate(model, prompts, max_new_tokens=8)
    eos = int(free[1, 0])
    firsts = [int((row == eos).nonzero()[0, 0]) if bool((row == eos).any()) else 8 for row in free]
    out = generate(model, prompts, max_new_tokens=8, eos_id=eos)
    assert out.shape == (3, max(firsts) + 1 if max(firsts) < 8 else 8)
    alone = generate(model, prompts[1:2], max_new_tokens=8, eos_id=eos)
    assert alone.tolist() == [[eos]]  # its first token: nothing decoded after


def test_decoding_uses_native_kernels_and_restores_the_setting():
    """Decoding turns oneDNN off (its per-call set-up costs more than a step's tiny ops) without
    changing results, and leaves torch's setting as it found it, also when decoding fails."""
    from blocklab.model.generate import decoding

    model = make_model("rope").float()
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(idx)
    before = torch.backends.mkldnn.enabled
    with decoding():
        assert not torch.backends.mkldnn.enabled and torch.is_inference_mode_enabled()
        torch.testing.assert_close(model(idx), reference, rtol=1e-5, atol=1e-6)
    assert torch.backends.mkldnn.enabled == before
    with pytest.raises(IndexError):
        generate(model, [torch.tensor([V + 5])], max_new_tokens=2)  # a token past the vocabulary
    assert torch.backends.mkldnn.enabled == before
