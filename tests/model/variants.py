"""Shared by the model tests: one tiny-model factory, and every registered position scheme, attention
kind and attention variant they sweep (a newly registered entry is tested automatically)."""
import torch

from blocklab.model import ModelConfig, build_model
from blocklab.model.attention import ATTENTION_KINDS
from blocklab.model.config import AttnConfig, InitConfig, PosConfig
from blocklab.model.position import POSITION_SCHEMES

SCHEMES = list(POSITION_SCHEMES)
KINDS = list(ATTENTION_KINDS)
assert {"none", "sinusoidal", "learned", "rope", "alibi", "t5_bias"} <= set(SCHEMES)
VARIANTS = {
    "mha": dict(n_kv_heads=None),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "local": dict(window=3),
    "softcap": dict(n_kv_heads=2, softcap=2.0),  # Gemma 2's soft-capped scores (its explicit path), GQA's grouping
}


def tiny_cfg(pos: str = "rope", causal: bool = True, n_layers: int = 2, std: float | None = 0.2,
             vocab_size: int = 20, max_len: int = 64, arch: str = "decoder", options: dict | None = None,
             **fields) -> ModelConfig:
    """4 heads of 8 dims; `fields` are attention options (n_kv_heads, window, kind...) or model fields,
    `options` the attention kind's own (n_features...). std None keeps the default init."""
    attn_keys = set(AttnConfig.__dataclass_fields__) - {"options"}
    attn = {k: fields.pop(k) for k in list(fields) if k in attn_keys}
    cfg = ModelConfig(arch=arch, vocab_size=vocab_size, max_len=max_len, d_model=32, n_layers=n_layers, n_heads=4,
                      pos=PosConfig(pos), attn=AttnConfig(causal=causal, options=options or {}, **attn),
                      init=InitConfig() if std is None else InitConfig("normal", std), **fields)
    assert cfg.errors() == []
    return cfg


def tiny_model(pos: str = "rope", seed: int = 0, **kw):
    """tiny_cfg's model in float64 and eval mode, its weights drawn from `seed`."""
    cfg = tiny_cfg(pos, **kw)
    torch.manual_seed(seed)
    return build_model(cfg).double().eval()
