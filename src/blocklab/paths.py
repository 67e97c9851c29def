"""Where BlockLab's own files are, wherever the package is installed: low in the layers, so that every module that
composes a config (the CLI, the override checks, sweeps, analyze, bench, the tests) reads it from here."""
from pathlib import Path

# The config groups: Hydra's config_path for the CLI, and the config dir of its compose API everywhere else.
CONF_DIR = Path(__file__).resolve().parent / "conf"
