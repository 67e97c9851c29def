"""A sweep folder is stale only where a job would train differently: editing the study's description (a claim, a
`paper` entry, notes, plots, the question, study.seeds) keeps its finished and interrupted jobs; a study key that a
trained key interpolates still refuses, through that key. And the claims a run was measured under are fingerprinted,
so a page knows when they were edited after (issue 55 item 3)."""
import pytest
from omegaconf import OmegaConf

from blocklab.errors import ConfigError
from blocklab.report.claims import claims_changed, claims_hash, claims_line
from blocklab.results import write_results
from blocklab.train.resume import config_differences
from blocklab.train.sweep import check_sweep_jobs
from conftest import compose_config

DESCRIPTION_EDITS = {
    "claim": lambda s: s["verdict"].update(claim="Reworded after the runs"),
    "paper entry": lambda s: s.update(paper="Someone et al. 2030, Table 9"),
    "notes": lambda s: s.update(notes=["jobs ran side by side"]),
    "plots": lambda s: s.update(plots=[{"kind": "bar", "metric": "final_val_loss", "by": "attn"}]),
    "question": lambda s: s.update(question="Another question?"),
    "seeds": lambda s: s.update(seeds={"min": 3, "max": 10}),
    "min_effect": lambda s: s["verdict"].update(min_effect=0.05),
}


def _finished_job(tmp_path, edit=None):
    """A finished sparse_patterns job whose saved config is this launch's, with `edit` applied to it (as if the
    sweep file had read so when the job trained)."""
    folder = tmp_path / "sweep"
    job = ["sweep=sparse_patterns", "attn=window", "task=periodic", "seed=0"]
    run_dir = folder / "attn=window,seed=0,task=periodic"
    (run_dir / ".hydra").mkdir(parents=True)
    write_results(run_dir, {"status": "completed"})
    saved = OmegaConf.to_container(compose_config(job), resolve=True)
    if edit:
        edit(saved)
    OmegaConf.save(OmegaConf.create(saved), run_dir / ".hydra" / "config.yaml")
    return [*job, f"hydra.sweep.dir={folder}"], run_dir


@pytest.mark.parametrize("what", sorted(DESCRIPTION_EDITS))
def test_editing_the_study_description_keeps_a_finished_job(tmp_path, what):
    job, _ = _finished_job(tmp_path, lambda saved: DESCRIPTION_EDITS[what](saved["study"]))
    assert check_sweep_jobs(job) == 1


def test_a_study_key_a_trained_key_interpolates_still_refuses_through_that_key(tmp_path):
    """sparse_patterns' attn.window reads study.window.<pattern>: a job trained with window 8 is not this launch's
    window 4, and the refusal names the key the job trains with, not the study key."""
    def older(saved):
        saved["study"]["window"]["window"] = 8
        saved["attn"]["window"] = 8

    job, run_dir = _finished_job(tmp_path, older)
    with pytest.raises(ConfigError) as refused:
        check_sweep_jobs(job)
    message = str(refused.value)
    assert message.startswith(f"{run_dir} was trained with another config than this launch asks of it "
                              "(attn.window: 8 -> 4),")
    assert "study.window" not in message


def test_resume_compares_no_study_key():
    """The resume check (train/resume.py) uses the same rule: only what a job trains differs."""
    saved = {"study": {"name": "x", "question": "old?", "verdict": {"claim": "a"}, "pack_seeds": True},
             "optim": {"lr": 0.001}}
    current = {"study": {"name": "x", "question": "new?", "verdict": {"claim": "b"}, "notes": ["n"]},
               "optim": {"lr": 0.001}}
    assert config_differences(saved, current, frozenset({"study.notes"})) == []
    current["optim"]["lr"] = 0.002
    assert config_differences(saved, current) == ["optim.lr: 0.001 -> 0.002"]


def test_the_claims_fingerprint_covers_what_a_claim_tests_only():
    claim = {"claim": "A beats B", "metric": "final_val_loss", "better": {"attn": "a"}, "than": {"attn": "b"},
             "paper": "P et al.", "why": "because"}
    base = claims_hash(claim)
    assert len(base) == 12 and claims_hash(None) is None
    assert claims_hash({**claim, "paper": "Q et al.", "why": "other", "paper_scale": "7B"}) == base
    for edit in ({"claim": "B beats A"}, {"metric": "loss_out"}, {"than": {"attn": "c"}}, {"min_effect": 0.1},
                 {"where": {"task": "lm"}}, {"also": [{"claim": "more", "metric": "x"}]}):
        assert claims_hash({**claim, **edit}) != base, edit


def test_a_page_knows_its_claims_changed_after_measurement():
    before = {"claim": "A beats B", "metric": "m", "better": {"k": 1}, "than": {"k": 2}}
    after = {**before, "claim": "A beats B by a lot"}
    jobs = [{"claims": claims_hash(before)}] * 3 + [{"claims": claims_hash(after)}, {}]
    meta = {"study": {"verdict": after}}
    seen = claims_changed(meta, jobs)
    assert seen == {"now": claims_hash(after), "measured": {claims_hash(before): 3, claims_hash(after): 1},
                    "changed": 3, "unrecorded": 1}
    assert claims_line(meta, jobs).startswith("The claims below were edited after the data was measured: 3 of 5")
    assert claims_line({"study": {"verdict": before}}, jobs[:3]) is None
