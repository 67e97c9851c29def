"""FIRE (Li et al. 2023, arXiv 2310.04418) checked against its definition
    bias_h(i, j) = f_theta(psi(i - j) / psi(max(L, i)))_h,  psi(x) = log(c x + 1),  f_theta(x) = W2 relu(w1 x + b1),
on arbitrary position tensors, its gradients by finite differences, and a model using it: causal,
cached decoding equal to recomputation, trained end to end, and its config errors."""
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blocklab.model import ModelConfig, build_model
from blocklab.model.config import AttnConfig, PosConfig
from blocklab.model.generate import generate
from blocklab.model.position_bias import FIRE
from blocklab.results import read_results
from blocklab.train.run import prepare
from conftest import FAST, compose_config, run_cli, run_in_process
from helpers import assert_cached_steps_equal_full, assert_learned_and_changed, refused

sys.path.insert(0, str(Path(__file__).parent / "model"))
from variants import tiny_cfg, tiny_model  # noqa: E402  (the model tests' tiny-model factory)

H = 4


def fire(dtype=torch.float64, seed=0, **options) -> FIRE:
    torch.manual_seed(seed)
    return FIRE(d_model=32, n_heads=H, d_head=8, **options).to(dtype)


def by_definition(scheme: FIRE, i: int, j: int) -> torch.Tensor:
    """The paper's formula for one pair, written out with Python floats: (H,) float64. For j > i, the
    signed extension this scheme documents for non-causal attention."""
    c, L = abs(float(scheme.c.detach())), abs(float(scheme.L_scale.detach())) * scheme.init_L
    psi = lambda x: math.log(c * x + 1)  # noqa: E731
    x = math.copysign(psi(abs(i - j)), i - j) / psi(max(L, i))
    hidden = torch.relu(scheme.w1.detach().double()[:, 0] * x + scheme.b1.detach().double())
    return scheme.w2.detach().double() @ hidden


def random_positions(shape, high, seed):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ the bias itself

@pytest.mark.parametrize("options, after", [({}, True), (dict(init_c=1.0, init_L=1.0), False)],
                         ids=["paper_init", "c1_L1"])
def test_bias_at_init_is_finite_for_every_distance_and_query_position(options, after):
    """Every query 0..4096 against every key before it (every causal distance 0..4096), in float32 as
    models train, position 0 included; with the paper's init also against the keys
    after it, which a non-causal model sees."""
    scheme = fire(torch.float32, **options)
    with torch.no_grad():
        for start in range(0, 4097, 128):
            queries = torch.arange(start, min(start + 128, 4097))[None]
            keys = torch.arange(4097 if after else int(queries.max()) + 1)[None]
            bias = scheme.bias(queries, keys)
            assert bias.shape == (1, H, queries.shape[1], keys.shape[1])
            assert bool(bias.isfinite().all()), f"queries {start}.."


@pytest.mark.parametrize("options", [{}, dict(init_c=0.7, init_L=6.5)], ids=["paper_init", "small_L"])
def test_bias_is_the_published_formula(options):
    scheme = fire(**options)
    q = torch.tensor([[0, 3, 7, 12, 40, 300, 1000, 5]])
    k = torch.tensor([[0, 2, 7, 11, 39, 0, 640, 9, 1000]])
    bias = scheme.bias(q, k)
    assert bias.shape == (1, H, 8, 9)
    for a, i in enumerate(q[0].tolist()):
        for b, j in enumerate(k[0].tolist()):
            torch.testing.assert_close(bias[0, :, a, b], by_definition(scheme, i, j), rtol=1e-5, atol=1e-6)


def test_bias_depends_only_on_the_distance_and_the_query_position():
    """Arbitrary positions (unsorted, repeated, per row, far beyond 0..T-1): entries with equal (i - j, i)
    are equal, wherever they sit in the tensors; equal distances at different queries past L are not."""
    scheme = fire(init_L=16.0)
    q = torch.cat([random_positions((3, 40), 30, seed=1), torch.tensor([[20, 100, 1000, 4000]] * 3)], dim=1)
    k = torch.cat([random_positions((3, 50), 30, seed=2), torch.tensor([[15, 95, 995, 3995]] * 3)], dim=1)
    with torch.no_grad():
        bias = scheme.bias(q, k)
    assert bias.shape == (3, H, 44, 54)
    seen, repeats = {}, 0
    for row in range(3):
        for a, i in enumerate(q[row].tolist()):
            for b, j in enumerate(k[row].tolist()):
                repeats += (i - j, i) in seen
                first = seen.setdefault((i - j, i), bias[row, :, a, b])
                torch.testing.assert_close(bias[row, :, a, b], first, rtol=1e-6, atol=1e-7)
    assert repeats > 3000  # most of the 3 * 44 * 54 entries repeat a pair met elsewhere
    # distance 5 at queries 20, 100, 1000, 4000 (all past L = 16): the normaliser psi(i) differs
    at_five = [seen[(5, i)] for i in (20, 100, 1000, 4000)]
    for one, other in zip(at_five, at_five[1:]):
        assert (one - other).abs().max() > 1e-4


