"""BlockLab: experiments on Transformer architecture choices."""
from omegaconf import OmegaConf

__version__ = "0.1.0"

# `${mul:300,${study.scale}}` in sweep files: training steps scaled by one knob.
OmegaConf.register_new_resolver("mul", lambda a, b: int(a * b), replace=True)
