from blocklab.model.config import ModelConfig
from blocklab.model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]
