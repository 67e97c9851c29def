"""Learning-rate transfer under param=sp and param=mup: the final training loss over a log grid of learning rates at
several widths (d_model, at d_head 16), on the built-in LM task (Shakespeare, characters). Under µP the best rate
should stay put as the model widens (Yang et al. 2022, "Tensor Programs V", Fig. 1); under sp it moves.

    OMP_NUM_THREADS=1 python scripts/mup_lr_transfer.py            # measure, then write the page and figure
    python scripts/mup_lr_transfer.py --render                      # redraw from the committed data only

Writes docs/measurements/DATE-mup-lr-transfer.{json,png,md}: the data (every run's loss curve), the figure (loss
against lr, one line per width, one panel per parametrization) and the page (machine, command, table)."""
import argparse
import datetime
import json
import math
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "measurements"
PARAMS = ("sp", "mup")


def measure(args) -> dict:
    from blocklab.hardware import machine_label
    from blocklab.train.width_check import train_briefly, width_setup

    runs = []
    for param in PARAMS:
        for width in args.widths:
            for lr in args.lrs:
                for seed in range(args.seeds):
                    overrides = ["task=lm", f"param={param}", f"model.n_layers={args.layers}", f"optim.lr={lr}",
                                 f"optim.min_lr={lr / 10}", f"optim.warmup_steps={args.steps // 10}",
                                 f"task.batch_size={args.batch_size}", f"task.block_size={args.block_size}",
                                 f"seed={seed}"]
                    start = time.perf_counter()
                    result = train_briefly(width_setup(width, overrides=overrides), args.steps)
                    result["losses"] = [round(loss, 4) for loss in result["losses"]]
                    runs.append({"param": param, "width": width, "lr": lr, "seed": seed, **result,
                                 "seconds": round(time.perf_counter() - start, 1)})
                    print(param, width, lr, seed, final_loss(runs[-1], args.last), runs[-1]["seconds"], flush=True)
    return {"machine": machine_label(), "date": datetime.date.today().isoformat(),
            "command": "OMP_NUM_THREADS=1 python scripts/mup_lr_transfer.py " + shlex.join(sys.argv[1:]),
            "settings": {k: v for k, v in vars(args).items() if k not in ("render", "data")}, "runs": runs}


def final_loss(run: dict, last: int) -> float:
    """The mean training loss of the last `last` steps (inf where the run diverged)."""
    return math.inf if run["diverged"] else sum(run["losses"][-last:]) / last


def table(data: dict) -> dict[str, dict[int, dict[float, float]]]:
    """param -> width -> lr -> the final loss averaged over seeds."""
    last, out = data["settings"]["last"], {}
    for run in data["runs"]:
        out.setdefault(run["param"], {}).setdefault(run["width"], {}).setdefault(run["lr"], []).append(
            final_loss(run, last))
    return {p: {w: {lr: sum(v) / len(v) for lr, v in lrs.items()} for w, lrs in ws.items()} for p, ws in out.items()}


def best_lrs(losses: dict[int, dict[float, float]]) -> dict[int, float]:
    return {width: min(by_lr, key=by_lr.get) for width, by_lr in losses.items()}


def render(data: dict, stem: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = table(data)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, param in zip(axes, PARAMS):
        for width, by_lr in sorted(losses[param].items()):
            lrs = sorted(by_lr)
            ax.plot(lrs, [by_lr[lr] if math.isfinite(by_lr[lr]) else float("nan") for lr in lrs], marker="o",
                    label=f"d_model={width}")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_title(f"param={param}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"training loss (mean of the last {data['settings']['last']} steps)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    stem.with_suffix(".md").write_text(page(data, losses, stem.name))


def page(data: dict, losses: dict, name: str) -> str:
    s = data["settings"]
    lines = [f"# Learning-rate transfer, sp against mup ({data['date']})", "",
             "[← README](../../README.md) · [measurements](README.md) · "
             "[param=mup](../model.md#width-and-parametrization-param) · "
             "[coordinate check](2026-11-28-mup-coord-check.md)", "",
             f"Machine: {data['machine']}, one thread (shared with other jobs).", "",
             f"Command: `{data['command']}` (redraw from the data: `python scripts/mup_lr_transfer.py --render "
             f"--data docs/measurements/{name}.json`).", "",
             f"Setup: task=lm (built-in Shakespeare, characters), model.n_layers={s['layers']}, d_head 16 "
             f"(n_heads = d_model / 16), init=normal (std 0.02), AdamW (betas 0.9, 0.99, weight decay 0.1), "
             f"{s['steps']} steps, warmup {s['steps'] // 10}, cosine to lr/10, gradient clipping 1.0, "
             f"batch {s['batch_size']} x {s['block_size']} tokens, {s['seeds']} seed(s). The loss is the mean training "
             f"loss of the last {s['last']} steps (inf: diverged), averaged over seeds.", "",
             f"![loss against lr]({name}.png)", ""]
    for param in PARAMS:
        widths = sorted(losses[param])
        lrs = sorted(losses[param][widths[0]])
        best = best_lrs(losses[param])
        lines += [f"param={param}:", "", "| d_model | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr |",
                  "|---" * (len(lrs) + 2) + "|"]
        lines += [f"| {w} | " + " | ".join(f"{losses[param][w][lr]:.3f}" for lr in lrs) + f" | {best[w]:g} |"
                  for w in widths]
        lines.append("")
    for param in PARAMS:
        grid = sorted(next(iter(losses[param].values())))
        best = best_lrs(losses[param])
        steps = [grid.index(lr) for lr in best.values()]
        edge = [w for w, lr in best.items() if lr in (grid[0], grid[-1])]
        lines.append(f"- {param}: the best lr moves over {max(steps) - min(steps)} grid point(s) from d_model "
                     f"{min(losses[param])} to {max(losses[param])}"
                     + (f"; at d_model {', '.join(map(str, edge))} it is at the grid's edge, so the true best may lie "
                        f"beyond it" if edge else "") + ". Lowest loss per width: "
                     + ", ".join(f"{w}: {losses[param][w][lr]:.3f}" for w, lr in sorted(best.items())) + ".")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--last", type=int, default=25, help="steps the final loss averages over")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--render", action="store_true", help="only redraw the figure and page from --data")
    parser.add_argument("--data", type=Path, help="the data file to redraw from (default: today's)")
    args = parser.parse_args()
    stem = OUT / f"{datetime.date.today().isoformat()}-mup-lr-transfer"
    if args.render:
        data_path = args.data or stem.with_suffix(".json")
        render(json.loads(data_path.read_text()), data_path.with_suffix(""))
        return
    data = measure(args)
    stem.with_suffix(".json").write_text(json.dumps(data) + "\n")
    render(data, stem)


if __name__ == "__main__":
    main()
