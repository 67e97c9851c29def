import argparse
import sys


class ConfigError(ValueError):
    """A bad config or data input, detected before any work. The message names the key and the fix."""


class RunFolderError(ConfigError):
    """A run folder that is damaged or owned by another process: refused, and nothing is written to it (a sweep
    records no result for such a job either, so the folder stays as the user left it)."""


def exit_on(error: str | None) -> None:
    """A command line's refusal: each line of `error` as "error: ..." on stderr, then exit 2; nothing when None."""
    if error is not None:
        for line in error.splitlines():
            print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusal (a missing argument, an integer option given a word) is one line and exit 2, as every
    other refusal is, instead of the usage and then the error."""

    def error(self, message: str):
        exit_on(f"{message}; see {self.prog} --help")
