"""Hybrid stacks (attn.layers, model/schedule.py) and the layers Based composes them of: the gated short convolution
(attn.kind=base_conv) and Taylor linear attention (attn.kind=taylor), each against a few lines of the authors' code;
the schedule builds the right kind per layer, decodes as it recomputes, refuses bad schedules in one line, and a model
saved without the key reads as a homogeneous stack."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from blocklab.model import ModelConfig, build_model
from blocklab.model.attention import ATTENTION_KINDS, SoftmaxAttention
from blocklab.model.base_conv import BaseConv
from blocklab.model.based import Based, Taylor
from blocklab.model.config import AttnConfig, PosConfig
from blocklab.model.mask import self_attention_context
from blocklab.model.patterns import Full, Window
from blocklab.model.position import build_position
from blocklab.model.schedule import layer_attn
from blocklab.train.resume import config_differences
from conftest import CONF
from helpers import assert_cached_steps_equal_full, tokens

F64 = dict(dtype=torch.float64)
HYBRID = [{"kind": "base_conv"}, {"kind": "taylor", "chunk": 4}, {"pattern": "window", "window": 3},
          {"kind": "based", "window_size": 2, "chunk": 4}]


def hybrid_cfg(layers=HYBRID, n_layers=8, pos="rope", **attn) -> ModelConfig:
    return ModelConfig(vocab_size=20, d_model=32, n_heads=4, n_layers=n_layers, max_len=64, pos=PosConfig(pos),
                       attn=AttnConfig(layers=layers, **attn))


def draw(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), **F64)


# ------------------------------------------------------------------------------------------- the schedule

def test_each_layer_gets_its_entry_repeated_over_depth():
    cfg = hybrid_cfg()
    assert cfg.errors() == []
    model = build_model(cfg)
    kinds = [BaseConv, Taylor, SoftmaxAttention, Based]
    assert [type(block.attn) for block in model.blocks] == kinds * 2
    assert [type(p) for p in model.patterns] == [Full, Full, Window, Full] * 2
    assert model.patterns[2] is model.patterns[6] and model.patterns[2].window == 3  # one pattern, one context
    assert model.blocks[7].attn.window_size == 2 and model.blocks[1].attn.chunk == 4
    assert cfg.attn_label == "base_conv+taylor+local+based_w2"


def test_an_entry_takes_the_group_for_what_it_leaves_out_but_not_another_kinds_options():
    attn = AttnConfig(kind="based", short_conv=4, options={"window_size": 8, "path_mix": False},
                      layers=[{"kind": "taylor"}, {"window_size": 2}, {"kind": "base_conv", "short_conv": 0}])
    taylor, based, conv = (layer_attn(attn, i) for i in range(3))
    assert (taylor.kind, taylor.short_conv, taylor.options, taylor.layers) == ("taylor", 4, {}, None)
    assert (based.kind, based.options) == ("based", {"window_size": 2, "path_mix": False})
    assert (conv.kind, conv.short_conv) == ("base_conv", 0)
    assert layer_attn(attn, 4) == based  # layer 4 is entry 1 again
    plain = AttnConfig(kind="gla")
    assert layer_attn(plain, 3) is plain and hybrid_cfg(None).layer(1) == hybrid_cfg(None)


@pytest.mark.parametrize("pos", ["rope", "none", "sinusoidal"])
def test_a_hybrid_decodes_as_it_recomputes(pos):
    """The cache holds each layer's own state (a convolution's last inputs, the Taylor sums, a window's keys, Based's
    both): one-token steps, and a prompt then a chunk, give the full pass's logits."""
    torch.manual_seed(0)
    model = build_model(hybrid_cfg(pos=pos)).double().eval()
    with torch.no_grad():
        assert_cached_steps_equal_full(model, tokens((2, 11)), prefix=3, then=2)
        assert model.new_cache().window is None  # the window layers keep every key beside fixed states


def test_a_window_schedule_of_softmax_layers_keeps_the_widest_reach():
    cfg = hybrid_cfg([{"pattern": "window", "window": 3}, {"pattern": "window", "window": 5}], n_layers=2)
    torch.manual_seed(1)
    model = build_model(cfg).double().eval()
    with torch.no_grad():
        cache = assert_cached_steps_equal_full(model, tokens((2, 12)), prefix=2)
    assert model.new_cache().window == 5 and cache.length == 5


