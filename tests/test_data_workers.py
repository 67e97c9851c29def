"""trainer.data_workers: batches built in DataLoader workers are the batches the training process would build,
in the same order, from any start step, for every kind of training stream."""
import json

import pytest
import torch
from torch.utils.data import DataLoader

from blocklab.experiment import Setup
from blocklab.tasks import build_task
from conftest import FAST, compose_config, run_cli
from test_mlm import corpus, task_cfg  # noqa: F401 (corpus: the fixture)


@pytest.fixture(scope="module")
def tasks(corpus, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    coupled = ["task=addition", "pos=learned", "pos.coupled=true", "pos.coupled_offset=5", "task.batch_size=8"]
    return {
        "copy": Setup.from_config(compose_config(["task.batch_size=8"])).task,
        "addition-coupled": Setup.from_config(compose_config(coupled)).task,
        "lm": build_task(task_cfg(corpus, cache, name="lm"), 0),
        "mlm": build_task(task_cfg(corpus, cache), 0),
        "mlm-nsp": build_task(task_cfg(corpus, cache, nsp=True), 0),
    }


def first(stream, n):
    return [batch for _, batch in zip(range(n), stream)]


@pytest.mark.parametrize("name", ["copy", "addition-coupled", "lm", "mlm", "mlm-nsp"])
@pytest.mark.parametrize("start_step", [0, 5])
def test_workers_yield_the_training_process_batches_in_order(tasks, name, start_step):
    task = tasks[name]
    alone = first(iter(task.train_batches(start_step)), 7)
    loader = DataLoader(task.train_batches(start_step), batch_size=None, num_workers=2)
    with_workers = first(iter(loader), 7)
    for a, b in zip(alone, with_workers, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(alone[0]["target"], alone[1]["target"])  # distinct steps, so order is tested


def test_a_run_with_workers_trains_on_the_same_batches(tmp_path):
    """Losses equal step for step: a worker that repeated or skipped steps would change them."""
    losses = {}
    for workers in (0, 2):
        run_dir = tmp_path / f"w{workers}"
        proc = run_cli([*FAST, f"trainer.data_workers={workers}", "diagnostics=none", f"run_dir={run_dir}"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads((run_dir / "results.json").read_text())
        losses[workers] = result["final_train_loss"]
    assert losses[0] == losses[2]
