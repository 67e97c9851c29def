"""The GPU path: trainer=gpu (CUDA, bf16-mixed) and trainer.compile. What needs CUDA skips, with the reason, where
torch sees no GPU; what can be checked on a CPU (the refusal, the preset's settings, compile) is checked here."""
import math

import pytest
import torch

from blocklab.results import read_results
from conftest import FAST, compose_config, run_cli, run_in_process
from helpers import assert_refused_cli

NO_CUDA = not torch.cuda.is_available()


def test_the_gpu_preset_is_one_cuda_device_in_bf16_mixed():
    trainer = compose_config(["trainer=gpu"]).trainer
    assert (trainer.accelerator, trainer.devices, trainer.precision, trainer.compile) == ("gpu", 1, "bf16-mixed", False)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA GPU, so trainer=gpu is not refused here")
@pytest.mark.parametrize("override", ["trainer=gpu", "trainer.accelerator=cuda"])
def test_asking_for_a_gpu_without_one_is_one_line_and_writes_nothing(tmp_path, override):
    run_dir = tmp_path / "run"
    fast = [o for o in FAST if o != "trainer=debug"] if override.startswith("trainer=") else FAST  # one trainer=
    proc = run_cli([*fast, override, f"hydra.run.dir={run_dir}"], timeout=120)
    line = assert_refused_cli(proc, "needs a CUDA GPU, and torch sees none", run_dir)
    assert "trainer=cpu" in line


@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_a_gpu_run_trains_in_bf16_and_matches_float32_closely(tmp_path):
    """20 steps (trainer=gpu replaces FAST's trainer=debug, so the steps are set again): bfloat16's round-off, not a
    different training."""
    short = ["trainer=gpu", "trainer.max_steps=20", "trainer.val_check_interval=20"]
    run_in_process([*FAST, *short], tmp_path / "gpu")
    run_in_process([*FAST, *short, "trainer.precision=32-true"], tmp_path / "fp32")
    bf16, fp32 = read_results(tmp_path / "gpu"), read_results(tmp_path / "fp32")
    assert bf16["status"] == "completed" and bf16["choices"]["precision"] == "bf16-mixed"
    assert bf16["final_train_loss"] == pytest.approx(fp32["final_train_loss"], rel=0.02)


@pytest.mark.slow  # compiling the forward and backward on the CPU takes a minute or two
def test_a_compiled_run_trains_to_the_losses_of_an_eager_one(tmp_path):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run_in_process([*FAST, "trainer.compile=true"], tmp_path / "compiled")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the training forward was compiled
    run_in_process([*FAST], tmp_path / "eager")
    compiled, eager = read_results(tmp_path / "compiled"), read_results(tmp_path / "eager")
    assert compiled["status"] == "completed" and math.isfinite(compiled["final_train_loss"])
    assert compiled["final_train_loss"] == pytest.approx(eager["final_train_loss"], rel=1e-4)
    # Evaluation runs eagerly either way: the same weights give the same rows.
    for a, b in zip(compiled["eval"], eager["eval"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_a_gpu_run_evaluates_and_measures_its_model_on_the_gpu(tmp_path):
    """Lightning's teardown moves the model to the CPU; the run moves it back, so results.json names the GPU it
    trained on, and the diagnostics' probe meets the model on its device instead of being skipped. The console
    carries the run's own lines, not Lightning's notes on the GPU, its precision or loader workers."""
    fast = [o for o in FAST if o != "trainer=debug"]  # one trainer= (the second is refused)
    proc = run_cli([*fast, "trainer=gpu", "trainer.max_steps=20", f"hydra.run.dir={tmp_path}"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    for chatter in ("Tensor Cores", "LOCAL_RANK", "Automatic Mixed Precision", "num_workers"):
        assert chatter not in proc.stdout + proc.stderr
    results = read_results(tmp_path)
    assert torch.cuda.get_device_name(0) in results["machine"]
    assert all("skipped" not in results["diagnostics"][tag] for tag in ("init", "end"))
    assert all(row["loss"] is not None for row in results["eval"])


@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("task", ["copy", "addition", "lm"])
def test_evaluation_on_the_gpu_scores_what_it_scores_on_the_cpu(task):
    """The same float32 weights evaluated on both devices: teacher-forced losses agree to round-off and greedy
    decoding reads the same tokens (exact match and token accuracy equal)."""
    from blocklab.experiment import Setup
    from blocklab.model import build_model

    small = ["task.eval_examples=16"] if task != "lm" else ["task.eval_multipliers=[1,2]"]
    setup = Setup.from_config(compose_config(["trainer=debug", "logger=none", f"task={task}", *small]))
    torch.manual_seed(0)
    model = build_model(setup.model_cfg)
    cpu = setup.task.evaluate(model.eval())
    gpu = setup.task.evaluate(model.cuda())
    for a, b in zip(cpu, gpu):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["token_acc"] == pytest.approx(a["token_acc"], abs=1e-3)
        assert b.get("exact_match") == a.get("exact_match")


@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("pos", ["t5_bias", "fire"])
def test_a_trained_bias_takes_the_memory_efficient_kernel_on_the_gpu(pos):
    """T5's and FIRE's biases are permuted views; CUDA's memory-efficient kernel refuses a mask whose last dimension
    is not contiguous, which left these schemes on the math kernel. Held to that kernel, a training step runs."""
    from torch.nn.attention import SDPBackend

    from blocklab.bench.kernels import SIZES, KernelStep

    step = KernelStep(pos, SDPBackend.EFFICIENT_ATTENTION, SIZES["full"], 256, torch.device("cuda", 0))
    assert step.refusal() is None
    assert step.layer.attn.qkv_proj.weight.grad is not None and torch.isfinite(step.layer.attn.qkv_proj.weight.grad).all()
