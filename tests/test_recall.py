"""The recall sweep's report: the decoding state a run records at its training length (results.json
decode.state_bytes), the plot kinds `recall_memory` (best over learning rates against that state) and `lr_range`
(best score and working learning-rate range per setting), and two jobs of sweeps/recall.yaml end to end."""
import json
import subprocess
import sys

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from blocklab.report import recall  # noqa: E402
from blocklab.report.build import PLOTS, check_plots  # noqa: E402
from blocklab.errors import ConfigError  # noqa: E402
from conftest import CONF, run_cli  # noqa: E402

LRS = (1e-4, 4.6e-4, 2.2e-3, 1e-2)


def row(attn, lr, seed, acc, state=1000, d_model=64):
    return {"attn": attn, "optim.lr": lr, "seed": seed, "token_acc_in": acc, "state_bytes": state,
            "model.d_model": d_model, "run": f"/nonexistent/{attn}-{lr}-{seed}-{d_model}"}


def draw(kind, rows, **spec):
    fig, ax = plt.subplots()
    try:
        return PLOTS[kind](ax, rows, {"kind": kind, **spec}, spec.get("metric", "token_acc_in"), ["attn"]), ax
    finally:
        plt.close(fig)


# ------------------------------------------------------- the state a run records at its training length

def mqar_task():
    from blocklab.tasks import build_task

    return build_task(dict(name="mqar", vocab_size=64, seq_len=16, num_kv_pairs=2, power_a=0.01,
                           random_non_queries=True, eval_buckets=[[16, 2]], eval_examples=8, eval_seed=1,
                           batch_size=4), 0)


def model_of(kind="softmax", causal=True, **attn):
    import torch
    from blocklab.model import ModelConfig, build_model
    from blocklab.model.config import AttnConfig, PosConfig

    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=64, max_len=32, d_model=32, n_layers=2, n_heads=4, pos=PosConfig("rope"),
                                   attn=AttnConfig(kind=kind, causal=causal, **attn))).eval()


@pytest.mark.parametrize("kind, attn, expected", [
    ("softmax", {}, 2 * 2 * 32 * 4 * 16),  # layers x (keys, values) x d_model x float32 x 16 training tokens
    ("softmax", {"window": 8}, 2 * 2 * 32 * 4 * 8),  # a window of 8 holds 8 of the 16
    ("gla", {}, 2 * 4 * 8 * 8 * 4),  # layers x heads x a d_head x d_head matrix x float32, at any length
    ("softmax", {"short_conv": 4}, 2 * 2 * 32 * 4 * 16 + 2 * 3 * 3 * 32 * 4),  # + K-1 inputs of q, k, v per layer
], ids=["mha", "window", "gla", "mha_short_conv"])
def test_the_state_at_the_training_length_is_the_kv_cache_or_the_fixed_state(kind, attn, expected):
    from blocklab.train.outcome import state_bytes_at_training_length

    assert state_bytes_at_training_length(model_of(kind, **attn), mqar_task()) == expected


def test_a_bidirectional_model_records_no_decoding_state():
    from blocklab.train.outcome import state_bytes_at_training_length

    assert state_bytes_at_training_length(model_of(causal=False), mqar_task()) is None


# ------------------------------------------------------------------ the working learning-rate range, by hand

def test_lr_range_counts_the_learning_rates_within_the_fraction_of_the_best():
    # attention: 0.2, 0.95, 1.0, 0.5 (mean of two seeds each) -> best 1.0 at 2.2e-3; 0.95 >= 0.9 x 1.0: 2 of 4.
    # gla: best 0.6 at 4.6e-4; only 0.58 (>= 0.54) joins it: 2 of 4, and 0.5 < 0.54 does not.
    acc = {"mha": (0.2, 0.95, 1.0, 0.5), "gla": (0.1, 0.6, 0.58, 0.5)}
    rows = [row(a, lr, s, v + (0.01 if s else -0.01)) for a, vs in acc.items() for lr, v in zip(LRS, vs)
            for s in (0, 1)]
    note, ax = draw("lr_range", rows)
    assert "attn=mha: best 1.000 at lr=0.0022, 2 of 4 reach 0.9 x best (0.00046, 0.0022)" in note
    assert "attn=gla: best 0.600 at lr=0.00046, 2 of 4 reach 0.9 x best (0.00046, 0.0022)" in note
    note, _ = draw("lr_range", rows, fraction=0.5)  # 0.5 x 0.6 = 0.3: every lr but 1e-4
    assert "attn=gla: best 0.600 at lr=0.00046, 3 of 4 reach 0.5 x best" in note
    # the helper the note rests on, on its own
    options = recall.choices([r for r in rows if r["attn"] == "mha"], "token_acc_in", "optim.lr")
    assert [c.value for c in options] == list(LRS) and [len(c.scores) for c in options] == [2] * 4
    assert [c.value for c in recall.working(options, 0.9)] == [4.6e-4, 2.2e-3]


