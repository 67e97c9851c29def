"""docs/findings/README.md: one row per exercise or claim (a sweep file), which a reader can scan.

Each row: its exercise (or source), the question, an answer of at most ANSWER_LIMIT characters (the best setting
on the question's metric and how many are not distinguishable from it: page_text.short_answer), "agrees" in
exactly one of AGREES' four words, "holds at scale?" (for a claim with a ladder, its own or one whose sweep file
says `ladder_of` it: the ladder page's transfer verdict said of the claim, report/ladder_page.holds, at most
ANSWER_LIMIT characters, linked to the page's section; "–" elsewhere), its seeds and its page. A sweep measured at
several `study.scale`s (and so on several machines) is one row: "at 1x: ...; at 4x: ...", with each scale's verdict
where they differ, and the agrees word of the largest scale measured (the longest training, the one a reader should
trust first)."""
import re
from collections import Counter
from pathlib import Path

from blocklab import folder
from blocklab.report import ladder_page
from blocklab.report.findings_data import ladders_of, read_jsonl
from blocklab.report.judge import AGREES, groups_of, judge
from blocklab.report.markdown import ENV
from blocklab.report.page_text import GUIDE, short_answer, study_line, sweep_study, SWEEPS

ANSWER_LIMIT = 140
EXERCISES = [f"1.{i}" for i in range(1, 15)]
PROOF = "1.6"  # a proof, answered by a test (tests/model/test_position.py), not by a sweep
PROOF_TEST = "tests/model/test_position.py"
SCALED = re.compile(r"(?P<base>.+)-scale(?P<scale>[0-9.]+)")


def sweep_names() -> list[str]:
    return sorted(p.stem for p in SWEEPS.glob("*.yaml"))


def _exercise_key(row: dict):
    first = row["exercises"][0] if row["exercises"] else "9"
    return tuple(int(x) if x.isdigit() else 99 for x in re.findall(r"\w+", first)), row["name"]


def _scale_label(scale) -> str:
    return f"{scale:g}x" if isinstance(scale, (int, float)) else f"{scale}x"


def fold(parts: list[dict], limit: int = ANSWER_LIMIT) -> str:
    """One answer from each scale's (`scale`, `outcome`, meta, jobs): "at 1x: ...; at 4x: ...", within `limit`."""
    if len(parts) == 1:
        return short_answer(parts[0]["meta"], parts[0]["jobs"], limit)
    differ = len({AGREES[p["outcome"]] for p in parts}) > 1
    heads = [f"at {_scale_label(p['scale'])}" + (f" ({AGREES[p['outcome']]})" if differ else "") + ": " for p in parts]
    room = (limit - len("; ") * (len(parts) - 1) - sum(len(h) for h in heads)) // len(parts)
    texts = [short_answer(p["meta"], p["jobs"], room) for p in parts]
    spare = sum(room - len(t) for t in texts if not t.endswith("…"))
    cut = [i for i, t in enumerate(texts) if t.endswith("…")]
    for i in cut:  # what the parts that fit leave over goes to those that did not
        texts[i] = short_answer(parts[i]["meta"], parts[i]["jobs"], room + spare // len(cut))
    return "; ".join(h + t for h, t in zip(heads, texts))[:limit]


def holds(stem: str, measured: dict[str, list[dict]]) -> list[dict]:
    """The "holds at scale?" cell of sweep `stem`: per ladder that tests its claim (itself, if it is one), the
    transfer verdict said of the claim (not measured yet: said so; too few rungs: "no fit yet")."""
    own = [p for p in measured.get(stem, []) if p["scale"] == 1 and isinstance(p["meta"]["study"].get("ladder"), dict)]
    cells = []
    for name in ([stem] if own else []) + ladders_of(stem):
        part = next((p for p in measured.get(name, []) if p["scale"] == 1), None)
        said = "not measured yet" if part is None else ladder_page.holds(part["meta"], part["jobs"]) or "no fit yet"
        cells.append({"stem": name, "anchor": ladder_page.ANCHOR,
                      "said": said if len(said) <= ANSWER_LIMIT else said[:ANSWER_LIMIT - 1].rstrip() + "…"})
    return cells


def index_rows(out: Path) -> list[dict]:
    """One row per sweep: its sweep file's, or a measured page's; pages of other scales fold into their sweep's."""
    measured: dict[str, list[dict]] = {}
    for data in sorted(out.glob("*.jsonl")):
        meta, jobs = read_jsonl(data)
        match = SCALED.fullmatch(data.stem)
        base = match["base"] if match and meta.get("scale") not in (None, 1) else data.stem
        outcome, _ = judge(meta, jobs)
        seeds = Counter(len(m) for m in groups_of(meta, jobs).values())
        measured.setdefault(base, []).append({"scale": meta.get("scale", 1), "outcome": outcome, "meta": meta,
                                              "jobs": jobs, "seeds": seeds})
    rows = []
    for stem in sorted(set(measured) | set(sweep_names())):
        parts = sorted(measured.get(stem, []), key=lambda p: p["scale"])
        if parts:
            study = study_line(parts[0]["meta"]["study"])
            counts = [n for p in parts for n in p["seeds"]]
            seeds = "–" if not counts else str(min(counts)) if min(counts) == max(counts) else \
                f"{min(counts)}-{max(counts)}"
            answer, agrees = fold(parts), AGREES[parts[-1]["outcome"]]
        else:
            study, answer, agrees, seeds = study_line(sweep_study(stem)), "Not measured yet.", AGREES["none"], "–"
        rows.append({"name": stem, **study, "answer": answer, "agrees": agrees, "seeds": seeds,
                     "holds": holds(stem, measured),
                     "others": [(_scale_label(p["scale"]), p["meta"]["sweep"]) for p in parts if p["scale"] != 1]})
    return sorted(rows, key=_exercise_key)


def render_index(out: Path) -> str:
    rows = index_rows(out)
    named = {x for r in rows for x in r["exercises"]}
    return ENV.get_template("findings_index.md.j2").render(
        rows=rows, missing=[x for x in EXERCISES if x not in named and x != PROOF], proof=PROOF, proof_test=PROOF_TEST,
        limit=ANSWER_LIMIT, guide=GUIDE)


def write_index(out: Path) -> Path:
    return folder.write_text(out, "README.md", render_index(out))
