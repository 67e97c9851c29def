"""Mixture-of-experts FFN (ffn=moe) against the Switch Transformer / top-k routing equations (model/moe.py):
top-k routing, expert capacity and dropped tokens, the load-balancing loss, the dense limit, gradients to the
router, the training loss, one-line errors and an end-to-end run."""
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from blocklab.model import ModelConfig, build_model
from blocklab.model.block import Residual
from blocklab.model.config import FfnConfig
from blocklab.model.ffn import FFN, FFN_KINDS
from blocklab.model.norm import PLACEMENTS
from blocklab.naming import names_the_job
from blocklab.train.module import LitTransformer
from blocklab.train.outcome import choices
from blocklab.train.run import prepare
from conftest import FAST, compose_config, run_in_process
from helpers import assert_cached_steps_equal_full, refused, tokens

D, D_FF = 8, 16
OPTIM = dict(lr=1e-3, betas=[0.9, 0.99], weight_decay=0.0, warmup_steps=0, min_lr=1e-4)


def moe(experts=4, top_k=1, capacity_factor=100.0, aux_loss_weight=0.01, seed=0):
    torch.manual_seed(seed)
    return FFN_KINDS["moe"](D, D_FF, "gelu", True, 0.0, True, experts=experts, top_k=top_k,
                            capacity_factor=capacity_factor, aux_loss_weight=aux_loss_weight).double()


def inputs(n=24, seed=1):
    return torch.randn(2, n // 2, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def rows_seen(layer):
    """Hooks recording the input rows each expert processed (what it computed on)."""
    seen = {i: [] for i in range(layer.n_experts)}
    hooks = [e.register_forward_hook(lambda m, a, out, i=i: seen[i].append(a[0].detach().clone()))
             for i, e in enumerate(layer.experts)]
    return seen, hooks


def reference(layer, x):
    """y(x) = sum over the top_k experts i of softmax(W_r x)_i E_i(x), token by token (Switch eq. 1-2)."""
    flat = x.reshape(-1, D)
    out = torch.zeros_like(flat)
    for t, token in enumerate(flat):
        p = torch.softmax(layer.router.weight @ token, -1)
        for i in p.topk(layer.top_k).indices.tolist():
            out[t] += p[i] * layer.experts[i](token[None])[0]
    return out.view_as(x)


def committed(layer, prefs):
    """Every token prefers the experts in the order of `prefs` (logit values): input coordinate 0 is 1 and
    only it reaches the router."""
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, 0] = torch.tensor(prefs, dtype=layer.router.weight.dtype)


def with_constant_coordinate(x):
    x = x.clone()
    x[..., 0] = 1.0
    return x


# ------------------------------------------------------------------------------------------- routing

@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("training", [True, False])
def test_each_token_goes_to_its_top_k_experts_weighted_by_the_router(top_k, training):
    layer, x = moe(experts=4, top_k=top_k), inputs()
    layer.train(training)
    seen, hooks = rows_seen(layer)
    out = layer(x)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(out, reference(layer, x), rtol=1e-12, atol=1e-12)
    flat = x.reshape(-1, D)
    chosen = torch.softmax(flat @ layer.router.weight.T, -1).topk(top_k).indices
    for i in range(4):
        rows = torch.cat(seen[i]) if seen[i] else torch.zeros(0, D, dtype=x.dtype)
        expected = flat[(chosen == i).any(-1)]
        by_first = lambda m: m[m[:, 0].argsort()]  # noqa: E731  (first choices come first, then second...)
        torch.testing.assert_close(by_first(rows), by_first(expected), rtol=0, atol=0)  # exactly its tokens
    assert sum(len(torch.cat(s)) for s in seen.values()) == top_k * flat.shape[0]


# ------------------------------------------------------------------------------------------ capacity

@pytest.mark.parametrize("experts, top_k, factor, n", [(4, 1, 1.0, 12), (4, 1, 1.5, 10), (4, 2, 1.5, 10),
                                                       (3, 2, 0.5, 14), (8, 1, 2.0, 24)])
