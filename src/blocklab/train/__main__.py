"""`python -m blocklab.train [overrides]`: train one configured model (or a sweep, with -m)."""
from blocklab.cli import run_and_exit

if __name__ == "__main__":
    run_and_exit()
