"""BlockLab: experiments on Transformer architecture choices."""
from omegaconf import DictConfig, OmegaConf

__version__ = "0.1.0"

# `${mul:300,${study.scale}}` in sweep files: training steps scaled by one knob.
def _mul(a, b) -> int:
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):  # 'abc' * 800 is a string
        raise ValueError(f"mul needs two numbers, got {a!r} and {b!r}")
    return int(a * b)


OmegaConf.register_new_resolver("mul", _mul, replace=True)


# `${div:38400,${task.batch_size}}` in sweep files: steps for a fixed number of examples at any batch size.
def _div(a, b) -> int:
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (a, b)) or a % b:
        raise ValueError(f"div needs two positive integers, the first a multiple of the second, got {a!r} and {b!r}")
    return a // b


OmegaConf.register_new_resolver("div", _div, replace=True)


def _if_study(with_study: str, without: str, *, _root_: DictConfig) -> str:
    """`${if_study:A,B}`: A when a sweep file set `study` (its name), else B (conf/config.yaml's hydra.sweep)."""
    return with_study if OmegaConf.select(_root_, "study.name", default=None) is not None else without


OmegaConf.register_new_resolver("if_study", _if_study, replace=True)


def study_folder(name: str, scale) -> str:
    """A sweep file's output folder under outputs/sweeps: its name, and its scale when not 1 (a 4x study is
    another experiment, whose finished jobs must not stand for the 1x ones, nor the other way round)."""
    return name if scale == 1 else f"{name}-scale{scale:g}"


def _study_folder(name: str | None = None, *, _root_: DictConfig) -> str:
    """`${study_folder:}`: study_folder of the config's study.name and study.scale (conf/config.yaml);
    `${study_folder:pe_lm}`: another sweep's folder at this study's scale (the runs a continuation starts from)."""
    return study_folder(name or OmegaConf.select(_root_, "study.name"),
                        OmegaConf.select(_root_, "study.scale", default=1))


OmegaConf.register_new_resolver("study_folder", _study_folder, replace=True)

from blocklab import ladder  # noqa: E402,F401 - registers ${ladder:...}, which ladder sweep files read
