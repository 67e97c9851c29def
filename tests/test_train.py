"""End to end: config -> model -> training -> evaluation -> results.json."""
import json
import math
import shutil
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import blocklab
from blocklab.hardware import cpu_model
from blocklab.train.callbacks import DivergenceGuard
from blocklab.results import read_results
from blocklab.tasks.references import Level, References
from conftest import FAST, compose_config, run_cli, run_in_process
from helpers import assert_learned_and_changed, loss_fell

EVAL_ROW_KEYS = {"length", "in_distribution", "exact_match", "token_acc", "loss", "n"}
CHOICE_KEYS = {"norm", "pos", "act", "attn", "init", "n_heads", "n_layers", "d_model", "seed"}
TOP_KEYS = {"status", "task", "choices", "params", "steps", "train_time_s", "tokens_per_s", "final_train_loss",
            "final_val_loss", "diverged_at_step", "eval"}


def check_schema(results: dict) -> None:
    assert TOP_KEYS <= set(results)
    assert results["status"] in ("completed", "diverged", "failed")
    assert CHOICE_KEYS <= set(results["choices"])
    assert isinstance(results["params"], int) and results["params"] > 0
    assert results["eval"] and all(EVAL_ROW_KEYS <= set(row) for row in results["eval"])
    for row in results["eval"]:
        assert 0 <= row["exact_match"] <= 1 and 0 <= row["token_acc"] <= 1 and row["n"] > 0
        by_place = row["token_acc_by_position"]  # an answer of a length-L input: at least L tokens and the EOS
        assert len(by_place) >= row["length"] + 1 and all(0 <= a <= 1 for a in by_place)
        assert min(by_place) <= row["token_acc"] <= max(by_place)  # token_acc is a weighted mean of the places
    assert any(r["in_distribution"] for r in results["eval"]) and any(not r["in_distribution"] for r in results["eval"])
    assert results["beside_other_jobs"] is False  # a single run: its speed is its own (sweeps: test_scale_out)
    # Where the numbers came from: the CPU, the kernel level torch picked for it, and torch's version.
    assert results["machine"] == (f"{cpu_model()}, {torch.backends.cpu.get_cpu_capability()} kernels, "
                                  f"torch {torch.__version__}")
    # ...and the code: the package checkout's commit (a findings page cites it), null outside git.
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(blocklab.__file__).parent, capture_output=True,
                          text=True)
    assert (results["commit"] or "").removesuffix("+modified") == (head.stdout.strip() if head.returncode == 0 else "")


ISSUE_COMBINATIONS = [
    "norm=pre_ln pos=rope",
    "task=addition act=swiglu attn=gqa",
    "model.n_heads=8 init=gpt2 norm=post_rms",
    "norm.type=rmsnorm norm.placement=sandwich",
    "model.residual=false model.ffn=false",
    "attn.scale=none attn.qk_norm=true",
    "attn.causal=false pos=t5_bias",
    "task=addition task.pad_operands=true task.reverse_answer=false pos=learned",
    "model.arch=encoder_decoder task=addition pos=t5_bias norm=post_ln",
    "model.arch=encoder_decoder pos=learned attn=gqa act=swiglu",
]
SINGLE_OPTIONS = [f"{group}={option}" for group, names in {
    "norm": ["post_ln", "pre_rms", "sandwich_ln", "deepnorm", "none"],
    "pos": ["none", "sinusoidal", "learned", "t5_bias", "alibi"],
    "act": ["relu", "silu", "relu2", "glu", "geglu", "reglu"],
    "attn": ["mqa", "local"],
    "init": ["default", "xavier", "small", "deepnet", "zero_branch"],
}.items() for option in names]


def composed(overrides: list[str]) -> dict:
    return OmegaConf.to_container(compose_config([*FAST, *overrides]), resolve=True)


@pytest.mark.parametrize("overrides", ISSUE_COMBINATIONS + SINGLE_OPTIONS)
def test_every_option_trains_and_writes_results(overrides, run_dir, default_run):
    run_in_process([*FAST, *overrides.split()], run_dir)
    results = read_results(run_dir)
    check_schema(results)
    assert results["status"] == "completed" and results["steps"] == 20
    # The loss fell, and the option changed what was trained (an ignored one would give the default run's curve
    # bit for bit); options that spell out the defaults give exactly the default run.
    if composed(overrides.split()) == composed([]):
        assert loss_fell(results) and results["train_loss_curve"] == default_run["train_loss_curve"]
    else:
        assert_learned_and_changed(results, default_run)
    for override in overrides.split():
        key, value = override.split("=")
        if key in results["choices"]:
            assert str(results["choices"][key]) == value
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert (run_dir / "checkpoints" / "last.ckpt").exists()


