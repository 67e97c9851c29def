"""A ladder's findings page (report/ladder_page.py through findings.write_page): its section is drawn from the jsonl
alone, its verdict is the one the synthetic laws were built to reach (test_scaling.py's crossing pair: A = 1.8 +
A_A N^-0.5 and B = 2.0 + 25 N^-0.35 cross at N = 1e5, solved by hand there), the parametrization it states is the
one the runs recorded, untrusted setting names stay text, a 1x page links the ladder that tests its claim, and the
committed activations_ladder page carries every part of the section."""
import json
from pathlib import Path

import numpy as np
import pytest

from blocklab.report import findings, findings_index, ladder_page, page_text, scaling
from test_scaling import A_CROSS, B_LAW, NS, SEEDS, law

ROOT = Path(__file__).resolve().parents[1]
RUNGS = {f"r{i}": n for i, n in enumerate(NS)}
SETUP = {"format": findings.FORMAT, "seeds": list(SEEDS), "task": ["lm"], "d_model": [16], "n_layers": [2],
         "n_heads": [2], "steps": [10], "scale": 1, "machines": {}, "train_time_s": 1.0, "commit": None,
         "commit_recorded": False, "date": "d", "command": "python train.py -m sweep=x", "report": "r"}


def _study(name: str, better: str = "a", than: str = "b") -> dict:
    return {"name": name, "compare": ["act", "study.rung"], "metrics": ["final_val_loss"], "question": "Q?",
            "ladder": {"sizes": ["model.d_model"], "rungs": {r: {"model.d_model": 1} for r in RUNGS},
                       "budget": {"rule": "tokens", "tokens": 1}},
            "verdict": {"claim": f"{better} beats {than}", "metric": "final_val_loss", "better": {"act": better},
                        "than": {"act": than}}}


def _jobs(laws: dict, param: str | None = None, seed: int = 5) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"job": f"{act}-{rung}-{s}", "setting": {"act": act, "study.rung": rung}, "seed": s, "status": "completed",
             "choices": {"param": param} if param else {}, "params": int(n), "eval": [], "metrics": {},
             "final_val_loss": float(curve(n) + rng.normal(0, 0.002))}
            for act, curve in laws.items() for rung, n in RUNGS.items() for s in SEEDS]


def _write(path: Path, study: dict, jobs: list[dict]) -> Path:
    meta = {**SETUP, "sweep": path.stem, "jobs": len(jobs), "study": study}
    path.write_text("".join(json.dumps(x) + "\n" for x in [meta, *jobs]), encoding="utf-8")
    return path


CROSSING = {"a": law(1.8, A_CROSS, 0.5), "b": B_LAW}


def test_a_ladder_page_draws_its_section_and_figure_from_its_jsonl(tmp_path):
    data = _write(tmp_path / "x.jsonl", _study("x"), _jobs(CROSSING))
    findings.write_page(data)
    page = (tmp_path / "x.md").read_text(encoding="utf-8")
    section = page[page.index("### Does it hold at scale?"):page.index("**Question.**")]
    # the laws cross at 1e5, inside the measured 1e4-1e6: A trails at 1e4 and leads at 1e6
    assert "**Transfer verdict: reverses within the measured range: crosses near N_x = " in section
    n_x = float(section.split("crosses near N_x = ")[1].split(" ")[0])
    assert n_x == pytest.approx(1e5, rel=0.1)
    assert "(a ahead at the largest rung)" in section and "yes: reverses within the measured range" in section
    assert "| a | " in section and "| b | " in section  # a fit per setting
    assert "[reading a transfer verdict](transfer_verdicts.md)" in section
    assert "Decision accuracy, smallest against largest rung" in section and ": 0.00 [0.00, 0.00]." in section
    png = tmp_path / "x.ladder.png"
    assert "![loss against parameters](x.ladder.png)" in section and png.read_bytes()[:4] == b"\x89PNG"
    meta, jobs = findings.read_jsonl(data)
    assert png.read_bytes() == ladder_page.page_png(meta, jobs)
    assert page == page_text.page_text(data)  # a re-rendering gives the same page


def test_the_claim_s_side_decides_yes_or_no():
    """The same measured order said of opposite claims: "a beats b" holds; "b beats a" is a no, b trailing."""
    rows = ladder_page.rows_of(_jobs(CROSSING))
    for better, than, said in (("a", "b", "yes: reverses"), ("b", "a", "no: a ahead, reverses")):
        comparison = ladder_page.analysis(rows, _study("x", better, than), resamples=200)[2][0]
        assert ladder_page.for_the_claim(comparison, better).startswith(said)


