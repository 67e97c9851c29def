"""The words of a findings page, from its jsonl: the direct answer to the sweep's question, the one-line learning
banner and the table of what did not learn, the reference levels, the sweep's caveats (`notes:`), the verdicts at
other scales, and the page itself (templates/findings.md.j2).

The answer: the best setting on the question's metric (the first claim's, else the study's first metric; each
setting at its best learning rate where the sweep tries several), and every setting not distinguishable from it:
each compared with the best seed by seed, a paired t-test, Holm over those comparisons (family-wise 0.05). Settings
of different tasks are never compared with each other: a sweep over tasks answers per task."""
import glob
from dataclasses import dataclass
from pathlib import Path

from blocklab import folder, study_folder
from blocklab.report import stats
from blocklab.report.build import _direction
from blocklab.report.common import name as setting_name, order
from blocklab.report import ladder_page
from blocklab.report.findings_data import SWEEPS, ladders_of, read_jsonl, sweep_plots, sweep_study
from blocklab.report.claims import claims_line
from blocklab.report.judge import KEPT, OUTCOMES, groups_of, judge, judge_page, keys_of, metric_of, rule
from blocklab.report.learned import learned
from blocklab.report.markdown import ENV
from blocklab.report.page_tables import (_against_baseline, _table, _tuned_table, at_best, rate_metric, tuned,
                                        verdict_metric)
from blocklab.report.recall import FRACTION
from blocklab.report.section_text import speed_caveat

GUIDE = "transfer_verdicts.md"  # the page that explains a ladder section (report/verdict_guide.py writes it)
SPLIT = "task"  # a compare key whose settings are never compared with each other
NAMED = 6  # settings named in the answer before "and N more"


# ---------------------------------------------------------------- the direct answer
@dataclass
class Answer:
    """The best setting of one task (or of the page), its mean, and those not distinguishable from it."""

    task: str | None
    best: str
    short: str
    mean: float
    ties: list[str]
    shorts: list[str]
    others: int
    seeds: int
    learned: bool | None
    left_out: int = 0  # settings that did not learn their task, so are not compared


def _short(keys: list[str], key: tuple) -> str:
    """A setting in few characters: its value alone under one key, else key=value with the key's last part."""
    shown = [(k, v) for k, v in zip(keys, key) if k != SPLIT]
    if len(shown) == 1 and isinstance(shown[0][1], str) and not shown[0][1].replace(".", "").isdigit():
        return shown[0][1]  # a name (mha, rope_ntk) reads alone; a number or a boolean needs its key
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in shown) or "all runs"


def answers(meta: dict, jobs: list[dict]) -> tuple[str, list[Answer]]:
    """The question's metric and its answer per task (one, unless the sweep compares tasks)."""
    keys, metric = keys_of(meta), verdict_metric(meta)
    groups = groups_of(meta, jobs)
    groups = at_best(meta, groups, tuned(meta, groups))
    verdict = meta["study"].get("verdict")
    # a question about cost alone (cost_only: speed, memory) has no learning gate, as its claim has none
    learn = {} if isinstance(verdict, dict) and verdict.get("cost_only") is True else learned(groups)
    higher = _direction(metric) is not False
    parts: dict = {}
    for key, members in groups.items():
        part = dict(zip(keys, key)).get(SPLIT) if SPLIT in keys else None
        parts.setdefault(part, {})[key] = members
    out = []
    for part in sorted(parts, key=order):
        means = {k: sum(v) / len(v) for k, m in parts[part].items()
                 if (v := stats.finite([metric_of(j, metric) for j in m]))}
        if not means:
            continue
        # Only settings that learned their task (or whose learning is not judged) are compared: where none did,
        # the best is named, flagged, and compared with nothing.
        not_learned = [k for k in means if k in learn and not learn[k].learned]
        if len(not_learned) < len(means):
            means = {k: v for k, v in means.items() if k not in not_learned}
        best = (max if higher else min)(means, key=lambda k: (means[k], tuple(order(x) for x in k)))
        others = [k for k in means if k != best and k not in not_learned]
        ps = []
        for k in others:
            p = stats.paired_by_seed(parts[part][best], parts[part][k], lambda j: metric_of(j, metric))
            ps.append(None if p is None else p.p)
        holm = stats.holm(ps) if ps else []
        ties = sorted((k for k, h in zip(others, holm) if not h.rejected), key=lambda k: (-means[k] if higher else means[k]))
        e = learn.get(best)
        seeds = {r.get("seed") for r in parts[part][best]}
        pairs = {k: len(seeds & {r.get("seed") for r in parts[part][k]}) for k in ties}  # fewer where k lacks seeds
        out.append(Answer(part, setting_name(keys, best) or "all runs", _short(keys, best), means[best],
                          [f"{setting_name(keys, k)} ({stats.fmt(means[k])}{_fewer_pairs(pairs[k], len(seeds))})"
                           for k in ties], [_short(keys, k) for k in ties],
                          len(others), len(parts[part][best]), None if e is None else e.learned,
                          len(not_learned)))
    return metric, out