def test_a_second_seed_at_the_best_rate_does_not_choose_the_best_again():
    """Stage 2 adds seed 1 at stage 1's best rate. Its mean over two seeds (0.99 and 0.25: 0.62) is no worse a rate
    than a neighbour seen at one seed (0.98): the rates are compared on seed 0, which every rate has, so the best
    stays 1e-2, its reported mean is over both seeds, and the neighbour still counts in the working range."""
    stage_1 = [row("gla", lr, 0, acc) for lr, acc in zip((4.6e-4, 2.2e-3, 1e-2, 3.16e-2), (0.3, 0.5, 0.99, 0.98))]
    rows = stage_1 + [row("gla", 1e-2, 1, 0.25)]
    options = recall.choices(rows, "token_acc_in", "optim.lr")
    top = recall.best(options)
    assert top.value == 1e-2 and top.mean == pytest.approx(0.62)
    assert recall.best_named(options) == "0.01"
    assert [c.value for c in recall.working(options, 0.9)] == [1e-2, 3.16e-2]  # 0.98 >= 0.9 x 0.99 on seed 0
    note, _ = draw("lr_range", rows)
    assert "attn=gla: best 0.620 at lr=0.01, 2 of 4 reach 0.9 x best (0.01, 0.0316)" in note
    # with no seed that every rate has, the means over each rate's own seeds decide
    apart = [row("gla", 1e-2, 1, 0.25), row("gla", 3.16e-2, 0, 0.98)]
    assert recall.best(recall.choices(apart, "token_acc_in", "optim.lr")).value == 3.16e-2


def test_a_setting_that_learned_nothing_has_no_working_range():
    rows = [row("linear", lr, 0, 0.0) for lr in LRS]
    note, _ = draw("lr_range", rows)
    assert "attn=linear: best 0.000 at lr=0.0001 (the lowest tried: not bracketed), 0 of 4 reach 0.9 x best" in note


def test_lr_range_refuses_a_loss_and_runs_it_would_pool():
    rows = [row("mha", lr, 0, 0.5) for lr in LRS]
    note, _ = draw("lr_range", rows, metric="final_val_loss")
    assert note.startswith("not drawn") and "better lower" in note
    # two widths under one setting and learning rate: the seeds alone would not tell them apart
    both = rows + [row("mha", lr, 0, 0.9, d_model=128) for lr in LRS]
    note, _ = draw("lr_range", both)
    assert note.startswith("not drawn") and "attn=mha, lr=0.0001 holds 2 runs of 1 seed" in note


# ------------------------------------------------------------ best over learning rates against the state size

