"""Shared by the model tests: every position scheme and attention variant they sweep."""
from blocklab.model.position import POSITION_SCHEMES

SCHEMES = list(POSITION_SCHEMES)  # a newly registered scheme is tested automatically
assert {"none", "sinusoidal", "learned", "rope", "alibi", "t5_bias"} <= set(SCHEMES)
VARIANTS = {
    "mha": dict(n_kv_heads=None),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "local": dict(window=3),
}
