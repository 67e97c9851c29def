"""A setting whose every run repeats another setting's bit for bit is one model under two names (modifications ran
attn=local and attn=window, the same windowed attention): a findings page shows it once and says so
(findings_data.shown_once). Runs that differ anywhere, or that have no finite loss, stay."""
from blocklab.report.findings_data import shown_once


def _job(name: str, seed: int, loss, choices=None) -> dict:
    return {"setting": {"modification": name}, "seed": seed, "params": 100, "final_val_loss": loss,
            "choices": choices or {"attn": "local"}}


def test_a_setting_that_repeats_another_bit_for_bit_is_shown_once_and_the_page_says_so():
    jobs = [_job(name, s, 2.0 + s / 10) for name in ("attn-window", "attn-local") for s in (0, 1)]
    jobs += [_job("baseline", s, 2.0 + s / 10, {"attn": "mha"}) for s in (0, 1)]  # same losses, other choices
    meta = {}
    kept = shown_once(meta, jobs)
    assert sorted({j["setting"]["modification"] for j in kept}) == ["attn-local", "baseline"]
    assert meta["duplicates"] == ["modification=attn-window ran the same model as modification=attn-local (every "
                                  "seed's choices, parameter count, losses and scores identical, bit for bit): it is "
                                  "shown once, as modification=attn-local."]


def test_settings_that_differ_in_one_seed_a_score_or_have_no_loss_all_stay():
    near = [_job("a", 0, 2.0), _job("a", 1, 2.1), _job("b", 0, 2.0), _job("b", 1, 2.1 + 1e-12)]
    scored = [{**_job(name, 0, 1.0), "metrics": {"exact_match_in": x}} for name, x in (("e", 0.9), ("f", 0.1))]
    timed = [{**_job(name, 0, 3.0), "metrics": {"tokens_per_s": x}} for name, x in (("g", 900.0), ("h", 1000.0))]
    diverged = [_job("c", 0, None), _job("d", 0, None)]
    meta = {}
    assert shown_once(meta, near + scored + diverged) == near + scored + diverged and "duplicates" not in meta
    assert [j["setting"]["modification"] for j in shown_once(meta, timed)] == ["g"]  # speeds differ run to run