def test_below_the_threshold_every_query_shares_one_normaliser():
    """max(L, i) = L for every query before L: there the bias is a function of i - j alone."""
    scheme = fire(init_L=64.0)
    with torch.no_grad():
        near = scheme.bias(torch.tensor([[10, 30, 63]]), torch.tensor([[7, 27, 60]]))
        far = scheme.bias(torch.tensor([[200]]), torch.tensor([[197]]))
    torch.testing.assert_close(near[0, :, 1, 1], near[0, :, 0, 0])
    torch.testing.assert_close(near[0, :, 2, 2], near[0, :, 0, 0])
    assert (far[0, :, 0, 0] - near[0, :, 0, 0]).abs().max() > 1e-4


def test_non_causal_bias_tells_keys_before_from_keys_after():
    """The signed extension: a key d after the query is not the key d before it (f_theta at -x and x)."""
    scheme = fire(causal=False)
    with torch.no_grad():
        bias = scheme.bias(torch.tensor([[10]]), torch.tensor([[7, 13]]))
    assert bool(bias.isfinite().all())
    assert (bias[0, :, 0, 0] - bias[0, :, 0, 1]).abs().max() > 1e-4


def test_remembered_geometry_never_holds_trained_values():
    """The same positions after a parameter update give the updated formula, not a remembered bias."""
    scheme = fire(init_L=4.0)
    q = k = torch.arange(12)[None]
    before = scheme.bias(q, k).detach()
    with torch.no_grad():
        scheme.c.mul_(3)
        scheme.L_scale.mul_(2)
        scheme.w2.add_(0.5)
    after = scheme.bias(q, k)
    assert (after - before).abs().max() > 1e-3
    scheme.memo.entries.clear()
    torch.testing.assert_close(after, scheme.bias(q, k), rtol=0, atol=0)
    torch.testing.assert_close(after[0, :, 9, 2], by_definition(scheme, 9, 2), rtol=1e-6, atol=1e-7)


def test_under_bf16_autocast_the_bias_is_computed_in_float32():
    """Nearby normalised distances differ by less than bfloat16 resolves: the bias ignores autocast."""
    scheme = fire(torch.float32)
    q = k = torch.arange(300)[None]
    with torch.no_grad():
        expected = scheme.bias(q, k)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = scheme.bias(q, k)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ gradients

class BiasOf(torch.nn.Module):
    def __init__(self, scheme, q, k):
        super().__init__()
        self.scheme, self.q, self.k = scheme, q, k

    def forward(self):
        return self.scheme.bias(self.q, self.k)


@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match_finite_differences(causal):
    """d bias / d (c, L, f_theta's weights and biases) against numerical derivatives, with queries on both
    sides of L (where L is the normaliser, and where the query position is)."""
    scheme = fire(causal=causal, init_c=0.3, init_L=6.5)
    q = torch.tensor([[0, 2, 5, 9, 14, 30]])
    k = torch.tensor([[0, 1, 4, 9, 13, 20, 31]]) if not causal else torch.tensor([[0, 1, 2, 5, 9, 14]])
    module = BiasOf(scheme, q, k)
    names = [name for name, _ in module.named_parameters()]
    assert {name.split(".")[-1] for name in names} == {"c", "L_scale", "w1", "b1", "w2"}
    params = tuple(p.detach().clone().requires_grad_(True) for p in module.parameters())

    def bias(*values):
        return torch.func.functional_call(module, dict(zip(names, values)), ())

    assert torch.autograd.gradcheck(bias, params)


def test_a_models_loss_reaches_c_L_and_the_mlp_through_attention():
    """Through the trained-bias attention path (LearnedBiasAttention): the loss's derivative in c and L
    against finite differences, and every FIRE parameter gets a gradient."""
    model = tiny_model("fire", n_layers=2)
    idx = random_positions((2, 9), 20, seed=3)
    model(idx).pow(2).mean().backward()
    for name, param in model.pos.named_parameters():
        assert param.grad is not None and param.grad.abs().max() > 0, name

    def loss(c, L_scale):
        return torch.func.functional_call(model, {"pos.c": c, "pos.L_scale": L_scale}, (idx,)).pow(2).mean()

    params = tuple(p.detach().clone().requires_grad_(True) for p in (model.pos.c, model.pos.L_scale))
    assert torch.autograd.gradcheck(loss, params)


# ------------------------------------------------------------------------------------- a model

def test_changing_a_later_token_never_changes_earlier_logits():
    model = tiny_model("fire")
    idx = random_positions((2, 10), 20, seed=1)
    with torch.no_grad():
        base = model(idx)
        for t in (1, 4, 9):
            changed = idx.clone()
            changed[:, t:] = (idx[:, t:] + 1) % 20
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
            assert (out[:, t] - base[:, t]).abs().max() > 1e-4


