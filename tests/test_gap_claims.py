"""A claim about a gap (report/gap.py): A's advantage over B is larger at `where` than at `than_where`, judged on
the per-seed differences of the two per-seed gaps, under the page's Holm step-down. Checked on cases computed by
hand (the paired t-test's closed form at 2 degrees of freedom), not against the implementation."""
from blocklab.report import findings
from blocklab.report.claims import claims_hash
from blocklab.report.judge import differences, sides

# Losses (better lower) of settings v=a (A), v=b (B) at n=2 and n=12, seeds 0, 1, 2.
LOSS = {("a", 2): [2.00, 2.10, 2.05], ("b", 2): [2.02, 2.11, 2.08],
        ("a", 12): [1.80, 1.90, 1.84], ("b", 12): [1.90, 1.95, 1.92]}
GAP = {"claim": "A's gain over B is larger at 12 than at 2", "metric": "final_val_loss", "better": {"v": "a"},
       "than": {"v": "b"}, "where": {"n": 12}, "than_where": {"n": 2}, "paper": "P", "paper_scale": "1B"}


def _jobs(loss=LOSS, learned=None) -> list[dict]:
    return [{"job": f"{v}-{n}-{seed}", "setting": {"v": v, "n": n}, "seed": seed, "choices": {}, "status": "completed",
             "in_distribution_exact_match": (learned or {}).get((v, n), 1.0), "metrics": {"final_val_loss": x},
             "eval": []} for (v, n), xs in loss.items() for seed, x in enumerate(xs)]


def _meta(first: dict, *also: dict) -> dict:
    return {"study": {"compare": ["v", "n"], "metrics": ["final_val_loss"], "verdict": {**first, "also": list(also)}}}


def test_the_gap_claim_is_the_paired_t_test_of_the_difference_of_the_per_seed_gaps():
    """Gaps A - B at n=2: -0.02, -0.01, -0.03; at n=12: -0.10, -0.05, -0.08. Their differences (12 minus 2): -0.08,
    -0.04, -0.05: mean -0.056667, sd sqrt(0.00086667 / 2) = 0.020817, se 0.012019, t = -4.7150 on 2 degrees of
    freedom, two-sided p = 1 - |t| / sqrt(t^2 + 2) = 0.0422; t_(0.975, 2) = 4.302653: -0.056667 ± 0.051711 =
    [-0.108, -0.00496]. A loss: a negative difference is A ahead by more at 12, the claimed way."""
    outcome, sentence = findings.judge(_meta(GAP), _jobs())
    assert outcome == "yes", sentence
    assert sentence.startswith("A's gain over B is larger at 12 than at 2: (v=a − v=b) at n=12 -0.077 against "
                               "(v=a − v=b) at n=2 -0.020 on final_val_loss; paired difference over 3 seeds -0.057 "
                               "[-0.108, -0.005] (95%, Holm), p = 0.042 (Holm): agrees with P.")
    assert [round(d, 9) for d in differences(_meta(GAP), _jobs(), GAP)] == [-0.08, -0.04, -0.05]


def test_the_gap_claim_is_corrected_with_the_page_s_others():
    """With the two per-place claims beside it, m = 3. At n=12, A - B = -0.10, -0.05, -0.08: mean -0.076667, sd
    0.025166, se 0.014530, t = -5.2765, p = 1 - 5.2765 / sqrt(29.8414) = 0.0341; at n=2, A - B = -0.02, -0.01, -0.03:
    mean -0.02, sd 0.01, t = -3.4641, p = 1 - 3.4641 / sqrt(14) = 0.0742. Holm: the smallest, 0.0341, against 0.05 / 3
    = 0.0167: not rejected, so none is; the gap's adjusted p = max(3 x 0.0341, 2 x 0.0422) = 0.102."""
    at = {k: v for k, v in GAP.items() if k != "than_where"}
    verdicts = findings.judge_page(_meta(at, {**at, "where": {"n": 2}}, GAP), _jobs())
    assert [v.outcome for v in verdicts] == ["nd", "nd", "nd"]
    assert "p = 0.102 (Holm)" in verdicts[2].sentence
    assert verdicts[2].row[1] == "(v=a − v=b) at n=12 − (v=a − v=b) at n=2" and verdicts[2].row[3] == "3"


def test_a_gap_that_shrinks_is_the_other_way():
    swapped = {**GAP, "where": {"n": 2}, "than_where": {"n": 12}}
    outcome, sentence = findings.judge(_meta(swapped), _jobs())
    assert outcome == "no" and "+0.057 [0.005, 0.108]" in sentence and "the other way: contradicts P" in sentence


def test_every_one_of_the_four_settings_must_learn():
    outcome, sentence = findings.judge(_meta(GAP), _jobs(learned={("b", 2): 0.3}))
    assert outcome == "learn" and "v=b did not learn its task" in sentence


def test_a_seed_one_place_lacks_is_named_and_the_claim_marked():
    """n=2 lacks seed 2 of B: final_val_loss counts a missing run as the page's worst (2.11), so the n=2 pair
    stands with it (gap 2.05 - 2.11 = -0.06); a seed with no run on either side at one place is left out."""
    loss = {**LOSS, ("b", 2): [2.02, 2.11]}
    v = findings.judge_page(_meta(GAP), _jobs(loss))[0]
    assert "seed 2: v=b has no run: counted as the worst final_val_loss on this page, 2.110" in v.sentence
    loss = {k: (xs[:2] if k[1] == 2 else xs) for k, xs in LOSS.items()}
    v = findings.judge_page(_meta(GAP), _jobs(loss))[0]
    assert v.row[3] == "2 (+1 incomplete)" and "Marked: 1 pair left out of the test (seed 2: " in v.sentence


def test_a_malformed_gap_claim_is_one_line_and_not_judged():
    for bad, said in [({"than_where": {"m": 2}}, "its than_where names ['m'], which `where` does not"),
                      ({"than_where": {"n": 12}}, "its than_where is its `where`"),
                      ({"than_where": [2]}, "is not a mapping")]:
        outcome, sentence = findings.judge(_meta({**GAP, **bad}), _jobs())
        assert outcome == "none" and said in sentence and "\n" not in sentence


def test_decide_launches_all_four_settings_and_old_fingerprints_stay():
    (_, a), (_, b) = sides(_meta(GAP), _jobs(), GAP)
    assert sorted({(j["setting"]["v"], j["setting"]["n"]) for j in a + b}) == [("a", 2), ("a", 12), ("b", 2), ("b", 12)]
    plain = {k: v for k, v in GAP.items() if k != "than_where"}
    # The fingerprint of a claim without than_where is the one it had before the key existed (12 hex digits of the
    # SHA-256 of its tested keys, computed here as claims.py computed it then)
    import hashlib
    import json
    old = [{k: plain.get(k) for k in ("claim", "metric", "better", "than", "where", "min_effect")}]
    text = json.dumps(old, sort_keys=True, default=str, separators=(",", ":"))
    assert claims_hash(plain) == hashlib.sha256(text.encode()).hexdigest()[:12] != claims_hash(GAP)