def test_the_page_states_the_parametrization_the_runs_recorded():
    old = ladder_page.parametrization(ladder_page.rows_of(_jobs(CROSSING)))
    assert "param=sp (30 of 30 runs)" in old and "30 of them record no `param`" in old and "Not µP" in old
    mup = ladder_page.parametrization(ladder_page.rows_of(_jobs(CROSSING, param="mup")))
    assert mup.startswith("Parametrization: param=mup (30 of 30 runs): one learning rate") and "Not µP" not in mup


def test_untrusted_setting_names_stay_text():
    laws = {"a|**x**": CROSSING["a"], "b": B_LAW}
    text, _ = ladder_page.ladder_section(ladder_page.rows_of(_jobs(laws)), _study("x", "a|**x**"), resamples=50)
    assert "| a\\|\\*\\*x\\*\\* |" in text and "**x**" not in text


def test_a_ladder_below_three_rungs_says_so_and_draws_nothing(tmp_path):
    jobs = [j for j in _jobs(CROSSING) if j["setting"]["study.rung"] in ("r0", "r1")]
    data = _write(tmp_path / "x.jsonl", _study("x"), jobs)
    findings.write_page(data)
    assert "no fit yet" in (tmp_path / "x.md").read_text(encoding="utf-8")
    assert not (tmp_path / "x.ladder.png").exists()


def test_a_1x_page_links_the_ladder_that_tests_its_claim(tmp_path, monkeypatch):
    monkeypatch.setattr(page_text, "ladders_of", lambda name: ["x_ladder"] if name == "x" else [])
    flat = {"name": "x", "compare": ["act"], "metrics": ["final_val_loss"], "question": "Q?",
            "verdict": {"claim": "a beats b", "metric": "final_val_loss", "better": {"act": "a"},
                        "than": {"act": "b"}}}
    base = _write(tmp_path / "x.jsonl", flat, [{**j, "setting": {"act": j["setting"]["act"]}}
                                               for j in _jobs(CROSSING) if j["setting"]["study.rung"] == "r0"])
    assert "[x_ladder](x_ladder.md#does-it-hold-at-scale): not measured yet." in page_text.page_text(base)
    _write(tmp_path / "x_ladder.jsonl", _study("x_ladder"), _jobs(CROSSING))
    assert "x_ladder.md#does-it-hold-at-scale): yes: reverses within the measured range" in page_text.page_text(base)


def test_the_committed_activations_ladder_page_has_its_section():
    """Generated from docs/findings/activations_ladder.jsonl (test_findings re-renders it byte for byte); here: the
    section's parts are there, the parametrization is the one the runs recorded, and the 1x page links it."""
    page = (ROOT / "docs/findings/activations_ladder.md").read_text(encoding="utf-8")
    meta, jobs = findings.read_jsonl(ROOT / "docs/findings/activations_ladder.jsonl")
    recorded = {(j.get("choices") or {}).get("param", "sp") for j in jobs}
    assert f"Parametrization: param={recorded.pop()} (45 of 45 runs)" in page and not recorded
    for part in ("| swiglu | ", "| gelu | ", "| relu | ", "**Transfer verdict: ", "Decision accuracy",
                 "![loss against parameters](activations_ladder.ladder.png)"):
        assert part in page, part
    holds = ladder_page.holds(meta, jobs)
    assert f"(activations_ladder.md#does-it-hold-at-scale): {holds}" in \
        (ROOT / "docs/findings/activations.md").read_text(encoding="utf-8")  # then its token ladder's
    index = (ROOT / "docs/findings/README.md").read_text(encoding="utf-8").splitlines()
    row = next(line for line in index if line.endswith("| [activations](activations.md) |"))
    assert f"| [{holds}](activations_ladder.md#does-it-hold-at-scale); [" in row  # then activations_tokens



@pytest.mark.parametrize("stem, base, settings", [("moe_ladder", "moe", ("dense", "moe")),
                                                  ("recipe_ladder", "recipe", ("gpt2_recipe", "llama_recipe")),
                                                  ("attention_kinds_ladder", "attention_kinds",
                                                   ("deltanet", "gla", "linear", "mha")),
                                                  ("modifications_ladder", "modifications",
                                                   ("attn-linear", "baseline", "norm-deepnorm", "pos-learned",
                                                    "pos-none", "pos-t5_bias"))])
