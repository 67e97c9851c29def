"""The memory bound's parameter count (model/size.py: the model built on the meta device) is the real model's, for
every entry of every registry that builds part of a model, so a new kind cannot be left out of it; and it stays
cheap whatever the sizes, since it runs on every command before anything is allocated."""
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from blocklab.model import ModelConfig, build_model
from blocklab.model.architectures import ARCHITECTURES
from blocklab.model.attention import ATTENTION_KINDS
from blocklab.model.config import AttnConfig, FfnConfig, InitConfig, NormConfig, PosConfig
from blocklab.model.ffn import ACTIVATIONS, FFN_KINDS
from blocklab.model.init import INIT_SCHEMES
from blocklab.model.norm import NORM_TYPES, PLACEMENTS
from blocklab.model.patterns import ATTENTION_PATTERNS
from blocklab.model.position import POSITION_SCHEMES
from blocklab.model.size import TooLargeToCount, model_size
from blocklab.schema import STATE_COPIES

# What an entry needs beside its name to make a valid tiny model (a new entry that needs more fails below with
# its errors: add it here).
NEEDS = {
    ("attn", "linformer"): dict(causal=False),
    ("pattern", "window"): dict(window=3), ("pattern", "local"): dict(window=3), ("pattern", "strided"): dict(window=3, pattern_options={"stride": 4}),
    ("pattern", "dilated"): dict(window=3), ("pattern", "global"): dict(window=3), ("pattern", "bigbird"): dict(window=3),
    ("placement", "rezero"): dict(type="none"),
    ("arch", "encoder"): dict(causal=False), ("arch", "encoder_decoder"): dict(),
}


def tiny(group: str, name: str) -> ModelConfig:
    """A valid model of 3 layers (the count extrapolates past 2) with `name` chosen in `group`."""
    needs = NEEDS.get((group, name), {})
    attn = AttnConfig(kind=name if group == "attn" else "softmax", pattern=name if group == "pattern" else None,
                      causal=needs.get("causal", True), window=needs.get("window"),
                      pattern_options=needs.get("pattern_options", {}))
    norm = NormConfig(type=name if group == "norm" else needs.get("type", "layernorm"),
                      placement=name if group == "placement" else "pre")
    cfg = ModelConfig(arch=name if group == "arch" else "decoder", vocab_size=20, max_len=64, d_model=32,
                      n_layers=3, n_heads=4, attn=attn, norm=norm, pos=PosConfig(name if group == "pos" else "rope"),
                      ffn_kind=FfnConfig(name if group == "ffn" else "dense"),
                      init=InitConfig(name if group == "init" else "normal"),
                      **({"act": type(ModelConfig().act)(name)} if group == "act" else {}))
    assert cfg.errors() == [], (group, name, cfg.errors())
    return cfg


ENTRIES = [(group, name) for group, registry in (
    ("attn", ATTENTION_KINDS), ("pattern", ATTENTION_PATTERNS), ("pos", POSITION_SCHEMES), ("ffn", FFN_KINDS),
    ("norm", NORM_TYPES), ("placement", PLACEMENTS), ("init", INIT_SCHEMES), ("act", ACTIVATIONS),
    ("arch", ARCHITECTURES)) for name in registry]


@pytest.mark.parametrize("group, name", ENTRIES, ids=[f"{g}={n}" for g, n in ENTRIES])
def test_the_meta_count_is_the_real_models(group, name):
    cfg = tiny(group, name)
    size, model = model_size(cfg), build_model(cfg)
    buffers = list(model.buffers())
    assert size.parameters == sum(p.numel() for p in model.parameters())
    assert size.float_buffers == sum(b.numel() for b in buffers if b.is_floating_point())
    assert size.other_buffer_bytes == sum(b.numel() * b.element_size() for b in buffers if not b.is_floating_point())
    assert not next(model.parameters()).is_meta  # the count leaves no meta device behind


def test_many_experts_and_layers_are_counted_exactly_from_one_and_two():
    cfg = tiny("ffn", "moe")
    cfg.ffn_kind.options["experts"], cfg.n_layers = 5, 4
    assert model_size(cfg).parameters == sum(p.numel() for p in build_model(cfg).parameters())


HUGE = 10 ** 9
HUGE_SIZES = {
    "attn.feature_dim": ("attn", "based", {"feature_dim": HUGE}),
    "attn.kv_rank": ("attn", "mla", {"kv_rank": HUGE}),
    "attn.gate_rank": ("attn", "gla", {"gate_rank": HUGE}),
    "attn.n_features": ("attn", "performer", {"n_features": HUGE}),  # a buffer, drawn by blocks in a loop when real
    "pos.mlp_hidden": ("pos", "fire", {"mlp_hidden": HUGE}),
    "pos.max_len": ("pos", "learned", {"max_len": HUGE}),
    "ffn.experts": ("ffn", "moe", {"experts": HUGE}),
}


@pytest.mark.parametrize("group, name, options", HUGE_SIZES.values(), ids=HUGE_SIZES.keys())
def test_a_huge_size_is_counted_in_well_under_a_second(group, name, options):
    cfg = tiny(group, name)
    {"attn": cfg.attn, "pos": cfg.pos, "ffn": cfg.ffn_kind}[group].options.update(options)
    model_size(cfg)  # the first count of a kind imports its modules
    start = time.perf_counter()
    size = model_size(cfg)
    assert time.perf_counter() - start < 1.0
    assert size.training_bytes("32-true") > HUGE * 4


def test_huge_model_fields_are_counted_at_once():
    cfg = tiny("pos", "alibi")
    model_size(cfg)
    start = time.perf_counter()
    deep = ModelConfig(**{**cfg.__dict__, "n_layers": 10 ** 6})
    assert model_size(deep).parameters > 10 ** 6 * 12 * 32 ** 2
    assert model_size(ModelConfig(**{**cfg.__dict__, "vocab_size": 10 ** 9})).parameters > 32 * 10 ** 9
    wide = ModelConfig(**{**cfg.__dict__, "d_model": HUGE, "n_heads": HUGE})  # ALiBi's slopes: one per head
    with pytest.raises(TooLargeToCount):
        model_size(wide)
    assert time.perf_counter() - start < 1.0


def test_training_bytes_are_each_parameter_four_times_at_the_precisions_width():
    size = model_size(tiny("ffn", "moe"))
    floats = size.parameters * STATE_COPIES + size.float_buffers
    assert size.training_bytes("32-true") == floats * 4 + size.other_buffer_bytes
    assert size.training_bytes("bf16-mixed") == floats * 4 + size.other_buffer_bytes  # float32 weights
    assert size.training_bytes("64-true") == floats * 8 + size.other_buffer_bytes


def test_a_count_meets_no_python_meta_kernel():
    """On meta, random draws and some arithmetic run Python kernels whose first call imports torch._dynamo or sympy
    (seconds): every command counts its model, so a count that met one would cost every command that long."""
    code = ("import sys; from test_model_size import ENTRIES, tiny; from blocklab.model.size import model_size; "
            "[model_size(tiny(group, name)) for group, name in ENTRIES]; "
            "print([name for name in ('torch._dynamo', 'sympy') if name in sys.modules])")
    tests = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", code], cwd=tests, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