def test_results_record_the_task_s_reference_levels(default_run):
    """results.json `references` (Task.references): the default copy task's bar, exact match 0.9, and its chance
    loss, ln 17 (16 characters and EOS: tests/test_references.py), for the findings page's learned gate."""
    refs = References.from_dict(default_run["references"])
    assert refs.learned == (Level("learned", "exact_match", 0.9),)
    assert refs.lines == (Level("chance", "loss", pytest.approx(math.log(17))),)


def test_same_seed_same_metrics_different_seed_different(tmp_path):
    def metrics(seed, name):
        run_in_process([*FAST, f"seed={seed}"], tmp_path / name)
        r = read_results(tmp_path / name)
        return r["final_train_loss"], [(row["loss"], row["token_acc"]) for row in r["eval"]]

    assert metrics(0, "a") == metrics(0, "b")
    assert metrics(0, "a2") != metrics(1, "c")


def test_loss_ceiling_marks_run_diverged(run_dir):
    run_in_process([*FAST, "max_loss=0.5"], run_dir)
    results = read_results(run_dir)
    assert results["status"] == "diverged" and results["diverged_at_step"] is not None
    assert results["steps"] < 20


def test_guard_catches_non_finite_loss():
    class Trainer:
        global_step, should_stop = 7, False

    guard, trainer = DivergenceGuard(), Trainer()
    guard.on_train_batch_end(trainer, None, {"loss": 2.0}, None, 0)
    assert not trainer.should_stop and guard.diverged_at_step is None
    guard.on_train_batch_end(trainer, None, {"loss": float("nan")}, None, 0)
    assert trainer.should_stop and guard.diverged_at_step == 7


