"""Train one configured model: `python train.py norm=pre_ln pos=rope` (same as `python -m blocklab.train`)."""
from blocklab.cli import run_and_exit

if __name__ == "__main__":
    run_and_exit()
