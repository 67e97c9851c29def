"""The run summary warns, and results.json records, when a run has not learned its task in distribution:
its columns beyond the training lengths then say nothing about extrapolation."""
import io

from rich.console import Console

from conftest import FAST, ROOT, run_in_process
from blocklab.results import (LEARNED_THRESHOLD, in_distribution_exact_match, learned_in_distribution,
                              learned_warning, print_summary, read_results)


def _row(length: int, inside: bool, exact: float | None) -> dict:
    return {"length": length, "in_distribution": inside, "exact_match": exact, "token_acc": 0.5, "loss": 1.0, "n": 128}


def _results(rows: list[dict], task: str = "copy") -> dict:
    return {"task": task, "choices": dict.fromkeys(("norm", "pos", "act", "attn", "n_heads", "init"), "x"),
            "train_lengths": [1, 16], "eval": rows, "diverged_at_step": None, "status": "completed",
            "params": 1000, "steps": 2000, "train_time_s": 1.0, "tokens_per_s": 100.0, "final_train_loss": 0.1}


def _summary(results: dict) -> str:
    out = io.StringIO()
    print_summary(results, ROOT / "results.json", Console(file=out, width=300))
    return out.getvalue()


LEARNED = _results([_row(1, True, 1.0), _row(8, True, 1.0), _row(16, True, 0.95), _row(32, False, 0.0)])
NOT_LEARNED = _results([_row(1, True, 1.0), _row(8, True, 0.5), _row(16, True, 0.0), _row(32, False, 0.0)])


def test_the_threshold_is_the_documented_one():
    assert LEARNED_THRESHOLD == 0.9


def test_a_run_that_learned_in_distribution_gets_no_warning_whatever_beyond():
    assert in_distribution_exact_match(LEARNED) == (1.0 + 1.0 + 0.95) / 3  # the length beyond (0.0) is not counted
    assert learned_in_distribution(LEARNED) is True
    assert learned_warning(LEARNED) is None
    assert "warning" not in _summary(LEARNED)


def test_a_run_that_did_not_learn_gets_one_warning_line_with_its_figure():
    assert in_distribution_exact_match(NOT_LEARNED) == 0.5
    assert learned_in_distribution(NOT_LEARNED) is False
    warning = learned_warning(NOT_LEARNED)
    assert warning.startswith("warning: in-distribution exact match 0.500 < 0.90")
    assert "has not learned the task" in warning and "beyond the training lengths" in warning
    summary = _summary(NOT_LEARNED)
    assert [line for line in summary.splitlines() if "warning" in line] == [warning]
    assert summary.rstrip().endswith(warning)  # the last line, after the status line


def test_the_threshold_itself_counts_as_learned_and_just_below_it_does_not():
    at = _results([_row(1, True, 1.0), _row(16, True, 0.8)])
    below = _results([_row(1, True, 1.0), _row(16, True, 0.79)])
    assert learned_in_distribution(at) is True and learned_warning(at) is None
    assert learned_in_distribution(below) is False and learned_warning(below) is not None


def test_a_task_without_exact_match_gets_no_warning():
    lm = _results([_row(64, True, None), _row(128, False, None)], task="lm")
    assert in_distribution_exact_match(lm) is None and learned_in_distribution(lm) is None
    assert learned_warning(lm) is None
    assert "warning" not in _summary(lm)


def test_results_without_the_new_keys_still_print():
    """print_summary decides from the eval rows, so results.json written before the key existed still show."""
    assert "warning: in-distribution exact match" in _summary(NOT_LEARNED)


def test_a_run_too_short_to_learn_warns_and_records_it(run_dir, capsys):
    """End to end: 20 steps (trainer=debug) cannot learn copy."""
    run_in_process([*FAST, "diagnostics=none"], run_dir)
    results = read_results(run_dir)
    assert results["learned_in_distribution"] is False
    inside = [r["exact_match"] for r in results["eval"] if r["in_distribution"]]
    assert results["in_distribution_exact_match"] == sum(inside) / len(inside) < LEARNED_THRESHOLD
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning: in-distribution exact match")]
    assert warnings == [learned_warning(results)]
