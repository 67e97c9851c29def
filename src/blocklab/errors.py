import argparse
import sys
import unicodedata


class ConfigError(ValueError):
    """A bad config or data input, detected before any work. The message names the key and the fix."""


class RunFolderError(ConfigError):
    """A run folder that is damaged or owned by another process: refused, and nothing is written to it (a sweep
    records no result for such a job either, so the folder stays as the user left it)."""


# Bidirectional overrides and isolates: shown as they are, they reorder the text around them on the terminal.
_BIDI = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def printable(text: str) -> str:
    """`text` with every control character (ESC, CR, backspace, DEL, C1 codes) and bidi override escaped as
    Python writes it (\\x1b, \\r, \\u202e): a folder or file name from someone else's folder is shown as its
    characters, never as a colour, a cursor move or a line rewritten. Newlines are the caller's to split on."""
    return "".join(ch.encode("unicode_escape").decode("ascii")
                   if (unicodedata.category(ch) == "Cc" and ch != "\n") or ch in _BIDI else ch for ch in text)


def print_error(error: str, prefix: str = "error: ") -> None:
    """Each line of `error` (one per problem) on stderr as "error: ...", its control characters escaped."""
    for line in filter(None, error.split("\n")):
        print(f"{prefix}{printable(line)}", file=sys.stderr)


def exit_on(error: str | None) -> None:
    """A command line's refusal: each line of `error` as "error: ..." on stderr, then exit 2; nothing when None."""
    if error is not None:
        print_error(error)
        raise SystemExit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusal (a missing argument, an integer option given a word) is one line and exit 2, as every
    other refusal is, instead of the usage and then the error."""

    def error(self, message: str):
        exit_on(f"{message}; see {self.prog} --help")
