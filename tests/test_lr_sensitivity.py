"""Learning-rate sensitivity (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities", ICLR 2024): the logit-growth diagnostics (the maximum attention logit, the maximum output logit and
mean log Z, on the probe batch with an explicit softmax) on hand-computed cases, their curve against step in
results.json, LR sensitivity by the paper's sec. 2.2 definition on a hand-computed grid, and the two plot kinds."""
import json
import math

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from blocklab.analysis import metrics  # noqa: E402
from blocklab.analysis.probe import logit_growth  # noqa: E402
from blocklab.report import lr_sensitivity  # noqa: E402
from blocklab.report.figures import PLOTS  # noqa: E402
from blocklab.report.figures_data import figure_record, page_rows  # noqa: E402
from conftest import FAST, run_in_process  # noqa: E402


# ---------------------------------------------------------------- the diagnostics, by hand
def test_the_max_attention_logit_reads_only_allowed_keys_of_real_queries():
    # one example, one head, 3 queries: causal weights (0 above the diagonal). The largest score, 9, sits where
    # the mask forbids it; the next, 7, at query 2 (padding); so the answer is 4 (query 1, key 0).
    scores = torch.tensor([[[[1.0, 9.0, 9.0], [4.0, 2.0, 9.0], [7.0, 0.0, 3.0]]]])
    weights = torch.tensor([[[[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [0.98, 0.0, 0.02]]]])
    assert metrics.max_score(scores, weights) == 7.0
    assert metrics.max_score(scores, weights, torch.tensor([[True, True, False]])) == 4.0


def test_output_logit_stats_by_hand():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [50.0, 0.0, 0.0]]])
    stats = metrics.output_logit_stats(logits, torch.tensor([[True, True, False]]))
    assert stats["max_output_logit"] == 3.0  # the padded position's 50 is not read
    log_z = [math.log(math.e + math.e ** 2 + math.e ** 3), math.log(3.0)]
    assert stats["mean_log_z"] == pytest.approx(sum(log_z) / 2)


def test_the_explicit_path_keeps_the_soft_capped_scores_before_the_mask():
    from blocklab.model.attention import SoftmaxAttention

    attn = SoftmaxAttention(d_model=2, n_heads=1)
    attn.scale, attn.softcap = 1.0, 2.0
    q = torch.tensor([[[[1.0, 0.0], [3.0, 1.0]]]])
    k = torch.tensor([[[[2.0, 0.0], [1.0, 1.0]]]])
    _, weights, scores = attn.explicit(q, k, torch.zeros(1, 1, 2, 2), None, True, 0.0)
    raw = torch.tensor([[2.0, 1.0], [6.0, 4.0]])  # q . k by hand
    torch.testing.assert_close(scores[0, 0], 2.0 * torch.tanh(raw / 2.0))  # Gemma 2's c tanh(s / c)
    assert weights[0, 0, 0, 1] == 0  # the mask acts after, on the weights
    assert metrics.max_score(scores, weights) == pytest.approx(2.0 * math.tanh(3.0))


def tiny_model(**model):
    from blocklab.model import ModelConfig, build_model
    from blocklab.model.config import PosConfig

    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=11, max_len=16, d_model=16, n_layers=2, n_heads=2,
                                   pos=PosConfig("learned"), **model)).eval()


