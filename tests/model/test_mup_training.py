"""param=mup in training, on the LM task (the built-in Shakespeare, characters), against what µP predicts (Yang et al.
2022, "Tensor Programs V", arXiv 2203.03466): the coordinate check (sec. D.1, Fig. 5; microsoft/mup's
`get_coord_data`), wider is better at one learning rate (Fig. 1, right: under µP the loss at a fixed lr falls with
width), and the best learning rate staying put across widths (Fig. 1). Short runs through blocklab.train.width_check:
BlockLab's model, loss, AdamW groups, schedule and clipping, without Lightning."""
import statistics

import pytest

from blocklab.train.width_check import slope, train_briefly, width_setup

WIDTHS = [32, 64, 128, 256]
SEEDS = [0, 1, 2]


def mean_sizes(param: str, steps: int, lr: float) -> dict[str, list[float]]:
    """layer -> its mean |output| after `steps` Adam steps at a constant lr, averaged over SEEDS, one per width."""
    sizes: dict[str, list[float]] = {}
    for width in WIDTHS:
        runs = [train_briefly(width_setup(width, overrides=[
            "task=lm", f"param={param}", f"optim.lr={lr}", "optim.warmup_steps=0", f"optim.min_lr={lr}",
            "task.batch_size=8", "task.block_size=64", f"seed={seed}"]), steps, record_at_end=True)["sizes"]
            for seed in SEEDS]
        for name in runs[0]:
            sizes.setdefault(name, []).append(statistics.mean(run[name] for run in runs))
    return sizes


@pytest.mark.slow
def test_coordinate_check():
    """After 5 Adam steps (lr 0.01), the slope of log mean |output| against log width, widths 32-256, 3 seeds: about 0
    (|slope| < 0.25) for every layer under mup (the embedding, each block's attention, FFN and residual stream, the
    logits); under sp the logits grow with width (slope > 0.5: Adam's updates to a readout of std 0.02 add up over
    d_model coordinates), so sp fails the check."""
    mup = {name: slope(WIDTHS, values) for name, values in mean_sizes("mup", 5, 0.01).items()}
    sp = {name: slope(WIDTHS, values) for name, values in mean_sizes("sp", 5, 0.01).items()}
    assert len(mup) == 8 and all(abs(s) < 0.25 for s in mup.values()), mup
    assert sp["logits"] > 0.5 and max(abs(s) for s in sp.values()) > 0.25, sp


def final_losses(param: str, lr: float, steps: int, seeds: list[int], widths: list[int]) -> dict[int, float]:
    """width -> the mean over seeds of the mean training loss of the last 25 steps (batch 8 x 32 tokens, warmup 10%,
    cosine to lr/10): the measurement scripts/mup_lr_transfer.py makes, on a smaller grid."""
    losses = {}
    for width in widths:
        finals = []
        for seed in seeds:
            run = train_briefly(width_setup(width, overrides=[
                "task=lm", f"param={param}", f"optim.lr={lr}", f"optim.min_lr={lr / 10}",
                f"optim.warmup_steps={steps // 10}", "task.batch_size=8", "task.block_size=32", f"seed={seed}"]), steps)
            finals.append(float("inf") if run["diverged"] else statistics.mean(run["losses"][-25:]))
        losses[width] = statistics.mean(finals)
    return losses


WIDER_TOLERANCE = 0.02  # nats: how much higher a wider model's loss may be and still count as not worse


@pytest.mark.slow
def test_wider_is_better_at_one_learning_rate():
    """Under mup at the lr tuned at the base width (0.003, the best of the grid at d_model 64 in
    docs/measurements/2026-11-28-mup-lr-transfer.md), 200 steps, 3 seeds: each wider model's final training loss is
    lower than the narrower one's, within WIDER_TOLERANCE (Tensor Programs V, Fig. 1: under µP wider is better at a
    fixed lr; under sp it need not be, the best lr moving)."""
    losses = final_losses("mup", 0.003, 200, SEEDS, WIDTHS)
    for narrow, wide in zip(WIDTHS, WIDTHS[1:]):
        assert losses[wide] < losses[narrow] + WIDER_TOLERANCE, losses


GRID = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1]  # the measurement's 5-point log grid


@pytest.mark.slow
def test_mup_best_learning_rate_transfers():
    """The best lr of GRID under mup stays within one grid point from d_model 32 to 128 (2 seeds, 200 steps: a smaller
    budget than docs/measurements/2026-11-28-mup-lr-transfer.md, which adds d_model 256 and shows sp's best moving)."""
    widths = [32, 64, 128]
    by_lr = {lr: final_losses("mup", lr, 200, [0, 1], widths) for lr in GRID}
    best = [GRID.index(min(GRID, key=lambda lr: by_lr[lr][width])) for width in widths]
    assert max(best) - min(best) <= 1, by_lr
