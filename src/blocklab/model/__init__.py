from blocklab.model import linear_attention, linformer  # noqa: F401  (register attn.kind linear, performer, linformer)
from blocklab.model.config import ModelConfig
from blocklab.model.transformer import EncoderDecoder, Transformer, build_model

__all__ = ["ModelConfig", "Transformer", "EncoderDecoder", "build_model"]