def _fewer_pairs(pairs: int, seeds: int) -> str:
    """What a tie rests on where it shares fewer seeds with the best than the best has: one pair cannot be tested."""
    if pairs >= seeds:
        return ""
    return f"; {pairs} seed{'s' if pairs != 1 else ''} paired" + (": too few to test" if pairs < 2 else "")


def answer_text(meta: dict, jobs: list[dict]) -> str:
    """One or two sentences: the best setting and every setting not distinguishable from it."""
    metric, found = answers(meta, jobs)
    if not found:
        return f"No setting recorded {metric}."
    way = {True: "highest", False: "lowest", None: "highest"}[_direction(metric)]
    said = []
    for a in found:
        where = f"On {a.task}, the" if a.task is not None else "The"
        learned_note = " (it did not learn its task)" if a.learned is False else ""
        if a.learned is False and a.left_out > 1:
            said.append(f"{where} {way} {metric} is {a.best}'s, {stats.fmt(a.mean)}, but none of the {a.left_out} "
                        "settings learned its task, so none is compared.")
            continue
        left = (f" {a.left_out} setting{'s' if a.left_out > 1 else ''} that did not learn {'their' if a.left_out > 1 else 'its'} task "
                f"{'are' if a.left_out > 1 else 'is'} not compared." if a.left_out and a.learned is not False else "")
        if not a.others:
            said.append(f"{where} only setting{' that learned' if left else ''}, {a.best}, has {metric} "
                        f"{stats.fmt(a.mean)}{learned_note}.{left}")
            continue
        ties = a.ties[:NAMED] + ([f"and {len(a.ties) - NAMED} more"] if len(a.ties) > NAMED else [])
        said.append(f"{where} {way} {metric} is {a.best}'s, {stats.fmt(a.mean)}{learned_note}; "
                    + (f"not distinguishable from it at {a.seeds} seed{'s' if a.seeds != 1 else ''} (paired by seed, "
                       f"Holm over {a.others} comparison{'s' if a.others != 1 else ''}): "
                       f"{'; '.join(ties)}." if a.ties else
                       ("the other setting is" if a.others == 1 else f"each of the other {a.others} settings is")
                       + " distinguishable from it (paired by seed, Holm).") + left)
    return " ".join(said)


def _values(label: str) -> str:
    """key=value, key=value -> value, value (the shortest a setting can read)."""
    return ", ".join(part.split("=", 1)[-1] for part in label.split(", "))


def short_answer(meta: dict, jobs: list[dict], limit: int) -> str:
    """The answer in at most `limit` characters, for the index: the longest of a few forms, most detail first."""
    metric, found = answers(meta, jobs)
    if not found:
        return f"no setting recorded {metric}"[:limit]

    def one(a: Answer, ties: str, short) -> str:
        head = f"{a.task}: " if a.task is not None else ""
        if a.learned is False and a.left_out > 1:
            return f"{head}none learned (best {short(a.short)}, {stats.fmt(a.mean)})"
        if not a.others and a.left_out:
            return f"{head}{short(a.short)} ({stats.fmt(a.mean)}), the only one learned"
        if not a.others:
            return f"{head}{stats.fmt(a.mean)}".strip()
        more = f" +{len(a.shorts) - 3}" if len(a.shorts) > 3 else ""
        sep = " / " if any(", " in x for x in a.shorts) else ", "  # settings of several keys: key=v, key=v / ...
        tail = {"names": f", tied: {sep.join(short(x) for x in a.shorts[:3])}{more}" if a.shorts else "",
                "count": f", {len(a.ties)}/{a.others} tied", "none": ""}[ties]
        return f"{head}{short(a.short)} best ({stats.fmt(a.mean)}){tail}"

    forms = [(m, ties, short) for short in (str, _values) for ties in ("names", "count", "none")
             for m in (True, False)]
    for with_metric, ties, short in forms:
        text = "; ".join(one(a, ties, short) for a in found)
        text = f"{metric}: {text}" if with_metric else text
        if len(text) <= limit:
            return text
    return text[:limit - 1].rstrip() + "…"


