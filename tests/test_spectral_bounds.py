"""Seed 000's claim about attention's spectral norm (sources/000: 1 <= ||A||_2 <= sqrt(n) for any row-stochastic A;
under pre-norm ||A||_2 <= sqrt(n / (1 + (n - 1) exp(-2M))), M = Gamma^2 sigma_Q sigma_K sqrt(d)), checked against
the math and on 24-layer models at init."""
import math

import pytest
import torch
import torch.nn.functional as F

from blocklab.analysis import metrics
from blocklab.analysis.probe import forward_stats, prenorm_score_bounds
from blocklab.model import ModelConfig, Transformer
from blocklab.model.config import AttnConfig, InitConfig, NormConfig, PosConfig
from helpers import masked_softmax


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def test_with_every_key_allowed_the_masked_bound_is_the_seed_formula():
    n, scores = 9, torch.tensor([0.0, 0.3, 1.0, 4.0])
    support = torch.ones(2, 4, n, n, dtype=torch.bool)
    expected = [metrics.prenorm_bound(n, float(m)) for m in scores]
    assert metrics.prenorm_bound_masked(support, scores).tolist() == pytest.approx(expected)


def test_equal_causal_scores_reach_the_harmonic_column_not_one():
    """At M = 0 each query spreads evenly over its i + 1 keys: the first column sums to H_n, the bound is sqrt(H_n).
    The unmasked formula gives 1, below the uniform causal matrix's own norm."""
    n = 12
    support = causal(n)[None, None]
    a = masked_softmax(torch.zeros(1, 1, n, n), support)
    harmonic = sum(1 / k for k in range(1, n + 1))
    assert metrics.prenorm_bound_masked(support, torch.zeros(1)).item() == pytest.approx(math.sqrt(harmonic))
    assert float(a[0, 0].sum(0).max()) == pytest.approx(harmonic)  # the bound's column sum is attained
    assert metrics.spectral_norms(a).item() > 1.2 > metrics.prenorm_bound(n, 0.0)


@pytest.mark.parametrize("m", [0.05, 0.5, 2.0])
def test_random_scores_within_m_stay_under_the_masked_bound(m):
    """Any scores in [-M, M] under a causal or random mask (every query keeps a key): ||A||_2 <= the bound."""
    g = torch.Generator().manual_seed(0)
    n, heads = 16, 64
    scores = (2 * torch.rand(1, heads, n, n, generator=g) - 1) * m
    scores[..., 0] = m  # extremes on one column push its sum, the bound's worst case
    for support in (causal(n)[None, None].expand(1, heads, n, n),
                    (torch.rand(1, heads, n, n, generator=g) < 0.4) | torch.eye(n, dtype=torch.bool)):
        a = masked_softmax(scores, support)
        bound = metrics.prenorm_bound_masked(support, torch.full((heads,), m))
        assert (metrics.spectral_norms(a)[0] <= bound + 1e-9).all()
        assert (bound <= math.sqrt(n) + 1e-9).all()  # never looser than the generic bound


def spectral(task, placement: str, init: str, seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=task.vocab_size, max_len=64, n_layers=24, d_model=32, n_heads=4,
                                    norm=NormConfig(placement=placement), init=InitConfig(init)))
    return forward_stats(model, task.probe_batch(16))["layers"]


@pytest.mark.parametrize("seed", [0, 1])
def test_post_ln_attention_norm_rises_with_depth_at_init(copy_task, seed):
    """Post-LN's first layer sees the raw embeddings (Xavier: small), scores ~ 0, so its heads are the uniform causal
    matrix (||A||_2 = 1.542 at n = 33); deeper layers see LayerNorm's unit-RMS output and attend more sharply.
    Measured: deepest layer 1.89 / 1.84 (seeds 0 / 1), peaks 2.2-2.4, sqrt(n) = 5.74."""
    layers = spectral(copy_task, "post", "xavier", seed)
    first, deepest = max(layers[0]["spectral_norm_max"]), max(layers[-1]["spectral_norm_max"])
    assert deepest > 1.1 * first
    assert all(layer["spectral_prenorm_bound"] is None for layer in layers)  # the theorem is about pre-norm inputs
    n = layers[0]["spectral_generic_bound"][1]
    assert all(1 - 1e-9 <= s <= n + 1e-9 for layer in layers for s in layer["spectral_norm_max"])


@pytest.mark.parametrize("init", ["normal", "xavier"])
def test_pre_ln_attention_norm_stays_under_its_computed_bound_at_init(copy_task, init):
    """Every head of every layer of a 24-layer pre-LN model within the bound computed from its Gamma, sigma_Q, sigma_K.
    With N(0, 0.02) weights the bound (about 2.4 at n = 33) is informative; with Xavier it is about sqrt(n)."""
    layers = spectral(copy_task, "pre", init)
    for layer in layers:
        assert all(s <= b + 1e-9 for s, b in zip(layer["spectral_norm_max"], layer["spectral_prenorm_bound"]))
    if init == "normal":
        n = layers[0]["spectral_generic_bound"][1]
        assert max(max(layer["spectral_prenorm_bound"]) for layer in layers) < 0.5 * n  # not the generic bound


