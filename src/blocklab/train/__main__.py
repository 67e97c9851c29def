"""`python -m blocklab.train [overrides]`: train one configured model (or a sweep, with -m)."""
from blocklab.cli import main

if __name__ == "__main__":
    main()
