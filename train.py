"""Train one configured model: `python train.py norm=pre_ln pos=rope`."""
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from blocklab.errors import ConfigError


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from blocklab.train.run import run  # heavy imports only after Hydra parsed the command line

    try:
        return run(cfg)
    except ConfigError as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        _remove_if_empty(Path(HydraConfig.get().runtime.output_dir))
        raise SystemExit(2) from None


def _remove_if_empty(run_dir: Path) -> None:
    """Hydra creates the run directory before the config is checked; leave no empty trace."""
    try:
        run_dir.rmdir()  # only ever succeeds on an empty directory
    except OSError:
        pass


if __name__ == "__main__":
    main()