def perturb_as_trained(model, seed: int, weight_std: float) -> None:
    """What training does to the quantities the bound reads, drawn at random: norm gains away from 1 (either sign),
    non-zero norm shifts and projection biases, and projection weights of another scale."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            norm = block.attn_residual.norm_in
            norm.weight.copy_((torch.rand(norm.weight.shape, generator=g) * 1.5 + 0.5)
                              * torch.randint(0, 2, norm.weight.shape, generator=g).mul(2).sub(1))
            if getattr(norm, "bias", None) is not None:
                norm.bias.copy_(0.3 * torch.randn(norm.bias.shape, generator=g))
            for name in ("q", "k"):
                weight, bias = block.attn.projection(name)
                weight.copy_(weight_std * torch.randn(weight.shape, generator=g))
                bias.copy_(0.1 * torch.randn(bias.shape, generator=g))


@pytest.mark.parametrize("weight_std", [0.01, 0.3], ids=["informative", "loose"])
@pytest.mark.parametrize("norm_type, n_kv_heads", [("layernorm", None), ("rmsnorm", None), ("layernorm", 2)],
                         ids=["ln", "rms", "ln-gqa"])
def test_pre_norm_bound_holds_with_trained_like_gains_and_biases(copy_task, norm_type, n_kv_heads, weight_std):
    """The report applies the bound to trained models, whose gains are not 1 and biases not 0. Written out here
    from the layer's parameters: the normalized input, each head's scores (which must lie within the M the probe
    computed) and weights (which must be the model's own), and ||A||_2 as the spectral norm of the Jacobian of
    the head's output A v with respect to its values v, computed by autograd."""
    from torch.func import jacrev

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=copy_task.vocab_size, max_len=64, n_layers=3, d_model=32, n_heads=4,
                                    attn=AttnConfig(n_kv_heads=n_kv_heads), norm=NormConfig(type=norm_type, placement="pre"),
                                    pos=PosConfig("none"))).double()
    perturb_as_trained(model, seed=1, weight_std=weight_std)
    inputs = {}
    hooks = [b.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0].detach()))
             for i, b in enumerate(model.blocks)]
    stats = forward_stats(model, copy_task.probe_batch(4), keep_weights=False)
    batch = copy_task.probe_batch(4)
    with torch.no_grad():
        _, model_weights = model.eval()(batch["input"], need_weights=True)
    for hook in hooks:
        hook.remove()
    n = batch["input"].shape[1]
    causal_keys = torch.ones(n, n, dtype=torch.bool).tril()
    for i, (block, layer) in enumerate(zip(model.blocks, stats["layers"])):
        attn, norm = block.attn, block.attn_residual.norm_in
        with torch.no_grad():
            x = inputs[i]
            xn = (F.layer_norm(x, (32,), norm.weight, norm.bias, norm.eps) if norm_type == "layernorm" else
                  F.rms_norm(x, (32,), norm.weight, norm.eps))
            kv_of = [h * attn.n_kv_heads // attn.n_heads for h in range(attn.n_heads)]
            (w_q, b_q), (w_k, b_k) = attn.projection("q"), attn.projection("k")
            q = (xn @ w_q.T + b_q).unflatten(-1, (attn.n_heads, attn.d_head)).transpose(1, 2)
            k = (xn @ w_k.T + b_k).unflatten(-1, (attn.n_kv_heads, attn.d_head)).transpose(1, 2)[:, kv_of]
            scores = attn.scale * q @ k.transpose(-1, -2)
            weights = masked_softmax(scores, causal_keys)
            m = prenorm_score_bounds(model, block)
        torch.testing.assert_close(weights, model_weights[i].double(), rtol=1e-9, atol=1e-12)
        assert all(float(scores[:, h].masked_select(causal_keys).abs().max()) <= m[h] for h in range(attn.n_heads))
        for h, bound in enumerate(layer["spectral_prenorm_bound"]):
            for row in weights[:, h]:  # each example's (n, n) matrix, against the head's bound
                v = torch.randn(n, attn.d_head, dtype=torch.float64, generator=torch.Generator().manual_seed(h))
                jacobian = jacrev(lambda v: row @ v)(v).reshape(n * attn.d_head, n * attn.d_head)
                assert float(torch.linalg.matrix_norm(jacobian, ord=2)) <= bound + 1e-9
        if weight_std == 0.01:  # small scores: the bound says more than the generic sqrt(n)
            assert max(layer["spectral_prenorm_bound"]) < 0.9 * math.sqrt(n)
