"""The report's tables and findings from synthetic runs (the end-to-end report is in test_sweeps)."""
from blocklab.report.build import group, section


def run(task: str, heads: int, seed: int, loss: float) -> dict:
    return {"run": f"/sweep/{task}-{heads}-{seed}", "status": "completed", "task": task, "n_heads": heads,
            "seed": seed, "final_val_loss": loss, "diverged": 0.0,
            "overrides": {"task": task, "model.n_heads": str(heads), "seed": str(seed)}}


def test_groups_are_in_numeric_order():
    rows = [run("copy", heads, 0, 1.0) for heads in (16, 2, 1, 32)]
    assert list(group(rows, ["n_heads"])) == [(1,), (2,), (16,), (32,)]


def test_a_sweep_over_tasks_is_judged_within_each_task(tmp_path):
    """Copy and LM losses are on different scales: best/worst are found per task, never across them."""
    rows = [run("copy", h, s, 0.1 * h + 0.01 * s) for h in (1, 2, 16) for s in (0, 1)]
    rows += [run("lm", h, s, 2.0 + 0.1 / h + 0.001 * s) for h in (1, 2, 16) for s in (0, 1)]
    page = section("head_count", {"compare": ["task", "n_heads"]}, rows, tmp_path)
    assert "task=copy: final_val_loss (lower is better): n_heads=1 is best, 0.105 [0.100, 0.110]" in page
    assert "task=lm: final_val_loss (lower is better): n_heads=16 is best, 2.007 [2.006, 2.007]" in page
    # What was swept comes from the runs' overrides, in numeric order.
    assert "swept: model.n_heads ∈ {1, 2, 16}; seed ∈ {0, 1}; task ∈ {copy, lm}." in page


def test_single_runs_make_no_claim_about_noise(tmp_path):
    rows = [run("copy", heads, 0, loss) for heads, loss in ((1, 0.5), (2, 0.4))]
    page = section("one_seed", {"compare": ["n_heads"]}, rows, tmp_path)
    assert "one run each, so the seed spread is unknown" in page and "twice the seed spread" not in page


def test_tradeoff_plots_quality_against_a_cost_from_results_and_names_the_front(tmp_path):
    """One point per setting at the seed means; a cost the report has no column for is read from the runs'
    results.json by dotted path; the note lists each setting's numbers and the ones no other beats on both axes."""
    import json

    from blocklab.report.build import PLOTS, plot

    settings = {"mha": (2.00, 500_000, 1000), "local": (2.05, 16_000, 3000), "linear": (2.30, 8_000, 2000),
                "slow": (2.40, 600_000, 500)}
    rows = []
    for attn, (loss, state, speed) in settings.items():
        for seed in (0, 1):
            run_dir = tmp_path / f"{attn}-{seed}"
            run_dir.mkdir()
            (run_dir / "results.json").write_text(json.dumps({"costs": {"decode_state_bytes": state + 1000 * seed}}))
            rows.append({**run("lm", 4, seed, loss + 0.01 * seed), "run": str(run_dir), "attn": attn,
                         "tokens_per_s": speed})
    assert "tradeoff" in PLOTS
    spec = {"kind": "tradeoff", "metric": "final_val_loss", "x": "costs.decode_state_bytes", "by": "attn"}
    note = plot(rows, spec, tmp_path / "tradeoff.png")
    assert (tmp_path / "tradeoff.png").stat().st_size > 1000
    assert "attn=local: final_val_loss 2.055 ± 0.007 at costs.decode_state_bytes 16500 ± 707" in note
    assert note.endswith("Not beaten on both: attn=linear, attn=local, attn=mha.")  # `slow` loses on both
    speed = plot(rows, {**spec, "x": "tokens_per_s"}, tmp_path / "speed.png")  # a column: higher is cheaper
    assert speed.endswith("Not beaten on both: attn=local, attn=mha.")  # linear: slower and worse than local


