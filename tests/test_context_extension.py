"""Context extension end to end on a tiny language model: a finished run evaluated under a scaling without
retraining (`analyze RUN --eval-scaling METHOD:FACTOR`), and continued training from its weights at a longer
context (`trainer.resume_from=RUN`)."""
import hashlib
import json
import random

import pytest
import torch

from blocklab.analyze import main as analyze_main
from blocklab.checkpoint import load_checkpoint
from blocklab.errors import ConfigError
from blocklab.results import CHECKPOINT, read_results

from conftest import run_in_process

LM = ["task=lm", "logger=none", "trainer=debug", "diagnostics=none", "task.block_size=16", "task.batch_size=8",
      "task.eval_multipliers=[1,2,4]", "task.eval_max_tokens=2048"]


def corpus_text(n=2000, seed=0) -> str:
    rng = random.Random(seed)
    words = ["the cat", "a dog", "my friend", "sees", "eats", "the fish.", "a bone.", "bread."]
    return "\n".join(" ".join(rng.choice(words) for _ in range(3)) for _ in range(n))


def trained_lm(root):
    """A finished LM run on a generated corpus under `root`: (its folder, the overrides that made it)."""
    (root / "corpus.txt").write_text(corpus_text())
    overrides = [*LM, f"task.data.path={root / 'corpus.txt'}", f"task.cache_dir={root / 'cache'}"]
    run_in_process(overrides, root / "run")
    return root / "run", overrides


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return trained_lm(tmp_path_factory.mktemp("ctx"))


def folder_digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_eval_scaling_writes_its_own_file_and_none_reproduces_the_run(lm, capsys):
    run, _ = lm
    before = folder_digest(run)
    analyze_main([str(run), "--eval-scaling", "none"])
    analyze_main([str(run), "--eval-scaling", "yarn:4"])
    written = {p.name for p in run.iterdir()} - {p.split("/")[0] for p in before}
    assert written == {"eval_scaling_none_1.json", "eval_scaling_yarn_4.json"}
    after = folder_digest(run)
    assert {k: v for k, v in after.items() if k in before} == before  # results.json and the rest untouched
    results = read_results(run)
    none = json.loads((run / "eval_scaling_none_1.json").read_text())
    # unscaled, the evaluation is training's own: the same rows as results.json
    assert [r["length"] for r in none["eval"]] == [r["length"] for r in results["eval"]] == [16, 32, 64]
    for mine, theirs in zip(none["eval"], results["eval"]):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
    yarn = json.loads((run / "eval_scaling_yarn_4.json").read_text())
    assert yarn["scaling"] == "yarn" and yarn["scaling_factor"] == 4 and yarn["original_context"] == 16
    assert all(a["loss"] != b["loss"] for a, b in zip(yarn["eval"], none["eval"]))  # the scaling was applied
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("spec,needle", [("pi:0.5", "FACTOR >= 1"), ("yarn", "METHOD:FACTOR"),
                                         ("ntk:nan", "finite FACTOR"), ("linear:2", "pos.scaling='linear' is unknown")])
def test_bad_eval_scaling_is_one_line_exit_2_and_writes_nothing(lm, spec, needle, capsys):
    run, _ = lm
    before = folder_digest(run)
    with pytest.raises(SystemExit) as exit_:
        analyze_main([str(run), "--eval-scaling", spec])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert folder_digest(run) == before


def test_continued_training_starts_from_the_runs_final_weights(lm, tmp_path, monkeypatch):
    import blocklab.train.run as train_run

    run, overrides = lm
    before = folder_digest(run)
    seen = {}

    class Recording(train_run.LitTransformer):
        def on_train_start(self):
            seen["weights"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            super().on_train_start()

    monkeypatch.setattr(train_run, "LitTransformer", Recording)
    longer = [*overrides, "task.block_size=32", "pos.scaling=yarn", "pos.scaling_factor=2", f"trainer.resume_from={run}"]
    run_in_process(longer, tmp_path / "longer")
    source = {k.removeprefix("model."): v for k, v in load_checkpoint(run, CHECKPOINT, None)["state_dict"].items()
              if k.startswith("model.")}
    assert seen["weights"].keys() == source.keys()
    assert all(torch.equal(seen["weights"][k], source[k]) for k in source)
    assert folder_digest(run) == before  # the source run is only read
    results = read_results(tmp_path / "longer")
    assert results["status"] == "completed" and [r["length"] for r in results["eval"]] == [32, 64, 128]
    model = json.loads((tmp_path / "longer" / "model.json").read_text())
    # YaRN's L is the context the source trained at, not the new task's
    assert model["pos"]["options"]["original_context"] == 16 and model["pos"]["options"]["scaling"] == "yarn"
    # it trained on: its weights moved away from the source's
    final = load_checkpoint(tmp_path / "longer", CHECKPOINT, None)["state_dict"]
    assert not torch.equal(final["model.tok_emb.weight"], source["tok_emb.weight"])


@pytest.mark.parametrize("change,needle", [("model.d_model=32", "holds a model of other shapes"),
                                           ("model.n_layers=3", "holds a model of other shapes")])
def test_continued_training_refuses_other_shapes_before_writing(lm, tmp_path, change, needle):
    run, overrides = lm
    with pytest.raises(ConfigError, match=needle) as err:
        run_in_process([*overrides, change, f"trainer.resume_from={run}"], tmp_path / "other")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "other").exists()


def test_continued_training_refuses_a_missing_source(lm, tmp_path):
    _, overrides = lm
    with pytest.raises(ConfigError, match="trainer.resume_from=") as err:
        run_in_process([*overrides, f"trainer.resume_from={tmp_path / 'nowhere'}"], tmp_path / "other")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "other").exists()
