"""Markdown for the findings pages: untrusted text escaped so it shows literally on one line (`md`, every
template's finalize), a code span that holds any text (`code`), and the templates' environment."""
import re

import jinja2
from markupsafe import Markup

NUMERIC = re.compile(r"[-+–\d.,\[\]\s%e]*(\(1 seed\))?")


def md(value) -> str:
    """Untrusted text as Markdown that shows it literally, on one line (a table cell stays one cell)."""
    if isinstance(value, Markup):
        return value
    if value is None:
        return "–"
    text = " ".join(str(value).split())
    if NUMERIC.fullmatch(text) and "](" not in text:  # a number, interval or count: nothing Markdown reads
        return text
    text = text.replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = re.sub(r"([`*\[\]|#!])", r"\\\1", text)
    return re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", text)  # an intraword _ is never emphasis


def code(value) -> Markup:
    """A code span that holds any text: fenced by one more backtick than its longest run (CommonMark)."""
    text = " ".join(str(value).split())
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return Markup(f"{fence}{pad}{text}{pad}{fence}")


ENV = jinja2.Environment(loader=jinja2.PackageLoader("blocklab.report", "templates"), autoescape=False,
                         finalize=md, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                         keep_trailing_newline=True)
ENV.filters["code"] = code