def test_speeds_of_runs_trained_beside_other_jobs_carry_a_caveat_with_the_fix(tmp_path):
    """A job's tokens/s depends on the job that ran beside it: the report says so, and how to measure cleanly."""
    rows = [{**run("copy", h, s, 0.1 * h + 0.01 * s), "tokens_per_s": 1000.0 / h} for h in (1, 2) for s in (0, 1)]
    alone = section("speed", {"compare": ["n_heads"], "metrics": ["tokens_per_s"]}, rows, tmp_path)
    assert "ran beside them" not in alone
    rows[1]["beside_other_jobs"] = rows[2]["beside_other_jobs"] = True
    beside = section("speed", {"compare": ["n_heads"], "metrics": ["tokens_per_s"]}, rows, tmp_path)
    assert "Speeds (tokens/s, ms per step, decoding tokens/s) of 2 of 4 runs were measured while other jobs ran " \
           "beside them" in beside and "hydra.launcher.n_jobs=1" in beside
    # and those speeds are never judged: alone, the one head is named faster; beside other jobs nothing is compared
    assert "tokens_per_s (higher is better): n_heads=1 is best" in alone and "not compared" not in alone
    assert "tokens_per_s: not compared: 2 of 4 runs were timed while other jobs ran beside them" in beside


def test_runs_from_two_machines_are_said_to_be_so(tmp_path):
    """A sweep resumed on another CPU holds runs whose kernels rounded differently: the report counts them per
    machine. Runs from before results.json recorded it are not guessed at."""
    rows = [run("copy", h, s, 0.1 * h + 0.01 * s) for h in (1, 2) for s in (0, 1)]
    spec = {"compare": ["n_heads"], "metrics": ["exact_match_out"]}
    rows[0]["machine"] = "AMD EPYC, AVX2 kernels, torch 2.13.0+cpu"
    assert "machines" not in section("m", spec, rows, tmp_path)  # one recorded, three unknown: nothing to say
    for r in rows[1:]:
        r["machine"] = "AMD EPYC, AVX512 kernels, torch 2.13.0+cpu"
    page = section("m", spec, rows, tmp_path)
    assert ("These runs come from 2 machines (AMD EPYC, AVX512 kernels, torch 2.13.0+cpu: 3 runs; AMD EPYC, AVX2 "
            "kernels, torch 2.13.0+cpu: 1 run).") in page


def test_runs_that_differ_in_a_key_the_study_does_not_compare_are_not_pooled_as_seeds(tmp_path):
    """Relaunching a study with an extra sweep (model.n_layers=2,4) puts both depths in its folder: each depth
    is a setting of its own in the tables, findings and plots, and the page says why."""
    from blocklab.report.build import pooled

    rows = [{**run("copy", h, s, 1.0 / layers + 0.01 * s), "model.n_layers": layers,
             "overrides": {"model.n_heads": str(h), "seed": str(s), "model.n_layers": str(layers)}}
            for h in (1, 2) for layers in (2, 4) for s in (0, 1, 2)]
    assert pooled(rows, ["n_heads"]) == ["model.n_layers"]
    assert pooled(rows, ["n_heads", "model.n_layers"]) == []
    assert pooled([r for r in rows if r["model.n_layers"] == 4], ["n_heads"]) == []  # one depth: nothing pooled
    spec = {"compare": ["n_heads"], "plots": [{"kind": "bar", "metric": "final_val_loss", "by": "n_heads"}]}
    page = section("extra", spec, rows, tmp_path)
    assert "Runs of one n_heads differ in model.n_layers, which the study does not compare" in page
    assert "3 seeds per setting (4 settings" in page  # not 6 seeds of 2 settings
    assert "best mean n_heads=1, n_layers=4 0.260 [0.250, 0.270] over 3 seeds" in page  # the 4-layer runs alone
    alone = section("one_depth", spec, [r for r in rows if r["model.n_layers"] == 2], tmp_path)
    assert "Also varied" not in alone and "3 seeds per setting (2 settings" in alone
