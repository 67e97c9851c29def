"""param=mup against the paper's table: Yang et al. 2022, "Tensor Programs V" (arXiv 2203.03466), Table 3, µP's
column for Adam, written out by hand below as how each kind of weight's init std and learning rate change when the
width (fan_in) goes from 64 to 256, in the effective form the table states (the readout multiplier folded into the
output weights, as the mup package's MuReadout is equivalent to it). And the config's side: sp unchanged, old runs
read as sp, an init that contradicts µP refused in one line."""
import dataclasses

import pytest
import torch
from conftest import FAST, run_cli, run_in_process
from helpers import assert_refused_cli

from blocklab.model import ModelConfig, build_model
from blocklab.experiment import Setup
from blocklab.model.attention import ATTENTION_KINDS
from blocklab.model.config import FfnConfig, InitConfig, ParamConfig
from blocklab.model.ffn import FFN_KINDS
from blocklab.results import read_results
from blocklab.optim import build_optimizer, optimizer_params
from blocklab.train.module import restore_error

# Table 3 (µP, Adam): init Var and LR of each kind of weight as functions of fan_in; with fan_in x4 (64 -> 256):
#   input weights & all biases: Var 1/fan_in with fan_in fixed (vocab, or 1 for a bias) -> std x1, LR 1 -> x1
#   hidden weights:             Var 1/fan_in   -> std x1/2,   LR 1/fan_in -> x1/4
#   output weights:             Var 1/fan_in^2 -> std x1/4,   LR 1/fan_in -> x1/4
TABLE3_ADAM = {"input": (1.0, 1.0), "bias": (1.0, 1.0), "hidden": (0.5, 0.25), "output": (0.25, 0.25)}

# Each weight of a one-layer untied decoder, by the kind Table 3 gives it (written by hand, not read from the code).
KINDS = {"tok_emb.weight": "input", "head.weight": "output",
         **{f"blocks.0.{layer}.weight": "hidden" for layer in ("attn.qkv_proj", "attn.out_proj", "ffn.in_proj",
                                                                "ffn.out_proj")},
         **{f"blocks.0.{layer}.bias": "bias" for layer in ("attn.qkv_proj", "attn.out_proj", "ffn.in_proj",
                                                            "ffn.out_proj")},
         **{f"{norm}.{part}": "bias" for norm in ("blocks.0.attn_residual.norm_in", "blocks.0.ffn_residual.norm_in",
                                                  "final_norm") for part in ("weight", "bias")}}


def mup_cfg(width: int, **changes) -> ModelConfig:
    return ModelConfig(vocab_size=50, d_model=width, n_heads=width // 16, n_layers=1, tie_embeddings=False,
                       param=ParamConfig("mup", {"base_width": 64}), init=InitConfig("normal", 0.02), **changes)


def effective(width: int) -> dict[str, tuple[float, float]]:
    """name -> (effective init std, effective lr multiplier): the output weights' with the readout multiplier in.
    Biases and norm weights start at constants: their 'std' is their mean |value| (0 or 1 at every width)."""
    cfg = mup_cfg(width)
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = build_optimizer(model, {"lr": 1.0, "betas": [0.9, 0.99], "weight_decay": 0.1})
    lrs = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    out = {}
    for name, p in model.named_parameters():
        size = p.std().item() if p.dim() == 2 else p.abs().mean().item()
        mult = model.head.multiplier if name == "head.weight" else 1.0
        out[name] = (size * mult, lrs[id(p)] * mult)
    return out


def test_per_parameter_init_and_lr_follow_table_3():
    small, wide = effective(64), effective(256)
    assert set(small) == set(KINDS)
    for name, kind in KINDS.items():
        std_ratio, lr_ratio = TABLE3_ADAM[kind]
        if small[name][0] != 0:
            assert wide[name][0] / small[name][0] == pytest.approx(std_ratio, rel=0.06), name
        else:
            assert wide[name][0] == 0, name
        assert wide[name][1] / small[name][1] == pytest.approx(lr_ratio, rel=1e-12), name
    # at the base width every multiplier is 1: µP there is the init scheme and optim.lr as given
    assert all(lr == 1.0 for _, lr in small.values())
    assert small["blocks.0.attn.qkv_proj.weight"][0] == pytest.approx(0.02, rel=0.03)


def test_weight_decay_times_width_where_the_lr_is_divided():
    """MuAdam (mup/optim.py, decoupled_wd=False): a matrix-like group's weight_decay times width_mult, so that torch's
    AdamW decay lr * wd is the same at every width."""
    model = build_model(mup_cfg(256))
    optimizer = build_optimizer(model, {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1})
    for group in optimizer.param_groups:
        if group["weight_decay"]:
            assert group["lr"] * group["weight_decay"] == pytest.approx(0.01 * 0.1)


