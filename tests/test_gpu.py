"""The GPU path: trainer=gpu (CUDA, bf16-mixed) and trainer.compile. What needs CUDA skips, with the reason, where
torch sees no GPU; what can be checked on a CPU (the refusal, the preset's settings, compile) is checked here."""
import math

import pytest
import torch

from blocklab.results import read_results
from conftest import FAST, compose_config, run_cli, run_in_process

NO_CUDA = not torch.cuda.is_available()


def test_the_gpu_preset_is_one_cuda_device_in_bf16_mixed():
    trainer = compose_config(["trainer=gpu"]).trainer
    assert (trainer.accelerator, trainer.devices, trainer.precision, trainer.compile) == ("gpu", 1, "bf16-mixed", False)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA GPU, so trainer=gpu is not refused here")
@pytest.mark.parametrize("override", ["trainer=gpu", "trainer.accelerator=cuda"])
def test_asking_for_a_gpu_without_one_is_one_line_and_writes_nothing(tmp_path, override):
    run_dir = tmp_path / "run"
    proc = run_cli([*FAST, override, f"hydra.run.dir={run_dir}"], timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU, and torch sees none" in lines[0] and "trainer=cpu" in lines[0]
    assert not run_dir.exists()


@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_a_gpu_run_trains_in_bf16_and_matches_float32_closely(tmp_path):
    run_in_process([*FAST, "trainer=gpu"], tmp_path / "gpu")
    run_in_process([*FAST, "trainer=gpu", "trainer.precision=32-true"], tmp_path / "fp32")
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
