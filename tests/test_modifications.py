"""The modifications sweep's jobs come from the registries: a new entry joins it, a variant that cannot be a
decoder LM is left out with its reason, and each job is composed by Hydra from one `+modification=` value."""
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from blocklab import modifications
import torch

from blocklab.model.ffn import ACTIVATIONS, Activation
from blocklab.paths import CONF_DIR


@pytest.fixture(scope="module")
def plan():
    return modifications.plan()


def test_the_baseline_is_the_llama_recipe_and_every_group_is_varied(plan):
    assert plan.jobs[0] == "baseline" and len(plan.jobs) >= 25
    modifications.register(modifications.candidates())
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        base = compose("config", ["sweep=modifications", "modification=baseline", "run_dir=x"],
                       return_hydra_config=True)
        mqa = compose("config", ["sweep=modifications", "modification=attn-mqa", "run_dir=x"],
                      return_hydra_config=True)
        # the sweep's params resolve to exactly the plan's jobs
        assert base.hydra.sweeper.params["modification"] == ",".join(plan.jobs)
    choices = base.hydra.runtime.choices
    assert (choices.norm, choices.pos, choices.act, choices.task) == ("pre_rms", "rope", "swiglu", "lm")
    assert base.model.bias is False and base.norm.placement == "pre" and base.norm.type == "rmsnorm"
    assert mqa.hydra.runtime.choices.attn == "mqa" and mqa.attn.n_kv_heads == 1 and mqa.norm == base.norm
    for group in ("norm", "pos", "act", "attn", "init", "ffn"):
        assert any(job.startswith(group) for job in plan.jobs), group
    assert {"attn-gqa", "ffn-moe", "norm-post_ln", "pos-alibi", "act-gelu", "init-xavier"} <= set(plan.jobs)


def test_a_variant_that_is_not_a_decoder_lm_is_left_out_with_its_reason(plan):
    assert "attn-linformer" not in plan.jobs and "causal" in plan.left_out["attn-linformer"]
    assert "model_arch-encoder" in plan.left_out and "bidirectional" in plan.left_out["model_arch-encoder"]


def test_a_change_that_computes_the_baselines_function_is_left_out(plan):
    # Position scaling at factor 1 leaves every rotation as trained (PI: m / 1; NTK: base * 1^(d/(d-2)); YaRN's
    # ramp interpolates by 1 and its temperature is 0.1 ln 1 + 1 = 1), and full is the default pattern.
    for name in ("pos_scaling-pi", "pos_scaling-ntk", "pos_scaling-yarn", "attn_pattern-full"):
        assert name not in plan.jobs and "computes what the baseline computes" in plan.left_out[name], name
    assert {"attn-local", "pos-alibi", "init-small"} <= set(plan.jobs)  # a change of function stays


def test_a_change_that_computes_another_change_s_function_is_shown_once(plan):
    """attn=window is attn=local by its newer name (local's yaml: a window alone makes the pattern window)."""
    assert "attn-local" in plan.jobs and "attn-window" not in plan.jobs
    assert plan.left_out["attn-window"].startswith("attn-window computes what attn-local computes")


def test_a_registry_entry_or_an_ablation_declared_later_joins_the_sweep(monkeypatch, plan):
    monkeypatch.setitem(ACTIVATIONS.entries, "fake_act", Activation(torch.tanh))  # a function no entry computes
    monkeypatch.setitem(modifications.ABLATIONS, "attn.short_conv", (4,))  # one plan() for both: it is slow
    grown = modifications.plan()
    assert set(grown.jobs) - set(plan.jobs) == {"act_name-fake_act", "attn_short_conv-4"}


def test_options_declared_as_ablations_join_the_sweep(plan):
    assert {"attn_output_gate-headwise", "attn_output_gate-elementwise", "model_value_residual-true",
            "attn_qk_norm-true"} <= set(plan.jobs)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        gated = compose("config", ["sweep=modifications", "modification=attn_output_gate-headwise", "run_dir=x"])
    assert gated.attn.output_gate == "headwise" and gated.attn.kind == "softmax" and gated.norm.type == "rmsnorm"
