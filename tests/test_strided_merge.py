"""The strided pattern's merged kernel (patterns.Strided.merged): the strided part written out, the local
part in window's fused blocked SDPA with one sink key per block whose score is the strided part's
log-sum-exp, equals one softmax over the union of both key sets: outputs and gradients (against the
one-softmax kernel, a dense masked softmax and finite differences), queries without a strided key,
large scores in float32, and the local part's scores never held for the backward."""
import pytest
import torch

from blocklab.model.patterns import ATTENTION_PATTERNS
from helpers import dense_attention

# (stride, window): window shorter than, equal to and longer than the stride.
SHAPES = [(3, 2), (4, 4), (2, 5), (5, 3)]


def strided(stride, window):
    return ATTENTION_PATTERNS["strided"](stride=stride, window=window)


def union_reference(q, k, v, pattern, causal, scale):
    """softmax over every key the pattern allows (causal: and no later one), written out densely."""
    index = torch.arange(q.shape[2])
    return dense_attention(q, k, v, scale, pattern.support(index, index, causal))


def inputs(length, kv_heads=2, heads=4, dim=6, batch=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=g, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=g, dtype=dtype, requires_grad=True) for _ in "kv")
    return q, k, v


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("length", [6, 12, 17, 31])
@pytest.mark.parametrize("stride, window", SHAPES, ids=[f"s{s}-w{w}" for s, w in SHAPES])
def test_merge_equals_one_softmax_over_the_union(stride, window, length, causal, kv_heads):
    pattern = strided(stride, window)
    q, k, v = inputs(length, kv_heads, seed=length)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    outs, grads = [], []
    for fn in (lambda: pattern.merged(q, k, v, causal, 0.4), lambda: pattern.one_softmax(q, k, v, causal, 0.4, 0.0),
               lambda: union_reference(q, k, v, pattern, causal, 0.4)):
        out = fn()
        outs.append(out)
        grads.append(torch.autograd.grad((out * weight).sum(), (q, k, v)))
    for out, grad in zip(outs[1:], grads[1:]):
        torch.testing.assert_close(outs[0], out, rtol=1e-10, atol=1e-12)
        for merged, other in zip(grads[0], grad):
            torch.testing.assert_close(merged, other, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_merge_gradients_by_finite_differences(causal):
    pattern = strided(3, 2)
    q, k, v = inputs(11, kv_heads=1, heads=2, dim=3, batch=1, seed=5)
    assert torch.autograd.gradcheck(lambda q, k, v: pattern.merged(q, k, v, causal, 0.7), (q, k, v))


def test_queries_without_a_strided_key_get_the_local_attention_alone():
    """Causal queries i < 4 (stride 4, window 3: the nearest strided key is 4 back) have no key of their
    class beyond the local block: their sink is masked out, so they equal the window pattern's output,
    and no gradient is NaN."""
    pattern, window = strided(4, 3), ATTENTION_PATTERNS["window"](window=3)
    q, k, v = inputs(20, seed=3)
    out = pattern.merged(q, k, v, True, 0.5)
    local = window.attend(q, k, v, True, 0.5, 0.0)
    torch.testing.assert_close(out[:, :, :4], local[:, :, :4], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out[:, :, 4], local[:, :, 4])  # query 4 also sees key 0
    assert all(g.isfinite().all() for g in torch.autograd.grad(out.sum(), (q, k, v)))


def test_large_scores_stay_accurate_in_float32():
    """The strided part's log-sum-exp enters the fused kernel as a score, which subtracts its running max."""
    pattern = strided(4, 4)
    q, k, v = inputs(40, seed=7, dtype=torch.float32)
    with torch.no_grad():
        q.mul_(12)
    out = pattern.merged(q, k, v, True, 0.5)
    exact = union_reference(*(x.double() for x in (q, k, v)), pattern, True, 0.5)
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), exact, rtol=1e-4, atol=1e-4)


def test_attend_merges_without_dropout_and_takes_one_softmax_with_it():
    pattern = strided(3, 2)
    q, k, v = inputs(14, seed=2)
    assert torch.equal(pattern.attend(q, k, v, True, 0.4, 0.0), pattern.merged(q, k, v, True, 0.4))
    torch.manual_seed(11)
    dropped = pattern.attend(q, k, v, True, 0.4, 0.3)
    torch.manual_seed(11)
    assert torch.equal(dropped, pattern.one_softmax(q, k, v, True, 0.4, 0.3))


def test_the_local_scores_are_never_held_for_the_backward():
    """What autograd keeps is about linear in n: no (H, n, 2w - 1) local score tensor, only the fused
    kernel's inputs, its block mask (shared by the heads) and the strided part's H n^2/s scores."""
    heads, length, window = 4, 512, 32
    pattern = strided(window, window)
    q, k, v = inputs(length, kv_heads=heads, heads=heads, dim=8, batch=1, dtype=torch.float32)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pattern.merged(q, k, v, True, 0.3)
    assert max(sizes) < heads * length * window  # the local scores alone would be heads * length * (2w - 1)
