"""Every yaml option composes and builds; bad configs fail before any work with a line naming the key."""
import pytest

from blocklab.errors import ConfigError
from blocklab.hardware import accelerator_error
from blocklab.train.run import prepare
from conftest import CONF, compose_config, run_cli
from helpers import refused

GROUPS = ["norm", "pos", "act", "attn", "init", "task", "model", "trainer", "logger", "optim"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_issue_groups_have_every_option():
    assert set(options("norm")) >= {"pre_ln", "post_ln", "pre_rms", "post_rms", "sandwich_ln", "deepnorm", "none"}
    assert set(options("pos")) >= {"none", "sinusoidal", "learned", "t5_bias", "rope", "alibi"}
    assert set(options("act")) >= {"relu", "gelu", "silu", "relu2", "glu", "swiglu", "geglu", "reglu"}
    assert set(options("attn")) >= {"mha", "mqa", "gqa", "local"}
    assert set(options("init")) >= {"default", "normal", "gpt2", "xavier", "small", "deepnet", "zero_branch"}
    assert set(options("task")) >= {"copy", "addition"}
    assert set(options("trainer")) >= {"cpu", "debug"} and set(options("logger")) >= {"wandb", "csv", "none"}


@pytest.mark.parametrize("group, option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_validates(group, option, tmp_path):
    cfg = compose_config([f"{group}={option}"], tmp_path / "run")
    if accelerator_error(cfg.trainer.accelerator):  # trainer=gpu where torch sees no GPU: refused (test_gpu.py)
        with pytest.raises(ConfigError, match="needs a CUDA GPU"):
            prepare(cfg)
        return
    assert prepare(cfg).model_cfg.errors() == []


def test_choices_are_named_by_what_the_model_computes(tmp_path):
    from blocklab.train.outcome import choices

    cfg = compose_config(["norm.type=rmsnorm", "norm.placement=sandwich", "attn=mha", "attn.n_kv_heads=1"], tmp_path)
    model_cfg = prepare(cfg).model_cfg
    picked = choices(model_cfg, 0)
    assert picked["norm"] == "sandwich_rmsnorm" and picked["attn"] == "mqa"
    assert model_cfg.norm.type == "rmsnorm" and model_cfg.norm.placement == "sandwich"


@pytest.mark.parametrize("overrides, message", [
    ("model.n_heads=3", "model.n_heads=3 does not divide model.d_model=64"),
    ("model.d_model=0", "model.d_model=0 must be a positive integer"),
    ("model.n_layers=-1", "model.n_layers=-1 must be a positive integer"),
    ("model.d_ff=0", "model.d_ff=0 must be null (4 * d_model) or a positive integer"),
    ("model.dropout=1.5", "model.dropout=1.5 must be a number in [0, 1)"),
    ("attn.n_kv_heads=3", "attn.n_kv_heads=3 must divide model.n_heads=4"),
    ("attn.window=0", "attn.window=0 must be null (full attention) or a positive integer"),
    ("trainer=debug trainer.limit_val_batches=0", "trainer.limit_val_batches=0 must be null (every batch"),
    ("trainer.limit_eval_examples=0", "trainer.limit_eval_examples=0 must be null (the task's"),
    ("attn.scale=-1", "attn.scale=-1 must be null"),
    ("model.d_model=60 model.n_heads=12", "pos=rope needs an even head dimension"),
    ("pos=sinusoidal model.d_model=63 model.n_heads=7", "pos=sinusoidal needs an even model.d_model"),
    ("pos=t5_bias pos.num_buckets=2", "pos.num_buckets=2"),
    ("pos=sinusoidal pos.scale_embeddings=maybe", "pos.scale_embeddings='maybe' must be true or false"),
    ("pos=rope pos.base=big", "pos.base='big' must be a number"),
    ("norm.type=groupnorm", "norm.type='groupnorm' is unknown"),
    ("norm.placement=middle", "norm.placement='middle' is unknown"),
    ("act.name=tanh", "act.name='tanh' is unknown"),
    ("init.name=orthogonal", "init.name='orthogonal' is unknown"),
    ("task.min_len=20", "the training length range is empty"),
    ("task.eval_lengths=[]", "task.eval_lengths=[] must be a non-empty list"),
    ("task=addition task.batch_size=0", "task.batch_size=0 must be a positive integer"),
    ("trainer.max_steps=0", "trainer.max_steps=0 trains nothing and needs trainer.resume_from=RUN"),
    ("trainer.max_steps=-1", "trainer.max_steps=-1 must be a positive integer (0, no training"),
    ("trainer.precision=16-mixed", "trainer.precision='16-mixed' is not supported; use 32-true"),
    ("trainer.precision=bf16-true", "trainer.precision='bf16-true' is not supported; use 32-true"),
    ("trainer.precision=bf16", "trainer.precision='bf16' is not supported; use 32-true (float32), bf16-mixed"),
    ("optim.lr=0", "optim.lr=0 must be a number > 0"),
    ("optim.min_lr=1.0", "optim.min_lr=1.0 must be at most optim.lr=0.003"),
    ("optim.warmup_steps=-5", "optim.warmup_steps=-5 must be an integer >= 0"),
    ("model.arch=transformer_xl", "model.arch='transformer_xl' is unknown"),
    ("model.arch=encoder_decoder task=lm", "model.arch=encoder_decoder needs a source/target task"),
    ("diagnostics.every_n_steps=0", "diagnostics.every_n_steps=0 must be a positive integer"),
    ("diagnostics.attention_maps=some", "diagnostics.attention_maps='some' is not an allowed value; use none, end"),
    ("checkpoint_every=0", "checkpoint_every=0 must be a positive number of steps"),
    ("task=lm task.block_size=0", "task.block_size=0 must be a positive integer"),
    ("task=lm task.tokenizer.type=bpe", "task.tokenizer.vocab_size=None: byte-level BPE needs an integer above 256"),
    ("task=lm task.eval_multipliers=[1,0]", "task.eval_multipliers=[1, 0] must be a non-empty list"),
    ("task=lm task.eval_lengths=[128,256]", "task.eval_lengths=[128, 256] must be null (task.eval_multipliers times "
                                             "task.block_size) or a list of positive token counts that holds task.block_size=64"),
])
def test_bad_config_raises_one_line_naming_the_key(overrides, message, tmp_path):
    run_dir = tmp_path / "run"
    with refused(message, run_dir):
        prepare(compose_config(overrides.split(), run_dir))


def test_learned_positions_must_cover_evaluated_lengths(tmp_path):
    with pytest.raises(ConfigError, match=r"pos.max_len=20 is shorter than the longest sequence"):
        prepare(compose_config(["pos=learned", "pos.max_len=20"], tmp_path / "run"))
    setup = prepare(compose_config(["pos=learned"], tmp_path / "run"))
    assert setup.model_cfg.position_options()["max_len"] == setup.task.max_seq_len


def test_cli_bad_config_exits_nonzero_with_one_line_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "bad"
    proc = run_cli(["model.n_heads=5", f"hydra.run.dir={run_dir}", "logger=none"])
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: model.n_heads=5 does not divide model.d_model=64; use one of [1, 2, 4, 8, 16, 32, 64]"]
    assert not run_dir.exists()


def test_cli_bad_config_leaves_an_existing_run_untouched(tmp_path):
    run_dir = tmp_path / "existing"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "results.json").write_text('{"status": "completed"}')
    (run_dir / ".hydra" / "config.yaml").write_text("seed: 0\n")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    proc = run_cli(["attn.n_kv_heads=3", f"hydra.run.dir={run_dir}", "logger=none"])
    assert proc.returncode == 2 and "attn.n_kv_heads=3" in proc.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # A valid config aimed at a finished run is refused too: results are never overwritten.
    proc = run_cli(["trainer=debug", f"hydra.run.dir={run_dir}", "logger=none"])
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_unknown_group_option_lists_the_choices():
    proc = run_cli(["pos=spiral"])
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: pos=spiral is not an option of group pos; options: "
                                        "alibi fire learned none rope sinusoidal t5_bias"]


def test_unwritable_run_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot write to run directory"):
        prepare(compose_config([], blocker / "run"))


@pytest.mark.parametrize("overrides, expected", [
    (["trainer=debug", "task=mqar"], 32),  # the debug trainer caps MQAR's 256 per bucket
    (["trainer=debug", "task=copy"], 32),
    (["trainer=debug", "task=copy", "task.eval_examples=16"], 16),  # a smaller set stays as asked
    (["task=mqar"], 256),  # no cap outside trainer=debug
    (["task=mqar", "trainer.limit_eval_examples=100"], 100),
])
def test_the_eval_cap_is_written_into_the_config_the_run_saves(overrides, expected, tmp_path):
    from blocklab.experiment import run_config

    config = prepare(compose_config(overrides, tmp_path / "run")).config
    assert config["task"]["eval_examples"] == expected
    assert run_config(compose_config(overrides, tmp_path / "run"))["task"]["eval_examples"] == expected
