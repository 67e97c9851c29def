"""Bad values of the optimizer, trainer, logger and max_loss are one line naming the key and the fix (exit 2,
no run directory); generate refuses prompt characters its tokenizer would drop; the result
table explains exact match only where it shows it."""
import io
import json
import re
import subprocess
import sys

import pytest
from rich.console import Console

from blocklab.errors import ConfigError
from blocklab.generate import unknown_characters_error
from blocklab.results import print_summary
from blocklab.schema import physical_memory
from blocklab.tasks.tokenizer import char_tokenizer
from conftest import FAST, ROOT, run_cli, run_in_process

BAD = {
    "one beta": (["optim.betas=[0.9]"], "optim.betas=[0.9] must be two numbers in [0, 1)"),
    "beta of 1": (["optim.betas=[0.9,1.0]"], "optim.betas=[0.9, 1.0] must be two numbers in [0, 1)"),
    "zero validation interval": (["trainer.val_check_interval=0"],
                                 "trainer.val_check_interval=0 must be a positive integer"),
    "fractional validation interval": (["trainer.val_check_interval=0.5"], "trainer.val_check_interval=0.5 must be"),
    "misspelled W&B mode": (["logger=wandb", "logger.mode=onlin"], "logger.mode='onlin' is not a W&B mode; "
                            "did you mean online? use offline, online or disabled"),
    "negative weight decay": (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be a number >= 0"),
    "negative clipping": (["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val=-1 must be null"),
    "negative loss ceiling": (["max_loss=-1"], "max_loss=-1 must be null (no ceiling) or a loss > 0"),
}


@pytest.mark.parametrize("overrides,message", BAD.values(), ids=BAD.keys())
def test_a_bad_value_is_one_line_naming_the_key_before_any_file(overrides, message, run_dir):
    with pytest.raises(ConfigError) as err:
        run_in_process([*FAST, *overrides], run_dir)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert not run_dir.exists()


def test_a_zero_validation_interval_leaves_nothing_that_blocks_the_corrected_command(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli([*FAST, "trainer.val_check_interval=0", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: trainer.val_check_interval=0 must be a positive integer number of steps between validations"]
    assert not run_dir.exists()


def test_generate_refuses_characters_the_copy_tokenizer_does_not_know(run_dir):
    run_in_process(FAST, run_dir)
    proc = subprocess.run([sys.executable, "-m", "blocklab.generate", str(run_dir), "--prompt", "xyz<sep>a x"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("error: --prompt has characters this run's tokenizer does not know: 'x' 'y' 'z' ' ' "
                                   "(it knows 'abcdefghijklmnop' and <eos> <bos> <sep>)")


def test_only_characters_that_would_be_dropped_are_refused():
    assert unknown_characters_error(char_tokenizer("ab"), "abz\n") is None  # byte fallback encodes them
    assert unknown_characters_error(char_tokenizer("ab", byte_fallback=False), "abz\n") == (
        "--prompt has characters this run's tokenizer does not know: 'z' '\\n' (it knows 'ab')")


def _summary(rows: list[dict]) -> str:
    results = {"task": "lm", "choices": dict.fromkeys(("norm", "pos", "act", "attn", "n_heads", "init"), "x"),
               "train_lengths": [64, 64], "eval": rows, "diverged_at_step": None, "status": "completed",
               "params": 1000, "steps": 20, "train_time_s": 1.0, "tokens_per_s": 100.0, "final_train_loss": 2.0}
    out = io.StringIO()
    print_summary(results, ROOT / "results.json", Console(file=out, width=300))
    return out.getvalue()


def test_the_table_explains_exact_match_only_where_it_shows_it():
    lm_row = {"length": 64, "in_distribution": True, "exact_match": None, "token_acc": 0.5, "loss": 2.0,
              "perplexity": 7.4, "bits_per_char": 2.9, "n": 4}
    lm = _summary([lm_row])
    assert "trained on length 64" in lm and "exact match" not in lm
    assert "exact match (greedy)" in _summary([{**lm_row, "exact_match": 0.25}])


# Values that cannot train: each passed validation, trained to NaN at step 1 (or without rotation: pos.base=inf)
# and was recorded as `status: diverged` with exit 0, or crashed with a traceback (seed=-1, a 1e9-wide model,
# an evaluation length of a million, /dev/zero as a corpus). Now: one line, exit 2, no folder.
CANNOT_TRAIN = {
    "rope base 0": (["pos.base=0"], "error: pos.base=0 must be > 1"),
    "rope base 1": (["pos.base=1"], "error: pos.base=1 must be > 1"),
    "sinusoidal base below 1": (["pos=sinusoidal", "pos.base=0.5"], "error: pos.base=0.5 must be > 1"),
    "rope base inf": (["pos.base=inf"], "error: pos.base=inf must be a finite number"),
    "scale factor inf": (["attn.scale_factor=inf"], "error: attn.scale_factor=inf must be a finite number"),
    "learning rate inf": (["optim.lr=inf"], "error: optim.lr=inf must be a finite number"),
    "nan in a list": (["optim.betas=[0.9,nan]"], "error: optim.betas=[0.9, nan] must hold finite numbers only"),
    "negative seed": (["seed=-1"], "error: seed=-1 must be an integer in [0, 4294967295]"),
    "seed past numpy's range": (["seed=4294967296"], "error: seed=4294967296 must be an integer in [0, 4294967295]"),
    "model too big to allocate": (["model.d_model=1000000000"], "error: model.d_model=1000000000, model.n_layers=2, "
                                  "model.d_ff=4000000000, task=copy's vocabulary of 20 tokens make a model with a "
                                  "tensor of more than 2**63 bytes"),
    # 10**10: the 10**8 (95 GiB) would fit a machine of 128 GiB.
    "embeddings too big to allocate": (["task=mqar", "task.vocab_size=10000000000"], "error: model.d_model=64, "
                                       "model.n_layers=2, model.d_ff=256, task.vocab_size=10000000000 make a model of "
                                       "640,000,100,096 parameters, which needs 9.54e+03 GiB to train"),
    "evaluation length of a million": (["task.eval_lengths=[1000000]"], "error: task=copy would build sequences of "
                                       "2000001 tokens"),
    "device as a corpus": (["task=lm", "task.data.path=/dev/zero"], "error: task.data.path=/dev/zero is not a "
                           "regular file"),
}


@pytest.mark.parametrize("overrides,message", CANNOT_TRAIN.values(), ids=CANNOT_TRAIN.keys())
def test_a_value_that_cannot_train_is_refused_not_recorded_as_diverged(overrides, message, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(["trainer=debug", "logger=none", *overrides, f"hydra.run.dir={run_dir}"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(message), proc.stderr[-2000:]
    assert not run_dir.exists()


def test_the_size_check_compares_the_models_own_count_with_this_machines_memory():
    """The count is the model's (built on the meta device: tests/test_model_size.py), each parameter held four
    times (gradient, Adam's two moments); what a machine has is the OS's figure."""
    from blocklab.model import ModelConfig
    from blocklab.model.size import memory_error

    assert physical_memory() > 2 ** 30
    assert memory_error(ModelConfig(), "32-true", "model.d_model=64", "make the model smaller") is None
    line = memory_error(ModelConfig(vocab_size=10 ** 8), "32-true", "task.vocab_size=100000000", "make it smaller")
    assert line.startswith("task.vocab_size=100000000 make a model of 6,400,") and line.endswith("; make it smaller")


def test_a_real_divergence_is_still_recorded_as_diverged(run_dir):
    """A finite learning rate far too large is a result, not a config error: the run records it."""
    run_in_process([*FAST, "optim.lr=1e6", "max_loss=20"], run_dir)
    assert json.loads((run_dir / "results.json").read_text())["status"] == "diverged"


def test_a_local_corpus_never_touches_the_network(tmp_path, monkeypatch):
    """`datasets` reported a download count to the hub for a local file (a DNS query) unless HF_HUB_OFFLINE=1."""
    import socket

    from blocklab.tasks.corpus import load_corpus

    lookups = []

    def no_network(*args, **kwargs):
        lookups.append(args[:2])
        raise OSError("no network in this test")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    loaded = load_corpus({"path": str(corpus), "val_fraction": 0.1, "encoding_errors": "strict"}, tmp_path / "cache")
    assert lookups == [] and len(loaded.train) + len(loaded.val) == len(corpus.read_text().rstrip("\n")) + 1


@pytest.mark.parametrize("content,message", [
    (b"\0" * 4000, "is not text (it has NUL bytes: a binary file?)"),
    (b"text " * 2000 + b"\0", "has NUL bytes at character 10000, so it is not text"),
], ids=["binary from the start", "binary past the first 8000 bytes"])
def test_a_binary_corpus_is_one_line(content, message, tmp_path):
    from blocklab.tasks.corpus import load_corpus

    path = tmp_path / "data.bin"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_corpus({"path": str(path), "val_fraction": 0.1, "encoding_errors": "strict"}, tmp_path / "cache")


@pytest.mark.parametrize("options,message", [
    (["--top-k", "0"], "error: --top-k=0 must be a positive integer"),
    (["--temperature", "-1"], "error: --temperature=-1.0 must be a finite number >= 0"),
    (["--temperature", "inf"], "error: --temperature=inf must be a finite number >= 0"),
    (["--max-new-tokens", "-5"], "error: --max-new-tokens=-5 must be a positive number of tokens"),
    (["--seed", "-1"], "error: --seed=-1 must be an integer in [0, 4294967295]"),
    (["--top-k", "abc"], "error: argument --top-k: invalid int value: 'abc'"),
], ids=["top-k 0", "negative temperature", "infinite temperature", "negative token count", "negative seed",
        "top-k a word"])
def test_generate_refuses_options_no_generation_can_use_before_torch(options, message, tmp_path):
    code = ("import sys\nfrom blocklab.generate import main\n"
            f"try:\n    main([{str(tmp_path)!r}, *{options!r}])\nexcept SystemExit as exit:\n"
            "    print(exit.code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(message), proc.stderr


@pytest.fixture(scope="module")
def truncated_run(tmp_path_factory):
    """A finished run whose checkpoint lost all but its first kilobyte."""
    run_dir = tmp_path_factory.mktemp("truncated") / "run"
    proc = run_cli([*FAST, "diagnostics=none", f"hydra.run.dir={run_dir}"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(run_dir / "checkpoints" / "last.ckpt", "r+b") as checkpoint:
        checkpoint.truncate(1000)
    return run_dir


@pytest.mark.parametrize("tool, args", [("blocklab.generate", ["--prompt", "abc<sep>"]), ("blocklab.analyze", [])],
                         ids=["generate", "analyze"])
def test_a_truncated_checkpoint_is_one_line_naming_it(tool, args, truncated_run):
    proc = subprocess.run([sys.executable, "-m", tool, str(truncated_run), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    checkpoint = truncated_run / "checkpoints" / "last.ckpt"
    assert proc.stderr.splitlines() == [f"error: checkpoint {checkpoint} is unreadable (BadZipFile); restore the run "
                                        "from a copy, or train it again in a new hydra.run.dir"]
    assert not (truncated_run / "diagnostics").exists()
