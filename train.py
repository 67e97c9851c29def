"""Train one configured model: `python train.py norm=pre_ln pos=rope`."""
import sys

import hydra
from omegaconf import DictConfig

from blocklab.errors import ConfigError


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from blocklab.train.run import run  # heavy imports only after Hydra parsed the command line

    try:
        return run(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
