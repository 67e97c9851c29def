"""The `model.arch` registry, filled by model/transformer.py (decoder, encoder_decoder, encoder). It lives below both
the model and its config, so that the config (a value) names the architectures without importing the model."""
from blocklab.registry import Registry

ARCHITECTURES: Registry = Registry("model.arch")