def test_a_committed_ladder_page_has_its_section_and_its_1x_page_links_it(stem, base, settings):
    """moe_ladder, recipe_ladder, attention_kinds_ladder and modifications_ladder, generated from their jsonl
    (test_findings re-renders them byte for byte): 15 runs a setting under param=mup, a row per setting, the verdict, the decision accuracy and the
    figure; the 1x page and its index row carry the ladder's verdict."""
    page = (ROOT / f"docs/findings/{stem}.md").read_text(encoding="utf-8")
    meta, jobs = findings.read_jsonl(ROOT / f"docs/findings/{stem}.jsonl")
    assert stem in page_text.ladders_of(base)  # its sweep file says `ladder_of: <base>`
    assert f"Parametrization: param=mup ({len(jobs)} of {len(jobs)} runs): one learning rate serves every width" \
        in page
    assert len(jobs) == 15 * len(settings)  # 5 rungs x 3 seeds per setting
    for part in (*(f"| {s} | " for s in settings), "**Transfer verdict: ", "Decision accuracy",
                 f"![loss against parameters]({stem}.ladder.png)"):
        assert part in page, part
    holds = ladder_page.holds(meta, jobs)
    assert holds is not None  # the claim's two sides are both on the ladder
    assert f"({stem}.md#does-it-hold-at-scale): {holds}." in (ROOT / f"docs/findings/{base}.md").read_text(encoding="utf-8")
    index = (ROOT / "docs/findings/README.md").read_text(encoding="utf-8").splitlines()
    row = next(line for line in index if f"| [{base}]({base}.md)" in line)  # moe's row links its 4x page too
    assert f"| [{holds}]({stem}.md#does-it-hold-at-scale) | " in row  # then the 1x page's seeds (moe: 3-10, decided)

def _index_folder(tmp_path, monkeypatch, said=None):
    monkeypatch.setattr(findings_index, "ladders_of", lambda name: ["x_ladder"] if name == "x" else [])
    if said is not None:
        monkeypatch.setattr(ladder_page, "holds", lambda meta, jobs: said)
    flat = {"name": "x", "compare": ["act"], "metrics": ["final_val_loss"], "question": "Q?",
            "verdict": {"claim": "a beats b", "metric": "final_val_loss", "better": {"act": "a"},
                        "than": {"act": "b"}}}
    _write(tmp_path / "x.jsonl", flat, [{**j, "setting": {"act": j["setting"]["act"]}}
                                        for j in _jobs(CROSSING) if j["setting"]["study.rung"] == "r0"])
    _write(tmp_path / "x_ladder.jsonl", _study("x_ladder"), _jobs(CROSSING))
    return {r["name"]: r for r in findings_index.index_rows(tmp_path)}


def test_the_index_says_whether_a_claim_holds_at_scale_where_it_has_a_ladder(tmp_path, monkeypatch):
    rows = _index_folder(tmp_path, monkeypatch)
    # the claim's 1x row and the ladder's own row both carry the ladder's verdict; every other row has none
    for name in ("x", "x_ladder"):
        (cell,) = rows[name]["holds"]
        assert cell["stem"] == "x_ladder" and cell["said"].startswith("yes: reverses within the measured range")
    assert all(not r["holds"] for name, r in rows.items() if name not in ("x", "x_ladder"))
    index = findings_index.render_index(tmp_path)
    assert "| holds at scale? |" in index and "[how to read\na transfer verdict](transfer_verdicts.md)" in index
    line = next(x for x in index.splitlines() if x.endswith("| [x](x.md) |"))
    assert "| [yes: reverses within the measured range: crosses near N_x = " in line
    other = next(x for x in index.splitlines() if x.endswith("| [activations](activations.md) |"))
    assert other.endswith("| not testable | – | – | [activations](activations.md) |")  # no ladder here: "–"


def test_an_index_cell_keeps_the_answer_length_rule(tmp_path, monkeypatch):
    rows = _index_folder(tmp_path, monkeypatch, said="holds but shrinks: " + "x" * 300)
    (cell,) = rows["x"]["holds"]
    assert len(cell["said"]) == findings_index.ANSWER_LIMIT and cell["said"].endswith("…")


# ---------------------------------------------------------------- docs/findings/transfer_verdicts.md
def _case(curve_a, noise=0.002, seed=3):
    from test_scaling import ladder

    rng = np.random.default_rng(seed)
    return scaling.compare({"a": ladder(curve_a, noise, rng), "b": ladder(B_LAW, noise, rng)}, "a", "b",
                           resamples=400)


# test_scaling.py's laws built for each verdict (A leads by 0.05 at 1e4 on a lower E; A leads by less each rung on a
# higher E until 1e7; one law; the crossing pair)
GROWING = law(1.7, (-0.05 + 0.3 + 25 * 1e4 ** -0.35) * 1e4 ** 0.3, 0.3)
SHRINKING = law(2.05, 25.0 - 0.05 * 1e7 ** 0.35, 0.35)


