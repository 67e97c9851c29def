"""Which overrides name a sweep job (conf/config.yaml's override_dirname.exclude_keys): results.json's swept
overrides, W&B tags, the report's columns and resume's rule of what changes results all read it. It reads the yaml
alone, so that the results contract and resume need nothing of the command line's checks."""
from functools import cache

from omegaconf import OmegaConf

from blocklab.paths import CONF_DIR


@cache
def job_name_excluded_keys() -> frozenset[str]:
    """Keys that are not part of a sweep job's identity (conf/config.yaml's override_dirname.exclude_keys):
    they do not change its results, or say where it writes. Hydra matches them exactly, as written."""
    conf = OmegaConf.load(CONF_DIR / "config.yaml")
    return frozenset(conf.hydra.job.config.override_dirname.exclude_keys)


def override_key(override: str) -> str:
    """The key an override sets: `+logger.mode=online` -> logger.mode, `~model.dropout` -> model.dropout."""
    return override.partition("=")[0].lstrip("+~").partition("@")[0]


def names_the_job(override: str) -> bool:
    """Whether an override (`pos=rope`, `+logger.mode=online`) is part of a sweep job's directory name, as
    Hydra decides it: not for the excluded keys, nor for Hydra's own (hydra.*, hydra/launcher)."""
    key = override_key(override)
    return key not in job_name_excluded_keys() and not key.startswith(("hydra.", "hydra/"))