def test_recall_memory_plots_each_width_at_its_own_best_learning_rate():
    # d_model 64: best lr 2.2e-3 (0.9); d_model 128: best lr 4.6e-4 (0.99). The state doubles with the width.
    acc = {64: (0.1, 0.5, 0.9, 0.3), 128: (0.2, 0.99, 0.7, 0.1)}
    rows = [row("gla", lr, s, v, state=2048 * d // 64, d_model=d) for d, vs in acc.items()
            for lr, v in zip(LRS, vs) for s in (0, 1)]
    note, ax = draw("recall_memory", rows, along="model.d_model")
    assert "attn=gla, d_model=64: 0.900 at lr=0.0022, state_bytes 2,048" in note
    assert "attn=gla, d_model=128: 0.990 at lr=0.00046, state_bytes 4,096" in note
    (line,) = ax.lines[:1]
    assert list(line.get_xdata()) == [2048, 4096] and list(line.get_ydata()) == [0.9, 0.99]
    assert ax.get_xscale() == "log"
    # without `along` the two widths would pool under one setting: refused, not averaged
    note, _ = draw("recall_memory", rows)
    assert note.startswith("not drawn")


def test_recall_memory_says_so_where_no_run_records_the_state():
    rows = [row("mha", lr, 0, 0.5, state=None) for lr in LRS]
    note, _ = draw("recall_memory", rows)
    assert "not recorded" in note


def test_the_report_check_refuses_a_bad_plot_spec_in_one_line_per_problem():
    with pytest.raises(ConfigError) as err:
        check_plots({"plots": [{"kind": "lr_range", "metric": "token_acc_in", "fraction": 1.5},
                               {"kind": "recall_memory", "metric": "token_acc_in", "alng": "model.d_model"}]})
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and "fraction" in lines[0] and "did you mean along" in lines[1]


# ----------------------------------------------------------------------------- two jobs of the sweep, end to end

@pytest.mark.slow
def test_two_recall_jobs_record_their_state_and_the_report_reads_them(tmp_path):
    """attn=mha and attn=gla from sweeps/recall.yaml at 10 steps: results.json's decode.state_bytes is the KV cache
    of a 64-token sequence (2 layers x keys and values x d_model 64 x 4 bytes x 64 tokens) for full attention and
    GLA's fixed state (2 layers x 1 head x a 64 x 64 matrix x 4 bytes), and the report draws both recall plots."""
    out = tmp_path / "sweep"
    proc = run_cli(["-m", "sweep=recall", "attn=mha,gla", "attn.short_conv=0", "optim.lr=2.2e-3", "seed=0",
                    "trainer.max_steps=10", "task.eval_examples=16", "logger=none", f"hydra.sweep.dir={out}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {json.loads(p.read_text())["choices"]["attn"]: json.loads(p.read_text())
            for p in out.rglob("results.json")}
    assert set(runs) == {"mha", "gla"}
    assert runs["mha"]["decode"]["state_bytes"] == 2 * 2 * 64 * 4 * 64
    assert runs["gla"]["decode"]["state_bytes"] == 2 * 1 * 64 * 64 * 4
    report = run_cli_report(out)
    assert report.returncode == 0, report.stderr[-3000:]
    page = (out / "report" / "index.html").read_text()
    assert "state_bytes 65,536" in page and "state_bytes 32,768" in page  # recall_memory's note, both kinds
    assert "working range" in page  # lr_range's note


def run_cli_report(folder):
    return subprocess.run([sys.executable, "-m", "blocklab.report", str(folder)], capture_output=True, text=True,
                          timeout=600)


def test_the_recall_sweep_file_asks_for_both_plots():
    from omegaconf import OmegaConf

    kinds = {p["kind"] for p in OmegaConf.to_container(OmegaConf.load(CONF / "sweep" / "recall.yaml"))["study"]["plots"]}
    assert {"recall_memory", "lr_range"} <= kinds


def test_a_best_learning_rate_at_the_grids_edge_is_not_named_the_best():
    """Issue 54 item 6: recall's best rate for several kinds was the top of its grid. A best with a tried rate on each
    side is named; one at either edge reads "not bracketed", since a better rate may lie past it."""
    from blocklab.report.recall import AtChoice, best_named

    def grid(means):
        return [AtChoice(lr, [m], []) for lr, m in zip([1e-4, 4.6e-4, 2.2e-3, 1e-2], means)]

    assert best_named(grid([0.2, 0.9, 0.5, 0.3])) == "0.00046"
    assert best_named(grid([0.2, 0.3, 0.5, 0.9])) == "0.01 (the highest tried: not bracketed)"
    assert best_named(grid([0.9, 0.3, 0.5, 0.2])) == "0.0001 (the lowest tried: not bracketed)"
    assert best_named(grid([3.0, 1.0, 2.0, 4.0]), higher=False) == "0.00046"  # a loss: lowest is best
    assert best_named(grid([0.9, 0.5])[:2]).endswith("not bracketed)")  # two rates bracket nothing
