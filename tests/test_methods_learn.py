"""Every length-generalization method preset (conf/method) learns copy inside its training lengths in a short run,
at the depth and step budget the length_gen sweeps use (4 layers, 1000 steps): a method that cannot learn the task says nothing about extrapolation. At
2 layers the NoPE-based presets do not (0.3-0.8 exact at the longest trained length). Slow: one training per preset."""
from pathlib import Path

import pytest

from blocklab.results import read_results
from conftest import run_in_process

METHODS = sorted(p.stem for p in (Path(__file__).parents[1] / "src/blocklab/conf/method").glob("*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_each_method_learns_copy_in_distribution(method, run_dir):
    run_in_process([f"method={method}", "model.n_layers=4", "task=copy", "task.max_len=4", "task.eval_lengths=[2,4,8]",
                    "task.eval_examples=64", "trainer.max_steps=1000", "trainer.val_check_interval=1000",
                    "logger=none", "diagnostics=none"], run_dir)
    rows = read_results(run_dir)["eval"]
    inside = [row["exact_match"] for row in rows if row["in_distribution"]]
    assert min(inside) >= 0.9, rows