def test_padding_in_a_hybrid_batch_changes_no_real_token():
    """Left padding: each row's real tokens get the logits they get alone (the convolution and the Taylor sums
    skip padded keys)."""
    torch.manual_seed(2)
    model = build_model(hybrid_cfg(pos="none")).double().eval()
    idx = tokens((2, 9))
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[0, :3] = False
    with torch.no_grad():
        padded = model(idx, valid=valid)
        alone = model(idx[:1, 3:], positions=torch.arange(3, 9)[None])
    torch.testing.assert_close(padded[0, 3:], alone[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layers, n_layers, message", [
    ([{"kind": "nope"}], 2, "attn.layers[0]: attn.kind='nope' is unknown"),
    ([{"kind": "taylor"}] * 3, 4, "attn.layers has 3 entries, which does not divide model.n_layers=4"),
    ([{"causal": False}], 2, "attn.layers[0].causal is the whole stack's, not a layer's"),
    ([{"kind": "base_conv", "qk_norm": True}], 2,
     "attn.layers[0]: attn.qk_norm=True do not apply to attn.kind=base_conv"),
    ([{"kind": "taylor", "window": 4}], 2, "attn.layers[0]: attn.window=4 (attn.pattern=window) needs a kind"),
    ([{"kind": "taylor", "feature_dm": 4}], 2, "attn.layers[0]: attn.feature_dm is not an option of attn.kind=taylor"),
    ([{"kind": "mla"}, {"kind": "softmax"}], 2, "attn.layers rotate [4, None] dimensions per head in different layers"),
    ([], 2, "attn.layers=[] must be null (every layer alike) or a non-empty list"),
    (["taylor"], 2, "attn.layers[0]='taylor' must be a mapping of attn keys"),
])
def test_a_bad_schedule_is_one_line_naming_the_key(layers, n_layers, message):
    errors = hybrid_cfg(layers, n_layers=n_layers).errors()
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0], errors


def test_the_command_line_refuses_a_bad_schedule_in_one_line_before_any_work(tmp_path):
    from conftest import run_cli
    from helpers import assert_refused_cli

    run = tmp_path / "run"
    proc = run_cli(["trainer=debug", "logger=none", "attn=based_mqar", "model.n_layers=3", f"hydra.run.dir={run}"],
                   timeout=120)
    assert_refused_cli(proc, "attn.layers has 2 entries, which does not divide model.n_layers=3", run)


def test_a_model_saved_without_the_key_is_a_homogeneous_stack():
    saved = dataclasses.asdict(ModelConfig(vocab_size=20, attn=AttnConfig(kind="taylor")))
    del saved["attn"]["layers"]
    cfg = ModelConfig.from_dict(saved)
    assert cfg.attn.layers is None and cfg.attn_label == "taylor"
    assert [type(b.attn) for b in build_model(cfg).blocks] == [Taylor, Taylor]
    old = {"attn": {"kind": "softmax", "window": None}, "optim": {"lr": 0.01}}
    assert config_differences(old, {"attn": {"kind": "softmax", "window": None, "layers": None},
                                    "optim": {"lr": 0.01}}) == []


def test_an_entry_naming_its_own_kind_records_its_old_run_options():
    """A schedule saved now says which behaviour each layer ran (Based's path_mix), as the group's kind does."""
    groups = {"model": {}, "norm": {}, "pos": {"name": "rope"}, "act": {}, "init": {},
              "attn": {"kind": "softmax", "layers": [{"kind": "based"}, {"kind": "softmax"}]}}
    cfg = ModelConfig.from_groups(groups, vocab_size=20, max_len=32)
    assert cfg.attn.layers == [{"kind": "based", "path_mix": True}, {"kind": "softmax"}]


def test_a_hybrids_size_is_counted_by_its_periods():
    from blocklab.model.size import model_size

    cfg = hybrid_cfg(n_layers=12)
    assert model_size(cfg).parameters == sum(p.numel() for p in build_model(cfg).parameters())


def test_the_based_preset_interleaves_as_the_released_models():
    """HazyResearch/based, train/configs/experiment/reference/based-360m.yaml (commit bbf9970): alt_mixer_layers
    (Taylor LinearAttention) [1, 6, 11, 16, 21], alt_mixer_2_layers (SlidingAttention) [2, 7, 12, 17, 22], the
    mixer BaseConv (kernel_sizes 3) elsewhere; feature_dim 16."""
    preset = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / "based_hybrid.yaml"))
    assert preset["model"]["n_layers"] == 5
    cfg = hybrid_cfg(preset["attn"]["layers"], n_layers=25)
    assert cfg.errors() == []
    kinds = [type(block.attn) for block in build_model(cfg).blocks]
    taylor, window = [1, 6, 11, 16, 21], [2, 7, 12, 17, 22]
    assert [i for i, k in enumerate(kinds) if k is Taylor] == taylor
    assert [i for i, k in enumerate(kinds) if k is SoftmaxAttention] == window
    assert all(k is BaseConv for i, k in enumerate(kinds) if i not in taylor + window)
    assert cfg.layer(1).attn.options["feature_dim"] == 16 and cfg.layer(0).attn.options["kernel_size"] == 3


# ------------------------------------------------------------------------ the layers, against the authors' code

