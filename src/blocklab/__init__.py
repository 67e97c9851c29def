"""BlockLab: experiments on Transformer architecture choices."""
from omegaconf import DictConfig, OmegaConf

__version__ = "0.1.0"

# `${mul:300,${study.scale}}` in sweep files: training steps scaled by one knob.
OmegaConf.register_new_resolver("mul", lambda a, b: int(a * b), replace=True)


def _if_study(with_study: str, without: str, *, _root_: DictConfig) -> str:
    """`${if_study:A,B}`: A when a sweep file set `study` (its name), else B (conf/config.yaml's hydra.sweep)."""
    return with_study if OmegaConf.select(_root_, "study.name", default=None) is not None else without


OmegaConf.register_new_resolver("if_study", _if_study, replace=True)
