"""A findings page's words on hand-made page data (report/learned.py, page_text.py, findings_index.py): a claim over
settings that did not learn is "not testable" with the reason first, whatever its metric; a claim that one side
learns what the other cannot needs only its winner to have learned; a claim about cost alone has no gate; an LM
learned below its bigram loss; the answer names the best setting and those not distinguishable from it; the index's
answers stay within 140 characters and its "agrees" column within four words."""
import json
import re
from pathlib import Path

import pytest

from blocklab.report import findings_index, learned, page_text
from blocklab.report.judge import AGREES, judge
from blocklab.tasks.references import Level

ROOT = Path(__file__).resolve().parents[1]
COPY = {"learned": [{"name": "learned", "metric": "exact_match", "value": 0.9}],
        "lines": [{"name": "chance", "metric": "loss", "value": 2.833}]}
LM = {"learned": [{"name": "bigram", "metric": "loss", "value": 2.5}],
      "lines": [{"name": "unigram", "metric": "loss", "value": 3.3}]}
SETUP = {"format": 1, "sweep": "x", "jobs": 6, "seeds": [0, 1, 2], "task": ["copy"], "d_model": [64], "n_layers": [2],
         "n_heads": [4], "steps": [10], "scale": 1, "machines": {}, "train_time_s": 1.0, "commit": None,
         "commit_recorded": False, "date": "d", "command": "c", "report": "r"}


def _meta(metric: str, **claim) -> dict:
    return {**SETUP, "study": {"name": "x", "compare": ["pos"], "metrics": [metric], "paper": "P",
                               "verdict": {"claim": "A beats B", "metric": metric, "better": {"pos": "a"},
                                           "than": {"pos": "b"}, **claim}}}


def _jobs(metric: str, values: dict[str, list[float]], learned: dict[str, float], refs=COPY) -> list[dict]:
    """Runs of pos=<name>, one per seed; `learned`: each setting's in-distribution exact match (copy) or validation
    loss (an LM, refs=LM)."""
    out = []
    for name, vs in values.items():
        for seed, v in enumerate(vs):
            level = learned[name]
            em, loss = (level, 1.0) if refs is COPY else (None, level)
            out.append({"job": f"{name}-{seed}", "setting": {"pos": name}, "seed": seed, "choices": {},
                        "status": "completed", "in_distribution_exact_match": em, "final_val_loss": loss,
                        "metrics": {metric: v}, "references": refs,
                        "eval": [{"length": 4, "in_distribution": True, "exact_match": em, "loss": loss}]})
    return out


@pytest.mark.parametrize("metric, values", [
    ("final_train_loss", {"a": [1.0, 1.1, 1.2], "b": [2.0, 2.2, 2.1]}),  # a training loss
    ("tokens_per_s", {"a": [900, 950, 1000], "b": [100, 120, 110]}),  # a speed from the training jobs
    ("diverged", {"a": [0, 0, 0], "b": [1, 1, 1]}),
])
def test_a_claim_over_settings_that_did_not_learn_is_not_testable_on_any_metric(metric, values):
    jobs = _jobs(metric, values, {"a": 0.3, "b": 0.95})
    outcome, sentence = judge(_meta(metric), jobs)
    assert outcome == "learn" and AGREES[outcome] == "not testable"
    assert sentence.startswith("Not testable: pos=a did not learn its task (pos=a: in-distribution exact match "
                               "0.300 < 0.900 (0 of 3 seeds clear it))")
    assert judge(_meta(metric), _jobs(metric, values, {"a": 0.95, "b": 0.95}))[0] != "learn"


def test_an_lm_learned_below_its_bigram_loss():
    values = {"a": [2.0, 2.1, 2.05], "b": [2.6, 2.7, 2.65]}
    outcome, sentence = judge(_meta("final_val_loss"), _jobs("final_val_loss", values, {"a": 2.05, "b": 2.65}, LM))
    assert outcome == "learn" and "pos=b: validation loss 2.650 ≥ the bigram's 2.500" in sentence
    assert judge(_meta("final_val_loss"), _jobs("final_val_loss", values, {"a": 2.05, "b": 2.4}, LM))[0] == "yes"


def test_one_side_learns_needs_only_the_winner_to_have_learned_and_cost_only_has_no_gate():
    """a - b = 0.8, 0.55, 0.7 on exact_match_out: decided at 3 seeds (p = 0.011, as test_findings computes)."""
    values = {"a": [0.9, 0.8, 0.85], "b": [0.1, 0.25, 0.15]}
    assert judge(_meta("exact_match_out", one_side_learns=True),
                 _jobs("exact_match_out", values, {"a": 0.95, "b": 0.1}))[0] == "yes"
    outcome, sentence = judge(_meta("exact_match_out", one_side_learns=True),
                              _jobs("exact_match_out", values, {"a": 0.5, "b": 0.95}))
    assert outcome == "learn" and sentence.startswith("Not testable: the side that scores better, pos=a, did not learn")
    times = {"a": [10.0, 11.0, 12.0], "b": [20.0, 22.5, 21.0]}
    assert judge(_meta("ms_per_step", cost_only=True), _jobs("ms_per_step", times, {"a": 0.0, "b": 0.0}))[0] == "yes"
    assert judge(_meta("ms_per_step"), _jobs("ms_per_step", times, {"a": 0.0, "b": 0.0}))[0] == "learn"


