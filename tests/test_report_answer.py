"""The report answers first (issue 46): each study section shows whether every setting learned its task in
distribution, then what the numbers show and the figures that carry it, and only then the setup and the tables.
No conclusion on any metric is drawn about a setting that did not learn: pe_copy's report once named ALiBi "best
beyond training, intervals apart from every other setting" while three of those never learned."""
import json
import re
from pathlib import Path

from omegaconf import OmegaConf

from blocklab.report.build import build_report, section
from blocklab.report.collect import collect, study_specs
from blocklab.results import LEARNED_THRESHOLD

# pos -> (in-distribution exact match per seed, beyond-training exact match per seed). nope never learns its
# training lengths yet scores highest beyond them: a comparison that kept it would name it best.
PE = {"alibi": ((0.96, 0.97, 0.98), (0.60, 0.62, 0.64)),
      "rope": ((0.95, 0.96, 0.97), (0.20, 0.22, 0.24)),
      "nope": ((0.36, 0.38, 0.40), (0.80, 0.82, 0.84)),
      "t5_bias": ((0.37, 0.38, 0.39), (0.01, 0.02, 0.03))}
STUDY = {"name": "pe", "question": "Which position scheme extrapolates?", "compare": ["pos"],
         "metrics": ["exact_match_in", "exact_match_out"],
         "plots": [{"kind": "length_curve", "metric": "exact_match", "by": "pos"}]}


def fabricate(root: Path, settings: dict = PE, task: str = "copy", **recorded) -> list[dict]:
    for pos, (inside, beyond) in settings.items():
        for seed, (em_in, em_out) in enumerate(zip(inside, beyond)):
            run_dir = root / f"pos={pos},seed={seed}"
            (run_dir / ".hydra").mkdir(parents=True)
            config = {"study": STUDY, "seed": seed, "pos": pos, "task": {"name": task}, "trainer": {"max_steps": 100}}
            OmegaConf.save(OmegaConf.create(config), run_dir / ".hydra" / "config.yaml")
            results = {"status": "completed", "task": task, "study": STUDY["name"], "choices": {"pos": pos},
                       "overrides": [f"pos={pos}", f"seed={seed}"], "params": 5000, "steps": 100,
                       "tokens_per_s": 1000.0, "final_train_loss": 0.1, "final_val_loss": 1 - em_in,
                       "train_lengths": [1, 8],
                       "eval": [{"length": n, "in_distribution": n <= 8, "loss": 1.0,
                                 "exact_match": None if task == "lm" else em_in if n <= 8 else em_out}
                                for n in (4, 8, 16)], **recorded}
            (run_dir / "results.json").write_text(json.dumps(results))
    return collect(root)


def findings_of(page: str) -> str:
    """The "What the numbers show" list (it ends where the setup begins)."""
    return page[page.index("What the numbers show"):page.index("<b>Setup.</b>")]


def test_a_setting_that_did_not_learn_is_flagged_first_and_never_judged(tmp_path):
    rows = fabricate(tmp_path / "pe")
    page = build_report(tmp_path / "pe", rows, study_specs(tmp_path / "pe", rows)).read_text()
    flag = re.search(r"<p class='not-learned'><b>Did every setting learn its task\?</b> (.*?)</p>", page).group(1)
    assert flag.startswith("No: 2 of 4 settings did not learn in distribution: pos=nope (in-distribution exact match "
                           f"0.380 &lt; {LEARNED_THRESHOLD:.3f} (0 of 3 seeds clear it)); pos=t5_bias (in-distribution "
                           f"exact match 0.380 &lt; {LEARNED_THRESHOLD:.3f} (0 of 3 seeds clear it)).")
    # The answer first: the flag, then the findings and the figure, then the setup and the tables.
    order = [page.index(mark) for mark in ("Did every setting learn", "What the numbers show", "<figure",
                                           "<b>Setup.</b>", "<table class='metrics'>", "<table class='summary'>")]
    assert order == sorted(order)
    shown = findings_of(page)
    # On every metric alibi against rope only. nope (0.82 beyond, never learned) is never named best.
    among = re.findall(r"<li>Among the settings.*?</li>", shown, re.DOTALL)
    wanted = [
        "<li>Among the settings that learned in distribution (left out as not learned: pos=nope; pos=t5_bias): "
        f"exact_match_{where} (higher is better): pos=alibi is best, {mean}" for where, mean in
        (("in", "0.970 [0.960, 0.980]"), ("out", "0.620 [0.600, 0.640]"))]
    assert len(among) == 2 and [m[:len(want)] for m, want in zip(among, wanted)] == wanted, among
    assert all("pos=nope" not in m.split("):", 1)[1] and "pos=t5_bias" not in m.split("):", 1)[1] for m in among)
    # The table marks every setting's seeds that learned.
    rows_html = re.findall(r"<tr><td>(\w+)</td>.*?<td>([^<]*)</td></tr>",
                           re.search(r"<table class='metrics'>.*?</table>", page, re.DOTALL).group(0))
    assert dict(rows_html) == {"alibi": "3/3 seeds", "nope": "0/3 seeds, not learned", "rope": "3/3 seeds",
                               "t5_bias": "0/3 seeds, not learned"}