def test_cli_tiny_model_learns_copy(tmp_path):
    """The point of the tool in one run: near-perfect inside the training lengths."""
    run_dir = tmp_path / "copy"
    proc = run_cli(["logger=none", "trainer.max_steps=1000", "trainer.val_check_interval=500", "task.max_len=8",
                    "task.eval_lengths=[4,8,12]", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = read_results(run_dir)
    check_schema(results)
    inside = [r for r in results["eval"] if r["in_distribution"]]
    assert min(r["exact_match"] for r in inside) >= 0.95, results["eval"]
    assert "exact match" in proc.stdout and "trained on" in proc.stdout  # the summary table


@pytest.mark.slow  # 18 s; every_option's encoder-decoder rows cover its training end to end in the default run
def test_encoder_decoder_learns_copy(run_dir):
    run_in_process(["logger=none", "model.arch=encoder_decoder", "trainer.max_steps=600", "trainer.val_check_interval=300",
                    "task.max_len=8", "task.eval_lengths=[4,8]", "task.eval_examples=64"], run_dir)
    results = read_results(run_dir)
    assert min(r["exact_match"] for r in results["eval"]) >= 0.95, results["eval"]


def test_wandb_offline_run_holds_config_and_metrics(tmp_path):
    run_dir = tmp_path / "wb"
    proc = run_cli(["trainer=debug", "logger=wandb", "task.eval_examples=16", f"hydra.run.dir={run_dir}"],
                   env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    wandb_cli = shutil.which("wandb", path=str(Path(sys.executable).parent))
    assert wandb_cli, "the wandb CLI is installed with the package"
    inspect = subprocess.run([wandb_cli, "leet", "inspect", "--summary", "--json", str(runs[0])],
                             capture_output=True, text=True, timeout=120)
    summary = json.loads(inspect.stdout)
    text = json.dumps(summary)
    for key in ('"norm": "pre_ln"', '"pos": "rope"', '"n_heads": 4', "train/loss", "val/loss", "train/grad_norm"):
        assert key in text, key
    # The run ends by skipping the interpreter's teardown (cli.run_and_exit): W&B's run is finished all the same,
    # with the results it was given last.
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    assert '"status": "completed"' in text and '"final_val_loss"' in text


def test_a_single_run_that_skips_the_interpreters_teardown_loses_nothing(tmp_path):
    """TensorBoard's results, written after training and closed at the very end, are all on disk, and the
    printed summary ends stdout (its warning: 20 steps do not learn copy)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "tb"
    proc = run_cli(["trainer=debug", "logger=tensorboard", "task.eval_examples=16", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("warning: in-distribution exact match")
    assert "status: completed" in proc.stdout.rstrip().splitlines()[-2]
    results = read_results(run_dir)
    tags = {}
    for folder in {p.parent for p in run_dir.rglob("events.out.tfevents.*")}:
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        tags.update({tag: events.Scalars(tag)[-1] for tag in events.Tags()["scalars"]})
    final = tags["results/final_val_loss"]
    assert final.step == results["steps"] and math.isclose(final.value, results["final_val_loss"], rel_tol=1e-6)


def test_wandb_online_without_network_falls_back_to_offline(run_dir, monkeypatch, capsys):
    monkeypatch.setattr("blocklab.train.loggers.reachable", lambda host, timeout=3.0: False)
    started = time.time()
    run_in_process([*FAST, "logger=wandb", "logger.mode=online"], run_dir)
    assert time.time() - started < 120  # never waits on the network
    assert "logging offline instead" in capsys.readouterr().err
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert read_results(run_dir)["status"] == "completed"


def test_a_diverging_config_is_recorded_as_diverged(run_dir, capsys):
    """No norm, lr 10, no warmup, no clipping: the loss becomes NaN within a few steps."""
    run_in_process(["logger=none", "diagnostics=none", "task.eval_examples=16", "norm=none", "init=default",
                    "model.n_layers=12", "optim.lr=10", "optim.warmup_steps=0", "trainer.gradient_clip_val=null",
                    "trainer.max_steps=200"], run_dir)
    text = (run_dir / "results.json").read_text()
    results = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert results["status"] == "diverged" and results["diverged_at_step"] < 200
    assert results["steps"] == results["diverged_at_step"]
    assert results["final_train_loss"] is None  # NaN is written as null
    assert "diverged at step" in capsys.readouterr().err


def test_full_disk_is_a_clear_error(run_dir, monkeypatch):
    import errno as errno_module

    from blocklab.errors import ConfigError
    from blocklab.results import write_results

    def full(*args, **kwargs):
        raise OSError(errno_module.ENOSPC, "No space left on device")

    run_dir.mkdir()
    monkeypatch.setattr("blocklab.folder.write_bytes", full)
    with pytest.raises(ConfigError, match="No space left on device; free disk space"):
        write_results(run_dir, {"status": "completed"})


@pytest.mark.parametrize("precision, recorded", [("bf16-mixed", "bf16-mixed"), ("64", "64-true")])
def test_other_precisions_train_end_to_end_and_are_recorded(precision, recorded, run_dir):
    run_in_process([*FAST, f"trainer.precision={precision}", "pos=t5_bias"], run_dir)
    results = read_results(run_dir)
    check_schema(results)
    assert results["status"] == "completed" and results["steps"] == 20
    assert math.isfinite(results["final_val_loss"])
    assert results["choices"]["precision"] == recorded


@pytest.mark.filterwarnings("ignore:.*no `val_dataloader`")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_gradient_clipping_bounds_the_update_in_every_precision(precision):
    """The fused optimizer's step sees gradients of total norm <= gradient_clip_val (Lightning itself
    refuses to clip a fused optimizer under autocast; bfloat16 needs no loss scaling, so BlockLab does)."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from blocklab.bench.common import baby_config, baby_optim, batches
    from blocklab.train.module import LitTransformer

    clip = 0.05
    norms = {"before_clip": [], "at_step": []}

    def total_norm(module):
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters() if p.grad is not None])))

    class Recorder(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # Lightning clips after this hook
            norms["before_clip"].append(total_norm(pl_module))

    class Lit(LitTransformer):
        def configure_optimizers(self):
            config = super().configure_optimizers()
            # Lightning runs forward and backward inside optimizer.step (a closure), so look after it:
            # the gradients the update used are still there, clipped in place.
            config["optimizer"].register_step_post_hook(lambda opt, *_: norms["at_step"].append(total_norm(self)))
            return config

    torch.manual_seed(0)
    lit = Lit(baby_config(n_layers=1, d_model=32, d_ff=64, block=16), baby_optim(), [])
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, gradient_clip_val=clip, precision=precision,
                        callbacks=[Recorder()])
    trainer.fit(lit, torch.utils.data.DataLoader(batches(3, 4, 16, 65), batch_size=None))
    assert len(norms["at_step"]) == 3
    assert all(before > 2 * clip for before in norms["before_clip"])  # clipping had work to do
    assert all(after == pytest.approx(clip, rel=1e-4) for after in norms["at_step"])


def test_a_run_dir_gives_back_the_setup_it_trained_and_generation_uses_it(run_dir):
    from blocklab.experiment import Setup
    from conftest import ROOT, compose_config

    run_in_process(FAST, run_dir)
    trained = Setup.from_config(compose_config(FAST, run_dir))
    saved = Setup.from_run_dir(run_dir, with_task=True)
    assert saved.model_cfg == trained.model_cfg and saved.config == trained.config
    assert saved.task.name == "copy" and Setup.from_run_dir(run_dir).task is None  # generation reads no data

    def generate(*args):
        return subprocess.run([sys.executable, "-m", "blocklab.generate", str(run_dir), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    proc = generate("--prompt", "abc<sep>", "--max-new-tokens", "4", "--temperature", "0")
    assert proc.returncode == 0 and proc.stdout.startswith("abc<sep>"), proc.stderr[-2000:]
    (run_dir / "model.json").unlink()
    proc = generate()
    assert proc.returncode == 2  # bad input, as for training
    assert proc.stderr.strip() == f"error: {run_dir} is not a finished BlockLab run (missing model.json)"
