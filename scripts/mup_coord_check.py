"""The coordinate check of param=sp and param=mup (Yang et al. 2022, "Tensor Programs V", sec. D.1; microsoft/mup's
`get_coord_data`): each layer's mean |output| after a few Adam steps, widths 32-256 at d_head 16, on the built-in LM
task, and the slope of its log against log width (0: the layer's coordinates keep their size as the model widens).
The same measurement as tests/model/test_mup_training.py::test_coordinate_check, written down with its numbers.

    OMP_NUM_THREADS=1 python scripts/mup_coord_check.py     # writes docs/measurements/DATE-mup-coord-check.md"""
import datetime
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTHS, SEEDS, STEPS, LR = [32, 64, 128, 256], [0, 1, 2], 5, 0.01


def main():
    from blocklab.hardware import machine_label
    from blocklab.train.width_check import slope, train_briefly, width_setup

    sizes = {}
    for param in ("sp", "mup"):
        for width in WIDTHS:
            runs = [train_briefly(width_setup(width, overrides=[
                "task=lm", f"param={param}", f"optim.lr={LR}", "optim.warmup_steps=0", f"optim.min_lr={LR}",
                "task.batch_size=8", "task.block_size=64", f"seed={seed}"]), STEPS, record_at_end=True)["sizes"]
                for seed in SEEDS]
            for name in runs[0]:
                sizes.setdefault(param, {}).setdefault(name, []).append(statistics.mean(r[name] for r in runs))
    today = datetime.date.today().isoformat()
    lines = [f"# Coordinate check, sp against mup ({today})", "",
             "[← README](../../README.md) · [measurements](README.md) · [lr transfer](2026-11-28-mup-lr-transfer.md)",
             "",
             f"Machine: {machine_label()}, one thread.", "",
             "Command: `OMP_NUM_THREADS=1 python scripts/mup_coord_check.py`", "",
             f"Each layer's mean |output| on one batch after {STEPS} AdamW steps at a constant lr {LR} (no warmup, "
             f"clipping 1.0), task=lm, 2 layers, init=normal, d_head 16, batch 8 x 64 tokens, averaged over seeds "
             f"{SEEDS}; the slope is that of log mean |output| against log d_model over {WIDTHS}.", "",
             "| layer | " + " | ".join(f"{p} d={w}" for p in ("sp", "mup") for w in WIDTHS)
             + " | sp slope | mup slope |",
             "|---" * (2 * len(WIDTHS) + 3) + "|"]
    for name in sizes["sp"]:
        values = [f"{v:.3g}" for p in ("sp", "mup") for v in sizes[p][name]]
        slopes = [f"{slope(WIDTHS, sizes[p][name]):+.2f}" for p in ("sp", "mup")]
        lines.append(f"| {name} | " + " | ".join(values + slopes) + " |")
    out = ROOT / "docs" / "measurements" / f"{today}-mup-coord-check.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
