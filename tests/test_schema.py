"""Property-based: override sets drawn from the schema, valid and invalid, go through the same validation as
the command line (overrides, schema, then the registries and the task), in process and without training.
Every draw is accepted, or rejected with exactly one line that names the key it got wrong; nothing raises."""
import copy
import math
import string

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from blocklab.experiment import config_errors
from blocklab.overrides import command_line_error, job_config
from blocklab.results import read_results
from blocklab.schema import SCHEMA, Int, Number, schema_errors
from conftest import FAST, run_in_process

# Values a careful user might set, per key, written from what each key means (not from the schema).
VALID = {
    "model.d_model": st.sampled_from([16, 32, 64]), "model.n_layers": st.integers(1, 3),
    "model.n_heads": st.sampled_from([1, 2, 4]), "model.d_ff": st.one_of(st.none(), st.integers(8, 96)),
    "model.dropout": st.floats(0, 0.5), "model.bias": st.booleans(), "model.tie_embeddings": st.booleans(),
    "model.residual": st.booleans(), "model.ffn": st.booleans(),
    "norm.eps": st.floats(1e-8, 1e-2), "attn.causal": st.just(True), "attn.qk_norm": st.booleans(),
    "attn.scale": st.one_of(st.none(), st.just("none"), st.floats(0.01, 2)),
    "init.std": st.floats(1e-3, 0.1),
    "optim.lr": st.floats(1e-3, 1e-2), "optim.min_lr": st.floats(0, 1e-4), "optim.weight_decay": st.floats(0, 0.5),
    "optim.warmup_steps": st.integers(0, 50), "optim.betas": st.lists(st.floats(0, 0.999), min_size=2, max_size=2),
    "trainer.max_steps": st.integers(1, 4), "trainer.val_check_interval": st.integers(1, 4),
    "trainer.compile": st.just(False),  # true is valid too, but would compile for minutes in the trained draws
    "trainer.log_every_n_steps": st.integers(1, 50), "trainer.gradient_clip_val": st.one_of(st.none(), st.floats(0.1, 5)),
    "diagnostics.enabled": st.booleans(), "diagnostics.every_n_steps": st.integers(1, 10),
    "diagnostics.probe_examples": st.integers(1, 8), "diagnostics.attention_maps": st.sampled_from(["none", "end"]),
    "seed": st.integers(0, 2**31 - 1), "max_loss": st.one_of(st.none(), st.floats(10, 1e6)),
    "checkpoint_every": st.integers(1, 1000),
}
# Keys whose values only the launch itself could refute (where it writes, the hardware).
NOT_DRAWN = {"run_dir", "study", "trainer.accelerator", "trainer.devices", "trainer.num_nodes", "trainer.strategy"}
SCHEMA_KEYS = [f"{group}.{key}".lstrip(".") for group, spec in SCHEMA.items() for key in spec.keys]
DRAWN = [key for key in SCHEMA_KEYS if key not in NOT_DRAWN]
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(string.ascii_letters + string.digits + "-_. ", max_size=8),
                 st.lists(st.floats(-2, 2), max_size=3), st.sampled_from([0, -1, 0.5, "", "none", "auto"]))


def as_override_value(value) -> str:
    """Hydra's override grammar for a Python value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(as_override_value(v) for v in value) + "]"
    return "'" + value + "'"


def validate(overrides: list[str]) -> list[str]:
    """The command line's checks, then what the run checks before any work: [] when accepted."""
    error = command_line_error(overrides)
    if error is not None:
        return error.splitlines()
    return config_errors(job_config(overrides))




@st.composite
def valid_settings(draw) -> dict:
    keys = draw(st.lists(st.sampled_from(sorted(VALID)), max_size=6, unique=True))
    return {key: draw(VALID[key]) for key in keys}


@st.composite
def one_bad_setting(draw) -> tuple[dict, str]:
    """Valid settings plus one key set to an arbitrary value, or misspelled; (settings, that key)."""
    chosen = draw(valid_settings())
    key = draw(st.sampled_from(DRAWN))
    chosen.pop(key, None)
    if draw(st.booleans()):
        return {**chosen, key: draw(JUNK)}, key
    group, _, leaf = key.rpartition(".")
    misspelled = f"{group}.{leaf[:-1] + 'x' if leaf[-1] != 'x' else leaf + 'y'}".lstrip(".")
    return {**chosen, misspelled: 1}, misspelled


def as_overrides(chosen: dict, base: dict) -> list[str]:
    """Hydra overrides for settings (+key for one the config does not have)."""
    return [f"{'' if _has(base, key) else '+'}{key}={as_override_value(value)}" for key, value in chosen.items()]


def _has(config: dict, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(config, dict) or part not in config:
            return False
        config = config[part]
    return True


def with_settings(base: dict, chosen: dict) -> dict:
    config = copy.deepcopy(base)
    for key, value in chosen.items():
        *groups, leaf = key.split(".")
        node = config
        for group in groups:
            node = node[group]
        node[leaf] = value
    return config


@pytest.fixture(scope="module")
def base() -> dict:
    return job_config(FAST)


def assert_one_line_naming(errors: list[str], key: str, context) -> None:
    assert len(errors) <= 1, (context, errors)
    if errors:
        assert errors[0].startswith((f"{key}=", f"{key} ")), (context, errors)


@settings(max_examples=500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(draw=one_bad_setting())
def test_a_drawn_setting_is_accepted_or_one_line_naming_its_key(base, draw):
    """The schema and the registries, on the resolved config (what a run validates before any work)."""
    chosen, key = draw
    assert_one_line_naming(config_errors(with_settings(base, chosen)), key, chosen)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(chosen=valid_settings())
def test_settings_a_user_would_choose_are_accepted(base, chosen):
    assert config_errors(with_settings(base, chosen)) == [], chosen


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(draw=one_bad_setting())
def test_a_drawn_command_line_is_accepted_or_one_line_naming_its_key(base, draw):
    """The same, typed as overrides: Hydra's parsing and composition, then the command line's checks."""
    chosen, key = draw
    overrides = as_overrides(chosen, base)
    assert_one_line_naming(validate([*FAST, *overrides]), key, overrides)


def test_every_numeric_key_refuses_a_bool_and_a_value_below_its_range(base):
    """Python counts a bool as an int; no numeric key may take one, nor a value just below its floor (or, for an
    integer with a ceiling, just above it)."""
    for group, spec in SCHEMA.items():
        for key, value_spec in spec.keys.items():
            inner = value_spec
            while hasattr(inner, "spec"):  # Described, Nullable
                inner = inner.spec
            if not isinstance(inner, (Int, Number)):
                continue
            dotted = f"{group}.{key}".lstrip(".")
            assert schema_errors(with_settings(base, {dotted: True}))[0].startswith(f"{dotted}=True")
            if inner.low is not None:
                assert schema_errors(with_settings(base, {dotted: inner.low - 1}))[0].startswith(f"{dotted}=")
            if isinstance(inner, Int) and inner.high is not None:  # attn.short_conv, seed: a ceiling too
                assert schema_errors(with_settings(base, {dotted: inner.high + 1}))[0].startswith(f"{dotted}=")


@settings(max_examples=3, deadline=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(chosen=valid_settings())
def test_accepted_draws_train(chosen, tmp_path_factory):
    """A few accepted draws train end to end with trainer=debug and write their results."""
    overrides = [*FAST, *as_overrides(chosen, job_config(FAST))]
    run_dir = tmp_path_factory.mktemp("draw") / "run"
    assert validate(overrides) == []
    run_in_process(overrides, run_dir)
    assert read_results(run_dir)["status"] in ("completed", "diverged")
