"""The report's HTML, rendered only through Jinja2 templates (templates/*.html.j2) with autoescape on.

Everything in a run or sweep folder is untrusted: task and study names, questions, override values, seeds, errors
and benchmark notes reach the page, so a crafted folder must not put markup into it. Python builds each section as
plain data (the blocks below) and the templates write every string of it escaped; no HTML is written anywhere else,
and nothing is marked safe. Images are PNG bytes matplotlib drew, inlined as base64 data URIs."""
import base64
from dataclasses import dataclass, field

import jinja2

ENV = jinja2.Environment(loader=jinja2.PackageLoader("blocklab.report", "templates"), autoescape=True,
                         undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


@dataclass(frozen=True)
class Code:
    """A run of text set as code (a command) inside a paragraph."""

    text: str


@dataclass
class Para:
    """A paragraph: an optional bold lead ("Budget."), then text runs (strings, or Code)."""

    lead: str = ""
    parts: tuple = ()
    cls: str = ""
    kind: str = "para"


@dataclass
class Items:
    """A bulleted list: strings, or items with `text` and sub-items `details` (a Finding)."""

    items: list
    kind: str = "items"


@dataclass
class Table:
    header: list[str]
    body: list[list[str]]
    cls: str = ""
    kind: str = "table"


@dataclass
class Figure:
    src: str  # a data URI of PNG bytes (png_uri), never a string from the folder
    alt: str
    caption: str
    kind: str = "figure"


@dataclass
class Section:
    """A report section: `blocks` in the order the page shows them."""

    id: str
    title: str
    blocks: list = field(default_factory=list)


def para(lead: str, *parts) -> Para:
    return Para(lead, tuple(parts))


def png_uri(png: bytes) -> str:
    if not png.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError("an inlined figure must be PNG bytes matplotlib wrote")
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def cells(row) -> list[str]:
    """A table row as strings: None reads "–"."""
    return ["–" if c is None else str(c) for c in row]


def section(s: Section) -> str:
    """One section's HTML (what build_report puts in the page; tests read it)."""
    return ENV.get_template("section.html.j2").render(s=s)


def page(title: str, intro: str, sections: list[Section]) -> str:
    return ENV.get_template("index.html.j2").render(title=title, intro=intro, sections=sections)