@pytest.mark.parametrize("curve, noise, steps, last", [
    (GROWING, 0.002, 4, "**holds and grows**"),
    (SHRINKING, 0.002, 4, "**holds but shrinks: crosses near N_x = "),
    (B_LAW, 0.01, 2, "**undetermined**"),
    (CROSSING["a"], 0.002, 3, "**reverses within the measured range: crosses near N_x = "),
])
def test_the_worked_example_walks_each_verdict_to_the_one_its_laws_were_built_for(curve, noise, steps, last):
    from blocklab.report import verdict_guide

    comparison = _case(curve, noise)
    said = verdict_guide.steps(comparison)
    assert len(said) == steps and last in said[-1]
    largest = comparison.measured[-1]
    gap = comparison.gaps[largest]
    assert f"N = {largest:,.0f}" in said[0] and f"{gap.value:.4f} [{gap.low:.4f}, {gap.high:.4f}]" in said[0]


def test_the_guide_s_example_is_read_from_the_committed_ladder(tmp_path):
    from blocklab.report import verdict_guide

    assert "not committed at this commit" in verdict_guide.render_guide(tmp_path)
    _write(tmp_path / f"{verdict_guide.EXAMPLE}.jsonl", _study(verdict_guide.EXAMPLE), _jobs(CROSSING))
    guide = verdict_guide.render_guide(tmp_path)
    meta, jobs = findings.read_jsonl(tmp_path / f"{verdict_guide.EXAMPLE}.jsonl")
    comparison = ladder_page.analysis(ladder_page.rows_of(jobs), meta["study"])[2][0]
    n_x = comparison.crossing_within
    assert f"**reverses within the measured range: crosses near N_x = {n_x.value:.3g}" in guide
    assert "Said of the claim: yes: reverses within the measured range" in guide
    assert "Decision accuracy over its 1 setting pairs: 0.00 [0.00, 0.00]." in guide
    committed = (ROOT / "docs/findings/transfer_verdicts.md").read_text(encoding="utf-8")
    assert committed == verdict_guide.render_guide(ROOT / "docs/findings")


def _with_bar(jobs: list[dict], bar: float) -> list[dict]:
    """The runs with an LM's learned bar recorded, as a run's task states it (a loss below `bar`)."""
    refs = {"learned": [{"name": "bigram", "metric": "loss", "value": bar}], "lines": []}
    return [{**j, "references": refs} for j in jobs]


def test_a_setting_that_did_not_learn_at_a_rung_is_left_out_and_its_claim_is_not_testable(tmp_path):
    """a's law sits at 3.84 at the smallest rung, above the bar 3.5, and below it at every other rung: a is left out
    of the fits, the claim "a beats b" is not testable across sizes, and the claim "b beats c" (c is b + 0.2, every
    rung below the bar) keeps its verdict: b ahead at the largest rung."""
    study = _study("x")
    study["verdict"]["also"] = [{"claim": "b beats c", "metric": "final_val_loss", "better": {"act": "b"},
                                 "than": {"act": "c"}}]
    laws = {**CROSSING, "c": lambda n: B_LAW(n) + 0.2}
    data = _write(tmp_path / "x.jsonl", study, _with_bar(_jobs(laws), 3.5))
    findings.write_page(data)
    page = (tmp_path / "x.md").read_text(encoding="utf-8")
    section = page[page.index("### Does it hold at scale?"):page.index("**Question.**")]
    assert "| a | r0 | 0 of 3 | validation loss 3.8" in section  # listed with its rung and why
    assert "| a | " not in section.split("| setting | E |")[1]  # and not fitted
    assert "| b | " in section.split("| setting | E |")[1] and "| c | " in section.split("| setting | E |")[1]
    assert ("Claim 1: a beats b. **Transfer verdict: not testable**: a did not learn its task at r0; said of the "
            "claim (the findings index's \"holds at scale?\"): not testable.") in section
    assert "Claim 2: b beats c. Gap L(b) - L(c)" in section and "(b ahead at the largest rung)" in section
    meta, jobs = findings.read_jsonl(data)
    said = ladder_page.holds(meta, jobs)
    assert said.startswith("not testable: a did not learn its task at r0 (the other claim: 1 yes")


def test_a_ladder_where_no_setting_learned_at_every_rung_fits_nothing():
    rows = ladder_page.rows_of(_with_bar(_jobs(CROSSING), 2.1))  # a and b are above 2.1 at the smaller rungs
    text, png = ladder_page.ladder_section(rows, _study("x"), figure="x.ladder.png", resamples=50)
    assert "No setting learned at every rung: nothing to fit." in text and png is None
    assert "**Transfer verdict: not testable**" in text
