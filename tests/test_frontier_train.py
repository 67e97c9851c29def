"""End to end for the frontier options (attn=diff, attn=forgetting, attn.output_gate, model.value_residual): each
trains, changes what is trained, and results.json records it; the attention sink (first_token_share) reaches
results.json's diagnostics and the report's rows."""
import json

import pytest

from blocklab.report.collect import _layers
from conftest import FAST, run_in_process
from helpers import assert_learned_and_changed


@pytest.mark.slow  # four runs of ~10 s; the sink test below trains one option in the default run
@pytest.mark.parametrize("overrides, attn, recorded", [
    (["attn=diff"], "diff", {}),
    (["attn=forgetting", "pos=none"], "forgetting", {}),
    (["attn.output_gate=elementwise"], "mha", {"attn_output_gate": "elementwise"}),
    (["model.value_residual=true", "model.value_residual_learned=true"], "mha", {"model_value_residual": True}),
])
def test_each_option_trains_end_to_end(overrides, attn, recorded, run_dir, default_run):
    run_in_process([*FAST, *overrides], run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    assert_learned_and_changed(results, default_run)
    assert results["choices"]["attn"] == attn
    assert {k: results["choices"][k] for k in recorded} == recorded  # the options a modification changes


def test_choices_name_every_declared_ablation_at_its_value(default_run):
    """A run at the defaults records each option of schema.ABLATIONS at its default (none, false, 1.0, 0): two
    runs that differ only in one of them differ in results.json's choices."""
    assert {k: default_run["choices"][k] for k in ("attn_output_gate", "model_value_residual",
                                                   "model_logit_softcap", "attn_softcap", "pos_rotary_fraction",
                                                   "optim_z_loss")} == \
        {"attn_output_gate": "none", "model_value_residual": False, "model_logit_softcap": "none", "attn_softcap": 0.0,
         "pos_rotary_fraction": 1.0, "optim_z_loss": 0.0}


def test_the_sink_reaches_results_and_the_report(run_dir):
    run_in_process([*FAST, "attn.output_gate=headwise", "diagnostics=full"], run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["choices"]["attn_output_gate"] == "headwise"
    for when in ("init", "end"):
        layers = results["diagnostics"][when]["layers"]
        shares = [layer["first_token_share"] for layer in layers]
        assert len(shares) == results["choices"]["n_layers"]
        assert all(len(s) == results["choices"]["n_heads"] and all(0 <= x <= 1 for x in s) for s in shares)
        series = _layers(results["diagnostics"], when)
        assert series["first_token_share_heads"] == shares
        assert series["first_token_share"] == [sum(s) / len(s) for s in shares]