def test_logit_growth_equals_the_scores_from_the_projections_and_the_models_logits():
    """The oracle: q and k read off each layer's qkv_proj output (a hook; no rotation under learned positions), the
    scores scale q k^T under the causal mask by hand, and the model's own forward for the output logits."""
    model = tiny_model(logit_softcap=3.0)
    tokens = torch.randint(11, (2, 6), generator=torch.Generator().manual_seed(1))
    batch = {"input": tokens[:, :-1], "target": tokens[:, 1:], "valid": torch.ones(2, 5, dtype=torch.bool)}
    qkv = {}
    hooks = [b.attn.qkv_proj.register_forward_hook(lambda m, a, out, i=i: qkv.__setitem__(i, out))
             for i, b in enumerate(model.blocks)]
    with torch.no_grad():
        logits = model(batch["input"])
    for h in hooks:
        h.remove()
    expected = []
    for i, block in enumerate(model.blocks):
        q, k, _ = qkv[i].split(block.attn.qkv_sizes, dim=-1)
        q, k = (x.view(2, 5, 2, 8).transpose(1, 2) for x in (q, k))
        s = (q @ k.transpose(-2, -1)) * block.attn.scale
        expected.append(float(s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -math.inf).max()))
    point = logit_growth(model, batch)
    assert point["max_attention_logit"] == pytest.approx(expected, rel=1e-5)
    assert point["max_output_logit"] == pytest.approx(float(logits.max()), rel=1e-6) and float(logits.max()) < 3.0
    assert point["mean_log_z"] == pytest.approx(float(logits.logsumexp(-1).mean()), rel=1e-6)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["target"].flatten())
    assert point["probe_loss"] == pytest.approx(float(ce), rel=1e-6)


def test_a_kind_without_softmax_scores_records_none():
    from blocklab.model.config import AttnConfig

    model = tiny_model(attn=AttnConfig(kind="linear"))
    batch = {"input": torch.zeros(1, 4, dtype=torch.long), "target": torch.zeros(1, 4, dtype=torch.long),
             "valid": torch.ones(1, 4, dtype=torch.bool)}
    assert logit_growth(model, batch)["max_attention_logit"] == [None, None]


