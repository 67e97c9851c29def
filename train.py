"""Train one configured model: `python train.py norm=pre_ln pos=rope` (same as `python -m blocklab.train`)."""
from blocklab.cli import main

if __name__ == "__main__":
    main()