# ---------------------------------------------------------------- did every setting learn
def banner(meta: dict, groups) -> tuple[str, list[list[str]]]:
    """The one line a page opens its verdicts with, and the rows of its table of what did not learn."""
    learn = learned(groups)
    keys = keys_of(meta)
    lead = "Did every setting learn its task?"
    if not learn:
        return f"{lead} Not judged: these runs record no reference level and no exact match.", []
    failed = [(k, e) for k, e in learn.items() if not e.learned]
    if not failed:
        return f"{lead} Yes: all {len(learn)} settings clear their task's bar (reference levels below).", []
    rows = [[setting_name(keys, k) or "all runs", f"{e.learned_seeds} of {e.measured}", e.why()] for k, e in failed]
    return f"{lead} No: {len(failed)} of {len(learn)} settings did not; a claim over them is not testable.", rows


def levels(jobs: list[dict]) -> list[str]:
    """The reference levels the page's tasks state (tasks/references.py), each once."""
    seen = {}
    for j in jobs:
        refs = j.get("references") if isinstance(j.get("references"), dict) else {}
        for part in ("learned", "lines"):
            for x in refs.get(part) or []:
                if not (isinstance(x, dict) and isinstance(x.get("value"), (int, float))):
                    continue
                name, metric, value = x.get("name"), x.get("metric"), stats.fmt(x["value"])
                said = (f"{name} {metric} {value}" if part == "lines" else
                        f"learned below the {name} {metric}, {value}" if metric == "loss" else
                        f"learned at {metric} ≥ {value}")
                seen.setdefault(said, None)
    return list(seen)


# ---------------------------------------------------------------- the sweep file's words
def notes(meta: dict) -> list[str]:
    """The sweep's caveats: its file's `notes:` list now (a caveat may be added after the runs), else the list
    recorded with the data."""
    name = meta["study"].get("name")
    current = sweep_study(name).get("notes") if isinstance(name, str) and (SWEEPS / f"{name}.yaml").is_file() else None
    found = current if current is not None else meta["study"].get("notes")
    found = [str(n) for n in found] if isinstance(found, list) else []
    if meta.get("gate_declared_later"):
        found.append(f"The sweep file declared how the learned gate applies after these runs were measured "
                     f"({'; '.join(meta['gate_declared_later'])}); the claims are otherwise as they were at run time.")
    found += meta.get("duplicates") or []  # settings that ran one model under two names (findings_data.shown_once)
    if meta.get("target_note"):  # what steps_to_target counts to (targets.apply, when the page's data is read)
        found.append(meta["target_note"])
    return found


def study_line(study: dict) -> dict:
    exercise = study.get("exercise")
    exercises = [str(x) for x in (exercise if isinstance(exercise, list) else [exercise] if exercise else [])]
    return {"question": study.get("question") or "", "exercises": exercises, "source": study.get("source"),
            "paper": study.get("paper")}


def other_scales(data: Path, meta: dict) -> list[dict]:
    """For a 1x page (`data`, whose header is `meta`), its sweep measured at other `study.scale`s
    (`<sweep>-scale<K>.jsonl` beside it, by study_folder): scale, machines, steps, the verdict and the short answer
    there, so the page answers at each scale it was run at."""
    if meta.get("scale") != 1:
        return []
    rows = []
    for other in sorted(data.parent.glob(f"{glob.escape(data.stem)}-scale*.jsonl")):
        their, jobs = read_jsonl(other)
        scale = their.get("scale")
        if not isinstance(scale, (int, float)) or their.get("sweep") != study_folder(meta["sweep"], scale) \
                or other.stem != their["sweep"]:
            continue  # another sweep's name that only starts alike
        outcome, verdict = judge(their, jobs)
        rows.append({"scale": scale, "stem": other.stem, "machines": ", ".join(their["machines"]) or None,
                     "steps": "/".join(str(x) for x in their["steps"]), "outcome": OUTCOMES[outcome], "key": outcome,
                     "verdict": verdict, "meta": their, "jobs": jobs})
    return sorted(rows, key=lambda r: r["scale"])


