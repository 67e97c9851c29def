"""The Python entry (blocklab.api): a model from overrides, one run's results, a sweep folder as rows."""
import json

import pytest
import torch

from blocklab import api
from blocklab.errors import ConfigError

TINY = ["trainer.max_steps=20", "logger=none", "diagnostics=none", "task.eval_examples=16"]


def decoder_params(vocab: int, d: int, d_ff: int, layers: int) -> int:
    """Pre-LN GPT with biases, tied embeddings and no position parameters (RoPE), counted from its parts:
    per layer W_qkv (3d^2 + 3d), W_o (d^2 + d), two LayerNorms (4d), the MLP (2 d d_ff + d_ff + d)."""
    per_layer = 4 * d * d + 4 * d + 4 * d + 2 * d * d_ff + d_ff + d
    return vocab * d + layers * per_layer + 2 * d  # + the final LayerNorm


def test_build_model_is_the_configured_architecture():
    model = api.build_model(["model.n_layers=3", "model.d_model=32", "model.n_heads=2", "model.d_ff=48"])
    assert isinstance(model, torch.nn.Module) and len(model.blocks) == 3
    count = sum(p.numel() for p in model.parameters())
    assert count == decoder_params(model.cfg.vocab_size, 32, 48, 3)
    # the config's seed sets the initial weights, as in a run
    again = api.build_model(["model.n_layers=3", "model.d_model=32", "model.n_heads=2", "model.d_ff=48"])
    other = api.build_model(["model.n_layers=3", "model.d_model=32", "model.n_heads=2", "model.d_ff=48", "seed=1"])
    assert torch.equal(model.tok_emb.weight, again.tok_emb.weight)
    assert not torch.equal(model.tok_emb.weight, other.tok_emb.weight)


@pytest.mark.parametrize("override, names", [("model.dmodel=3", "model.dmodel"), ("pos=rpe", "pos/rpe"),
                                             ("norm.eps=-1", "norm.eps")])
def test_build_model_refuses_bad_overrides_in_one_line(override, names):
    with pytest.raises(ConfigError) as err:
        api.build_model([override])
    assert names in str(err.value) and len(str(err.value).splitlines()) == 1


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Two tiny runs of one setting, seeds 0 and 1, in one folder: what a sweep folder holds."""
    root = tmp_path_factory.mktemp("sweep")
    return root, [api.run([*TINY, f"seed={seed}"], root / f"seed={seed}") for seed in (0, 1)]


def test_run_returns_the_runs_results(sweep):
    root, (first, second) = sweep
    assert first == json.loads((root / "seed=0" / "results.json").read_text())
    assert first["status"] == "completed" and first["steps"] == 20
    # the model Python builds from the same overrides is the one that trained
    assert first["params"] == sum(p.numel() for p in api.build_model([*TINY, "seed=0"]).parameters())
    assert {row["length"] for row in first["eval"]} == {1, 4, 8, 12, 16, 20, 24, 28, 32}  # copy: 1-16, up to 2x
    assert first["final_train_loss"] != second["final_train_loss"]  # another seed, another run


def test_run_refuses_bad_overrides_before_writing(tmp_path):
    with pytest.raises(ConfigError, match="model.d_model"):
        api.run([*TINY, "model.dmodel=3"], tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_read_sweep_has_one_row_per_run_with_its_results(sweep):
    root, runs = sweep
    rows = api.read_sweep(root)
    assert [row["seed"] for row in rows] == [0, 1]
    for row, results in zip(rows, runs, strict=True):
        assert row["status"] == results["status"] and row["steps"] == 20 and row["params"] == results["params"]
        assert row["final_train_loss"] == results["final_train_loss"]
        for line in results["eval"]:
            assert row[f"exact_match@{line['length']}"] == line["exact_match"]
            assert row[f"token_acc@{line['length']}"] == line["token_acc"]
        inside = [line["exact_match"] for line in results["eval"] if line["in_distribution"]]
        assert row["exact_match_in"] == pytest.approx(sum(inside) / len(inside))
        assert all(not isinstance(value, (dict, list)) for value in row.values())  # a flat table


def test_read_sweep_refuses_a_missing_folder(tmp_path):
    with pytest.raises(ConfigError, match="not a folder"):
        api.read_sweep(tmp_path / "nowhere")