def test_non_causal_model_runs_and_sees_later_tokens():
    model = tiny_model("fire", causal=False)
    idx = random_positions((2, 10), 20, seed=1)
    changed = idx.clone()
    changed[:, -1] = (idx[:, -1] + 1) % 20
    with torch.no_grad():
        base, out = model(idx), model(changed)
    assert bool(base.isfinite().all()) and (out[:, 0] - base[:, 0]).abs().max() > 1e-6


@pytest.mark.parametrize("init_L", [512.0, 3.0], ids=["paper_L", "L_below_the_sequence"])
def test_cached_decoding_equals_full_recomputation(init_L):
    """Step-by-step logits with the cache equal one full forward; generation with and without the cache
    (left-padded prompts of different lengths) gives the same tokens."""
    cfg = replace(tiny_cfg("fire", std=0.3, tie_embeddings=False), pos=PosConfig("fire", {"init_L": init_L}))
    torch.manual_seed(0)
    model = build_model(cfg).double().eval()
    assert model.pos.L == init_L
    assert_cached_steps_equal_full(model, random_positions((1, 12), 20, seed=3), prefix=5)
    prompts = [random_positions((n,), 20, seed=n) for n in (3, 7, 5)]
    cached = generate(model, prompts, max_new_tokens=8, use_cache=True)
    assert torch.equal(cached, generate(model, prompts, max_new_tokens=8, use_cache=False))
    assert len(set(cached.flatten().tolist())) > 1  # not a degenerate constant output


def test_cli_trains_pos_fire_end_to_end(tmp_path):
    """`python train.py pos=fire trainer=debug logger=none`, as a user types it."""
    run_dir = tmp_path / "fire"
    proc = run_cli(["pos=fire", "trainer=debug", "logger=none", "task.eval_examples=16", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = read_results(run_dir)
    assert results["status"] == "completed" and results["steps"] == 20
    assert results["choices"]["pos"] == "fire"
    assert math.isfinite(results["final_train_loss"]) and math.isfinite(results["final_val_loss"])


def test_trains_in_bf16_mixed_precision(tmp_path):
    """The loss falls in bf16 too, and bf16 is what ran: the same run in float32 gives another loss curve (one that
    ignored the setting would give the same, bit for bit), though one that starts at the same loss, to bf16's
    precision (8 bits of mantissa: a relative error of 2^-8 a rounding)."""
    runs = {}
    for precision in ("32-true", "bf16-mixed"):
        run_in_process([*FAST, "pos=fire", f"trainer.precision={precision}"], tmp_path / precision)
        runs[precision] = read_results(tmp_path / precision)
    assert runs["bf16-mixed"]["choices"]["precision"] == "bf16-mixed"
    assert math.isfinite(runs["bf16-mixed"]["final_val_loss"])
    assert_learned_and_changed(runs["bf16-mixed"], runs["32-true"])
    first = {precision: r["train_loss_curve"][0][1] for precision, r in runs.items()}
    assert first["bf16-mixed"] == pytest.approx(first["32-true"], rel=0.02)


# ---------------------------------------------------------------------------------- config errors

def test_fire_with_linear_attention_is_a_one_line_config_error(tmp_path):
    run_dir = tmp_path / "run"
    with refused("pos=fire adds a bias to every score", run_dir):
        prepare(compose_config(["pos=fire", "attn=linear"], run_dir))


@pytest.mark.parametrize("override, says", [
    ("pos.mlp_hidden=0", "pos.mlp_hidden=0 must be a positive integer"),
    ("pos.mlp_hidden=-3", "pos.mlp_hidden=-3 must be a positive integer"),
    ("pos.mlp_hidden=2.5", "pos.mlp_hidden=2.5 must be a positive integer"),
    ("pos.init_c=0", "pos.init_c=0 must be a finite number > 0"),
    ("pos.init_c=-0.1", "pos.init_c=-0.1 must be a finite number > 0"),
    ("pos.init_c=inf", "pos.init_c=inf must be a finite number"),
    ("pos.init_L=0", "pos.init_L=0 must be a finite number > 0"),
    ("pos.init_L=-512", "pos.init_L=-512 must be a finite number > 0"),
    ("pos.init_L=big", "pos.init_L='big' must be a number"),
    ("pos.mlp_hidden=true", "pos.mlp_hidden=True must be a number"),
])
def test_bad_options_are_one_line_errors_naming_the_key(override, says, tmp_path):
    run_dir = tmp_path / "run"
    with refused(says, run_dir):
        prepare(compose_config(["pos=fire", override], run_dir))


def test_good_options_validate_and_build():
    for options in ({}, dict(mlp_hidden=8, init_c=2, init_L=16), dict(mlp_hidden=None, init_L=None)):
        cfg = ModelConfig(vocab_size=20, d_model=32, n_heads=4, max_len=64, pos=PosConfig("fire", options),
                          attn=AttnConfig(causal=True))
        assert cfg.errors() == [], options
    assert tiny_model("fire").pos.w1.shape == (32, 1)
