"""What a decoding cache holds (DecodingCache.total_bytes: the layers' states, cross-attention K/V, the
held keys' positions and padding flags): the same for linear kinds however long the generation (their
running states keep no keys, so the cache keeps the newest key's position alone), growing linearly for
full softmax, and w keys for a window."""
import pytest
import torch

from blocklab.model import ModelConfig, build_model
from blocklab.model.cache import DecodingCache
from blocklab.model.config import AttnConfig, PosConfig
from blocklab.model.generate import generate

V, BATCH, PROMPT = 20, 2, 4


def make_model(kind="softmax", pos="rope", **attn):
    cfg = ModelConfig(vocab_size=V, max_len=520, d_model=16, n_layers=2, n_heads=2, pos=PosConfig(pos),
                      attn=AttnConfig(kind=kind, **attn))
    assert cfg.errors() == []
    torch.manual_seed(0)
    return build_model(cfg).double().eval()


def decoded(model, length: int, valid=None) -> DecodingCache:
    """The cache after a PROMPT-token prompt and greedy steps up to `length` tokens."""
    cache = model.new_cache()
    prompt = torch.randint(V, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    positions = None if valid is None else (valid.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(prompt, positions, valid, cache)
        while cache.next_index < length:
            logits = model(logits[:, -1:].argmax(-1), cache=cache)
    assert cache.next_index == length
    return cache


@pytest.mark.parametrize("kind", ["linear", "performer"])
def test_a_running_state_holds_the_same_bytes_at_64_and_512_tokens(kind):
    model = make_model(kind)
    assert not model.new_cache().keeps_keys
    short, long = decoded(model, 64), decoded(model, 512)
    assert long.total_bytes() == short.total_bytes() > long.bytes() > 0  # the positions counted too
    assert long.positions.shape == (BATCH, 1) and long.length == 1 and long.keys == []
    assert torch.equal(long.positions, torch.full((BATCH, 1), 511))


def test_padding_flags_are_kept_for_the_newest_key_alone():
    model = make_model("linear")
    valid = torch.ones(BATCH, PROMPT, dtype=torch.bool)
    valid[0, :2] = False  # left padding
    short, long = decoded(model, 64, valid), decoded(model, 512, valid)
    assert long.valid.shape == (BATCH, 1) and long.total_bytes() == short.total_bytes()
    assert long.positions.tolist() == [[509], [511]]  # row 0 starts counting after its padding


def test_a_kv_cache_grows_linearly_with_its_positions():
    model = make_model("softmax")
    assert model.new_cache().keeps_keys
    short, long = decoded(model, 64), decoded(model, 512)
    assert long.total_bytes() == 8 * short.total_bytes()
    assert long.total_bytes() - long.bytes() == BATCH * 512 * 8  # int64 positions, no padding flags
    assert {k.shape[2] for k in long.keys} == {512}


def test_a_window_cache_stays_at_w_keys():
    model = make_model("softmax", window=16)
    short, long = decoded(model, 64), decoded(model, 512)
    assert {k.shape[2] for k in long.keys} == {16} and long.positions.shape == (BATCH, 16)
    assert long.total_bytes() == short.total_bytes()


@pytest.mark.parametrize("kind", ["linear", "performer"])
def test_long_generation_through_the_state_equals_recomputation(kind):
    """Padded prompts of different lengths, 40 new tokens: the cache's one held position carries on."""
    model = make_model(kind)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, V, (n,), generator=g) for n in (3, 7, 5)]
    cached = generate(model, prompts, max_new_tokens=40)
    assert torch.equal(cached, generate(model, prompts, max_new_tokens=40, use_cache=False))


class Running:
    """A layer state that keeps no keys (as linear attention's): it cannot drop any."""

    def bytes(self):
        return 0

    def drop_oldest(self, count):
        raise AssertionError("no keys to drop")


def test_a_cache_without_keys_keeps_the_newest_position_and_drops_nothing_from_its_layers():
    cache = DecodingCache(keeps_keys=False)
    cache.state(0, Running)
    cache.commit(torch.arange(5).expand(2, 5), None)
    assert (cache.start, cache.length, cache.next_index) == (4, 1, 5)
    positions, valid = cache.with_new_keys(torch.full((2, 1), 5), torch.tensor([[True], [False]]))
    assert positions.tolist() == [[4, 5], [4, 5]] and valid.tolist() == [[True, True], [True, False]]
    cache.commit(positions, valid)
    assert cache.positions.tolist() == [[5], [5]] and cache.valid.tolist() == [[True], [False]]
    assert cache.total_bytes() == 2 * 8 + 2 * 1