def test_no_setting_that_learned_means_no_judgement_beyond_training(tmp_path):
    failing = {k: v for k, v in PE.items() if k in ("nope", "t5_bias")}
    page = section("pe", STUDY, fabricate(tmp_path / "pe", failing), tmp_path)
    assert "No: 2 of 2 settings did not learn in distribution" in page
    for metric in ("exact_match_in", "exact_match_out"):
        assert (f"{metric}: no setting learned its task in distribution (pos=nope; pos=t5_bias), so none is "
                "judged.") in page
    assert "is best" not in findings_of(page)


def test_a_setting_that_learned_on_most_seeds_is_judged_and_its_failing_seed_named(tmp_path):
    mixed = {"alibi": ((0.96, 0.97, 0.70), (0.60, 0.62, 0.10)), "rope": PE["rope"]}  # alibi: mean 0.877 < 0.9
    page = section("pe", STUDY, fabricate(tmp_path / "pe", mixed), tmp_path)
    assert ("did not learn in distribution: pos=alibi (in-distribution exact match 0.877 &lt; 0.900 (2 of 3 seeds "
            "clear it))") in page
    mostly = {"alibi": ((0.96, 0.97, 0.88), PE["alibi"][1]), "rope": PE["rope"]}  # mean 0.937: learned
    page = section("pe", STUDY, fabricate(tmp_path / "pe2", mostly), tmp_path)
    assert "Learned, but not on every seed: pos=alibi (2 of 3 seeds clear it)." in page
    assert "<li>exact_match_out (higher is better): pos=alibi is best" in page and "left out" not in page


def test_every_setting_learned_says_so_and_an_lm_is_not_judged_on_exact_match(tmp_path):
    learned = {k: v for k, v in PE.items() if k in ("alibi", "rope")}
    page = section("pe", STUDY, fabricate(tmp_path / "pe", learned), tmp_path)
    assert "<b>Did every setting learn its task?</b> Yes: every seed of every setting clears its task&#39;s bar" in page
    assert "left out" not in page and "not learned" not in page
    lm = section("pe", {**STUDY, "metrics": ["final_val_loss"]}, fabricate(tmp_path / "lm", learned, task="lm"),
                 tmp_path)
    assert "Did every setting learn" not in lm and "learned (seeds" not in lm


def test_an_lm_is_held_to_its_recorded_bigram_bar_on_every_metric(tmp_path):
    """An LM learned when its validation loss is below its corpus' bigram loss (the run's recorded `references`).
    Here pos=nope's loss, 0.62, is above the bigram's 0.5: it is flagged and left out of the comparison."""
    settings = {k: v for k, v in PE.items() if k in ("alibi", "rope", "nope")}
    bigram = {"learned": [{"name": "bigram", "metric": "loss", "value": 0.5}], "lines": []}
    rows = fabricate(tmp_path / "lm", settings, task="lm", references=bigram)
    for r in rows:  # the in-distribution rows' loss is the final validation loss
        r["eval"] = [{**e, "loss": r["final_val_loss"]} for e in r["eval"]]
    page = section("pe", {**STUDY, "metrics": ["final_val_loss"]}, rows, tmp_path)
    assert ("No: 1 of 3 settings did not learn in distribution: pos=nope (validation loss 0.620 ≥ the bigram&#39;s "
            "0.500 (0 of 3 seeds clear it))") in page
    assert ("Among the settings that learned in distribution (left out as not learned: pos=nope): final_val_loss "
            "(lower is better): pos=alibi is best") in page