def test_a_paper_that_did_not_test_the_claim_is_neither_agreed_nor_contradicted():
    """paper_tested: false (LLaMA adopted its recipe without an ablation): the verdict stands, the page says the
    comparison is its own, in every outcome; without the key the sentence agrees with the paper."""
    values = {"a": [0.9, 0.8, 0.85], "b": [0.1, 0.25, 0.15]}
    jobs = _jobs("exact_match_out", values, {"a": 0.95, "b": 0.95})
    assert judge(_meta("exact_match_out", paper="P, Table 1"), jobs)[1].endswith(": agrees with P, Table 1.")
    for got in (values, {"a": values["b"], "b": values["a"]}):
        outcome, sentence = judge(_meta("exact_match_out", paper="P", paper_tested=False),
                                  _jobs("exact_match_out", got, {"a": 0.95, "b": 0.95}))
        assert outcome in ("yes", "no") and "not a claim the cited work tested: P" in sentence
        assert "agrees" not in sentence and "contradicts" not in sentence
    outcome, sentence = judge(_meta("exact_match_out", paper="P", paper_tested=False),
                              _jobs("exact_match_out", values, {"a": 0.3, "b": 0.3}))
    assert outcome == "learn" and "saw it at" not in sentence and "not a claim the cited work tested: P" in sentence


def test_a_page_words_its_paper_as_the_sweep_file_does_now():
    """paper, paper_scale, paper_tested and why are wording: a page takes them from its sweep file, matched by the
    claim's sentence, whatever its data's header held when the runs were measured."""
    from blocklab.report.findings_data import sweep_study, with_gate_keys

    now = sweep_study("recipe")
    claim = {k: now["verdict"][k] for k in ("claim", "metric", "better", "than")}
    meta = with_gate_keys({"study": {"name": "recipe", "paper": "old", "verdict": {**claim, "paper_scale": "old"}}})
    assert meta["study"]["paper"] == now["paper"] != "old"
    assert meta["study"]["verdict"]["paper_scale"] == now["verdict"]["paper_scale"]
    assert meta["study"]["verdict"]["paper_tested"] is False


def test_a_tie_that_shares_one_seed_with_the_best_says_it_is_too_few_to_test():
    """recall's ablation rows ran at seed 0 alone, beside settings at seeds 0 and 1: one pair has no t-test, so the
    answer must not count such a setting "not distinguishable at 2 seeds" without saying it rests on one."""
    values = {"a": [0.95, 0.97], "b": [0.90], "c": [0.94, 0.93]}
    text = page_text.answer_text(_meta("exact_match_in"), _jobs("exact_match_in", values, {k: 0.95 for k in values}))
    assert text == ("The highest exact_match_in is pos=a's, 0.960; not distinguishable from it at 2 seeds (paired by "
                    "seed, Holm over 2 comparisons): pos=c (0.935); pos=b (0.900; 1 seed paired: too few to test).")


def test_the_answer_names_the_best_and_every_setting_not_distinguishable_from_it():
    """exact_match_in, higher is better. a = 0.90, 0.92, 0.91 is best; a - b = 0.01, -0.01, 0.01 (mean 0.0033, sd
    0.0115: t = 0.5, p = 0.667) cannot be told from it. c did not learn its task, so it is compared with nothing (it
    would be told apart: a - c = 0.80, 0.81, 0.80), and Holm runs over the one comparison left."""
    values = {"a": [0.90, 0.92, 0.91], "b": [0.89, 0.93, 0.90], "c": [0.10, 0.11, 0.11]}
    jobs = _jobs("exact_match_in", values, {"a": 0.95, "b": 0.95, "c": 0.1})
    meta = _meta("exact_match_in")
    text = page_text.answer_text(meta, jobs)
    assert text == ("The highest exact_match_in is pos=a's, 0.910; not distinguishable from it at 3 seeds (paired by "
                    "seed, Holm over 1 comparison): pos=b (0.907). 1 setting that did not learn its task is not "
                    "compared.")
    assert page_text.short_answer(meta, jobs, 140) == "exact_match_in: a best (0.910), tied: b"
    # c alone best, but it never learned; nor did the others: nothing is compared.
    unlearned = _jobs("exact_match_in", {"a": [0.5, 0.5, 0.5], "c": [0.6, 0.7, 0.6]}, {"a": 0.5, "c": 0.6})
    assert page_text.answer_text(meta, unlearned) == ("The highest exact_match_in is pos=c's, 0.633, but none of the 2 "
                                                      "settings learned its task, so none is compared.")
    assert page_text.short_answer(meta, unlearned, 140) == "exact_match_in: none learned (best c, 0.633)"
    one = _jobs("exact_match_in", {"a": [0.95, 0.96, 0.97], "c": [0.6, 0.7, 0.6]}, {"a": 0.95, "c": 0.6})
    assert page_text.short_answer(meta, one, 140) == "exact_match_in: a (0.960), the only one learned"
    # A question about cost alone (cost_only: attention_cost's 20 steps train nothing) compares every setting.
    times = _jobs("ms_per_step", {"a": [10.0, 11.0, 12.0], "b": [20.0, 22.5, 21.0]}, {"a": 0.0, "b": 0.0})
    assert page_text.short_answer(_meta("ms_per_step", cost_only=True), times, 140) == "ms_per_step: a best (11.000)"
    assert page_text.short_answer(_meta("ms_per_step"), times, 140) == "ms_per_step: none learned (best a, 11.000)"
    line, rows = page_text.banner(meta, page_text.groups_of(meta, jobs))
    assert line == "Did every setting learn its task? No: 1 of 3 settings did not; a claim over them is not testable."
    assert rows == [["pos=c", "0 of 3", "in-distribution exact match 0.100 < 0.900 (0 of 3 seeds clear it)"]]
    page = page_text.render_page(meta, jobs, None)
    lines = page.splitlines()
    assert lines[4].startswith("**Answer.** The highest") and lines[6].endswith("([which, and why](#what-did-not-learn))")
    assert page.index("**Answer.**") < page.index("### Registered claims") < page.index("### What did not learn")