def test_no_expert_takes_more_than_its_capacity_and_overflow_tokens_are_dropped(experts, top_k, factor, n):
    """Every token prefers experts 0, 1, ... in that order: the first `capacity` tokens (batch order) fill each
    preferred expert, the rest are dropped and output 0 from the layer."""
    layer = moe(experts=experts, top_k=top_k, capacity_factor=factor).train()
    committed(layer, [float(experts - i) for i in range(experts)])
    x = with_constant_coordinate(inputs(n))
    capacity = math.ceil(factor * n * top_k / experts)
    seen, hooks = rows_seen(layer)
    out = layer(x).reshape(-1, D)
    for hook in hooks:
        hook.remove()
    counts = [sum(len(r) for r in seen[i]) for i in range(experts)]
    assert counts == [min(n, capacity)] * top_k + [0] * (experts - top_k)
    kept = min(n, capacity)
    assert torch.equal(out[kept:], torch.zeros_like(out[kept:]))  # dropped from every choice: nothing added
    torch.testing.assert_close(out[:kept], reference(layer, x).reshape(-1, D)[:kept], rtol=1e-12, atol=1e-12)
    assert int(layer.dropped_total) == top_k * (n - kept)


@pytest.mark.parametrize("top_k", [1, 2])
def test_random_routing_respects_capacity_and_counts_what_it_drops(top_k):
    layer = moe(experts=4, top_k=top_k, capacity_factor=0.75).train()
    with torch.no_grad():
        layer.router.weight.mul_(50)  # confident, uneven routing
    x = inputs(40)
    capacity = math.ceil(0.75 * 40 * top_k / 4)
    seen, hooks = rows_seen(layer)
    layer(x)
    for hook in hooks:
        hook.remove()
    counts = torch.tensor([sum(len(r) for r in seen[i]) for i in range(4)])
    demand = torch.bincount(torch.softmax(x.reshape(-1, D) @ layer.router.weight.T, -1).topk(top_k).indices.flatten(),
                            minlength=4)
    assert (counts <= capacity).all() and torch.equal(counts, demand.clamp(max=capacity))
    assert int(layer.dropped_total) == int((demand - counts).sum()) > 0
    assert torch.equal(layer.routed_total, demand)


def test_dropped_tokens_pass_through_the_residual_only():
    """x + MoE(LN(x)) in a pre-norm block: a token dropped from every choice comes out as x itself."""
    layer = moe(experts=2, top_k=1, capacity_factor=0.5).train()
    wrapped = Residual(layer, PLACEMENTS["pre"], "layernorm", D, 1e-5, True, 0.0).double().train()
    with torch.no_grad():  # LN(x) = its shift for every token, whose coordinate 0 alone reaches the router
        wrapped.norm_in.weight.zero_()
        wrapped.norm_in.bias.copy_(torch.linspace(1, 2, D))
    committed(layer, [1.0, 0.0])
    x = inputs(8)
    y, flat = wrapped(x).reshape(-1, D), x.reshape(-1, D)
    capacity = math.ceil(0.5 * 8 * 1 / 2)  # 2 of the 8 tokens, all of which pick expert 0
    assert torch.equal(y[capacity:], flat[capacity:])
    assert not torch.isclose(y[:capacity], flat[:capacity]).all(-1).any()


def test_evaluation_drops_nothing_so_cached_decoding_equals_recomputation():
    cfg = ModelConfig(vocab_size=20, d_model=16, n_heads=2, n_layers=2, max_len=32,
                      ffn_kind=FfnConfig("moe", {"experts": 4, "top_k": 2, "capacity_factor": 0.25}))
    torch.manual_seed(0)
    model = build_model(cfg).double().eval()
    assert_cached_steps_equal_full(model, tokens((3, 12), seed=2), prefix=5)
    assert all(int(layer.dropped_total) == 0 and int(layer.routed_total.sum()) == 0
               for layer in model.modules() if hasattr(layer, "routed_total"))  # eval forwards are not counted


# ------------------------------------------------------------------------------- load-balancing loss