def context(d_model, n_heads, length):
    scheme = build_position("none", d_model, n_heads, d_model // n_heads, True)
    return self_attention_context(torch.zeros(1, length, dtype=torch.long), None, None, None, scheme, True, None)


def test_base_conv_is_the_reference_gated_convolution():
    """HazyResearch/based, based/models/mixers/convolution.py (commit 5f862a4), BaseConv.forward on the CPU path:
    u = in_proj(u); u1, u2 = split(u, d_inner); u_conv = silu(conv(u1)); y = out_proj(u_conv * u2), the conv an
    nn.Conv1d(groups=d_inner, padding=kernel_size - 1, bias=False) cut to the first l outputs (ShortConvolution)."""
    layer = ATTENTION_KINDS["base_conv"](8, 2, kernel_size=3, expand=2).double()
    for p in layer.parameters():
        p.data = draw(*p.shape, seed=p.numel()) * 0.5
    x = draw(2, 7, 8, seed=1)
    d_inner = 16
    conv = torch.nn.Conv1d(d_inner, d_inner, 3, groups=d_inner, padding=2, bias=False).double()
    conv.weight.data = layer.conv_weight.data
    u1, u2 = torch.split(layer.qkv_proj(x), d_inner, dim=-1)
    u_conv = F.silu(conv(u1.transpose(1, 2))[..., :7].transpose(1, 2))
    expected = layer.out_proj(u_conv * u2)
    torch.testing.assert_close(layer(x, context(8, 2, 7)), expected, rtol=1e-12, atol=1e-12)


def test_taylor_is_the_reference_linear_attention():
    """HazyResearch/based, based/models/mixers/linear_attention.py (commit 202f499): TaylorExp
    phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) sqrt(d))] and LinearAttention's "quadratic" parallel form,
    y = tril(phi(q) phi(k)^T) v / (phi(q) . cumsum(phi(k)) + eps), proj_q = proj_k's per-head feature maps. Here q
    and k reach the d' features through W_q (W_k) then the head's feature_proj: the reference's proj_q per head is
    their product."""
    heads, d_model, length, d_feat = 2, 16, 9, 4
    layer = ATTENTION_KINDS["taylor"](d_model, heads, bias=False, chunk=4, feature_dim=d_feat).double()
    for p in layer.parameters():
        p.data = draw(*p.shape, seed=p.numel()) * 0.4
    x = draw(1, length, d_model, seed=3)
    q, k, v = (t.view(1, length, heads, -1).transpose(1, 2) for t in layer.qkv_proj(x).split(layer.qkv_sizes, -1))
    q, k = layer.feature_proj(q), layer.feature_proj(k)

    def taylor_exp(t):  # the reference's TaylorExp.forward
        x2 = (t.unsqueeze(-1) * t.unsqueeze(-2)).flatten(start_dim=-2) / 2 ** 0.5
        return torch.cat([t[..., :1] ** 0, t / d_feat ** 0.25, x2 / d_feat ** 0.5], dim=-1)

    q, k = taylor_exp(q), taylor_exp(k)
    a_qk = torch.tril(torch.einsum("bhnd,bhmd->bhnm", q, k))
    y = torch.einsum("bhnm,bhme->bhne", a_qk, v)
    y = y / (torch.einsum("bhld,bhld->bhl", q, k.cumsum(2)) + 1e-12)[..., None]
    expected = layer.out_proj(y.transpose(1, 2).flatten(2))
    torch.testing.assert_close(layer(x, context(d_model, heads, length)), expected, rtol=1e-9, atol=1e-9)


def test_the_conv_layers_weights_are_its_taps_normalized_where_it_reads():
    layer = ATTENTION_KINDS["base_conv"](8, 2, kernel_size=3).double()
    weights = layer.tap_weights(1, 5)
    assert weights.shape == (1, 2, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 5, **F64))
    assert (weights.tril(-3) == 0).all() and (weights.triu(1) == 0).all()  # itself and 2 back: K = 3
    taps = layer.conv_weight.detach().abs()[:8, 0].mean(0)  # head 0: channels 0-7; tap K-1 is the token itself
    torch.testing.assert_close(weights[0, 0, 4, 2:], taps / taps.sum())


# ------------------------------------------------------------------------------------------- end to end

def test_a_hybrid_trains_through_the_entry_point_and_its_results_and_report_name_it(run_dir):
    """attn=based_mqar (BaseConv then Taylor) at trainer=debug: it trains, results.json records the schedule by its
    layers' labels and the positions it applied (none: neither layer rotates), model.json holds the schedule, and the
    report's row for the run names it."""
    from conftest import FAST, run_in_process
    from blocklab import folder
    from blocklab.report.collect import load_run
    from blocklab.results import read_results

    run_in_process([*FAST, "attn=based_mqar"], run_dir)
    results = read_results(run_dir)
    assert results["status"] == "completed" and results["steps"] == 20
    assert results["choices"]["attn"] == "base_conv+taylor" and results["choices"]["positions"] == "none"
    assert results["decode"]["kv_cache_bytes_per_token"] == 0  # both layers keep a fixed state
    saved = ModelConfig.from_dict(folder.read_json(run_dir, "model.json"))
    assert [entry["kind"] for entry in saved.attn.layers] == ["base_conv", "taylor"]
    assert load_run(run_dir)["attn"] == "base_conv+taylor"