def test_folded_scales_and_long_names_stay_within_the_limit():
    long = {f"{'v' * 40}{i}": [0.5 + i / 100, 0.5, 0.5 + i / 50] for i in range(12)}
    jobs = _jobs("exact_match_in", long, dict.fromkeys(long, 0.95))
    meta = _meta("exact_match_in", better={"pos": "x"}, than={"pos": "y"})
    parts = [{"scale": s, "outcome": o, "meta": meta, "jobs": jobs} for s, o in ((1, "nd"), (4, "yes"))]
    folded = findings_index.fold(parts)
    assert len(folded) <= findings_index.ANSWER_LIMIT
    assert folded.startswith("at 1x (not distinguishable): ") and "; at 4x (yes): " in folded


def _cells(index: str) -> list[list[str]]:
    rows = [line for line in index.splitlines() if line.startswith("| ") and not line.startswith("| exercise")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def test_the_committed_index_answers_in_140_characters_with_four_words_of_agreement():
    cells = _cells((ROOT / "docs" / "findings" / "README.md").read_text(encoding="utf-8"))
    assert cells
    for row in cells:
        answer = re.sub(r"\\(.)", r"\1", row[2]).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
        assert len(answer) <= findings_index.ANSWER_LIMIT, answer
        assert row[3] in ("yes", "no", "not distinguishable", "not testable"), row[3]
    assert set(AGREES.values()) == {"yes", "no", "not distinguishable", "not testable"}


def test_scale_pages_fold_into_their_sweep_s_row(tmp_path):
    values = {"a": [0.9, 0.8, 0.85], "b": [0.1, 0.25, 0.15]}
    jobs = _jobs("exact_match_in", values, {"a": 0.95, "b": 0.95})
    for stem, scale in (("zz_base", 1), ("zz_base-scale4", 4)):
        meta = {**_meta("exact_match_in"), "sweep": stem, "scale": scale}
        (tmp_path / f"{stem}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [meta, *jobs]))
    rows = [r for r in findings_index.index_rows(tmp_path) if r["name"].startswith("zz_base")]
    assert len(rows) == 1 and rows[0]["others"] == [("4x", "zz_base-scale4")]
    assert rows[0]["answer"].startswith("at 1x: ") and rows[0]["agrees"] == "yes"


def test_a_figure_finds_the_reference_levels_of_its_metric():
    jobs = _jobs("final_val_loss", {"a": [2.0], "b": [2.6]}, {"a": 2.0, "b": 2.6}, LM)
    assert learned.reference_lines(jobs, "final_val_loss") == [Level("bigram", "loss", 2.5), Level("unigram", "loss", 3.3)]
    assert learned.reference_lines(jobs, "loss_out") == learned.reference_lines(jobs, "final_val_loss")
    copy = _jobs("exact_match_in", {"a": [0.9]}, {"a": 0.9})
    assert learned.reference_lines(copy, "exact_match_out") == [Level("learned", "exact_match", 0.9)]
    assert learned.reference_lines(copy, "tokens_per_s") == []


def test_a_page_that_picks_each_setting_s_best_rate_says_it_was_picked_on_the_judged_seeds():
    """Issue 55: a best learning rate is chosen on other seeds than it is judged on, or the page says it was not."""
    tuned = [p for p in (ROOT / "docs" / "findings").glob("*.md")
             if "Each setting at its best learning rate" in p.read_text(encoding="utf-8")]
    assert {"lr_sensitivity.md", "muon_lr.md", "recall.md"} <= {p.name for p in tuned}
    for page in tuned:
        assert "no seed is held out for the choice" in page.read_text(encoding="utf-8"), page.name