def switch_loss(layer, x):
    """N * sum_i f_i P_i (Switch eq. 4-6), f_i over the top_k choices of every token."""
    p = torch.softmax(x.reshape(-1, D) @ layer.router.weight.T, -1)
    f = torch.bincount(p.topk(layer.top_k).indices.flatten(), minlength=layer.n_experts).to(p.dtype)
    return layer.n_experts * (f / f.sum() * p.mean(0)).sum()


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_is_switchs_formula(top_k):
    layer, x = moe(experts=4, top_k=top_k).train(), inputs()
    layer(x)
    torch.testing.assert_close(layer.aux_loss, switch_loss(layer, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("experts", [2, 4, 8])
def test_aux_loss_is_at_its_lower_bound_under_uniform_routing(experts):
    """Uniform router probabilities: N * sum_i f_i / N = 1, the least N * sum_i P_i^2 can be (Cauchy-Schwarz);
    committed routing is N * sum_i f_i^2: 1 when balanced, N when every token picks one expert."""
    layer = moe(experts=experts).train()
    with torch.no_grad():
        layer.router.weight.zero_()
    layer(inputs())
    assert float(layer.aux_loss.detach()) == pytest.approx(1.0, abs=1e-12)
    # Confident routing, token t to expert t mod N: balanced.
    n = 4 * experts
    x = torch.zeros(1, n, D, dtype=torch.float64)
    with torch.no_grad():
        layer.router.weight.zero_()
        for e in range(experts):
            layer.router.weight[e, e % D] = 60.0
    for t in range(n):
        x[0, t, (t % experts) % D] = 1.0
    if experts <= D:
        layer(x)
        assert float(layer.aux_loss.detach()) == pytest.approx(1.0, abs=1e-6)
    committed(layer, [60.0] + [0.0] * (experts - 1))  # all to expert 0
    layer(with_constant_coordinate(inputs()))
    assert float(layer.aux_loss.detach()) == pytest.approx(experts, rel=1e-6)
    for seed in range(5):  # anything in between lies above the bound (committed: f = P)
        committed(layer, (60 * torch.rand(experts, generator=torch.Generator().manual_seed(seed))).tolist())
        layer(with_constant_coordinate(inputs()))
        assert float(layer.aux_loss.detach()) >= 1.0 - 1e-9


@pytest.mark.parametrize("seed", [0, 1])
def test_training_on_the_aux_loss_alone_balances_the_load(seed):
    """From every token on expert 0 (aux = N) to a quarter each (aux = 1), by the aux loss's gradient alone."""
    layer = moe(experts=4, top_k=1, seed=seed).train()
    x = with_constant_coordinate(inputs(64, seed=seed + 1))
    with torch.no_grad():
        layer.router.weight[0, 0] += 5
    opt = torch.optim.Adam(layer.router.parameters(), lr=0.05)

    def shares():
        probs = torch.softmax(x.reshape(-1, D) @ layer.router.weight.T, -1)
        return torch.bincount(probs.argmax(-1), minlength=4) / 64

    assert shares().tolist() == [1.0, 0.0, 0.0, 0.0]
    for _ in range(150):
        opt.zero_grad()
        layer(x)
        layer.aux_loss.backward()
        opt.step()
    assert shares().max() <= 0.3 and float(layer.aux_loss.detach()) == pytest.approx(1.0, abs=0.02)


# ------------------------------------------------------------------------------------- dense limit

@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("training", [True, False])
def test_one_expert_with_room_for_every_token_is_the_dense_ffn(act, training):
    torch.manual_seed(0)
    dense = FFN(D, D_FF, act).double().train(training)
    layer = FFN_KINDS["moe"](D, D_FF, act, experts=1, top_k=1, capacity_factor=1.0).double().train(training)
    layer.experts[0].load_state_dict(dense.state_dict())
    x = inputs()
    torch.testing.assert_close(layer(x), dense(x), rtol=0, atol=0)
    (layer(x) ** 2).sum().backward()
    (dense(x) ** 2).sum().backward()
    for (name, p), q in zip(layer.experts[0].named_parameters(), dense.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_one_expert_model_equals_the_dense_model_with_the_same_weights():
    base = dict(vocab_size=20, d_model=16, n_heads=2, n_layers=2)
    torch.manual_seed(0)
    dense = build_model(ModelConfig(**base)).double().train()
    routed = build_model(ModelConfig(**base, ffn_kind=FfnConfig("moe", {"experts": 1, "capacity_factor": 1.0})))
    routed = routed.double().train()
    state = {k.replace(".ffn.experts.0.", ".ffn."): v for k, v in routed.state_dict().items()}
    state.update(dense.state_dict())
    routed.load_state_dict({k: state[k.replace(".ffn.experts.0.", ".ffn.")] for k in routed.state_dict()})
    idx = torch.randint(0, 20, (4, 10), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(routed(idx), dense(idx), rtol=0, atol=0)


def test_dense_is_the_default_and_builds_the_plain_ffn():
    model = build_model(ModelConfig(vocab_size=20))
    assert all(type(block.ffn) is FFN for block in model.blocks)
    assert "blocks.0.ffn.in_proj.weight" in model.state_dict()  # checkpoints keep their keys


# ---------------------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("top_k", [1, 2])
def test_gradients_reach_the_router_from_the_task_loss_and_from_the_aux_loss(top_k):
    cfg = ModelConfig(vocab_size=20, d_model=16, n_heads=2, n_layers=2,
                      ffn_kind=FfnConfig("moe", {"experts": 4, "top_k": top_k}))
    torch.manual_seed(0)
    model = build_model(cfg).double().train()
    idx = torch.randint(0, 20, (4, 10), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    routers = [block.ffn.router.weight for block in model.blocks]
    assert all(r.grad is not None and r.grad.abs().sum() > 0 and torch.isfinite(r.grad).all() for r in routers)
    model.zero_grad()
    model(idx)
    sum(block.ffn.aux_loss for block in model.blocks).backward()
    assert all(r.grad.abs().sum() > 0 for r in routers)


def test_the_training_loss_adds_each_layers_weighted_aux_loss():
    cfg = ModelConfig(vocab_size=20, d_model=16, n_heads=2, n_layers=2,
                      ffn_kind=FfnConfig("moe", {"experts": 4, "top_k": 2, "aux_loss_weight": 0.5}))
    torch.manual_seed(0)
    lit = LitTransformer(cfg, OPTIM).train()
    lit._trainer = SimpleNamespace(_logger_connector=SimpleNamespace(should_update_logs=False))
    idx = torch.randint(0, 20, (4, 10), generator=torch.Generator().manual_seed(1))
    batch = {"input": idx, "target": idx, "valid": torch.ones_like(idx, dtype=torch.bool)}
    logits = {}
    hooks = [block.ffn.router.register_forward_hook(lambda m, a, out, i=i: logits.__setitem__(i, out))
             for i, block in enumerate(lit.model.blocks)]
    out = lit.training_step(batch, 0)
    for hook in hooks:
        hook.remove()
    task = F.cross_entropy(lit.model(idx).flatten(0, 1), idx.flatten())
    aux = 0.0
    for z in logits.values():
        p = z.softmax(-1)
        f = torch.bincount(p.topk(2).indices.flatten(), minlength=4).to(p.dtype)
        aux = aux + 0.5 * 4 * (f / f.sum() * p.mean(0)).sum()
    torch.testing.assert_close(out["task_loss"], task.detach())
    torch.testing.assert_close(out["loss"], task + aux)
    out["loss"].backward()
    assert all(block.ffn.router.weight.grad.abs().sum() > 0 for block in lit.model.blocks)


def test_a_dense_model_trains_on_the_task_loss_alone():
    lit = LitTransformer(ModelConfig(vocab_size=20), OPTIM).train()
    lit._trainer = SimpleNamespace(_logger_connector=SimpleNamespace(should_update_logs=False))
    idx = torch.randint(0, 20, (4, 10), generator=torch.Generator().manual_seed(1))
    out = lit.training_step({"input": idx, "target": idx, "valid": torch.ones_like(idx, dtype=torch.bool)}, 0)
    assert lit.routed == [] and isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, F.cross_entropy(lit.model(idx).flatten(0, 1), idx.flatten()))


# ----------------------------------------------------------------------------------- config, errors

def test_ffn_options_compose_and_are_named_in_choices_and_job_names(tmp_path):
    for option, label in (("dense", "dense"), ("moe", "moe")):
        model_cfg = prepare(compose_config([f"ffn={option}"], tmp_path / option)).model_cfg
        assert model_cfg.errors() == [] and choices(model_cfg, 0)["ffn"] == label
    removed = prepare(compose_config(["model.ffn=false"], tmp_path / "none")).model_cfg
    assert choices(removed, 0)["ffn"] == "none" and all(b.ffn is None for b in build_model(removed).blocks)
    cfg = prepare(compose_config(["ffn=moe", "ffn.experts=8", "ffn.top_k=2"], tmp_path / "moe8")).model_cfg
    assert cfg.ffn_kind.options == {"experts": 8, "top_k": 2, "capacity_factor": 1.25, "aux_loss_weight": 0.01}
    assert len(build_model(cfg).blocks[0].ffn.experts) == 8
    assert names_the_job("ffn=moe") and names_the_job("ffn.experts=8")


@pytest.mark.parametrize("overrides, message", [
    (["ffn.top_k=5"], "ffn.top_k=5 is more than ffn.experts=4: each token goes to top_k different experts; "
                      "use ffn.top_k<=4 or more experts"),
    (["ffn.capacity_factor=0"], "ffn.capacity_factor=0 must be a number > 0 (an expert takes at most "
                                "ceil(capacity_factor * tokens * top_k / experts) assignments of a batch)"),
    (["ffn.capacity_factor=-1.5"], "ffn.capacity_factor=-1.5 must be a number > 0 (an expert takes at most "
                                   "ceil(capacity_factor * tokens * top_k / experts) assignments of a batch)"),
    (["ffn.experts=0"], "ffn.experts=0 must be a positive integer"),
    (["ffn.experts=2.5"], "ffn.experts=2.5 must be a positive integer"),
    (["ffn.top_k=0"], "ffn.top_k=0 must be a positive integer"),
    (["ffn.aux_loss_weight=-1"], "ffn.aux_loss_weight=-1 must be a number >= 0"),
    (["ffn.experts=many"], "ffn.experts='many' must be a number"),
    (["model.ffn=false"], "model.ffn=false removes the FFN sublayers, so ffn=moe has nothing to replace; "
                          "use ffn=dense or model.ffn=true"),
])
def test_bad_moe_options_are_one_line_errors_before_any_work(overrides, message, run_dir):
    with refused(message, run_dir) as err:
        run_in_process([*FAST, "ffn=moe", *overrides], run_dir)
    assert str(err.value) == message


def test_unknown_ffn_kind_and_options_of_another_kind_are_one_line_errors(run_dir):
    with refused("ffn.name='mo' is unknown; did you mean 'moe'? use one of ['dense', 'moe']", run_dir):
        run_in_process([*FAST, "ffn.name=mo"], run_dir)
    with refused("ffn.experts is not an option of ffn.name=dense; its options are []", run_dir):
        run_in_process([*FAST, "+ffn.experts=4"], run_dir)


# -------------------------------------------------------------------------------------- end to end

def test_moe_run_end_to_end_adds_and_logs_the_aux_loss_and_records_the_routing(run_dir):
    run_in_process([*FAST, "ffn=moe", "ffn.experts=4", "ffn.top_k=2", "ffn.capacity_factor=1.0", "logger=csv"],
                   run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "completed" and results["choices"]["ffn"] == "moe"
    moe_stats = results["moe"]
    assert (moe_stats["experts"], moe_stats["top_k"]) == (4, 2) and moe_stats["assignments"] > 0
    assert len(moe_stats["expert_load"]) == len(moe_stats["dropped_fraction"]) == 2  # one per layer
    for load, dropped in zip(moe_stats["expert_load"], moe_stats["dropped_fraction"]):
        assert len(load) == 4 and sum(load) == pytest.approx(1.0) and 0 <= dropped < 1
    logged = "\n".join(p.read_text() for p in run_dir.rglob("metrics.csv"))
    assert "train/aux_loss" in logged and "moe/layer0/dropped" in logged and "moe/layer1/load_expert3" in logged