def test_the_logit_curve_is_recorded_at_init_and_each_validation(run_dir):
    run_in_process([*FAST, "trainer.max_steps=20", "trainer.val_check_interval=10"], run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    curve = results["diagnostics"]["logit_curve"]
    assert [p["step"] for p in curve] == [0] + [s for s, _ in results["val_loss_curve"]] == [0, 10, 20]
    n_layers = results["choices"]["n_layers"]
    assert all(len(p["max_attention_logit"]) == n_layers and p["max_output_logit"] > 0 for p in curve)
    assert all(p["probe_loss"] > 0 and p["mean_log_z"] is not None for p in curve)


def test_a_resume_keeps_the_curve_and_an_old_checkpoint_has_none(tmp_path):
    from blocklab.train.diagnostics import Diagnostics

    diag = Diagnostics({}, tmp_path / "diagnostics", 10, 1e-3, "none")
    diag.logit_curve = [{"step": 0, "max_output_logit": 1.0}]
    resumed = Diagnostics({}, tmp_path / "diagnostics", 10, 1e-3, "none")
    resumed.load_state_dict(diag.state_dict())
    assert resumed.logit_curve == diag.logit_curve
    resumed.load_state_dict({"history": []})  # saved before the curve existed
    assert resumed.logit_curve == [] and "logit_curve" not in resumed.summary()


# ---------------------------------------------------------------- LR sensitivity, by the paper's definition
def run_row(setting, lr, seed, loss, status="completed", init=5.0):
    return {"run": f"/nonexistent/{setting}-{lr}-{seed}", "study": "s", "status": status, "modification": setting,
            "optim.lr": lr, "seed": seed, "final_val_loss": loss,
            "overrides": {"modification": setting, "optim.lr": str(lr), "seed": str(seed)},
            "logit_curve": [{"step": 0, "probe_loss": init}, {"step": 10, "probe_loss": 1.0}]}


def test_lr_sensitivity_caps_each_rate_at_the_loss_at_init():
    # losses 2.0, 1.5, 6.0 (above l_0 = 5) and a diverged run: capped 2.0, 1.5, 5.0, 5.0 -> mean 3.375, l* 1.5
    rows = [run_row("a", 0.01, 0, 2.0), run_row("a", 0.1, 0, 1.5), run_row("a", 0.3, 0, 6.0),
            run_row("a", 1.0, 0, None, status="diverged"),
            run_row("a", 0.01, 1, 2.0), run_row("a", 0.1, 1, 1.0),  # seed 1: its own curve, (2 + 1) / 2 - 1
            run_row("b", 0.01, 0, 2.0, status="failed")]  # a failed run measured nothing
    lr_sensitivity.annotate(rows)
    assert [r.get("lr_sensitivity") for r in rows] == pytest.approx([1.875] * 4 + [0.5] * 2 + [None])
    assert rows[0]["init_loss"] == 5.0
    assert lr_sensitivity.sensitivity([2.0]) is None  # one rate is no curve


def draw(kind, rows, metric, **spec):
    fig, ax = plt.subplots()
    try:
        return PLOTS[kind](ax, rows, {"kind": kind, "metric": metric, **spec}, metric, ["modification"]), ax
    finally:
        plt.close(fig)


def grid():
    losses = {"baseline": (2.4, 2.1, 2.0, 2.6, None), "qk": (2.4, 2.1, 2.0, 2.02, 2.2)}
    rows = [run_row(s, lr, seed, None if v is None else v + 0.01 * seed, "diverged" if v is None else "completed")
            for s, vs in losses.items() for lr, v in zip((0.001, 0.003, 0.01, 0.03, 0.1), vs) for seed in (0, 1)]
    return lr_sensitivity.annotate(rows)


def test_lr_curve_draws_capped_losses_and_names_each_settings_sensitivity():
    note, ax = draw("lr_curve", grid(), "final_val_loss")
    (base, qk) = [line for line in ax.get_lines()]
    assert list(base.get_ydata()) == pytest.approx([2.405, 2.105, 2.005, 2.605, 5.0])  # diverged: l_0
    # baseline: seed 0 (2.4 + 2.1 + 2.0 + 2.6 + 5) / 5 - 2.0 = 0.82, seed 1 the same +0.01 but its l_0: 0.818;
    # qk: 0.144 on both seeds
    assert "modification=baseline: LR sensitivity 0.819 [0.818, 0.820]" in note
    assert "modification=qk: LR sensitivity 0.144" in note
    assert "best lr 0.01 (2.005); within 0.05 of it: 0.01" in note
    assert "within 0.05 of it: 0.01, 0.03" in note  # qk's 2.025 is within 0.05 of 2.005


def test_over_step_plots_the_largest_layer_against_step_mean_over_seeds():
    rows = [{"modification": "baseline", "seed": s, "logit_curve": [
        {"step": 0, "max_attention_logit": [1.0, 2.0]}, {"step": 10, "max_attention_logit": [None, 10.0 + s]}]}
        for s in (0, 1)]
    note, ax = draw("over_step", rows, "max_attention_logit")
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0, 10] and list(line.get_ydata()) == [2.0, 10.5]
    assert "modification=baseline: 2 at step 0, highest 10.5 (step 10), 10.5 at step 10" in note


def test_a_page_line_keeps_what_the_two_kinds_draw():
    plots = [{"kind": "lr_curve", "metric": "final_val_loss", "by": ["modification"]},
             {"kind": "over_step", "metric": "max_attention_logit", "by": ["modification"]}]
    row = {**grid()[0], "logit_curve": [{"step": 0, "max_attention_logit": [1.0, 3.0]}]}
    record = figure_record(row, plots, with_maps=False)
    assert record["values"]["init_loss"] == 5.0 and record["values"]["lr_sensitivity"] == pytest.approx(0.82)
    assert record["curves"] == {"max_attention_logit": [[0, 3.0]]}
    (page,) = page_rows([{"status": "completed", "setting": {"modification": "baseline", "optim.lr": 0.001},
                          "seed": 0, "metrics": {"final_val_loss": 2.4}, "figure": record}])
    note, _ = draw("over_step", [page], "max_attention_logit")
    assert "3 at step 0" in note
