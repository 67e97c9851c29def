import sys


class ConfigError(ValueError):
    """A bad config or data input, detected before any work. The message names the key and the fix."""


def exit_on(error: str | None) -> None:
    """A command line's refusal: each line of `error` as "error: ..." on stderr, then exit 2; nothing when None."""
    if error is not None:
        for line in error.splitlines():
            print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2)
