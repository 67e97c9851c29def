"""Bad values of the optimizer, trainer, logger and max_loss are one line naming the key and the fix (exit 2,
no run directory); generate refuses prompt characters its tokenizer would drop; the result
table explains exact match only where it shows it."""
import io
import subprocess
import sys

import pytest
from rich.console import Console

from blocklab.errors import ConfigError
from blocklab.generate import unknown_characters_error
from blocklab.results import print_summary
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
