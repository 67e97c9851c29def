from blocklab.model import linear_attention, linformer, moe, ssmax  # noqa: F401  (register attn.kind and ffn.name entries)
from blocklab.model import base_conv, based, deltanet, gla  # noqa: F401  (register the recurrent attn.kind entries)
from blocklab.model import mla  # noqa: F401  (registers attn.kind=mla)
from blocklab.model import diff_attention, forgetting  # noqa: F401  (register attn.kind=diff and forgetting)
from blocklab.model import position_bias  # noqa: F401  (registers pos=alibi, t5_bias and fire)
from blocklab.model.config import ModelConfig
from blocklab.model.transformer import EncoderDecoder, Transformer, build_model

__all__ = ["ModelConfig", "Transformer", "EncoderDecoder", "build_model"]
