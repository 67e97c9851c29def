"""generate and analyze rebuild a model from a run folder's model.json and tokenizer.json, which may come from anyone:
with a checkpoint that carries no digests of them (one from before the record, or crafted), nothing vouches for
them. So they are checked as the command line checks a config, before anything is allocated: model.json through
ModelConfig.errors() and the memory bound, tokenizer.json's ids against its vocabulary. Each problem is one line
naming the file and the fix, exit 2."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from blocklab.checkpoint import CHECKPOINT_FILES_KEY
from blocklab.errors import ConfigError
from blocklab.experiment import Setup
from conftest import FAST, ROOT, run_in_process


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("saved_model") / "run"
    run_in_process(FAST, run_dir)
    return run_dir


def model_edit(key, value):
    def edit(model, tokenizer):
        model[key] = value
    return edit


def unknown_kind(model, tokenizer):
    model["attn"]["kind"] = "spiral"


def token_past_the_vocabulary(model, tokenizer):
    tokenizer["model"]["vocab"]["z"] = 100000


def smaller_vocabulary(model, tokenizer):
    model["vocab_size"] = 10


def options_not_a_mapping(model, tokenizer):
    model["attn"]["options"] = [1]


# case -> (how model.json or tokenizer.json is edited, the file the line names, what it says)
CRAFTED = {
    "d_model of a billion": (model_edit("d_model", 10 ** 9), "model.json", "model.d_model=1000000000"),
    "d_model of -4": (model_edit("d_model", -4), "model.json", "model.d_model=-4 must be a positive integer"),
    "unknown attention kind": (unknown_kind, "model.json", "attn.kind='spiral' is unknown"),
    "vocabulary of a billion": (model_edit("vocab_size", 10 ** 10), "model.json", "vocab_size=10000000000"),
    "a token id past the vocabulary": (token_past_the_vocabulary, "tokenizer.json", "has token id 100000"),
    "a vocabulary smaller than the tokenizer's": (smaller_vocabulary, "tokenizer.json", "(vocab_size=10)"),
    "options of the wrong type": (options_not_a_mapping, "model.json", "is unreadable or damaged"),
}


def crafted(finished_run, tmp_path, edit):
    """A copy of the run with model.json or tokenizer.json edited, and a checkpoint with no digests of them."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    state = torch.load(checkpoint, weights_only=True)
    del state[CHECKPOINT_FILES_KEY]
    torch.save(state, checkpoint)
    model, tokenizer = (json.loads((run_dir / name).read_text()) for name in ("model.json", "tokenizer.json"))
    edit(model, tokenizer)
    (run_dir / "model.json").write_text(json.dumps(model))
    (run_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    return run_dir


@pytest.mark.parametrize("edit, name, says", CRAFTED.values(), ids=CRAFTED.keys())
def test_a_crafted_model_file_is_one_line_naming_it(finished_run, tmp_path, edit, name, says):
    run_dir = crafted(finished_run, tmp_path, edit)
    for with_task in (False, True):
        with pytest.raises(ConfigError) as err:
            Setup.from_run_dir(run_dir, with_task=with_task)
        line = str(err.value)
        assert "\n" not in line and str(run_dir / name) in line and says in line, line
        assert line.endswith("train it again in a new hydra.run.dir") or "train the run again" in line


def test_the_untouched_copy_still_loads(finished_run, tmp_path):
    run_dir = crafted(finished_run, tmp_path, lambda model, tokenizer: None)
    assert Setup.from_run_dir(run_dir, with_task=True).trained_model() is not None


COMMANDS = {"generate": ["-m", "blocklab.generate", "{run}", "--prompt", "ab"], "analyze": ["-m", "blocklab.analyze",
                                                                                          "{run}"]}
CLI_CASES = [pytest.param(case, command, id=f"{command}: {case}",
                          marks=() if (case, command) in {("d_model of a billion", "generate"),
                                                          ("a token id past the vocabulary", "analyze")}
                          else pytest.mark.slow)
             for case in ("d_model of a billion", "d_model of -4", "unknown attention kind",
                          "a token id past the vocabulary") for command in COMMANDS]


@pytest.mark.parametrize("case, command", CLI_CASES)
def test_generate_and_analyze_refuse_it_in_one_line_exit_2(finished_run, tmp_path, case, command):
    edit, name, says = CRAFTED[case]
    run_dir = crafted(finished_run, tmp_path, edit)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    args = [arg.replace("{run}", str(run_dir)) for arg in COMMANDS[command]]
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith(f"error: {run_dir / name}") and says in lines[0], lines[0]
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before  # nothing written