def test_tied_head_is_the_embedding_at_the_base_lr_with_its_own_multiplier():
    """MuSharedReadout: the shared weight keeps the embedding's rule (std and lr as at the base width); the logits are
    x W^T times base_width / width."""
    cfg = dataclasses.replace(mup_cfg(256), tie_embeddings=True)
    torch.manual_seed(0)
    model = build_model(cfg)
    assert model.head.weight is model.tok_emb.weight and model.head.multiplier == 64 / 256
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    optimizer = build_optimizer(model, {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1})
    assert [g["lr"] for g in optimizer.param_groups if any(p is model.tok_emb.weight for p in g["params"])] == [0.01]
    x = torch.randn(3, 256)
    torch.testing.assert_close(model.head(x), x @ model.tok_emb.weight.T * 0.25)


@pytest.mark.parametrize("kind, scale", [("softmax", 1 / 16), ("gla", 1 / 4)])
def test_attention_scale_is_one_over_d_head_where_it_is_a_softmax_temperature(kind, scale):
    """nanoGPT-mup's CausalSelfAttention: 1/d_head under µP; GLA's q scale is no softmax temperature and stays."""
    for width in (64, 256):
        model = build_model(dataclasses.replace(mup_cfg(width), attn=dataclasses.replace(mup_cfg(width).attn,
                                                                                          kind=kind)))
        assert model.blocks[0].attn.scale == pytest.approx(scale)


def test_sp_is_unchanged():
    """sp: two AdamW groups (decayed, not), one learning rate, 1/sqrt(d_head), no readout multiplier; an old model.json
    without `param` reads as sp."""
    cfg = ModelConfig(vocab_size=50, d_model=256, n_heads=16, n_layers=1)
    model = build_model(cfg)
    params = list(model.parameters())
    assert optimizer_params(model) == [[p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]]
    assert model.head.multiplier == 1 and model.blocks[0].attn.scale == pytest.approx(0.25)
    saved = dataclasses.asdict(cfg)
    del saved["param"]
    assert ModelConfig.from_dict(saved).param == ParamConfig("sp", {})


def test_mup_refuses_a_width_dependent_init_and_a_base_width_off_the_head_grid():
    errors = dataclasses.replace(mup_cfg(64), init=InitConfig("xavier")).errors()
    assert len(errors) == 1 and "init=xavier" in errors[0] and "param=sp" in errors[0]
    errors = dataclasses.replace(mup_cfg(64), param=ParamConfig("mup", {"base_width": 24})).errors()
    assert len(errors) == 1 and "param.base_width" in errors[0]
    assert mup_cfg(32).errors() == [] and dataclasses.replace(mup_cfg(64), init=InitConfig("gpt2")).errors() == []


def test_command_line_refuses_mup_with_xavier(tmp_path):
    proc = run_cli(["param=mup", "init=xavier", *FAST, f"hydra.run.dir={tmp_path / 'run'}"])
    assert_refused_cli(proc, "init=xavier", tmp_path / "run")


def kind_cfg(width: int, kind: str, ffn: str = "dense") -> ModelConfig:
    """A decoder of attn.kind `kind` (non-causal where the kind has no causal form) under mup at `width`."""
    cfg = dataclasses.replace(mup_cfg(width), ffn_kind=FfnConfig(ffn))
    cfg = dataclasses.replace(cfg, attn=dataclasses.replace(cfg.attn, kind=kind))
    if cfg.errors():
        cfg = dataclasses.replace(cfg, attn=dataclasses.replace(cfg.attn, causal=False))
    return cfg


@pytest.mark.parametrize("kind, ffn", [(kind, "dense") for kind in ATTENTION_KINDS]
                         + [("softmax", ffn) for ffn in FFN_KINDS])
def test_every_kind_takes_mup_on_its_projections(kind, ffn):
    """Every attention and FFN kind builds under mup, and its W_qkv and W_out (every expert's FFN too) get the hidden
    rule: lr / m at d_model 128 (m = 2), its biases and norms the base lr."""
    cfg = kind_cfg(128, kind, ffn)
    assert cfg.errors() == []
    model = build_model(cfg)
    optimizer = build_optimizer(model, {"lr": 1.0, "betas": [0.9, 0.99], "weight_decay": 0.1})
    lrs = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    for name, p in model.named_parameters():
        if name.endswith(("qkv_proj.weight", "out_proj.weight", "in_proj.weight")):
            assert lrs[id(p)] == 0.5, name
        elif p.dim() < 2:
            assert lrs[id(p)] == 1.0, name


@pytest.mark.slow
def test_mup_trains_end_to_end(run_dir):
    """config -> model -> training -> results.json, and the checkpoint's AdamW groups fit the model's (a resume)."""
    run_in_process([*FAST, "param=mup", "model.d_model=128", "model.n_heads=8"], run_dir)
    results = read_results(run_dir)
    assert results["status"] == "completed" and results["choices"]["param"] == "mup"
    setup = Setup.from_run_dir(run_dir)
    assert setup.model_cfg.param == ParamConfig("mup", {"base_width": 64})
    assert restore_error(setup.checkpoint, setup.model_cfg) is None