def ladder_links(data: Path, meta: dict) -> list[dict]:
    """For a 1x page (`data`), the ladders that test its claim across sizes (findings_data.ladders_of), each with
    the transfer verdict said of the claim as its own page (`<ladder>.jsonl` beside it) gives it."""
    if meta.get("scale") != 1 or not isinstance(name := meta["study"].get("name"), str):
        return []
    links = []
    for stem in ladders_of(name):
        said = "not measured yet"
        if folder.exists(data.parent, f"{stem}.jsonl"):
            said = ladder_page.holds(*read_jsonl(data.parent / f"{stem}.jsonl")) or "no fit yet"
        links.append({"stem": stem, "holds": said, "anchor": ladder_page.ANCHOR})
    return links


# ---------------------------------------------------------------- the page
def render_page(meta: dict, jobs: list[dict], figure: list | None, scales: list[dict] = (),
                ladders: list[dict] = ()) -> str:
    """A measured page, from its jsonl (and, for a 1x page, the verdicts of its other scales' jsonl and of the
    ladders that test its claim; a ladder's own page draws its section: report/ladder_page.py)."""
    groups = groups_of(meta, jobs)
    verdicts = judge_page(meta, jobs)
    best = tuned(meta, groups)
    # a learning-rate grid first: each setting at its best rate, where a baseline row would pick one rate of many
    table = (_tuned_table(meta, groups, best) if best else
             _against_baseline(meta, groups) if meta["study"].get("baseline") else _table(meta, groups))
    failed = [j for j in jobs if j.get("status") not in KEPT]
    diverged = [j for j in jobs if j.get("status") == "diverged"]
    rows = [v.row for v in verdicts if v.row]
    line, not_learned = banner(meta, at_best(meta, groups, best))
    hours = meta["train_time_s"] / 3600
    return ENV.get_template("findings.md.j2").render(
        meta=meta, study=study_line(meta["study"]), answer=answer_text(meta, jobs), banner=line,
        not_learned=not_learned, levels=levels(jobs), notes=notes(meta) + [c for c in [speed_caveat(jobs)] if c],
        table=table, tuned=best is not None,
        rate_metric=rate_metric(meta) if rate_metric(meta) != verdict_metric(meta) else None,
        range_fraction=f"{FRACTION:g}", verdicts=[(OUTCOMES[v.outcome], v.sentence) for v in verdicts],
        comparisons=rows, claims=len(rows), floor=verdicts[0].floor, flips=stats.MIN_FLIP_PAIRS,
        cl_formula=stats.CL_FORMULA, outcome=OUTCOMES[verdicts[0].outcome], figures=figure or [], failed=failed,
        diverged=diverged, settings=len(groups),
        time=f"{meta['train_time_s']:,.0f} s" + (f" ({hours:.1f} h)" if hours >= 1 else ""),
        seeds=", ".join(str(s) for s in meta["seeds"]), left_out=meta.get("left_out") or [],
        not_run=meta.get("not_run") or [], scales=list(scales), rule=rule(meta), claims_edited=claims_line(meta, jobs),
        ladder=ladder_page.page_section(meta, jobs, guide=GUIDE), ladders=list(ladders))


def render_unmeasured(name: str) -> str:
    """The page of a sweep with no committed data: its first line says so; no number on it."""
    study = sweep_study(name)
    return ENV.get_template("findings_unmeasured.md.j2").render(
        name=name, study=study_line(study), verdict=study.get("verdict") or {},
        notes=[str(n) for n in study.get("notes") or []])


def figure_files(data: Path, meta: dict, jobs: list[dict]) -> list[tuple[str, str | None]]:
    """The page's figures (report/figures.py: one per plot its sweep's `plots:` names): file name and caption."""
    from blocklab.report import figures

    plots = sweep_plots(meta["study"].get("name")) or meta["study"].get("plots") or []
    return [(figures.page_png_name(data.stem, i), note)
            for i, (note, _) in enumerate(figures.page_figures(meta, jobs, plots))]


def page_text(data: Path) -> str:
    """A measured page as its data renders it now, with its figures beside it."""
    meta, jobs = read_jsonl(data)
    return render_page(meta, jobs, figure_files(data, meta, jobs), other_scales(data, meta), ladder_links(data, meta))
